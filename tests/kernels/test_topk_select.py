"""sparse_topk_select (Pallas) vs sparse_topk_select_reference (lax.top_k); msa_index_select
end to end."""
import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _helpers import INTERPRET
from pallas_kernels.index_select import msa_index_select, msa_index_select_reference
from pallas_kernels.topk_select import sparse_topk_select, sparse_topk_select_reference
from test_index_scores import MAX_PAGES, make_batch

TOPK = 16


def select(scores, nvp, **kw):
    return np.asarray(sparse_topk_select(jnp.asarray(scores, jnp.float32),
                                         jnp.asarray(nvp, jnp.int32), interpret=INTERPRET, **kw))


def check_structure(sel, nvp, num_pages):
    """Valid ids ascending, distinct, in [0, n); -1 only at the tail; count = min(n, 16)
    when every visible block is selectable."""
    n = np.clip(np.asarray(nvp), 0, num_pages)
    for t in range(sel.shape[0]):
        for row in sel[t]:
            valid = row[row >= 0]
            k = len(valid)
            assert (row[k:] == -1).all(), f"-1 not only at the tail: {row}"
            assert (np.diff(valid) > 0).all(), f"ids not ascending: {row}"
            assert (valid < max(n[t], 0)).all(), f"id >= n={n[t]}: {row}"
            if n[t] <= TOPK:
                np.testing.assert_array_equal(row, np.r_[np.arange(n[t]), -np.ones(TOPK - n[t])])


@pytest.mark.parametrize("num_heads,num_pages", [(4, 40), (1, 64), (2, 8)])
def test_matches_reference_random(num_heads, num_pages):
    rng = np.random.default_rng(num_pages)
    t = 12
    scores = rng.standard_normal((t, num_heads, num_pages)).astype(np.float32)
    scores[0] = np.round(scores[0])  # many ties
    scores[1, :, ::3] = -np.inf
    scores[2, 0, 5] = np.nan
    nvp = np.array([num_pages, num_pages, 30, 0, -3, 1, 16, 17, num_pages + 9, 2, 33, 24])
    got = select(scores, nvp)
    want = np.asarray(sparse_topk_select_reference(jnp.asarray(scores), jnp.asarray(nvp, jnp.int32)))
    chex.assert_shape(got, (t, num_heads, TOPK))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    check_structure(got, nvp, num_pages)


def test_identity_when_at_most_16_pages():
    scores = np.random.default_rng(0).standard_normal((4, 4, 32)).astype(np.float32)
    nvp = [0, 1, 7, 16]
    got = select(scores, nvp)
    for t, n in enumerate(nvp):
        want = np.r_[np.arange(n), -np.ones(TOPK - n)].astype(np.int32)
        np.testing.assert_array_equal(got[t], np.broadcast_to(want, (4, TOPK)))


def test_ties_prefer_smaller_ids_and_local_block_forced():
    scores = np.zeros((2, 1, 40), np.float32)
    scores[1, 0, 30] = 1.0  # one strictly better block; the rest tie at 0 (and -0.0)
    scores[1, 0, 3] = -0.0
    got = select(scores, [40, 40])
    np.testing.assert_array_equal(got[0, 0], np.r_[np.arange(15), 39])
    np.testing.assert_array_equal(got[1, 0], np.r_[np.arange(14), 30, 39])


def test_forced_local_and_init_blocks_beat_high_scores():
    scores = np.full((1, 1, 64), 5.0, np.float32)
    scores[0, 0, 20] = -1e30  # the local block of nvp=21, worst score
    scores[0, 0, 0] = -1e30
    got = select(scores, [21])
    assert 20 in got[0, 0] and 0 not in got[0, 0]
    got = select(scores, [21], init_blocks=1)
    np.testing.assert_array_equal(got[0, 0], np.r_[0, np.arange(1, 15), 20])
    want = np.asarray(sparse_topk_select_reference(jnp.asarray(scores), jnp.asarray([21], jnp.int32),
                                                   init_blocks=1))
    np.testing.assert_array_equal(got, want)
    got = select(scores, [21], local_blocks=0)
    np.testing.assert_array_equal(got[0, 0], np.arange(1, 17))


def test_all_minus_inf_rows_keep_only_forced_block():
    scores = np.full((2, 4, 40), -np.inf, np.float32)
    scores[1] = np.nan
    got = select(scores, [33, 40])
    np.testing.assert_array_equal(got[0], np.broadcast_to(np.r_[32, -np.ones(15)], (4, TOPK)))
    np.testing.assert_array_equal(got[1], np.broadcast_to(np.r_[39, -np.ones(15)], (4, TOPK)))


def test_num_valid_pages_clamped_to_max_pages():
    scores = np.random.default_rng(1).standard_normal((3, 4, 40)).astype(np.float32)
    a = select(scores, [40, 40, 0])
    b = select(scores, [41, 10 ** 6, -(10 ** 6)])
    np.testing.assert_array_equal(a, b)
    assert 39 in a[0, 0] and (a[2] == -1).all()


def test_validation_errors():
    s = jnp.zeros((2, 1, 8), jnp.float32)
    nvp = jnp.zeros((2,), jnp.int32)
    with pytest.raises(TypeError, match="scores: dtype must be float32"):
        sparse_topk_select(s.astype(jnp.bfloat16), nvp, interpret=INTERPRET)
    with pytest.raises(ValueError, match="num_valid_pages: expected shape"):
        sparse_topk_select(s, nvp[:1], interpret=INTERPRET)
    with pytest.raises(TypeError, match="num_valid_pages: dtype must be int32"):
        sparse_topk_select(s, nvp.astype(jnp.float32), interpret=INTERPRET)
    with pytest.raises(ValueError, match="topk: must be a power of two"):
        sparse_topk_select(s, nvp, topk=12, interpret=INTERPRET)
    with pytest.raises(ValueError, match="init_blocks"):
        sparse_topk_select(s, nvp, init_blocks=16, interpret=INTERPRET)
    with pytest.raises(ValueError, match="scores: expected shape"):
        sparse_topk_select_reference(s[0], nvp)


# One static shape, so every example reuses the same compiled kernel.
H_PROP, P_PROP, T_PROP = 2, 24, 4
_VALUES = st.sampled_from([-np.inf, np.nan, -2.0, -1.0, -0.0, 0.0, 0.5, 1.0, 3.0, np.inf])


@settings(max_examples=25)
@given(values=st.lists(_VALUES, min_size=T_PROP * H_PROP * P_PROP,
                       max_size=T_PROP * H_PROP * P_PROP),
       nvp=st.lists(st.integers(-2, P_PROP + 3), min_size=T_PROP, max_size=T_PROP))
def test_property_matches_reference(values, nvp):
    scores = np.asarray(values, np.float32).reshape(T_PROP, H_PROP, P_PROP)
    got = select(scores, nvp)
    want = np.asarray(sparse_topk_select_reference(jnp.asarray(scores), jnp.asarray(nvp, jnp.int32)))
    np.testing.assert_array_equal(got, want)
    check_structure(got, nvp, P_PROP)


@pytest.mark.parametrize("dtype,num_heads,index_dim", [(jnp.bfloat16, 4, 128),
                                                       (jnp.float32, 1, 32)])
def test_msa_index_select_end_to_end(dtype, num_heads, index_dim):
    q, k, bt, req, pos = make_batch(5, dtype, num_heads, index_dim)
    got = np.asarray(msa_index_select(q, k, bt, req, pos, interpret=INTERPRET))
    want = np.asarray(msa_index_select_reference(q, k, bt, req, pos))
    chex.assert_shape(got, (pos.shape[0], num_heads, TOPK))
    np.testing.assert_array_equal(got, want)
    nvp = np.asarray(pos) // 128 + 1
    check_structure(got, nvp, MAX_PAGES)
    # while position < 2048 every visible block is selected
    small = np.asarray(pos) < 2048
    for t in np.nonzero(small)[0]:
        np.testing.assert_array_equal(got[t, :, :nvp[t]], np.broadcast_to(np.arange(nvp[t]),
                                                                          (num_heads, nvp[t])))

"""Paged caches: slot-mapped writes (-1 writes nothing), the fp8 index-K cache (clipped writes),
donation, the page pool as a plain allocator (no keys)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import numpy.testing as npt
import pytest

from jax_msa_runner.attention.paged_cache import (init_kv_caches, write_index_k,
                                                  write_index_k_donated, write_kv,
                                                  write_kv_donated)
from jax_msa_runner.config import DUMMY_PAGE_ID as DUMMY_PAGE, NULL_PAGE_ID as NULL_PAGE
from jax_msa_runner.serving.kv_cache import block_table_row, pages_needed
from jax_msa_runner.serving.prefix_cache import OutOfPagesError, PagePool


def test_shapes_and_layers():
    c = init_kv_caches(6, 2, 8, 4, [False, True, True])
    assert [a.shape for a in c.kv] == [(6, 2, 128, 16)] * 3
    assert c.index_k[0] is None
    assert [a.shape for a in c.index_k[1:]] == [(6, 128, 4)] * 2
    assert c.num_pages == 6


def test_write_kv_through_slot_mapping():
    rng = np.random.default_rng(0)
    N, H, D, T = 5, 2, 4, 6
    cache = jnp.asarray(rng.normal(size=(N, H, 128, 2 * D)).astype(np.float32))
    k = rng.normal(size=(T, H, D)).astype(np.float32)
    v = rng.normal(size=(T, H, D)).astype(np.float32)
    slots = np.array([2 * 128 + 0, 2 * 128 + 127, -1, 4 * 128 + 5, -1, 3 * 128 + 64], np.int32)
    out = np.asarray(write_kv(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots)))
    expect = np.asarray(cache).copy()
    for t, s in enumerate(slots):
        if s >= 0:
            expect[s // 128, :, s % 128] = np.concatenate([k[t], v[t]], -1)
    npt.assert_array_equal(out, expect)  # -1 rows wrote nothing (no wrap to the last page)


def test_write_index_k_through_slot_mapping():
    rng = np.random.default_rng(1)
    cache = jnp.zeros((4, 128, 3), jnp.float32)
    ik = rng.normal(size=(3, 3)).astype(np.float32)
    slots = np.array([-1, 3 * 128 + 127, 128 + 1], np.int32)
    out = np.asarray(write_index_k(cache, jnp.asarray(ik), jnp.asarray(slots)))
    expect = np.zeros((4, 128, 3), np.float32)
    expect[3, 127], expect[1, 1] = ik[1], ik[2]
    npt.assert_array_equal(out, expect)


def test_donated_write_reuses_the_buffer():
    cache = jnp.zeros((4, 1, 128, 8), jnp.float32)
    k = jnp.ones((2, 1, 4), jnp.float32)
    slots = jnp.array([128 * 2 + 3, -1], jnp.int32)
    out = write_kv_donated(cache, k, k, slots)
    assert cache.is_deleted()  # the input buffer was donated: the write happened in place
    assert float(out[2, 0, 3].sum()) == 8.0
    idx = jnp.zeros((4, 128, 2), jnp.float32)
    out2 = write_index_k_donated(idx, jnp.ones((2, 2), jnp.float32), slots)
    assert idx.is_deleted() and float(out2.sum()) == 2.0


def test_allocator_never_hands_out_reserved_pages_and_is_deterministic():
    a = PagePool(8)
    assert a.num_usable == 6 and a.num_free == 6
    got = a.allocate(4)
    assert got == [2, 3, 4, 5]
    assert a.can_allocate(2) and not a.can_allocate(3)
    with pytest.raises(OutOfPagesError, match="requested 3 pages, 2 free"):
        a.allocate(3)
    assert a.num_free == 2  # a failed allocation takes nothing
    a.release([3, 2])
    assert a.allocate(1) == [2]  # lowest id first again
    with pytest.raises(ValueError, match="not held"):
        a.release([3])  # double release
    with pytest.raises(ValueError, match="reserved"):
        a.release([NULL_PAGE])
    rest = a.allocate(a.num_free)
    assert NULL_PAGE not in rest and DUMMY_PAGE not in rest
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(2)


def test_pages_needed_and_rows():
    assert [pages_needed(n) for n in (0, 1, 128, 129, 256)] == [0, 1, 1, 2, 2]
    npt.assert_array_equal(block_table_row([5, 7], 4), [5, 7, 0, 0])
    with pytest.raises(ValueError, match="block table has 1"):
        block_table_row([5, 7], 1)


def test_write_inside_jit_with_donated_pytree():
    caches = init_kv_caches(4, 1, 4, 2, [True])

    @jax.jit
    def step(c, slots):
        return type(c)(kv=(write_kv(c.kv[0], jnp.ones((2, 1, 4)), jnp.ones((2, 1, 4)), slots),),
                       index_k=(write_index_k(c.index_k[0], jnp.ones((2, 2)), slots),))

    step_d = jax.jit(step, donate_argnums=0)
    new = step_d(caches, jnp.array([130, -1], jnp.int32))
    assert caches.kv[0].is_deleted() and caches.index_k[0].is_deleted()
    assert float(new.kv[0].sum()) == 8.0 and float(new.index_k[0].sum()) == 2.0


@pytest.mark.parametrize("src_dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_index_cache_allocates_and_writes_clipped(src_dtype):
    """index_dtype float8_e4m3fn: index-K pages in fp8 (kv pages keep their dtype); writes clip
    to +-448 before the cast (an e4m3fn overflow would be NaN), -1 slots write nothing."""
    fp8 = jnp.float8_e4m3fn
    c = init_kv_caches(5, 1, 4, 48, [False, True], dtype=jnp.bfloat16, index_dtype=fp8)
    assert c.kv[1].dtype == jnp.bfloat16 and c.index_k[1].dtype == fp8 and c.index_k[0] is None
    chex.assert_shape(c.index_k[1], (5, 128, 48))
    rng = np.random.default_rng(21)
    ik = (rng.standard_normal((3, 48)) * 200.0).astype(np.float32)
    ik[0, :4] = [1e4, -1e4, 460.0, -470.0]  # beyond the finite range
    ik = np.asarray(jnp.asarray(ik, src_dtype).astype(jnp.float32))  # the values as written
    slots = np.array([4 * 128 + 9, -1, 2 * 128 + 127], np.int32)
    out = write_index_k_donated(c.index_k[1], jnp.asarray(ik, src_dtype), jnp.asarray(slots))
    assert out.dtype == fp8
    got = np.asarray(out.astype(jnp.float32))
    chex.assert_tree_all_finite(got)
    expect = np.zeros((5, 128, 48), np.float32)
    for t in (0, 2):
        expect[slots[t] // 128, slots[t] % 128] = np.clip(ik[t], -448, 448).astype(fp8)
    npt.assert_array_equal(got, expect)
    npt.assert_array_equal(got[4, 9, :4], [448, -448, 448, -448])

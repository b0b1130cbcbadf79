"""msa_index_scores (Pallas) vs msa_index_scores_reference (jnp)."""
import re

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from _helpers import INTERPRET
from pallas_kernels import PAGE_SIZE
from pallas_kernels.index_scores import (default_pages_per_program, dot_dtype,
                                         msa_index_scores, msa_index_scores_reference)
from pallas_kernels.index_select import (msa_index_select, msa_index_select_reference,
                                         num_valid_pages_of)
from pallas_kernels.topk_select import sparse_topk_select_reference

FP8 = jnp.float8_e4m3fn

# (seq_len, q_len) per request row: one decode token each at the boundary lengths, one long
# request, one 4-token row (consecutive positions 2046..2049, across a page boundary), and a
# padded row (seq_len 0). P = 32 pages = 4096 tokens.
REQUESTS = [(1, 1), (127, 1), (128, 1), (129, 1), (2047, 1), (2048, 1), (2049, 1), (4000, 1),
            (2050, 4), (0, 0)]
MAX_PAGES = 32


def make_batch(seed: int, dtype, num_heads: int, index_dim: int, poison: bool = True,
               k_dtype=None):
    """Random caches and metadata. Pages are a random permutation of 1..N-2; page 0 is the
    null page; page N-1 is the poison page, where a wrapped -1 or a clamped too-large id
    would land: rows of +-96 (exact in fp8), so a block that read it would score
    96 * |sum(index_q)|, far from any real score. Block-table entries beyond a request's pages
    are -1 or N + 7. The index-K cache is in `k_dtype` (None: `dtype`)."""
    rng = np.random.default_rng(seed)
    pages_per_req = [-(-s // PAGE_SIZE) for s, _ in REQUESTS]
    num_pages = sum(pages_per_req) + 2
    perm = rng.permutation(np.arange(1, num_pages - 1)).astype(np.int32)
    block_table = np.where(rng.random((len(REQUESTS), MAX_PAGES)) < 0.5, -1, num_pages + 7)
    block_table = block_table.astype(np.int32)
    off = 0
    req_indices, positions = [], []
    for r, ((seq_len, q_len), npg) in enumerate(zip(REQUESTS, pages_per_req)):
        block_table[r, :npg] = perm[off:off + npg]
        off += npg
        for i in range(q_len):
            req_indices.append(r)
            positions.append(seq_len - q_len + i)
    block_table[len(REQUESTS) - 1, :] = 0  # padded request row -> null page
    # padded tokens: req 0 / the padded row, position 0
    req_indices += [0, len(REQUESTS) - 1]
    positions += [0, 0]
    k = rng.standard_normal((num_pages, PAGE_SIZE, index_dim)).astype(np.float32)
    if poison:
        k[-1] = np.where(np.arange(PAGE_SIZE) % 2 == 0, 96.0, -96.0)[:, None]
    q = rng.standard_normal((len(positions), num_heads, index_dim)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, k_dtype or dtype), jnp.asarray(block_table),
            jnp.asarray(req_indices, jnp.int32), jnp.asarray(positions, jnp.int32))


def check_scores(got, want, positions, num_heads, atol=1e-3):
    t = positions.shape[0]
    chex.assert_shape(got, (t, num_heads, MAX_PAGES))
    assert got.dtype == jnp.float32
    got, want = np.asarray(got), np.asarray(want)
    assert not np.isnan(got).any()
    nvp = np.minimum(np.asarray(positions) // PAGE_SIZE + 1, MAX_PAGES)
    visible = np.arange(MAX_PAGES)[None, :] < nvp[:, None]  # [T, P]
    np.testing.assert_array_equal(np.isfinite(got), np.broadcast_to(visible[:, None, :], got.shape))
    np.testing.assert_array_equal(np.isneginf(got), ~np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("dtype,num_heads,index_dim,pages_per_program,preload", [
    (jnp.float32, 4, 32, None, True),
    (jnp.bfloat16, 1, 128, 8, True),
    (jnp.bfloat16, 4, 128, 64, True),  # one chunk wider than P: masked block-table preload
    (jnp.float32, 1, 128, 4, False),
])
def test_matches_reference(dtype, num_heads, index_dim, pages_per_program, preload):
    q, k, bt, req, pos = make_batch(0, dtype, num_heads, index_dim)
    got = msa_index_scores(q, k, bt, req, pos, interpret=INTERPRET,
                           pages_per_program=pages_per_program, preload_block_table=preload)
    want = msa_index_scores_reference(q, k, bt, req, pos)
    check_scores(got, want, pos, num_heads)


@pytest.mark.parametrize("dtype,num_heads,index_dim,pages_per_program,preload,seed", [
    (jnp.bfloat16, 3, 64, 64, True, 11),  # H=3 padded to 4; one chunk wider than P=32
    (jnp.float32, 1, 32, 8, False, 12),
])
def test_fp8_index_k_cache_matches_reference(dtype, num_heads, index_dim, pages_per_program,
                                             preload, seed):
    """A raw float8_e4m3fn index-K cache with bf16/f32 index queries: kernel == reference
    (both cast to `dot_dtype`: f16 for bf16 queries), equal within f32 rounding to the same
    values stored in index_q's dtype (the casts are exact for queries in f16's normal range),
    and msa_index_select picks the reference's blocks."""
    q, k, bt, req, pos = make_batch(seed, dtype, num_heads, index_dim, k_dtype=FP8)
    assert k.dtype == FP8 and q.dtype == dtype
    kw = dict(interpret=INTERPRET, pages_per_program=pages_per_program,
              preload_block_table=preload)
    got = msa_index_scores(q, k, bt, req, pos, **kw)
    check_scores(got, msa_index_scores_reference(q, k, bt, req, pos), pos, num_heads)
    check_scores(got, msa_index_scores(q, k.astype(dtype), bt, req, pos, **kw), pos, num_heads)
    sel = msa_index_select(q, k, bt, req, pos, **kw)
    chex.assert_shape(sel, (pos.shape[0], num_heads, 16))
    chex.assert_trees_all_equal(sel, msa_index_select_reference(q, k, bt, req, pos))


def test_fp8_cache_bf16_queries_dot_in_f16_clipped():
    """bf16 queries over an fp8 cache score in f16 (`dot_dtype`); a query beyond f16's range
    is clipped to +-65504, never inf: scores stay finite and equal the reference's."""
    assert dot_dtype(jnp.bfloat16, FP8) == jnp.float16
    assert dot_dtype(jnp.float32, FP8) == jnp.float32
    assert dot_dtype(jnp.bfloat16, jnp.bfloat16) == jnp.bfloat16
    q, k, bt, req, pos = make_batch(13, jnp.bfloat16, 2, 32, k_dtype=FP8)
    q = q.at[0, 0, :4].set(jnp.bfloat16(1e6)).at[1, 1, 5].set(jnp.bfloat16(-3e5))
    got = msa_index_scores(q, k, bt, req, pos, interpret=INTERPRET)
    want = msa_index_scores_reference(q, k, bt, req, pos)
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-2)
    visible = np.isfinite(np.asarray(want))
    assert visible.any() and np.isfinite(np.asarray(got))[visible].all()


@pytest.mark.parametrize("q_dtype,k_dtype", [
    (jnp.bfloat16, jnp.float16), (jnp.bfloat16, jnp.float8_e5m2), (jnp.float32, jnp.bfloat16),
    (jnp.float16, jnp.int8)])
def test_index_k_cache_dtype_errors(q_dtype, k_dtype):
    """Only index_q's dtype or float8_e4m3fn; the error names the argument and both dtypes."""
    q = jnp.zeros((2, 1, 32), q_dtype)
    k = jnp.zeros((4, PAGE_SIZE, 32), k_dtype)
    bt = jnp.zeros((1, 2), jnp.int32)
    ri = jnp.zeros((2,), jnp.int32)
    msg = re.escape(f"index_k_cache: dtype must be index_q's {jnp.dtype(q_dtype)} or "
                    f"float8_e4m3fn, got {jnp.dtype(k_dtype)}")
    with pytest.raises(TypeError, match=msg):
        msa_index_scores(q, k, bt, ri, ri, interpret=INTERPRET)
    with pytest.raises(TypeError, match=msg):
        msa_index_scores_reference(q, k, bt, ri, ri)
    with pytest.raises(TypeError, match="index_q: dtype"):  # fp8 queries need an fp8 cache
        msa_index_scores(q.astype(FP8), k, bt, ri, ri, interpret=INTERPRET)


def test_reference_against_numpy_loop():
    """The reference itself, on a tiny case, against an explicit per-key loop."""
    q, k, bt, req, pos = make_batch(1, jnp.float32, 2, 16, poison=False)
    want = np.full((pos.shape[0], 2, MAX_PAGES), -np.inf, np.float32)
    qn, kn, btn = np.asarray(q, np.float64), np.asarray(k, np.float64), np.asarray(bt)
    for t, (r, p) in enumerate(zip(np.asarray(req), np.asarray(pos))):
        for b in range(p // PAGE_SIZE + 1):
            page = np.clip(btn[r, b], 0, k.shape[0] - 1)
            n_keys = min(PAGE_SIZE, p - b * PAGE_SIZE + 1)
            want[t, :, b] = (qn[t] @ kn[page, :n_keys].T).max(axis=1)
    got = msa_index_scores_reference(q, k, bt, req, pos)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


def test_single_key_page_and_block_boundaries():
    """Token at position 128*b: block b has exactly one visible key."""
    q, k, bt, req, pos = make_batch(2, jnp.float32, 1, 32)
    got = np.asarray(msa_index_scores(q, k, bt, req, pos, interpret=INTERPRET,
                                      pages_per_program=4))
    t = int(np.nonzero((np.asarray(pos) == 2048) & (np.asarray(req) == 8))[0][0])
    page = int(bt[8, 16])
    np.testing.assert_allclose(got[t, 0, 16], float(np.asarray(q)[t, 0] @ np.asarray(k)[page, 0]),
                               rtol=1e-5, atol=1e-4)
    assert np.isneginf(got[t, 0, 17:]).all()


def test_out_of_range_ids_are_clamped():
    """Visible block-table entries of -1 / >= N read page 0 / page N-1 (documented clamp),
    never out of bounds; request rows are clamped to [0, R) likewise."""
    q, k, bt, req, pos = make_batch(3, jnp.float32, 4, 32, poison=False)
    n, r = k.shape[0], bt.shape[0]
    bad = bt.at[7, 0].set(-1).at[7, 1].set(n + 100).at[7, 2].set(-(2 ** 30))
    bad_req = req.at[0].set(-5).at[1].set(r + 3)
    fixed = bt.at[7, 0].set(0).at[7, 1].set(n - 1).at[7, 2].set(0)
    fixed_req = req.at[0].set(0).at[1].set(r - 1)
    got = msa_index_scores(q, k, bad, bad_req, pos, interpret=INTERPRET, pages_per_program=8)
    want = msa_index_scores_reference(q, k, fixed, fixed_req, pos)
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-3)
    chex.assert_trees_all_close(msa_index_scores_reference(q, k, bad, bad_req, pos), want,
                                rtol=1e-5, atol=1e-5)


def test_validation_errors():
    q = jnp.zeros((2, 1, 32), jnp.bfloat16)
    k = jnp.zeros((4, PAGE_SIZE, 32), jnp.bfloat16)
    bt = jnp.zeros((1, 2), jnp.int32)
    ri = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="Di must be a power of two >= 16"):
        msa_index_scores(q[..., :24], k[..., :24], bt, ri, ri, interpret=INTERPRET)
    with pytest.raises(ValueError, match="Di must be a power of two >= 16"):
        msa_index_scores(q[..., :8], k[..., :8], bt, ri, ri, interpret=INTERPRET)
    with pytest.raises(ValueError, match="index_k_cache"):
        msa_index_scores(q, k[:, :64], bt, ri, ri, interpret=INTERPRET)
    with pytest.raises(TypeError, match="index_k_cache: dtype"):
        msa_index_scores(q, k.astype(jnp.float32), bt, ri, ri, interpret=INTERPRET)
    with pytest.raises(TypeError, match="index_q: dtype"):
        msa_index_scores(q.astype(jnp.int8), k.astype(jnp.int8), bt, ri, ri,
                         interpret=INTERPRET)
    with pytest.raises(TypeError, match="block_table: dtype must be int32"):
        msa_index_scores(q, k, bt.astype(jnp.float32), ri, ri, interpret=INTERPRET)
    with pytest.raises(ValueError, match="positions: expected shape"):
        msa_index_scores(q, k, bt, ri, ri[:1], interpret=INTERPRET)
    with pytest.raises(ValueError, match="pages_per_program: must be a power of two"):
        msa_index_scores(q, k, bt, ri, ri, interpret=INTERPRET, pages_per_program=3)
    with pytest.raises(ValueError, match="index_q: expected rank 3"):
        msa_index_scores_reference(q[0], k, bt, ri, ri)


def test_default_pages_per_program():
    for t, p in [(1, 64), (1, 512), (16, 64), (16, 512), (64, 64), (64, 512), (128, 64),
                 (128, 512), (3, 5)]:
        for fp8, cap in ((False, 64), (True, 8)):
            ppp = default_pages_per_program(t, p, fp8)
            assert ppp >= 1 and ppp & (ppp - 1) == 0 and ppp <= cap
            assert t * -(-p // ppp) >= min(t * p, 2 * 132)  # enough programs to fill the SMs
    assert default_pages_per_program(128, 512, fp8=True) == 8  # bf16: 64


@pytest.mark.parametrize("num_heads,pages_per_program", [(1, 1), (4, 8)])
def test_fp8_queries_over_fp8_cache_match_reference(num_heads, pages_per_program):
    """e4m3 index queries over the e4m3 cache (vLLM's fp8 indexer computation): an fp8 x fp8
    dot. Scores equal the reference's (f32 products of the same e4m3 values) within the fp8
    tensor-core accumulation error (Hopper's fp8 MMA keeps fewer accumulator bits than f32:
    about 1e-4 of |q| |k| on the GPU, exact in interpret mode), with the poison page and
    padded tokens of make_batch; msa_index_select picks the top 16 of exactly those scores."""
    q, k, bt, req, pos = make_batch(21, jnp.bfloat16, num_heads, 128, k_dtype=FP8)
    q8 = q.astype(FP8)
    assert dot_dtype(q8.dtype, k.dtype) == FP8
    kw = dict(interpret=INTERPRET, pages_per_program=pages_per_program)
    got = msa_index_scores(q8, k, bt, req, pos, **kw)
    want = msa_index_scores_reference(q8, k, bt, req, pos)
    check_scores(got, want, pos, num_heads, atol=1e-3 if INTERPRET else 5e-2)
    sel = msa_index_select(q8, k, bt, req, pos, **kw)
    chex.assert_trees_all_equal(sel, sparse_topk_select_reference(got, num_valid_pages_of(pos)))
    if INTERPRET:
        chex.assert_trees_all_equal(sel, msa_index_select_reference(q8, k, bt, req, pos))


def test_fp8_queries_need_an_fp8_cache():
    q, k, bt, req, pos = make_batch(22, jnp.bfloat16, 1, 32)
    with pytest.raises(TypeError, match="index_q: dtype"):
        msa_index_scores(q.astype(FP8), k, bt, req, pos, interpret=INTERPRET)

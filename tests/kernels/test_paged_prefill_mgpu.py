"""Mosaic GPU dense paged prefill against ``paged_attention_reference`` (through the tiling
helpers), and its CUDA lowering.

On a CPU backend the kernel runs in Mosaic GPU interpret mode without being asked
(``interpret=None``); on a GPU the same tests run it compiled, with the full GQA shapes
(16/1 and 64/4) where the CPU runs reduced ones (4/1 and 8/2), plus compiled-only tests of
long contexts and of every ring depth. Each batch draws a fresh seed
(printed on failure): chunks at a context offset (a request with 150 prior tokens and a
70-token chunk: kv_lens 151..220), lengths not multiples of 128, a padded token inside a run
and padded tokens on a block-table row of their own (kv_len 0), a decode-like request of one
token, a chunk split at BQ, and the empty tiles that ``max_tiles`` leaves. NaN fills every
page no request consumes (the pages that clamped -1 / out-of-range ids land on included) and
the keys and values past each request's final kv_len in its last page; block-table entries
past a request's pages are -1 or out-of-range ids.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _helpers import fresh_seed
from pallas_kernels import PAGE_SIZE
from pallas_kernels._lowering import custom_call_counts, lower_for_cuda
from pallas_kernels._shapes import SMEM_BYTES
from pallas_kernels.paged_attention import (max_tiles, paged_attention_reference, prefill_tiles,
                                            tiles_to_tokens)
from pallas_kernels.paged_prefill_mgpu import (STAGES, default_stages, paged_prefill_mgpu,
                                               smem_bytes, tile_bounds)

ON_GPU = jax.default_backend() == "gpu"
TOL = dict(atol=2e-2, rtol=2e-2)  # bf16 output, P rounded to bf16 before P V
LSE_TOL = dict(atol=1e-3, rtol=1e-4)
BAD_IDS = (-1, -7, 10**6)  # block-table entries past a request's pages (with N and N + 3)


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    """A kernel that raised inside the Mosaic GPU interpreter leaves its state behind; reset it
    so one failure does not cascade into the next test."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    interpret_pallas_call.reset_gpu_interpret_mode_state()
    yield


def gqa(hq, hkv):
    """The GQA shape a test runs: the reduced CPU shapes 4/1 and 8/2 become the full 16/1 and
    64/4 on a GPU; others stay."""
    return {(4, 1): (16, 1), (8, 2): (64, 4)}.get((hq, hkv), (hq, hkv)) if ON_GPU else (hq, hkv)


def build_batch(seed, *, hq, hkv, d, requests, pads=2, dtype=jnp.bfloat16):
    """A prefill batch as numpy arrays ``(q, kv_cache, block_table, req_indices, kv_lens)``.

    ``requests``: ``(prior, chunk)`` per request row: ``chunk`` tokens with kv_lens
    ``prior + 1 .. prior + chunk`` (``chunk == 1``: decode-like). The first run holds one
    padded token (kv_len 0) in its middle; ``pads`` padded tokens close the batch on a row of
    their own whose entries are all bad ids. Each request's consumed blocks get distinct
    pages; pages 0 and N - 1 (where clamped ids land) and two more are consumed by nobody and
    hold NaN, as do the keys past each request's final kv_len in its last page.
    """
    rng = np.random.default_rng(seed)
    n_req = len(requests)
    final = [prior + chunk for prior, chunk in requests]
    blocks = [-(-f // PAGE_SIZE) for f in final]
    n_pages = sum(blocks) + 4
    cols = max(blocks) + 2
    req, lens = [], []
    for r, (prior, chunk) in enumerate(requests):
        run = list(range(prior + 1, prior + chunk + 1))
        if r == 0 and chunk > 1:
            run.insert(chunk // 2, 0)  # a padded token inside the run
        req += [r] * len(run)
        lens += run
    req += [n_req] * pads
    lens += [0] * pads
    bt = rng.choice(BAD_IDS + (n_pages, n_pages + 3), size=(n_req + 1, cols)).astype(np.int32)
    pages = rng.permutation(np.arange(1, n_pages - 1))
    kv = rng.standard_normal((n_pages, hkv, PAGE_SIZE, 2 * d)).astype(np.float32)
    consumed = np.zeros(n_pages, bool)
    at = 0
    for r in range(n_req):
        bt[r, :blocks[r]] = pages[at:at + blocks[r]]
        at += blocks[r]
        consumed[bt[r, :blocks[r]]] = True
        kv[bt[r, blocks[r] - 1], :, final[r] - (blocks[r] - 1) * PAGE_SIZE:] = np.nan
    kv[~consumed] = np.nan
    q = rng.standard_normal((len(req), hq, d)).astype(np.float32)
    return (q.astype(dtype), kv.astype(dtype), bt, np.asarray(req, np.int32),
            np.asarray(lens, np.int32))


def run_tiles(q, kv, bt, req, lens, *, block_q, scale, **kw):
    """The kernel on the batch's tiles: ``(tiles, out_tiles, lse_tiles, out, lse)``."""
    t = req.shape[0]
    nt = max_tiles(t, block_q, bt.shape[0])
    tiles = prefill_tiles(jnp.asarray(req), jnp.asarray(lens), block_q=block_q, num_tiles=nt)
    q_tiles = jnp.asarray(q)[jnp.where(tiles.token >= 0, tiles.token, 0)]
    out_t, lse_t = paged_prefill_mgpu(q_tiles, jnp.asarray(kv), jnp.asarray(bt), tiles.req,
                                      tiles.kv_lens, scale=scale, **kw)
    hq, d = q.shape[1:]
    chex.assert_shape((out_t, lse_t), ((nt, block_q, hq, d), (nt, hq, block_q)))
    assert out_t.dtype == q.dtype and lse_t.dtype == jnp.float32
    out, lse = tiles_to_tokens(tiles, out_t, lse_t, t)
    return tiles, out_t, lse_t, out, lse


def check_matches_reference(seed, hq, hkv, d, block_q, num_stages, requests):
    q, kv, bt, req, lens = build_batch(seed, hq=hq, hkv=hkv, d=d, requests=requests)
    scale = d ** -0.5
    tiles, out_t, lse_t, out, lse = run_tiles(q, kv, bt, req, lens, block_q=block_q,
                                              scale=scale, num_stages=num_stages)
    ref_out, ref_lse = paged_attention_reference(*map(jnp.asarray, (q, kv, bt, req, lens)),
                                                 scale=scale)
    msg = f"seed {seed}, {hq}/{hkv}, D {d}, BQ {block_q}, stages {num_stages}"
    assert np.isfinite(np.asarray(out, np.float32)).all(), f"NaN leaked ({msg})"
    try:
        chex.assert_trees_all_close(out.astype(jnp.float32), ref_out.astype(jnp.float32), **TOL)
        chex.assert_trees_all_close(lse, ref_lse, **LSE_TOL)
    except AssertionError as e:
        raise AssertionError(f"{msg}: {e}") from None
    assert bool(jnp.all((lse == -jnp.inf) == (jnp.asarray(lens)[:, None] == 0))), msg
    # rows no token fills (empty rows, empty tiles): zeros and -inf
    empty = np.asarray(tiles.token) < 0
    assert empty.all(axis=1).any(), "the batch should leave an empty tile"
    chex.assert_trees_all_equal(np.asarray(out_t, np.float32)[empty],
                                np.zeros((int(empty.sum()),) + out_t.shape[2:], np.float32))
    assert (np.asarray(lse_t).transpose(0, 2, 1)[empty] == -np.inf).all(), msg


# (prior, chunk) per request. A 70-token chunk after 150 tokens: kv_lens 151..220 (with the
# padded token inside the run, 71 rows: a split at BQ 64), pages 1 and 2 diagonal; a
# decode-like token at 300 (3 pages, 2 of them unmasked); a 130-token chunk from the start
# (a split at BQ 128, every page diagonal); a 60-token chunk across a page boundary.
# (hq, hkv, d, block_q, num_stages, requests); hq/hkv as gqa() maps them
CASES = [
    (4, 1, 64, 64, 1, ((150, 70), (299, 1))),     # a 1-deep ring: each page waits its slot
    (8, 2, 128, 128, 2, ((150, 70), (0, 130))),   # two compute warpgroups, a ring that wraps
    (16, 1, 128, 64, None, ((100, 60),)),         # the M3 TP4 group, the default 3-deep ring
]


@pytest.mark.parametrize("hq,hkv,d,block_q,num_stages,requests", CASES)
def test_matches_reference(hq, hkv, d, block_q, num_stages, requests):
    hq, hkv = gqa(hq, hkv)
    check_matches_reference(fresh_seed(), hq, hkv, d, block_q, num_stages, requests)


@pytest.mark.skipif(not ON_GPU, reason="long contexts: too slow interpreted")
@pytest.mark.parametrize("hq,hkv", [(16, 1), (64, 4)])
@pytest.mark.parametrize("d,block_q", [(128, 128), (128, 64), (64, 128)])
def test_long_context_matches_reference(hq, hkv, d, block_q):
    """Compiled only: chunks after thousands of tokens, so the ring wraps many times and
    most pages run unmasked."""
    requests = ((5000, 300), (2047, 1), (700, 257), (0, 129))
    check_matches_reference(fresh_seed(), hq, hkv, d, block_q, None, requests)


@pytest.mark.skipif(not ON_GPU, reason="every ring depth: too slow interpreted")
@pytest.mark.parametrize("num_stages", STAGES)
def test_every_ring_depth_matches_reference(num_stages):
    """Compiled only: each ring depth that fits at D 64 with two compute warpgroups."""
    check_matches_reference(fresh_seed(), 16, 1, 64, 128, num_stages,
                            ((1000, 200), (129, 1), (0, 300)))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nan_in_a_consumed_key_or_value_reaches_its_rows():
    """Request 0: NaN in key 5 (seen by all its rows) -> its out and lse are NaN. Request 1:
    NaN in the value of key 3 -> its out is NaN, its lse finite. Request 2: unchanged. At D 64
    with BQ 128 (the default 4-deep ring), the combination the reference tests leave out."""
    seed = fresh_seed()
    hq, hkv = gqa(4, 1)
    d = 64
    q, kv, bt, req, lens = build_batch(seed, hq=hq, hkv=hkv, d=d,
                                       requests=((10, 20), (0, 10), (100, 40)))
    kv[bt[0, 0], :, 5, :d] = np.nan
    kv[bt[1, 0], :, 3, d:] = np.nan
    _, _, _, out, lse = run_tiles(q, kv, bt, req, lens, block_q=128, scale=d ** -0.5)
    ref_out, ref_lse = paged_attention_reference(*map(jnp.asarray, (q, kv, bt, req, lens)),
                                                 scale=d ** -0.5)
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    r0, r1, r2 = ((req == r) & (lens > 0) for r in range(3))
    msg = f"seed {seed}"
    assert np.isnan(out[r0]).all() and np.isnan(lse[r0]).all(), msg
    assert np.isnan(out[r1]).all() and np.isfinite(lse[r1]).all(), msg
    chex.assert_trees_all_close(out[r2], np.asarray(ref_out, np.float32)[r2], **TOL)
    chex.assert_trees_all_close(lse[r2], np.asarray(ref_lse)[r2], **LSE_TOL)
    assert (out[lens == 0] == 0).all() and (lse[lens == 0] == -np.inf).all(), msg


def test_all_padded_batch_reads_nothing_and_gives_zeros():
    """Only padded tokens, a cache of NaN and a block table of bad ids: zeros and -inf; and
    a batch of no tile returns empty results."""
    d = 64
    q = jnp.ones((3, 2, d), jnp.bfloat16)
    kv = jnp.full((2, 1, PAGE_SIZE, 2 * d), jnp.nan, jnp.bfloat16)
    bt = jnp.full((2, 3), -1, jnp.int32)
    z = jnp.zeros((3,), jnp.int32)
    _, out_t, lse_t, _, _ = run_tiles(q, kv, bt, z, z, block_q=64, scale=1.0)
    chex.assert_trees_all_equal(out_t, jnp.zeros_like(out_t))
    assert bool(jnp.all(lse_t == -jnp.inf))
    out0, lse0 = paged_prefill_mgpu(jnp.zeros((0, 64, 2, d), jnp.bfloat16), kv, bt,
                                    jnp.zeros((0,), jnp.int32), jnp.zeros((0, 64), jnp.int32),
                                    scale=1.0)
    chex.assert_shape((out0, lse0), ((0, 64, 2, d), (0, 2, 64)))


def test_tile_bounds():
    lens = jnp.asarray([[0, 151, 152, 0], [0, 0, 0, 0], [7, 3, 0, 300]], jnp.int32)
    chex.assert_trees_all_equal(tile_bounds(lens),
                                jnp.asarray([[152, 151], [0, 0], [300, 3]], jnp.int32))


def test_default_stages_fit_shared_memory():
    assert [default_stages(d, bq) for d, bq in ((128, 128), (128, 64), (64, 128), (64, 64))] \
        == [2, 3, 4, 4]
    for d in (64, 128):
        for bq in (64, 128):
            assert smem_bytes(d, bq, default_stages(d, bq)) <= SMEM_BYTES
            assert default_stages(d, bq) in STAGES


def specs(nt, bq, hq, hkv, d, *, pages, cols, rows=1, dtype=jnp.bfloat16, len_shape=None,
          req_dtype=jnp.int32):
    """``jax.ShapeDtypeStruct``s of the kernel's five arguments."""
    s = jax.ShapeDtypeStruct
    return (s((nt, bq, hq, d), dtype), s((pages, hkv, PAGE_SIZE, 2 * d), dtype),
            s((rows, cols), jnp.int32), s((nt,), req_dtype),
            s(len_shape or (nt, bq), jnp.int32))


@pytest.mark.parametrize("block_q", [64, 128])
def test_lowers_for_h200_at_a_long_prefill_chunk(block_q):
    """Hq 16 / Hkv 1, D 128: a 2048-token chunk after a 128K context (P = 1024 pages, NT from
    ``max_tiles``) lowers (the Mosaic GPU lowering runs) to one Mosaic GPU kernel on wgmma
    with the approximate exp2, no Triton."""
    nt = max_tiles(2048, block_q, 1)
    text = lower_for_cuda(paged_prefill_mgpu,
                          *specs(nt, block_q, 16, 1, 128, pages=1040, cols=1024),
                          scale=128 ** -0.5, interpret=False)
    counts = custom_call_counts(text)
    assert counts["mosaic"] == 1 and counts["triton"] == 0, counts
    assert "wgmma" in text and "ex2.approx" in text


@pytest.mark.parametrize("block_q,d", [(64, 64), (64, 128), (128, 64), (128, 128)])
def test_every_ring_that_fits_lowers_for_h200(block_q, d):
    """Each ring depth that fits shared memory lowers at each tile height and head dim (64/4,
    a 16K context); two compute warpgroups move registers from the memory warpgroup."""
    for stages in STAGES:
        if smem_bytes(d, block_q, stages) > SMEM_BYTES:
            continue
        text = lower_for_cuda(paged_prefill_mgpu,
                              *specs(8, block_q, 64, 4, d, pages=160, cols=128, rows=4),
                              scale=1.0, interpret=False, num_stages=stages)
        assert custom_call_counts(text)["mosaic"] == 1, stages


@pytest.mark.parametrize("kw,match,exc", [
    (dict(dtype=jnp.float32), "q_tiles dtype must be bf16 or f16", TypeError),
    (dict(len_shape=(9, 65)), r"tile_kv_lens must be \[NT, BQ\] = \(9, 64\)", ValueError),
    (dict(req_dtype=jnp.int16), "tile_req dtype must be int32", TypeError),
    (dict(bq=32), "tile rows BQ", ValueError),
    (dict(d=96), "head dim D", ValueError),
    (dict(num_stages=3, bq=128), "bytes of shared memory", ValueError),
    (dict(num_stages=5), "num_stages must be one of", ValueError),
])
def test_rejects_bad_inputs(kw, match, exc):
    bq, d, stages = kw.pop("bq", 64), kw.pop("d", 128), kw.pop("num_stages", None)
    with pytest.raises(exc, match=match):
        lower_for_cuda(paged_prefill_mgpu, *specs(9, bq, 16, 1, d, pages=8, cols=4, **kw),
                       scale=1.0, interpret=False, num_stages=stages)

"""msa_index_select_mgpu (Mosaic GPU scores + select, two launches with PDL) against the jnp
references, on random data with a fresh seed; and its CUDA lowering for an abstract H200.

On a CPU backend both kernels run in Mosaic GPU interpret mode without being asked
(``interpret=None``); on the H200 the same tests run them compiled. The batches are
``test_index_scores.make_batch``'s: requests of lengths that are not multiples of 128, padded
tokens, block-table entries past each request set to -1 or N + 7, and a poison page where a
wrapped or clamped id would land (a read of it would win every selection it entered).
Where the kernel's scratch could leak into the result, the interpreter fills uninitialised
memory with zeros (``ZERO_FILLED``) instead of NaN, which the selector would turn into -inf.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from _helpers import fresh_seed
from pallas_kernels import PAGE_SIZE, TOPK
from pallas_kernels._interpret import resolve_interpret
from pallas_kernels._lowering import custom_call_counts, lower_for_cuda
from pallas_kernels.index_scores import msa_index_scores_reference
from pallas_kernels.index_select import msa_index_select_reference, num_valid_pages_of
from pallas_kernels.index_select_mgpu import (first_item, heads_per_select,
                                              msa_index_scores_mgpu, msa_index_select_mgpu,
                                              sparse_topk_select_mgpu)
from pallas_kernels.topk_select import sparse_topk_select_reference
from test_index_scores import MAX_PAGES, check_scores, make_batch
from test_topk_select import check_structure

ZERO_FILLED = (plgpu.InterpretGPUParams(uninitialized_memory="zero")
               if resolve_interpret(None) else None)  # None: compiled on a GPU


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    """A kernel that raised inside the Mosaic GPU interpreter leaves its state behind."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    interpret_pallas_call.reset_gpu_interpret_mode_state()
    yield


@pytest.mark.parametrize("dtype,num_heads,index_dim,kw", [
    # CTAs over the flattened (token, column) items: tokens split between CTAs, rings deeper
    # and shallower than a CTA's items, H not a power of two; e4m3 queries over an e4m3 cache
    # (128-byte rows; 64-byte rows: a 64-byte swizzle)
    (jnp.bfloat16, 4, 128, dict(num_ctas=7, num_stages=3)),
    (jnp.bfloat16, 1, 64, dict()),  # the defaults: one CTA per item here
    (jnp.float16, 3, 128, dict(num_ctas=2, num_stages=6)),
    (jnp.bfloat16, 8, 128, dict(num_ctas=5, num_stages=2)),  # every Q column a head
    (jnp.float8_e4m3fn, 2, 128, dict(num_ctas=5, num_stages=4)),
    (jnp.float8_e4m3fn, 1, 64, dict(num_ctas=3, num_stages=1)),
    (jnp.float8_e4m3fn, 8, 64, dict(num_ctas=1000, num_stages=5)),  # more CTAs than items
])
def test_matches_reference(dtype, num_heads, index_dim, kw):
    q, k, bt, req, pos = make_batch(fresh_seed(), dtype, num_heads, index_dim)
    got = msa_index_select_mgpu(q, k, bt, req, pos, **kw)
    chex.assert_shape(got, (pos.shape[0], num_heads, TOPK))
    chex.assert_trees_all_equal(got, msa_index_select_reference(q, k, bt, req, pos))
    check_structure(np.asarray(got), np.asarray(num_valid_pages_of(pos)), MAX_PAGES)


@pytest.mark.parametrize("local_blocks,init_blocks", [(1, 0), (2, 1), (0, 0)])
def test_given_page_counts_and_forced_blocks(local_blocks, init_blocks):
    """num_valid_pages given (below and above positions // 128 + 1, negative, past P): pages
    past the position score -inf, whatever the scratch held."""
    q, k, bt, req, pos = make_batch(fresh_seed(), jnp.bfloat16, 2, 64)
    rng = np.random.default_rng(fresh_seed())
    nvp = np.asarray(num_valid_pages_of(pos)) + rng.integers(-3, 4, pos.shape[0])
    nvp[0], nvp[-1] = -2, MAX_PAGES + 5
    nvp = jnp.asarray(nvp, jnp.int32)
    got = msa_index_select_mgpu(q, k, bt, req, pos, nvp, local_blocks=local_blocks,
                                init_blocks=init_blocks, num_ctas=4,
                                interpret=ZERO_FILLED)
    want = msa_index_select_reference(q, k, bt, req, pos, nvp, local_blocks=local_blocks,
                                      init_blocks=init_blocks)
    chex.assert_trees_all_equal(got, want)


def test_pages_past_the_position_are_never_read():
    """Every block-table entry past the last block any token of its request may read points
    at the poison page: the selection is the same as with those entries at the null page,
    since no such page is read (the poison page would outscore any real page)."""
    q, k, bt, req, pos = make_batch(fresh_seed(), jnp.bfloat16, 4, 128)
    poison = k.shape[0] - 1
    nvp = np.asarray(num_valid_pages_of(pos))
    tables = {}
    for fill in (poison, 0):
        table = np.asarray(bt).copy()
        for r in set(np.asarray(req).tolist()):
            table[r, nvp[np.asarray(req) == r].max():] = fill
        tables[fill] = jnp.asarray(table)
    got = msa_index_select_mgpu(q, k, tables[poison], req, pos, num_ctas=4)
    chex.assert_trees_all_equal(
        got, msa_index_select_mgpu(q, k, tables[0], req, pos, num_ctas=4))
    chex.assert_trees_all_equal(got, msa_index_select_reference(q, k, tables[0], req, pos))


@pytest.mark.parametrize("dtype,num_heads,index_dim,num_ctas", [
    (jnp.bfloat16, 4, 128, 3),       # a CTA's items across several tokens
    (jnp.float16, 3, 64, None),
    (jnp.float8_e4m3fn, 2, 128, 6),  # e4m3 queries over an e4m3 cache
])
def test_scores_alone_match_reference(dtype, num_heads, index_dim, num_ctas):
    """msa_index_scores_mgpu: [T, H, P] scores, -inf exactly past each token's last block, the
    poison page never read (it would score far from any real page)."""
    q, k, bt, req, pos = make_batch(fresh_seed(), dtype, num_heads, index_dim)
    got = msa_index_scores_mgpu(q, k, bt, req, pos, num_ctas=num_ctas, interpret=ZERO_FILLED)
    fp8_on_gpu = dtype == jnp.float8_e4m3fn and not resolve_interpret(None)
    check_scores(got, msa_index_scores_reference(q, k, bt, req, pos), pos, num_heads,
                 atol=5e-2 if fp8_on_gpu else 1e-3)


def test_scores_alternating_read_and_unread_items():
    """Items alternate read (column 0) and unread (column 1: every token's position is in its
    first block), so a CTA rewrites each of its two score rows right after an unread item: the
    kernel has no automatic barriers, and the unread item's barrier must keep that rewrite
    behind the other warps' reads of the row. Compiled, the kernel runs repeatedly."""
    rng = np.random.default_rng(fresh_seed())
    t, h, di, n = 96, 4, 128, 40
    q = jnp.asarray(rng.standard_normal((t, h, di)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((n, PAGE_SIZE, di)), jnp.bfloat16)
    bt = jnp.asarray(rng.integers(0, n, (t, 2)), jnp.int32)
    req = jnp.arange(t, dtype=jnp.int32)
    pos = jnp.asarray(rng.integers(0, PAGE_SIZE, t), jnp.int32)
    want = np.asarray(msa_index_scores_reference(q, k, bt, req, pos))
    chex.assert_trees_all_equal(np.isneginf(want[:, :, 1]), np.ones((t, h), bool))
    for _ in range(1 if resolve_interpret(None) else 50):
        got = msa_index_scores_mgpu(q, k, bt, req, pos, num_ctas=6)
        chex.assert_shape(got, (t, h, 2))
        chex.assert_trees_all_close(np.asarray(got), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("num_heads,num_pages,local_blocks,init_blocks", [
    (4, 40, 1, 0), (1, 128, 2, 1), (2, 200, 0, 0), (3, 1024, 1, 0), (8, 130, 1, 0)])
def test_select_alone_matches_reference(num_heads, num_pages, local_blocks, init_blocks):
    """sparse_topk_select_mgpu on random scores with ties, -0.0, -inf and NaN entries, counts
    below 16, past P and negative; rows of P not a multiple of 128 are padded first. H = 4 and
    8 run four heads per CTA (one per warp), the others one."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    t = 8
    scores = rng.standard_normal((t, num_heads, num_pages)).astype(np.float32)
    scores[0] = np.round(scores[0])  # many ties
    scores[1, :, ::3] = -np.inf
    scores[2, 0, 5], scores[2, -1, 7] = np.nan, -0.0
    nvp = rng.integers(17, num_pages + 1, t)
    nvp[3:6] = -3, 9, num_pages + 9
    scores, nvp = jnp.asarray(scores), jnp.asarray(nvp, jnp.int32)
    kw = dict(local_blocks=local_blocks, init_blocks=init_blocks)
    got = sparse_topk_select_mgpu(scores, nvp, **kw)
    chex.assert_shape(got, (t, num_heads, TOPK))
    chex.assert_trees_all_equal(got, sparse_topk_select_reference(scores, nvp, **kw),
                                custom_message=f"seed {seed}")
    check_structure(np.asarray(got), np.asarray(nvp), num_pages)


def index_specs(t, h, context, dtype=jnp.bfloat16, di=128):
    """Abstract indexer arguments: T tokens of H heads, one request each at `context` keys."""
    s = jax.ShapeDtypeStruct
    p = context // PAGE_SIZE
    return (s((t, h, di), dtype), s((t * p + 1, PAGE_SIZE, di), dtype), s((t, p), jnp.int32),
            s((t,), jnp.int32), s((t,), jnp.int32))


@pytest.mark.parametrize("t,h,context,dtype", [
    (1, 1, 8192, jnp.bfloat16), (1, 4, 65536, jnp.bfloat16), (16, 1, 8192, jnp.bfloat16),
    (128, 4, 65536, jnp.bfloat16), (1, 1, 65536, jnp.float8_e4m3fn),
    (64, 4, 65536, jnp.float8_e4m3fn)])
def test_lowers_for_h200_as_two_kernels_with_pdl(t, h, context, dtype):
    """The benchmark shapes (bf16, and fp8 at L=64K) lower to exactly two Mosaic GPU custom
    calls (scores, select), both launched with programmatic dependent launch, and no other op
    that would be a kernel."""
    text = lower_for_cuda(msa_index_select_mgpu, *index_specs(t, h, context, dtype))
    assert custom_call_counts(text) == dict(mosaic=2, triton=0, other=0)
    for op in ("stablehlo.pad", "stablehlo.concatenate", "stablehlo.gather",
               "stablehlo.transpose", "stablehlo.slice", "stablehlo.broadcast"):
        assert op not in text, op
    for marker in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"):
        assert text.count(marker) >= 2, marker


@pytest.mark.parametrize("t,h,context,dtype", [(1, 1, 65536, jnp.bfloat16),
                                             (16, 4, 8192, jnp.float8_e4m3fn)])
def test_scores_and_select_alone_lower_as_one_kernel_each(t, h, context, dtype):
    """The two halves on their own: one Mosaic GPU custom call each, launched with PDL; the
    select of a P that is not a multiple of 128 adds only its pad."""
    specs = index_specs(t, h, context, dtype)
    scores = jax.ShapeDtypeStruct((t, h, context // PAGE_SIZE - 8), jnp.float32)
    counts = jax.ShapeDtypeStruct((t,), jnp.int32)
    for text in (lower_for_cuda(msa_index_scores_mgpu, *specs),
                 lower_for_cuda(sparse_topk_select_mgpu, scores, counts)):
        assert custom_call_counts(text) == dict(mosaic=1, triton=0, other=0)
        for marker in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"):
            assert marker in text, marker


def test_select_alone_rejects_unsupported_arguments():
    scores = jax.ShapeDtypeStruct((2, 1, 64), jnp.float32)
    counts = jax.ShapeDtypeStruct((2,), jnp.int32)
    with pytest.raises(ValueError, match="topk must be 16"):
        lower_for_cuda(sparse_topk_select_mgpu, scores, counts, topk=8, local_blocks=1)
    with pytest.raises(ValueError, match="at most 1024"):
        lower_for_cuda(sparse_topk_select_mgpu, jax.ShapeDtypeStruct((2, 1, 2048), jnp.float32),
                       counts)
    with pytest.raises(TypeError, match="scores: dtype must be float32"):
        lower_for_cuda(sparse_topk_select_mgpu, jax.ShapeDtypeStruct((2, 1, 64), jnp.bfloat16),
                       counts)


@pytest.mark.parametrize("kw,match,exc", [
    (dict(dtype=jnp.float32), "both be bf16, both f16 or both float8_e4m3fn", TypeError),
    (dict(h=16), "H = 16 exceeds 8", ValueError),
    (dict(di=256), "Di must be one of", ValueError),
    (dict(context=2048 * PAGE_SIZE), "at most 1024", ValueError),
    (dict(num_stages=7), "num_stages", ValueError),
    (dict(num_ctas=0), r"num_ctas must be >= 1", ValueError),
])
def test_rejects_unsupported_arguments(kw, match, exc):
    shape_kw = {k: kw.pop(k) for k in ("dtype", "h", "di", "context") if k in kw}
    args = dict(t=2, h=4, context=8192)
    args.update(shape_kw)
    with pytest.raises(exc, match=match):
        lower_for_cuda(msa_index_select_mgpu, *index_specs(**args), **kw)


def test_heads_per_select_cta():
    assert [heads_per_select(h) for h in range(1, 9)] == [1, 1, 1, 4, 1, 1, 1, 4]


@pytest.mark.parametrize("num_items,num_ctas", [(7, 3), (64, 264), (8192 * 1024, 528),
                                                (2 ** 31 - 1, 527)])
def test_item_ranges_split_exactly_in_int32(num_items, num_ctas):
    """Each CTA's first item is floor(g * W / G) in int32 even where g * W passes 2^31: the
    ranges cover the W items once, in order."""
    g = jnp.arange(num_ctas + 1, dtype=jnp.int32)
    got = np.asarray(first_item(g, num_items, num_ctas)).astype(np.int64)
    want = np.arange(num_ctas + 1, dtype=np.int64) * num_items // num_ctas
    np.testing.assert_array_equal(got, want)
    assert got[0] == 0 and got[-1] == num_items and np.all(np.diff(got) >= 0)

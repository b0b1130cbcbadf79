"""The default indexer kernels (indexer + select, scores alone, select alone): the kernel each
picks per call, and that every kernel behind them matches the reference.

The choice is checked on the CUDA lowering for an abstract H200 (which custom calls the call
lowers to). Numerics: ``test_index_scores.make_batch``'s batch (padded tokens, block-table
entries past each request at -1 or N + 7, a poison page) with given page counts; on a CPU
backend every kernel runs interpreted, on the H200 compiled.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _helpers import fresh_seed
from pallas_kernels import TOPK
from pallas_kernels._lowering import custom_call_counts, lower_for_cuda
from pallas_kernels.index_scores import msa_index_scores_reference
from pallas_kernels.index_select import (msa_index_select, msa_index_select_reference,
                                         num_valid_pages_of)
from pallas_kernels.index_select_default import (
    BACKENDS, index_backend,
    msa_index_scores_default, msa_index_select_default, scores_backend, select_backend,
    sparse_topk_select_default)
from pallas_kernels.topk_select import sparse_topk_select_reference
from test_index_scores import check_scores, make_batch
from test_index_select_mgpu import index_specs

BF16, F16, FP8 = jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn


@pytest.mark.parametrize("p,h,di,q_dtype,k_dtype,interpreting,want", [
    (64, 1, 128, BF16, BF16, False, "mosaic"),
    (512, 4, 128, F16, F16, False, "mosaic"),
    (1024, 8, 64, FP8, FP8, False, "mosaic"),     # e4m3 x e4m3, the most columns and heads
    (512, 1, 128, BF16, FP8, False, "triton"),    # bf16 queries over an e4m3 cache
    (512, 16, 128, BF16, BF16, False, "triton"),  # more than 8 index heads
    (512, 1, 96, BF16, BF16, False, "triton"),    # index dims 64 and 128 only
    (2048, 1, 128, BF16, BF16, False, "mosaic"),  # over 1024 columns: the chunked select
    (65536, 1, 128, FP8, FP8, False, "mosaic"),   # the chunked select's most columns
    (65537, 1, 128, BF16, BF16, False, "triton"),
    (64, 1, 128, BF16, BF16, True, "triton"),     # interpreted: the Triton kernel
])
def test_index_backend_rule(p, h, di, q_dtype, k_dtype, interpreting, want):
    assert index_backend(p, h, di, q_dtype, k_dtype, interpreting=interpreting) == want


@pytest.mark.parametrize("h,di,q_dtype,k_dtype,interpreting,want", [
    (4, 128, BF16, BF16, False, "mosaic"),
    (8, 64, FP8, FP8, False, "mosaic"),
    (9, 128, F16, F16, False, "triton"),
    (1, 128, BF16, FP8, False, "triton"),
    (1, 128, BF16, BF16, True, "triton"),
])
def test_scores_backend_rule(h, di, q_dtype, k_dtype, interpreting, want):
    assert scores_backend(h, di, q_dtype, k_dtype, interpreting=interpreting) == want


@pytest.mark.parametrize("t,p,topk,interpreting,want", [
    (1, 40, TOPK, False, "mosaic"), (64, 512, TOPK, False, "mosaic"),
    (256, 512, TOPK, False, "mosaic"), (2048, 1024, TOPK, False, "mosaic"),
    (1, 2048, TOPK, False, "mosaic"), (2048, 65536, TOPK, False, "mosaic"),
    (1, 65537, TOPK, False, "triton"), (1, 64, 8, False, "triton"), (1, 64, TOPK, True, "triton"),
])
def test_select_backend_rule(t, p, topk, interpreting, want):
    assert select_backend(t, p, topk, interpreting=interpreting) == want


@pytest.mark.parametrize("t,h,context,dtype,mosaic", [
    (1, 1, 8192, BF16, 2), (1, 4, 65536, BF16, 2), (16, 4, 8192, BF16, 2),
    (16, 4, 65536, BF16, 2), (128, 1, 8192, BF16, 2), (128, 4, 65536, FP8, 2),
    (1, 1, 128 * 1024, BF16, 2),  # 1024 columns: still one select
    (4, 1, 2048 * 128, BF16, 3), (1, 1, 2 ** 20, FP8, 3),  # past 128K: scores + 2 selects
    (2048, 1, 2 ** 20, BF16, 3),  # a 2048-token prefill chunk at 1M
])
def test_lowers_to_mosaic_kernels_only_for_h200(t, h, context, dtype, mosaic):
    """Compiled for an H200 (``interpret=None`` under an abstract H200 mesh), every context
    the runner serves lowers to Mosaic GPU custom calls only: the scores kernel and one select
    (at most 1024 columns) or the chunked select's two; no Triton."""
    text = lower_for_cuda(msa_index_select_default, *index_specs(t, h, context, dtype))
    assert custom_call_counts(text) == dict(mosaic=mosaic, triton=0, other=0)


def test_triton_past_the_chunked_select():
    text = lower_for_cuda(msa_index_select_default, *index_specs(1, 1, 65537 * 128))
    assert custom_call_counts(text) == dict(mosaic=0, triton=1, other=0)


@pytest.mark.parametrize("t,h,want", [(1, 1, "mosaic"), (16, 4, "mosaic"), (2, 16, "triton")])
def test_scores_and_select_alone_lower_to_the_chosen_kernel(t, h, want):
    specs = index_specs(t, h, 65536)
    text = lower_for_cuda(msa_index_scores_default, *specs)
    assert custom_call_counts(text) == {"mosaic": int(want == "mosaic"),
                                        "triton": int(want == "triton"), "other": 0}
    for p, launches in ((512, 1), (4096, 2)):
        scores = jax.ShapeDtypeStruct((t, 1, p), jnp.float32)
        text = lower_for_cuda(sparse_topk_select_default, scores, specs[-1])
        assert custom_call_counts(text) == dict(mosaic=launches, triton=0, other=0)


@pytest.mark.parametrize("backend", [None, *BACKENDS])
def test_matches_reference_on_every_backend(backend):
    seed = fresh_seed()
    q, k, bt, req, pos = make_batch(seed, BF16, 2, 64)
    nvp = jnp.asarray(num_valid_pages_of(pos))
    for counts in (None, nvp):
        got = msa_index_select_default(q, k, bt, req, pos, counts, backend=backend)
        chex.assert_shape(got, (pos.shape[0], 2, TOPK))
        want = msa_index_select_reference(q, k, bt, req, pos, counts)
        chex.assert_trees_all_equal(got, want, custom_message=f"seed {seed}, counts {counts}")
    if backend == "triton":  # the same kernel as a direct call
        chex.assert_trees_all_equal(got, msa_index_select(q, k, bt, req, pos, nvp))


@pytest.mark.parametrize("backend", [None, "mosaic", "triton"])
def test_scores_and_select_alone_match_reference(backend):
    seed = fresh_seed()
    q, k, bt, req, pos = make_batch(seed, BF16, 2, 64)
    scores = msa_index_scores_default(q, k, bt, req, pos, backend=backend)
    check_scores(scores, msa_index_scores_reference(q, k, bt, req, pos), pos, 2)
    nvp = jnp.asarray(np.asarray(num_valid_pages_of(pos)) + 3)  # past the position: -inf pages
    got = sparse_topk_select_default(scores, nvp, local_blocks=2, backend=backend)
    chex.assert_trees_all_equal(
        got, sparse_topk_select_reference(scores, nvp, local_blocks=2),
        custom_message=f"seed {seed}")


def test_past_1024_columns_matches_reference():
    """A block table of 1030 columns (the batch's 32, then -1 past every request's pages):
    Mosaic scores and the chunked select against the reference, for two tokens of the batch
    (positions 3999 and 2046; interpreting the scores kernel costs per column), with counts
    from the positions and given ones past them."""
    seed = fresh_seed()
    q, k, bt, req, pos = make_batch(seed, BF16, 2, 64)
    bt = jnp.pad(bt, ((0, 0), (0, 1030 - bt.shape[1])), constant_values=-1)
    q, req, pos = q[7:9], req[7:9], pos[7:9]
    for counts in (None, jnp.asarray(num_valid_pages_of(pos)) + 2):
        got = msa_index_select_default(q, k, bt, req, pos, counts, local_blocks=2,
                                       backend="mosaic")
        want = msa_index_select_reference(q, k, bt, req, pos, counts, local_blocks=2)
        chex.assert_shape(got, (2, 2, TOPK))
        chex.assert_trees_all_equal(got, want, custom_message=f"seed {seed}, counts {counts}")


def test_rejects_an_unknown_backend():
    q, k, bt, req, pos = make_batch(fresh_seed(), BF16, 2, 64)
    with pytest.raises(ValueError, match="backend must be one of"):
        msa_index_select_default(q, k, bt, req, pos, backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        msa_index_scores_default(q, k, bt, req, pos, backend="mixed")
    with pytest.raises(ValueError, match="backend must be one of"):
        sparse_topk_select_default(jnp.zeros((1, 1, 32)), jnp.ones((1,), jnp.int32),
                                   backend="cuda")

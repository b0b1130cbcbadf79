"""The default indexer + select: the kernel it picks per call, and that either kernel behind it
matches the reference.

The choice is checked on the CUDA lowering for an abstract H200 (which custom calls the call
lowers to). Numerics: ``test_index_scores.make_batch``'s batch (padded tokens, block-table
entries past each request at -1 or N + 7, a poison page) with given page counts; on a CPU
backend both kernels run interpreted, on the H200 compiled.
"""
from __future__ import annotations

import chex
import jax.numpy as jnp
import pytest

from _helpers import fresh_seed
from pallas_kernels import TOPK
from pallas_kernels._lowering import custom_call_counts, lower_for_cuda
from pallas_kernels.index_select import (msa_index_select, msa_index_select_reference,
                                         num_valid_pages_of)
from pallas_kernels.index_select_default import (MOSAIC_MAX_TOKENS, index_backend,
                                                 msa_index_select_default)
from test_index_scores import make_batch
from test_index_select_mgpu import index_specs

BF16, F16, FP8 = jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn


@pytest.mark.parametrize("t,p,h,di,q_dtype,k_dtype,interpreting,want", [
    (1, 64, 1, 128, BF16, BF16, False, "mosaic"),
    (1, 512, 4, 128, F16, F16, False, "mosaic"),
    (MOSAIC_MAX_TOKENS, 512, 4, 128, BF16, BF16, False, "mosaic"),
    (MOSAIC_MAX_TOKENS + 1, 64, 1, 128, BF16, BF16, False, "triton"),
    (1, 512, 1, 128, FP8, FP8, False, "mosaic"),      # e4m3 queries over an e4m3 cache
    (64, 512, 1, 128, FP8, FP8, False, "triton"),
    (1, 512, 1, 128, BF16, FP8, False, "triton"),     # bf16 queries over an e4m3 cache
    (1, 512, 16, 128, BF16, BF16, False, "triton"),   # more than 8 index heads
    (1, 512, 1, 96, BF16, BF16, False, "triton"),     # index dims 64 and 128 only
    (1, 2048, 1, 128, BF16, BF16, False, "triton"),   # over 1024 block-table columns
    (1, 64, 1, 128, BF16, BF16, True, "triton"),      # interpreted: the Triton kernel
])
def test_index_backend_rule(t, p, h, di, q_dtype, k_dtype, interpreting, want):
    assert index_backend(t, p, h, di, q_dtype, k_dtype, interpreting=interpreting) == want


@pytest.mark.parametrize("t,h,context,dtype,want", [
    (1, 1, 8192, BF16, "mosaic"), (1, 4, 65536, BF16, "mosaic"), (16, 4, 65536, BF16, "mosaic"),
    (16, 1, 65536, FP8, "mosaic"), (64, 1, 8192, BF16, "triton"), (128, 4, 65536, FP8, "triton"),
])
def test_lowers_to_the_chosen_kernel_for_h200(t, h, context, dtype, want):
    """Compiled for an H200 (``interpret=None`` under an abstract H200 mesh), the call lowers
    to the chosen kernel's custom calls only: two Mosaic GPU ones, or one Triton one."""
    text = lower_for_cuda(msa_index_select_default, *index_specs(t, h, context, dtype))
    counts = dict(mosaic=2, triton=0) if want == "mosaic" else dict(mosaic=0, triton=1)
    assert custom_call_counts(text) == dict(counts, other=0)


@pytest.mark.parametrize("backend", [None, "mosaic", "triton"])
def test_matches_reference_on_either_kernel(backend):
    seed = fresh_seed()
    q, k, bt, req, pos = make_batch(seed, BF16, 2, 64)
    nvp = jnp.asarray(num_valid_pages_of(pos))
    got = msa_index_select_default(q, k, bt, req, pos, nvp, backend=backend)
    chex.assert_shape(got, (pos.shape[0], 2, TOPK))
    chex.assert_trees_all_equal(got, msa_index_select_reference(q, k, bt, req, pos, nvp),
                                custom_message=f"seed {seed}")
    if backend == "triton":  # the same kernel as a direct call
        chex.assert_trees_all_equal(got, msa_index_select(q, k, bt, req, pos, nvp))


def test_rejects_an_unknown_backend():
    q, k, bt, req, pos = make_batch(fresh_seed(), BF16, 2, 64)
    with pytest.raises(ValueError, match="backend must be one of"):
        msa_index_select_default(q, k, bt, req, pos, backend="cuda")

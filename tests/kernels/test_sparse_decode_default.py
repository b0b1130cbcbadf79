"""The default sparse decode: the kernel it picks per call, and that either kernel behind it
matches the reference.

The choice is checked on the CUDA lowering for an abstract H200 (which custom call the call
lowers to). Numerics: a fresh ``_decode_batch.build_batch`` of 68 (token, KV head) rows (the
Mosaic GPU kernel then runs clusters of 2, which the CPU interpreter can run in process);
on a CPU backend both kernels run interpreted, on the H200 compiled.
"""
from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from _decode_batch import POISON_V, build_batch, decode_specs as _specs
from _helpers import fresh_seed
from pallas_kernels._lowering import custom_call_counts, lower_for_cuda
from pallas_kernels.sparse_decode import sparse_decode, sparse_decode_reference
from pallas_kernels.sparse_decode_default import (decode_backend,
                                                  sparse_decode_default)


@pytest.mark.parametrize("rows,hq,hkv,d,dtype,interpreting,want", [
    (1, 16, 1, 128, jnp.bfloat16, False, "mosaic"),
    (264, 64, 4, 128, jnp.bfloat16, False, "mosaic"),
    (265, 16, 1, 128, jnp.bfloat16, False, "mosaic"),  # every row count: Triton is deprecated
    (8192, 64, 4, 128, jnp.float16, False, "mosaic"),  # a 2048-token chunk at 64/4
    (1, 16, 1, 128, jnp.float32, False, "triton"),   # wgmma operands are 16-bit
    (1, 16, 1, 256, jnp.bfloat16, False, "triton"),  # head dims 64 and 128 only
    (1, 128, 1, 128, jnp.bfloat16, False, "triton"),  # GQA group over 64 rows
    (1, 16, 1, 128, jnp.bfloat16, True, "triton"),   # interpreted: the Triton kernel
])
def test_decode_backend_rule(rows, hq, hkv, d, dtype, interpreting, want):
    assert decode_backend(rows, hq, hkv, d, dtype, interpreting=interpreting) == want


@pytest.mark.parametrize("t,hq,hkv,dtype,want", [
    (1, 16, 1, jnp.bfloat16, "mosaic"), (4, 64, 4, jnp.bfloat16, "mosaic"),
    (16, 16, 1, jnp.bfloat16, "mosaic"), (16, 64, 4, jnp.bfloat16, "mosaic"),
    (32, 64, 4, jnp.bfloat16, "mosaic"), (128, 16, 1, jnp.bfloat16, "mosaic"),
    (66, 64, 4, jnp.bfloat16, "mosaic"), (264, 16, 1, jnp.bfloat16, "mosaic"),
    (67, 64, 4, jnp.bfloat16, "mosaic"), (265, 16, 1, jnp.bfloat16, "mosaic"),
    (2048, 16, 1, jnp.bfloat16, "mosaic"), (2048, 64, 4, jnp.bfloat16, "mosaic"),
    (1, 16, 1, jnp.float32, "triton"),
])
def test_lowers_to_the_chosen_kernel_for_h200(t, hq, hkv, dtype, want):
    """Compiled for an H200 (``interpret=None`` under an abstract H200 mesh), the call lowers
    to exactly one custom call of the chosen kernel."""
    text = lower_for_cuda(sparse_decode_default, *_specs(t, hq, hkv, dtype=dtype),
                          scale=128 ** -0.5)
    counts = dict(mosaic=1, triton=0) if want == "mosaic" else dict(mosaic=0, triton=1)
    assert custom_call_counts(text) == dict(counts, other=0)


@pytest.mark.parametrize("backend", [None, "mosaic", "triton"])
def test_matches_reference_on_either_kernel(backend):
    seed = fresh_seed()
    args, _ = build_batch(seed, hq=16, hkv=4, d=64, tokens=16, long_first=True)
    args = tuple(jnp.asarray(a) for a in args)
    scale = 64 ** -0.5
    out, lse = sparse_decode_default(*args, scale=scale, backend=backend)
    ref_out, ref_lse = sparse_decode_reference(*args, scale=scale)
    chex.assert_shape((out, lse), (args[0].shape, args[0].shape[:2]))
    chex.assert_tree_all_finite(out)
    assert float(jnp.max(jnp.abs(out.astype(jnp.float32)))) < 0.1 * POISON_V, seed
    chex.assert_trees_all_close(out.astype(jnp.float32), ref_out.astype(jnp.float32),
                                atol=2e-2, rtol=2e-2, custom_message=f"seed {seed}")
    chex.assert_trees_all_close(lse, ref_lse, atol=1e-3, rtol=1e-4,
                                custom_message=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(lse[-1]), -np.inf)
    if backend == "triton":  # the same kernel as a direct call
        chex.assert_trees_all_equal((out, lse), sparse_decode(*args, scale=scale))


def test_rejects_an_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        args, _ = build_batch(0, hq=16, hkv=1, d=64, tokens=2)
        sparse_decode_default(*map(jnp.asarray, args), scale=1.0, backend="cuda")

"""The default sparse decode: the kernel it picks per call, and that either kernel behind it
matches the reference.

The choice is checked on the CUDA lowering for an abstract H200 (which custom call the call
lowers to). Numerics: a fresh random batch of 64 (token, KV head) rows (the Mosaic GPU kernel
then runs clusters of 2, which the CPU interpreter can run in process) with -1 and
out-of-range ids, padded rows and a finite poison page wherever no token may read; on a CPU
backend both kernels run interpreted, on the H200 compiled.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _helpers import fresh_seed
from pallas_kernels import PAGE_SIZE, TOPK
from pallas_kernels._lowering import TRITON_CUSTOM_CALL, lower_for_cuda
from pallas_kernels.sparse_decode import sparse_decode, sparse_decode_reference
from pallas_kernels.sparse_decode_default import (MOSAIC_MAX_ROWS, decode_backend,
                                                  sparse_decode_default)

POISON_V = 1000.0


@pytest.mark.parametrize("rows,hq,hkv,d,dtype,interpreting,want", [
    (1, 16, 1, 128, jnp.bfloat16, False, "mosaic"),
    (MOSAIC_MAX_ROWS, 64, 4, 128, jnp.bfloat16, False, "mosaic"),
    (MOSAIC_MAX_ROWS + 1, 16, 1, 128, jnp.bfloat16, False, "triton"),
    (512, 64, 4, 128, jnp.float16, False, "triton"),
    (1, 16, 1, 128, jnp.float32, False, "triton"),   # wgmma operands are 16-bit
    (1, 16, 1, 256, jnp.bfloat16, False, "triton"),  # head dims 64 and 128 only
    (1, 128, 1, 128, jnp.bfloat16, False, "triton"),  # GQA group over 64 rows
    (1, 16, 1, 128, jnp.bfloat16, True, "triton"),   # interpreted: the Triton kernel
])
def test_decode_backend_rule(rows, hq, hkv, d, dtype, interpreting, want):
    assert decode_backend(rows, hq, hkv, d, dtype, interpreting=interpreting) == want


def _specs(t, hq, hkv, d=128, dtype=jnp.bfloat16):
    s = jax.ShapeDtypeStruct
    return (s((t, hq, d), dtype), s((4096, hkv, PAGE_SIZE, 2 * d), dtype),
            s((t, hkv, TOPK), jnp.int32), s((128, 512), jnp.int32), s((t,), jnp.int32),
            s((t,), jnp.int32))


@pytest.mark.parametrize("t,hq,hkv,dtype,want", [
    (1, 16, 1, jnp.bfloat16, "mosaic"), (4, 64, 4, jnp.bfloat16, "mosaic"),
    (16, 16, 1, jnp.bfloat16, "mosaic"), (16, 64, 4, jnp.bfloat16, "triton"),
    (128, 16, 1, jnp.bfloat16, "triton"), (1, 16, 1, jnp.float32, "triton"),
])
def test_lowers_to_the_chosen_kernel_for_h200(t, hq, hkv, dtype, want):
    """Compiled for an H200 (``interpret=None`` under an abstract H200 mesh), the call lowers
    to exactly one custom call of the chosen kernel."""
    text = lower_for_cuda(sparse_decode_default, *_specs(t, hq, hkv, dtype=dtype),
                          scale=128 ** -0.5)
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    mosaic = [c for c in calls if "@mosaic_gpu" in c]
    triton = [c for c in calls if TRITON_CUSTOM_CALL in c]
    assert (len(mosaic), len(triton)) == ((1, 0) if want == "mosaic" else (0, 1)), calls


def random_batch(seed, *, tokens=16, hq=16, hkv=4, d=64, dtype=jnp.bfloat16):
    """``tokens`` decode tokens (the last one padded: kv_len 0) of one request each, random
    kv lengths (not multiples of 128, up to 20 blocks), selections with repeats, -1 and
    out-of-range ids; every block-table entry no token may read is the poison page
    (K = 0, V = 1000), so a read of it shows in the output."""
    rng = np.random.default_rng(seed)
    kv_lens = rng.integers(1, 20 * PAGE_SIZE, tokens).astype(np.int32)
    kv_lens[-1] = 0
    cols = 21
    n_pages = tokens * cols + 2
    poison = n_pages - 1
    blocks = -(-kv_lens // PAGE_SIZE)
    block_table = np.full((tokens, cols), poison, np.int32)
    pages = rng.permutation(np.arange(1, poison))
    for i in range(tokens):
        block_table[i, :blocks[i]] = pages[i * cols:i * cols + blocks[i]]
    sel = rng.integers(0, np.maximum(blocks, 1)[:, None, None], (tokens, hkv, TOPK))
    sel[rng.random(sel.shape) < 0.2] = -1
    sel[rng.random(sel.shape) < 0.05] = 100_000
    kv = rng.standard_normal((n_pages, hkv, PAGE_SIZE, 2 * d)).astype(np.float32)
    kv[poison, :, :, :d] = 0.0
    kv[poison, :, :, d:] = POISON_V
    q = rng.standard_normal((tokens, hq, d)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(kv, dtype), jnp.asarray(sel, jnp.int32),
            jnp.asarray(block_table), jnp.arange(tokens, dtype=jnp.int32),
            jnp.asarray(kv_lens))


@pytest.mark.parametrize("backend", [None, "mosaic", "triton"])
def test_matches_reference_on_either_kernel(backend):
    seed = fresh_seed()
    args = random_batch(seed)
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
        sparse_decode_default(*random_batch(0, tokens=2, hkv=1), scale=1.0, backend="cuda")

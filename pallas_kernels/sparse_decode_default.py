"""The default sparse decode: which of the two decode kernels runs a call.

Both kernels compute :func:`pallas_kernels.sparse_decode.sparse_decode` (same arguments,
results, safety boundary and reference). The Mosaic GPU kernel
(:mod:`pallas_kernels.sparse_decode_mgpu`) is one launch with programmatic dependent launch;
the Triton kernel (:mod:`pallas_kernels.sparse_decode`) is on JAX's deprecated Pallas Triton
backend. :func:`decode_backend` picks Mosaic GPU for every compiled call whose dtype, head
dim and GQA group it supports (prefill chunks included: a chunk's rows are decode rows to
it), Triton otherwise. Interpreted calls (a CPU backend) run the Triton kernel unless
``backend`` names one.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._interpret import resolve_interpret
from pallas_kernels.sparse_decode import sparse_decode, validate_inputs
from pallas_kernels.sparse_decode_mgpu import HEAD_DIMS, ROWS, sparse_decode_mgpu

BACKENDS = ("mosaic", "triton")
_MOSAIC_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def decode_backend(num_rows: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype,
                   *, interpreting: bool) -> str:
    """``"mosaic"`` or ``"triton"`` for a call of ``num_rows = T * Hkv`` rows (see the module
    docstring; every row count runs on Mosaic GPU)."""
    mosaic_ok = (jnp.dtype(dtype) in _MOSAIC_DTYPES and head_dim in HEAD_DIMS
                 and num_q_heads // num_kv_heads <= ROWS)
    if interpreting or not mosaic_ok:
        return "triton"
    return "mosaic"


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "backend"))
def sparse_decode_default(q, kv_cache, selected, block_table, req_indices, kv_lens, *, scale,
                          interpret=None, backend=None):
    """MSA sparse decode on the kernel :func:`decode_backend` picks.

    Arguments and results as :func:`pallas_kernels.sparse_decode.sparse_decode` (q ``[T, Hq,
    D]``, kv_cache ``[N, Hkv, 128, 2D]``, selected ``[T, Hkv, 16]`` int32, block_table ``[R, P]``
    int32, req_indices and kv_lens ``[T]`` int32 -> ``(out [T, Hq, D] q.dtype, lse [T, Hq]
    f32)``), with each kernel's launch defaults. ``backend``: None (the rule), ``"mosaic"``
    or ``"triton"`` (static).
    """
    t, hq, d, _, hkv, _, _ = validate_inputs(q, kv_cache, selected, block_table, req_indices,
                                             kv_lens, name="sparse_decode_default")
    if backend is None:
        backend = decode_backend(t * hkv, hq, hkv, d, q.dtype,
                                 interpreting=resolve_interpret(interpret))
    if backend not in BACKENDS:
        raise ValueError(f"sparse_decode_default: backend must be one of {BACKENDS} or None, "
                         f"got {backend!r}")
    kernel = sparse_decode_mgpu if backend == "mosaic" else sparse_decode
    return kernel(q, kv_cache, selected, block_table, req_indices, kv_lens, scale=scale,
                  interpret=interpret)


__all__ = ["sparse_decode_default", "decode_backend", "BACKENDS"]

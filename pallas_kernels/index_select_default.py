"""The default indexer + top-16 select: which of the two kernels runs a call.

Both compute :func:`pallas_kernels.index_select.msa_index_select` (same arguments, results,
safety boundary and reference). The Mosaic GPU kernels
(:mod:`pallas_kernels.index_select_mgpu`) are two launches with programmatic dependent
launch; the Triton kernel (:mod:`pallas_kernels.index_select`) is one launch after a counter
memset. :func:`index_backend` picks Mosaic GPU for compiled calls of at most
:data:`MOSAIC_MAX_TOKENS` tokens whose dtypes (bf16, f16, or e4m3 queries over an e4m3 cache),
head count, index dim and block-table width it supports, Triton otherwise (bench/RESULTS.md
has the measurements behind the bound). Interpreted calls (a CPU backend) run the Triton
kernel unless ``backend`` names one.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._interpret import resolve_interpret
from pallas_kernels.index_scores import validate_index_inputs
from pallas_kernels.index_select import msa_index_select
from pallas_kernels.index_select_mgpu import (DTYPES, HEAD_DIMS, MAX_HEADS, MAX_PAGES,
                                              msa_index_select_mgpu)

MOSAIC_MAX_TOKENS = 16  # tokens T up to which the Mosaic GPU kernels are the default
BACKENDS = ("mosaic", "triton")


def index_backend(num_tokens: int, max_pages: int, num_heads: int, index_dim: int, q_dtype,
                  k_dtype, *, interpreting: bool) -> str:
    """``"mosaic"`` or ``"triton"`` for a call of ``num_tokens`` tokens and ``num_heads`` index
    heads over a block table of ``max_pages`` columns (see the module docstring)."""
    mosaic_ok = (jnp.dtype(q_dtype) in DTYPES
                 and jnp.dtype(k_dtype) == jnp.dtype(q_dtype)
                 and num_heads <= MAX_HEADS and index_dim in HEAD_DIMS
                 and max_pages <= MAX_PAGES)
    if interpreting or not mosaic_ok or num_tokens > MOSAIC_MAX_TOKENS:
        return "triton"
    return "mosaic"


@functools.partial(jax.jit, static_argnames=("local_blocks", "init_blocks", "interpret",
                                             "backend"))
def msa_index_select_default(index_q, index_k_cache, block_table, req_indices, positions,
                             num_valid_pages=None, *, local_blocks=1, init_blocks=0,
                             interpret=None, backend=None):
    """Selected block ids ``[T, H, 16]`` int32 on the kernel :func:`index_backend` picks.

    Arguments and results as :func:`pallas_kernels.index_select.msa_index_select` (index_q
    ``[T, H, Di]``, index_k_cache ``[N, 128, Di]``, block_table ``[R, P]`` int32, req_indices
    and positions ``[T]`` int32, num_valid_pages ``[T]`` int32 or None), with each kernel's
    launch defaults. ``backend``: None (the rule), ``"mosaic"`` or ``"triton"`` (static).
    """
    validate_index_inputs(index_q, index_k_cache, block_table, req_indices, positions)
    t, h, di = index_q.shape
    if backend is None:
        backend = index_backend(t, block_table.shape[1], h, di, index_q.dtype,
                                index_k_cache.dtype, interpreting=resolve_interpret(interpret))
    if backend not in BACKENDS:
        raise ValueError(f"msa_index_select_default: backend must be one of {BACKENDS} or "
                         f"None, got {backend!r}")
    kernel = msa_index_select_mgpu if backend == "mosaic" else msa_index_select
    return kernel(index_q, index_k_cache, block_table, req_indices, positions, num_valid_pages,
                  local_blocks=local_blocks, init_blocks=init_blocks, interpret=interpret)


__all__ = ["msa_index_select_default", "index_backend", "MOSAIC_MAX_TOKENS", "BACKENDS"]

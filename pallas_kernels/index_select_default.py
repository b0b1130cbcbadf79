"""The default indexer kernels: which kernel runs each call of the indexer, its scores alone
(the DCP path) and the select alone.

Each default computes the same thing as its Triton kernel (same arguments, results, safety
boundary and reference); bench/RESULTS.md has the H200 measurements behind each rule. A rule
picks a Mosaic GPU kernel (:mod:`pallas_kernels.index_select_mgpu`, launched with programmatic
dependent launch) only for compiled calls whose dtypes (bf16, f16, or e4m3 queries over an
e4m3 cache), head count and index dim it supports; interpreted calls (a CPU backend) run the
Triton kernels unless ``backend`` names one.

- :func:`index_backend` (indexer + select): ``"mosaic"`` (the streaming scores kernel and the
  select, two Mosaic launches; over ``MAX_PAGES`` columns the select is
  :mod:`pallas_kernels.topk_select_chunked`'s two) for block tables of at most
  ``max_chunked_pages()`` columns; ``"triton"`` (one fused launch after a counter memset)
  otherwise.
- :func:`scores_backend` (scores alone): Mosaic wherever it is supported, Triton otherwise.
- :func:`select_backend` (select alone): Mosaic for ``topk`` 16 and up to
  ``max_chunked_pages()`` columns at any token count (chunked over ``MAX_PAGES``), Triton
  otherwise.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._interpret import resolve_interpret
from pallas_kernels._shapes import TOPK
from pallas_kernels.index_scores import msa_index_scores, validate_index_inputs
from pallas_kernels.index_select import msa_index_select, num_valid_pages_of
from pallas_kernels.index_select_mgpu import (DTYPES, HEAD_DIMS, MAX_HEADS, MAX_PAGES,
                                              msa_index_scores_mgpu, msa_index_select_mgpu)
from pallas_kernels.topk_select import sparse_topk_select, validate_scores
from pallas_kernels.topk_select_chunked import max_chunked_pages, sparse_topk_select_chunked

BACKENDS = ("mosaic", "triton")


def _mosaic_scores_ok(num_heads: int, index_dim: int, q_dtype, k_dtype) -> bool:
    return (jnp.dtype(q_dtype) in DTYPES and jnp.dtype(k_dtype) == jnp.dtype(q_dtype)
            and num_heads <= MAX_HEADS and index_dim in HEAD_DIMS)


def index_backend(max_pages: int, num_heads: int, index_dim: int, q_dtype, k_dtype, *,
                  interpreting: bool) -> str:
    """``"mosaic"`` or ``"triton"`` for an indexer + select call of ``num_heads`` index heads
    over a block table of ``max_pages`` columns (see the module docstring)."""
    if (interpreting or max_pages > max_chunked_pages()
            or not _mosaic_scores_ok(num_heads, index_dim, q_dtype, k_dtype)):
        return "triton"
    return "mosaic"


def scores_backend(num_heads: int, index_dim: int, q_dtype, k_dtype, *,
                   interpreting: bool) -> str:
    """``"mosaic"`` or ``"triton"`` for a scores call (see the module docstring)."""
    if interpreting or not _mosaic_scores_ok(num_heads, index_dim, q_dtype, k_dtype):
        return "triton"
    return "mosaic"


def select_backend(num_tokens: int, max_pages: int, topk: int, *, interpreting: bool) -> str:
    """``"mosaic"`` or ``"triton"`` for a select call (see the module docstring)."""
    if interpreting or topk != TOPK or max_pages > max_chunked_pages():
        return "triton"
    return "mosaic"


def _checked(backend, allowed, name):
    if backend not in allowed:
        raise ValueError(f"{name}: backend must be one of {allowed} or None, got {backend!r}")
    return backend


@functools.partial(jax.jit, static_argnames=("local_blocks", "init_blocks", "interpret",
                                             "backend"))
def msa_index_select_default(index_q, index_k_cache, block_table, req_indices, positions,
                             num_valid_pages=None, *, local_blocks=1, init_blocks=0,
                             interpret=None, backend=None):
    """Selected block ids ``[T, H, 16]`` int32 on the kernels :func:`index_backend` picks.

    Arguments and results as :func:`pallas_kernels.index_select.msa_index_select` (index_q
    ``[T, H, Di]``, index_k_cache ``[N, 128, Di]``, block_table ``[R, P]`` int32, req_indices
    and positions ``[T]`` int32, num_valid_pages ``[T]`` int32 or None), with each kernel's
    launch defaults. ``backend``: None (the rule), or one of :data:`BACKENDS` (static).
    """
    validate_index_inputs(index_q, index_k_cache, block_table, req_indices, positions)
    _, h, di = index_q.shape
    if backend is None:
        backend = index_backend(block_table.shape[1], h, di, index_q.dtype,
                                index_k_cache.dtype, interpreting=resolve_interpret(interpret))
    kw = dict(local_blocks=local_blocks, init_blocks=init_blocks, interpret=interpret)
    args = (index_q, index_k_cache, block_table, req_indices, positions)
    if _checked(backend, BACKENDS, "msa_index_select_default") == "mosaic":
        if block_table.shape[1] <= MAX_PAGES:
            return msa_index_select_mgpu(*args, num_valid_pages, **kw)
        scores = msa_index_scores_mgpu(*args, interpret=interpret)
        counts = num_valid_pages_of(positions) if num_valid_pages is None else num_valid_pages
        return sparse_topk_select_chunked(scores, counts, **kw)
    return msa_index_select(*args, num_valid_pages, **kw)


@functools.partial(jax.jit, static_argnames=("interpret", "backend"))
def msa_index_scores_default(index_q, index_k_cache, block_table, req_indices, positions, *,
                             interpret=None, backend=None):
    """Block scores ``[T, H, P]`` f32 on the kernel :func:`scores_backend` picks; arguments and
    results as :func:`pallas_kernels.index_scores.msa_index_scores`. ``backend``: None (the
    rule), ``"mosaic"`` or ``"triton"`` (static)."""
    validate_index_inputs(index_q, index_k_cache, block_table, req_indices, positions)
    _, h, di = index_q.shape
    if backend is None:
        backend = scores_backend(h, di, index_q.dtype, index_k_cache.dtype,
                                 interpreting=resolve_interpret(interpret))
    kernel = {"mosaic": msa_index_scores_mgpu, "triton": msa_index_scores}[
        _checked(backend, BACKENDS, "msa_index_scores_default")]
    return kernel(index_q, index_k_cache, block_table, req_indices, positions,
                  interpret=interpret)


@functools.partial(jax.jit, static_argnames=("topk", "local_blocks", "init_blocks", "interpret",
                                             "backend"))
def sparse_topk_select_default(scores, num_valid_pages, *, topk=TOPK, local_blocks=1,
                               init_blocks=0, interpret=None, backend=None):
    """Selected block ids ``[T, H, topk]`` int32 on the kernel :func:`select_backend` picks;
    arguments and results as :func:`pallas_kernels.topk_select.sparse_topk_select`.
    ``backend``: None (the rule), ``"mosaic"`` or ``"triton"`` (static)."""
    validate_scores(scores, num_valid_pages, topk, local_blocks, init_blocks)
    t, _, p = scores.shape
    if backend is None:
        backend = select_backend(t, p, topk, interpreting=resolve_interpret(interpret))
    kernel = {"mosaic": sparse_topk_select_chunked, "triton": sparse_topk_select}[
        _checked(backend, ("mosaic", "triton"), "sparse_topk_select_default")]
    return kernel(scores, num_valid_pages, topk=topk, local_blocks=local_blocks,
                  init_blocks=init_blocks, interpret=interpret)


__all__ = ["msa_index_select_default", "msa_index_scores_default", "sparse_topk_select_default",
           "index_backend", "scores_backend", "select_backend", "BACKENDS"]

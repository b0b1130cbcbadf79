"""The top-16 page select over more block-table columns than one select kernel holds: two
launches of the Mosaic GPU select
(:func:`pallas_kernels.index_select_mgpu.sparse_topk_select_mgpu`, at most ``MAX_PAGES``
columns a row) with XLA between them.

The selector's rules (:mod:`pallas_kernels.topk_select`) are applied to the whole row first
(``prepare_scores``: forced blocks +inf, invalid and NaN -inf, -0 as +0), so what is left is
a plain top-16 by (score desc, block id asc) with -inf picks as -1, which decomposes:

1. the row is cut into ``C = ceil(P / chunk_pages) >= 2`` chunks (one chunk: the one-pass
   select); the select takes each chunk's top 16 (``[T * C, H, chunk_pages]``, no forcing,
   every column valid);
2. the ``16 C`` winners, in chunk order and ascending within a chunk (so their position order
   is their block-id order), are gathered with their scores (-1 picks as -inf); the select
   takes the top 16 of those (no forcing) and the positions map back to block ids.

Every block of the row's top 16 is in its chunk's top 16 (fewer than 16 blocks of the chunk
beat it), and the order is total, so the result is the one-pass select's, bit for bit.

Shapes / dtypes:
  scores           [T, H, P]     f32, P <= chunk_pages * MAX_PAGES / 16 (stage 2 is one row)
  num_valid_pages  [T]           int32
  result           [T, H, 16]    int32, ascending, -1 last
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._shapes import TOPK
from pallas_kernels.index_select_mgpu import MAX_PAGES, ROW_TILE, sparse_topk_select_mgpu
from pallas_kernels.topk_select import prepare_scores, validate_scores


def max_chunked_pages(chunk_pages: int = MAX_PAGES) -> int:
    """The most columns a row may have: stage 2 holds ``16 C <= MAX_PAGES`` winners."""
    return chunk_pages * (MAX_PAGES // TOPK)


@functools.partial(jax.jit, static_argnames=("topk", "local_blocks", "init_blocks",
                                             "interpret", "chunk_pages"))
def sparse_topk_select_chunked(scores, num_valid_pages, *, topk=TOPK, local_blocks=1,
                               init_blocks=0, interpret=None, chunk_pages=MAX_PAGES):
    """Selected block ids ``[T, H, 16]`` int32, as
    :func:`pallas_kernels.topk_select.sparse_topk_select` (same arguments, rules and results),
    for rows of any length up to :func:`max_chunked_pages`. ``chunk_pages``: columns per
    stage-1 chunk, whole select row tiles (``ROW_TILE``) up to MAX_PAGES (static; tests use
    small ones).
    ``interpret``: as the Mosaic select's."""
    validate_scores(scores, num_valid_pages, topk, local_blocks, init_blocks)
    name = "sparse_topk_select_chunked"
    if topk != TOPK:
        raise ValueError(f"{name}: topk must be {TOPK}, got {topk}")
    if chunk_pages % ROW_TILE or not ROW_TILE <= chunk_pages <= MAX_PAGES:
        raise ValueError(f"{name}: chunk_pages must be a multiple of {ROW_TILE} in "
                         f"[{ROW_TILE}, {MAX_PAGES}], got {chunk_pages}")
    t, h, p = scores.shape
    if p > max_chunked_pages(chunk_pages):
        raise ValueError(f"{name}: {p} pages per row; at most {max_chunked_pages(chunk_pages)} "
                         f"(chunk_pages * {MAX_PAGES} / {TOPK})")
    if p <= chunk_pages:  # one chunk: the one-pass select
        return sparse_topk_select_mgpu(scores, num_valid_pages, topk=topk,
                                       local_blocks=local_blocks, init_blocks=init_blocks,
                                       interpret=interpret)
    ids = jnp.arange(p, dtype=jnp.int32)[None, None, :]
    x = prepare_scores(scores, ids, num_valid_pages[:, None, None], max_pages=p, topk=topk,
                       local_blocks=local_blocks, init_blocks=init_blocks)
    c = -(-p // chunk_pages)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, c * chunk_pages - p)), constant_values=-jnp.inf)
    chunks = x.reshape(t, h, c, chunk_pages).transpose(0, 2, 1, 3).reshape(t * c, h, chunk_pages)
    every = functools.partial(sparse_topk_select_mgpu, topk=TOPK, local_blocks=0, init_blocks=0,
                              interpret=interpret)
    local = every(chunks, jnp.full((t * c,), chunk_pages, jnp.int32))  # [T * C, H, 16]
    local = local.reshape(t, c, h, TOPK).transpose(0, 2, 1, 3)  # [T, H, C, 16]
    offset = (jnp.arange(c, dtype=jnp.int32) * chunk_pages)[None, None, :, None]
    winners = jnp.where(local >= 0, local + offset, -1).reshape(t, h, c * TOPK)
    cand = jnp.take_along_axis(x, jnp.maximum(winners, 0), axis=2)
    cand = jnp.where(winners >= 0, cand, -jnp.inf)
    pick = every(cand, jnp.full((t,), c * TOPK, jnp.int32))  # [T, H, 16] positions in cand
    out = jnp.take_along_axis(winners, jnp.maximum(pick, 0), axis=2)
    return jnp.where(pick >= 0, out, -1)


__all__ = ["sparse_topk_select_chunked", "max_chunked_pages"]

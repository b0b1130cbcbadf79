"""Dense paged causal attention: the contract, input checks, jnp reference and prefill tiling.

Token ``t`` (query heads ``[T, Hq, D]``) attends to keys ``[0, kv_lens[t])`` of its request
``req_indices[t]``: key ``j`` lives in page ``block_table[req, j // 128]``, row ``j % 128`` of
``kv_cache [N, Hkv, 128, 2D]`` (K = ``[..., :D]``, V = ``[..., D:]``), KV head ``h // G`` for
query head ``h`` (GQA group ``G = Hq / Hkv``). A token with ``kv_len`` 0 (padding) gives zeros
and ``lse = -inf``.

Safety boundary (kernels and reference): only the pages ``[0, ceil(kv_len / 128))`` of a
token's request are consumed, and of the last one only the rows below ``kv_len``; every other
page, row and block-table entry may hold anything (NaN, -1, out-of-range ids) without changing
the result. The request row is clamped to ``[0, R)`` and a consumed page id to ``[0, N)``
before they form an address (the batch validator reports such ids as errors in ``--debug``).

Prefill tiling (:func:`prefill_tiles`): the tokens of a batch are cut into tiles of at most
``block_q`` consecutive tokens of one request; the prefill kernel runs one CTA per (tile,
query head), so that a tile's tokens share each K/V page load.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels._shapes import PAGE_SIZE

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def check_cache_and_table(kv_cache, block_table, *, hq: int, d: int, dtype, q_name: str,
                          name: str) -> tuple[int, int]:
    """The checks every dense attention entry makes of ``kv_cache [N, Hkv, 128, 2D]`` (against
    the queries' ``hq`` heads, head dim ``d`` and ``dtype``; ``q_name`` names them) and of
    ``block_table [R, P]``: ``ValueError``/``TypeError`` naming the argument and bound
    (the table's int32 dtype is the caller's, with its other int32 inputs). Returns
    ``(N, Hkv)``."""
    def need(cond, msg, exc=ValueError):
        if not cond:
            raise exc(f"{name}: {msg}")

    need(kv_cache.ndim == 4,
         f"kv_cache must be [N, Hkv, {PAGE_SIZE}, 2*D], got shape {kv_cache.shape}")
    n, hkv, page, two_d = kv_cache.shape
    need(page == PAGE_SIZE, f"kv_cache page size (axis 2) must be {PAGE_SIZE}, got {page}")
    need(two_d == 2 * d, f"kv_cache last axis must be 2*D = {2 * d} (K then V), got {two_d}")
    need(n >= 1, f"kv_cache needs at least 1 page, got {n}")
    need(hkv >= 1 and hq % hkv == 0,
         f"{q_name} heads Hq = {hq} must be a multiple of kv_cache heads Hkv = {hkv}")
    need(kv_cache.dtype == dtype,
         f"kv_cache dtype {kv_cache.dtype} must equal {q_name} dtype {dtype}", TypeError)
    need(block_table.ndim == 2 and block_table.shape[0] >= 1 and block_table.shape[1] >= 1,
         f"block_table must be [R, P] with R, P >= 1, got shape {block_table.shape}")
    return n, hkv


def validate_inputs(q, kv_cache, block_table, req_indices, kv_lens, *, name: str):
    """Raise ``ValueError``/``TypeError`` naming the argument and bound; returns
    ``(T, Hq, D, N, Hkv, R, P)``."""
    def need(cond, msg, exc=ValueError):
        if not cond:
            raise exc(f"{name}: {msg}")

    need(q.ndim == 3, f"q must be [T, Hq, D], got shape {q.shape}")
    t, hq, d = q.shape
    need(jnp.dtype(q.dtype) in _FLOATS, f"q dtype must be bf16, f16 or f32, got {q.dtype}",
         TypeError)
    n, hkv = check_cache_and_table(kv_cache, block_table, hq=hq, d=d, dtype=q.dtype,
                                   q_name="q", name=name)
    need(req_indices.shape == (t,), f"req_indices must be [T] = {(t,)}, got {req_indices.shape}")
    need(kv_lens.shape == (t,), f"kv_lens must be [T] = {(t,)}, got {kv_lens.shape}")
    for arg, val in (("block_table", block_table), ("req_indices", req_indices),
                     ("kv_lens", kv_lens)):
        need(val.dtype == jnp.int32, f"{arg} dtype must be int32, got {val.dtype}", TypeError)
    r, p = block_table.shape
    return t, hq, d, n, hkv, r, p


def paged_attention_reference(q, kv_cache, block_table, req_indices, kv_lens, *, scale):
    """The contract in plain jnp (f32 math), one page at a time; unconsumed pages and rows are
    removed with selects before they meet a score or a value, so NaN there changes nothing.

    q ``[T, Hq, D]``; kv_cache ``[N, Hkv, 128, 2D]``; block_table ``[R, P]`` int32;
    req_indices, kv_lens ``[T]`` int32. Returns ``(out [T, Hq, D] q.dtype, lse [T, Hq] f32)``.
    """
    t, hq, d, n, hkv, r, p = validate_inputs(q, kv_cache, block_table, req_indices, kv_lens,
                                             name="paged_attention_reference")
    g = hq // hkv
    qg = q.astype(jnp.float32).reshape(t, hkv, g, d) * scale
    kv_len = jnp.maximum(kv_lens, 0)
    rows = block_table[jnp.clip(req_indices, 0, r - 1)]  # [T, P]
    key_off = jnp.arange(PAGE_SIZE, dtype=jnp.int32)

    def body(j, carry):
        m, l, acc = carry
        page = jnp.clip(rows[:, j], 0, n - 1)
        valid = (j * PAGE_SIZE + key_off)[None, :] < kv_len[:, None]  # [T, 128]
        kv = kv_cache[page].astype(jnp.float32)  # [T, Hkv, 128, 2D]
        kv = jnp.where(valid[:, None, :, None], kv, 0.0)
        k, v = kv[..., :d], kv[..., d:]
        s = jnp.einsum("thgd,thkd->thgk", qg, k, precision="highest")
        s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - m_safe)
        pr = jnp.exp(s - m_safe[..., None])
        l = l * alpha + jnp.sum(pr, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("thgk,thkd->thgd", pr, v,
                                                  precision="highest")
        return m_new, l, acc

    init = (jnp.full((t, hkv, g), -jnp.inf, jnp.float32), jnp.zeros((t, hkv, g), jnp.float32),
            jnp.zeros((t, hkv, g, d), jnp.float32))
    n_iters = jnp.minimum(jnp.max((kv_len + PAGE_SIZE - 1) // PAGE_SIZE, initial=0), p)
    m, l, acc = jax.lax.fori_loop(0, n_iters, body, init)  # up to the batch's longest context
    has = l > 0
    out = jnp.where(has[..., None], acc / jnp.where(has, l, 1.0)[..., None], 0.0)
    lse = jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)
    return out.reshape(t, hq, d).astype(q.dtype), lse.reshape(t, hq)


class PrefillTiles(NamedTuple):
    """Tiles of at most ``block_q`` consecutive tokens of one request (a pytree).

    token ``[NT, block_q]`` int32: the batch token of each tile row, ``-1`` for a row no token
    fills; req ``[NT]`` int32: the tile's request row (0 for an empty tile); kv_lens
    ``[NT, block_q]`` int32: the row's visible keys (0 for empty rows and tiles).
    """
    token: jax.Array
    req: jax.Array
    kv_lens: jax.Array


def max_tiles(num_tokens: int, block_q: int, num_reqs: int) -> int:
    """Static tile count that any batch of ``num_tokens`` tokens over ``num_reqs`` request
    rows fits: each request run adds at most one partial tile."""
    return max(1, min(num_tokens, -(-num_tokens // block_q) + num_reqs))


def prefill_tiles(req_indices, kv_lens, *, block_q: int, num_tiles: int) -> PrefillTiles:
    """Cut the batch into tiles: a tile starts at a token whose request differs from the
    previous token's, or ``block_q`` tokens into a run. Padded tokens (``kv_len`` 0) join the
    run they sit in and stay rows of kv_len 0. ``num_tiles`` (static) must be at least
    :func:`max_tiles`; tiles past the batch's own are empty.

    req_indices, kv_lens ``[T]`` int32 -> :class:`PrefillTiles`.
    """
    t = req_indices.shape[0]
    idx = jnp.arange(t, dtype=jnp.int32)
    new_run = jnp.concatenate([jnp.ones((1,), bool), req_indices[1:] != req_indices[:-1]])
    run_start = jax.lax.cummax(jnp.where(new_run, idx, 0))
    new_tile = (idx - run_start) % block_q == 0
    tile = jnp.cumsum(new_tile.astype(jnp.int32)) - 1  # [T]
    tile_start = jnp.full((num_tiles,), t, jnp.int32).at[tile].min(idx, mode="drop")
    row = idx - tile_start[tile]
    token = jnp.full((num_tiles, block_q), -1, jnp.int32).at[tile, row].set(idx, mode="drop")
    filled = token >= 0
    safe = jnp.where(filled, token, 0)
    lens = jnp.where(filled, jnp.maximum(kv_lens[safe], 0), 0)
    req = jnp.where(tile_start < t, req_indices[jnp.minimum(tile_start, t - 1)], 0)
    return PrefillTiles(token=token, req=req.astype(jnp.int32), kv_lens=lens)


def tiles_to_tokens(tiles: PrefillTiles, out_tiles, lse_tiles, num_tokens: int):
    """Per-token results from per-tile ones: out_tiles ``[NT, BQ, Hq, D]``, lse_tiles
    ``[NT, Hq, BQ]`` -> ``(out [T, Hq, D], lse [T, Hq])``."""
    nt, bq = tiles.token.shape
    flat = tiles.token.reshape(-1)
    flat = jnp.where(flat >= 0, flat, num_tokens)  # empty rows: out of bounds, dropped
    where = jnp.zeros((num_tokens,), jnp.int32).at[flat].set(
        jnp.arange(nt * bq, dtype=jnp.int32), mode="drop")
    tile, row = where // bq, where % bq
    return out_tiles[tile, row], lse_tiles[tile, :, row]


__all__ = ["validate_inputs", "check_cache_and_table", "paged_attention_reference", "PrefillTiles", "max_tiles",
           "prefill_tiles", "tiles_to_tokens", "LOG2E", "LN2"]

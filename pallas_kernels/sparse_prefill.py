"""MSA sparse prefill: sparse decode semantics for many tokens, page loads shared.

Same contract as :func:`pallas_kernels.sparse_decode.sparse_decode` (prefill rows pass
``kv_len = position + 1``). The kernel tiles the tokens: ``tokens_per_tile`` consecutive tokens
(TQ) form one program's dot rows (TQ x padded group, e.g. 4 x 16 = 64). For each (tile, KV head)
the wrapper builds, in jnp, the sorted union of the tile's consumed ``(request row, block)``
pairs (after the safety boundary); the kernel walks that union, loads each page once and masks
per row: a row takes the page with the multiplicity its token selected it, keys ``< kv_len`` of
the row's token. Consecutive tokens of one request select mostly the same pages, so a tile loads
about 16-30 pages instead of ``16 * TQ``; tokens of different requests in one tile stay correct
(the union keys carry the request row), they just share less.

The kernel re-derives every row's selection from the raw ``selected`` with the same boundary
(negative or ``>= ceil(kv_len/128)`` ids and slots ``>= n_use`` contribute nothing) and clamps
the union entry's request row, block and page id before forming an address, so a malformed union
can only waste work, never read out of bounds or change the result.

A tile's rows belong to different tokens, so a key can be valid for some rows and not for
others. Scores and probabilities are masked per row with selects; a V row that is NaN or inf
is zeroed for the shared dot and the rows that consume it get a NaN output instead, so a NaN
reaches exactly the rows that consume it (as in dense attention) and no other.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._interpret import resolve_interpret
from pallas_kernels._shapes import NUM_SMS_H200, PAGE_SIZE, TOPK, whole_block
from pallas_kernels.sparse_decode import (
    LOG2E, MASK, _check_tunable, check_pipeline_fits, consumed_slots, finalize,
    merge_splits, online_softmax_step, padded_group, sanitize_selection, step_bytes,
    sparse_decode_reference, validate_inputs)

MAX_TILE_ROWS = 256  # tokens_per_tile * padded group: accumulator rows of one program
_NO_KEY = jnp.iinfo(jnp.int32).max


def default_num_splits(num_programs: int) -> int:
    """Split factor (power of two <= 16) so that ``num_programs * splits`` fills the SMs."""
    splits = 1
    while splits < TOPK and num_programs * splits < NUM_SMS_H200:
        splits *= 2
    return splits


def default_num_stages(dtype, head_dim: int, tile_rows: int, num_warps: int) -> int:
    """Pipeline depth for a program of ``tile_rows`` dot rows on ``num_warps`` warps.

    The default 64-row tile (4 tokens x 16 heads) on 4 warps: 1 stage (unpipelined; the
    ``bench/prefill.py --sweep`` choice). Otherwise the deepest pipeline, at most 3, whose
    stage buffers (``stages * 128 * 2D * itemsize``, counted more conservatively than
    Triton's ``stages - 1``: a prefill program's larger dots need more scratch) stay within
    160 KiB: bf16 D=128 -> 2, f32 -> 1.
    """
    if tile_rows == 64 and num_warps == 4:
        return 1
    page_bytes = PAGE_SIZE * 2 * head_dim * jnp.dtype(dtype).itemsize
    return max(1, min(3, (160 * 1024) // page_bytes))


@functools.partial(jax.jit, static_argnames=("scale",))
def sparse_prefill_reference(q, kv_cache, selected, block_table, req_indices, kv_lens, *, scale):
    """Reference of :func:`sparse_prefill`: the decode reference (identical semantics).

    Returns ``(out [T,Hq,D] q.dtype, lse [T,Hq] f32)``.
    """
    validate_inputs(q, kv_cache, selected, block_table, req_indices, kv_lens,
                    name="sparse_prefill_reference")
    return sparse_decode_reference(q, kv_cache, selected, block_table, req_indices, kv_lens,
                                   scale=scale)


def tile_page_union(selected, kv_lens, req_rows, num_cols, tokens_per_tile):
    """Sorted unique consumed ``(row, block)`` keys ``row * P + block`` per (tile, KV head).

    ``selected [Tp,Hkv,16]``, ``kv_lens [Tp]``, ``req_rows [Tp]`` (clamped) int32, ``Tp`` a
    multiple of ``tokens_per_tile``. Returns ``(keys [Tp/TQ, Hkv, TQ*16] int32, count
    [Tp/TQ, Hkv] int32)``; entries at or beyond ``count`` are 0.
    """
    tp, hkv, _ = selected.shape
    tiles = tp // tokens_per_tile
    blk, ok = sanitize_selection(selected, kv_lens, num_cols)
    keys = jnp.where(ok, req_rows[:, None, None] * num_cols + blk, _NO_KEY)
    keys = keys.reshape(tiles, tokens_per_tile, hkv, TOPK).transpose(0, 2, 1, 3)
    keys = jnp.sort(keys.reshape(tiles, hkv, tokens_per_tile * TOPK), axis=-1)
    first = jnp.concatenate([jnp.ones_like(keys[..., :1], bool), keys[..., 1:] != keys[..., :-1]],
                            axis=-1) & (keys != _NO_KEY)
    count = jnp.sum(first, axis=-1, dtype=jnp.int32)
    keys = jnp.sort(jnp.where(first, keys, _NO_KEY), axis=-1)
    return jnp.where(keys == _NO_KEY, 0, keys), count


def _prefill_kernel(row_ref, len_ref, cnt_ref, bt_ref, sel_ref, union_ref, q_ref, kv_ref,
                    o_ref, lse_ref, *, num_splits, head_dim, num_pages, num_rows, num_cols,
                    group_rows, scale_log2):
    """One (tile, kv head, split): ``row_ref, len_ref [TQ]``, ``sel_ref [TQ,16]``,
    ``union_ref [TQ*16]``, ``q_ref [TQ*G,D]`` (token-major rows), whole
    ``kv_ref``/``bt_ref``/``cnt_ref``; writes ``o_ref [TQ*G,D]``, ``lse_ref [TQ*G]``."""
    tile = pl.program_id(0)
    h = pl.program_id(1)
    split = pl.program_id(2)
    count = cnt_ref[tile, h]
    chunk = (count + num_splits - 1) // num_splits
    first = split * chunk
    n_iter = jnp.clip(count - first, 0, chunk)

    tok_len = jnp.maximum(len_ref[...], 0)                                # [TQ]
    tok_row = row_ref[...]
    tq = tok_len.shape[0]
    rows = tq * group_rows
    sel = sel_ref[...]                                                    # [TQ,16]
    sel = jnp.where(consumed_slots(sel, tok_len, num_cols), sel, -1)
    # row -> token expansion as a [rows, TQ] one-hot (no gathers in Triton)
    row_tok = jnp.arange(rows, dtype=jnp.int32) // group_rows
    onehot = row_tok[:, None] == jnp.arange(tq, dtype=jnp.int32)[None, :]
    row_len = jnp.sum(jnp.where(onehot, tok_len[None, :], 0), axis=1)    # [rows]
    keys = jnp.arange(PAGE_SIZE, dtype=jnp.int32)
    q = q_ref[...]                                                        # [rows, D]
    # The whole union at once, outside the loop: clamp, then one gather of its page ids.
    ukey = jnp.clip(union_ref[...], 0, num_rows * num_cols - 1)         # [TQ*16]
    urow = ukey // num_cols
    ublk = ukey - urow * num_cols
    upage = jnp.clip(bt_ref[urow, ublk], 0, num_pages - 1)
    uslot = jnp.arange(ukey.shape[0], dtype=jnp.int32)

    def body(i, carry):
        pick = uslot == first + i                        # register "indexing": one-hot sum
        row = jnp.sum(jnp.where(pick, urow, 0))
        blk = jnp.sum(jnp.where(pick, ublk, 0))
        page = jnp.sum(jnp.where(pick, upage, 0))
        k = kv_ref[page, h, :, pl.ds(0, head_dim)]
        v = kv_ref[page, h, :, pl.ds(head_dim, head_dim)]
        hits = jnp.sum((sel == blk).astype(jnp.int32), axis=1)           # [TQ]
        hits = jnp.where(tok_row == row, hits, 0)
        row_hits = jnp.sum(jnp.where(onehot, hits[None, :], 0), axis=1)  # [rows]
        key_ok = (row_hits[:, None] > 0) & (blk * PAGE_SIZE + keys[None, :] < row_len[:, None])
        return online_softmax_step(carry, q, k, v, key_ok, scale_log2,
                                   row_weight=row_hits.astype(jnp.float32))

    init = (jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), MASK, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, n_iter, body, init)
    out, lse = finalize(acc, m, l)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "tokens_per_tile",
                                             "num_splits", "num_warps", "num_stages"))
def sparse_prefill(q, kv_cache, selected, block_table, req_indices, kv_lens, *, scale,
                   interpret=None, tokens_per_tile=4, num_splits=None, num_warps=None,
                   num_stages=None):
    """MSA sparse prefill: :func:`sparse_decode` semantics, page loads shared by a token tile.

    Args:
      q: ``[T, Hq, D]`` bf16/f16/f32, D a power of two >= 16.
      kv_cache: ``[N, Hkv, 128, 2D]`` (K then V), q's dtype.
      selected: ``[T, Hkv, 16]`` int32; block_table ``[R, P]``, req_indices ``[T]``,
        kv_lens ``[T]`` (``position + 1`` for prefill rows) int32.
      scale: softmax scale (static). interpret: Pallas interpret mode; None (default): on
        every backend but a GPU.
      tokens_per_tile: consecutive tokens per program (power of two; rows = TQ * padded group
        <= 256). num_splits: split of a tile's page union in {1, 2, 4, 8, 16}; default fills
        132 SMs. num_warps (default 4 up to 64 rows, else 8), num_stages (default
        :func:`default_num_stages`; ``num_stages - 1`` page buffers must fit 227 KiB): Triton
        tunables.
    Returns:
      ``(out [T, Hq, D] q.dtype, lse [T, Hq] f32)``; rows without a visible key give 0 / -inf;
      a NaN in a consumed key or value makes its row NaN.
    """
    t, hq, d, n, hkv, r, p = validate_inputs(q, kv_cache, selected, block_table, req_indices,
                                             kv_lens, name="sparse_prefill")
    g = hq // hkv
    gp = padded_group(hq, hkv)
    tq = tokens_per_tile
    if tq < 1 or tq & (tq - 1) or tq * gp > MAX_TILE_ROWS:
        raise ValueError(f"sparse_prefill: tokens_per_tile must be a power of two with "
                         f"tokens_per_tile * padded group {gp} <= {MAX_TILE_ROWS}, got {tq}")
    if r * p >= _NO_KEY:
        raise ValueError(f"sparse_prefill: block_table size R*P = {r * p} must be < 2**31 - 1")
    tiles = -(-t // tq)
    splits = default_num_splits(tiles * hkv) if num_splits is None else num_splits
    _check_tunable("num_splits", "sparse_prefill", splits, (1, 2, 4, 8, 16))
    num_warps = (4 if tq * gp <= 64 else 8) if num_warps is None else num_warps
    if num_stages is None:
        num_stages = default_num_stages(q.dtype, d, tq * gp, num_warps)
    _check_tunable("num_warps", "sparse_prefill", num_warps, (1, 2, 4, 8, 16))
    _check_tunable("num_stages", "sparse_prefill", num_stages, (1, 2, 3, 4, 5, 6))
    check_pipeline_fits("sparse_prefill", num_stages, step_bytes(q.dtype, d))
    if t == 0:
        return jnp.zeros((0, hq, d), q.dtype), jnp.zeros((0, hq), jnp.float32)

    tp = tiles * tq
    pad_t = tp - t
    rows = jnp.clip(req_indices, 0, r - 1)
    rows = jnp.pad(rows, (0, pad_t))
    lens = jnp.pad(kv_lens, (0, pad_t))                                   # padded tokens: 0
    sel = jnp.pad(selected, ((0, pad_t), (0, 0), (0, 0)), constant_values=-1)
    qg = jnp.pad(q.reshape(t, hkv, g, d), ((0, pad_t), (0, 0), (0, gp - g), (0, 0)))
    # [tiles, Hkv, TQ*G, D]: a tile's rows token-major (a pure reshape when Hkv == 1)
    qg = qg.reshape(tiles, tq, hkv, gp, d).transpose(0, 2, 1, 3, 4).reshape(tiles, hkv, tq * gp, d)
    union, count = tile_page_union(sel, lens, rows, p, tq)

    out_dtype = q.dtype if splits == 1 else jnp.float32
    kernel = functools.partial(_prefill_kernel, num_splits=splits, head_dim=d, num_pages=n,
                               num_rows=r, num_cols=p, group_rows=gp,
                               scale_log2=float(scale) * LOG2E)
    o, lse = pl.pallas_call(
        kernel,
        grid=(tiles, hkv, splits),
        in_specs=[
            pl.BlockSpec((tq,), lambda i, h, s: (i,)),                         # request rows
            pl.BlockSpec((tq,), lambda i, h, s: (i,)),                         # kv_lens
            whole_block(count.shape),                                          # union counts
            whole_block(block_table.shape),                                    # block_table
            pl.BlockSpec((tq, None, TOPK), lambda i, h, s: (i, h, 0)),         # selected
            pl.BlockSpec((None, None, tq * TOPK), lambda i, h, s: (i, h, 0)),  # union keys
            pl.BlockSpec((None, None, tq * gp, d), lambda i, h, s: (i, h, 0, 0)),  # q
            whole_block(kv_cache.shape),                                       # kv_cache
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, tq * gp, d), lambda i, h, s: (s, i, h, 0, 0)),
            pl.BlockSpec((None, None, None, tq * gp), lambda i, h, s: (s, i, h, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((splits, tiles, hkv, tq * gp, d), out_dtype),
                   jax.ShapeDtypeStruct((splits, tiles, hkv, tq * gp), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=resolve_interpret(interpret),
        name="msa_sparse_prefill",
    )(rows, lens, count, block_table, sel, union, qg, kv_cache)
    if splits == 1:
        o, lse = o[0], lse[0]
    else:
        o, lse = merge_splits(o, lse)
    o = o.reshape(tiles, hkv, tq, gp, d).transpose(0, 2, 1, 3, 4).reshape(tp, hkv, gp, d)
    lse = lse.reshape(tiles, hkv, tq, gp).transpose(0, 2, 1, 3).reshape(tp, hkv, gp)
    out = o[:t, :, :g].reshape(t, hq, d).astype(q.dtype)
    return out, lse[:t, :, :g].reshape(t, hq)


__all__ = ["sparse_prefill", "sparse_prefill_reference", "tile_page_union", "default_num_splits",
           "default_num_stages"]

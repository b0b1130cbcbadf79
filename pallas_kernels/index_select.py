"""MSA indexer and top-16 page select in one Pallas (Triton) kernel launch.

Result: the selection of :func:`pallas_kernels.topk_select.sparse_topk_select` over the block
scores of :func:`pallas_kernels.index_scores.msa_index_scores` (same safety boundary, same
tie-breaks), with ``num_valid_pages`` given or ``positions // 128 + 1``.

Kernel: grid ``(T, ceil(P / ppp))`` as the indexer's. Program ``(t, c)`` scores its ``ppp``
pages, stores them in an f32 scratch output ``[T, Hs, Pp]`` (``Pp`` a power of two >= P)
and takes a ticket from token t's counter (``pallas_kernels._ticket``). The program that
draws the last ticket reads the token's whole score row and runs the selection on it. No
program waits for another. With a single chunk per token the scores stay in registers and
there is no ticket.

Shapes / dtypes:
  index_q          [T, H, Di]   bf16 | f16 | f32
  index_k_cache    [N, 128, Di] index_q's dtype or float8_e4m3fn
  block_table      [R, P]       int32
  req_indices      [T]          int32
  positions        [T]          int32
  num_valid_pages  [T]          int32 (optional)
  result           [T, H, 16]   int32
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._interpret import resolve_interpret
from pallas_kernels._shapes import PAGE_SIZE, TOPK, next_pow2, whole_block
from pallas_kernels._ticket import last_to_arrive, with_ticket
from pallas_kernels.index_scores import chunk_scores, msa_index_scores_reference, scores_launch
from pallas_kernels.topk_select import (select_rows, sparse_topk_select_reference,
                                        validate_selection)


def num_valid_pages_of(positions: jax.Array) -> jax.Array:
    """nvp = positions // 128 + 1 (>= 0; clamped to P by the selector), int32 [T]."""
    return jnp.maximum(jnp.floor_divide(positions, PAGE_SIZE) + 1, 0).astype(jnp.int32)


def _index_select_kernel(q_ref, k_ref, bt_ref, req_ref, pos_ref, *refs, nvp_given, num_chunks,
                         select_kw, interpreting, **score_kw):
    """Program (t, c): ``q_ref [Hs, Di]`` (block), whole ``k_ref``, ``bt_ref``, ``req_ref``,
    ``pos_ref`` and, when ``nvp_given``, ``nvp_ref [T]`` (else nvp = position // 128 + 1);
    writes ``sel_ref [Hs, 16]`` (block). With several chunks also ``ticket_in_ref`` (whole
    ``[T]`` int32 zeros, aliased to ``ticket_ref``) and the whole scratch ``scores_ref
    [T, Hs, Pp]`` f32."""
    t = pl.program_id(0)
    c = pl.program_id(1)
    if nvp_given:
        nvp_ref, *refs = refs
        nvp = nvp_ref[t]
    else:
        nvp = jnp.floor_divide(pos_ref[t], PAGE_SIZE) + 1
    acc = chunk_scores(q_ref, k_ref, bt_ref, req_ref, pos_ref, **score_kw)   # [Hs, ppp]
    if num_chunks == 1:
        (sel_ref,) = refs
        sel_ref[...] = select_rows(acc, nvp, **select_kw)
        return
    _, sel_ref, scores_ref, ticket_ref = refs
    ppp = score_kw["pages_per_program"]
    scores_ref[t, :, pl.ds(c * ppp, ppp)] = acc

    @pl.when(last_to_arrive(ticket_ref, t, num_chunks, interpreting=interpreting))
    def _select():  # the token's last program: every chunk's scores are visible
        row = plt.load(scores_ref.at[t], volatile=True)                      # [Hs, Pp]
        sel_ref[...] = select_rows(row, nvp, **select_kw)


@functools.partial(jax.jit, static_argnames=("local_blocks", "init_blocks", "interpret",
                                             "pages_per_program", "num_warps", "num_stages",
                                             "preload_block_table"))
def msa_index_select(index_q: jax.Array, index_k_cache: jax.Array, block_table: jax.Array,
                     req_indices: jax.Array, positions: jax.Array,
                     num_valid_pages: jax.Array | None = None, *, local_blocks: int = 1,
                     init_blocks: int = 0, interpret: bool | None = None,
                     pages_per_program: int | None = None, num_warps: int = 4,
                     num_stages: int = 3, preload_block_table: bool = True) -> jax.Array:
    """Selected block ids ``[T, H, 16]`` int32 of the MSA decode/prefill path, one launch.

    ``num_valid_pages``: the selector's page counts (None: ``positions // 128 + 1``, computed
    in the kernel).
    ``local_blocks``, ``init_blocks``: the selector's forced blocks. ``interpret``: Pallas
    interpret mode; None (default) interprets on every backend but a GPU. Tunables (static)
    are the indexer's (:func:`pallas_kernels.index_scores.msa_index_scores`).
    """
    padded_q, score_kw = scores_launch(
        index_q, index_k_cache, block_table, req_indices, positions,
        pages_per_program=pages_per_program, num_warps=num_warps, num_stages=num_stages,
        preload_block_table=preload_block_table)
    t, h, di = index_q.shape
    validate_selection(t, num_valid_pages, TOPK, local_blocks, init_blocks)
    n = index_k_cache.shape[0]
    r, p = block_table.shape
    hs, ppp = score_kw["num_heads_pow2"], score_kw["pages_per_program"]
    num_chunks = pl.cdiv(p, ppp)
    interpreting = resolve_interpret(interpret)
    kernel = functools.partial(
        _index_select_kernel, nvp_given=num_valid_pages is not None, num_chunks=num_chunks,
        interpreting=interpreting,
        select_kw=dict(max_pages=p, topk=TOPK, local_blocks=local_blocks,
                       init_blocks=init_blocks), **score_kw)
    in_specs = [pl.BlockSpec((None, hs, di), lambda i, c: (i, 0, 0)),
                whole_block((n, PAGE_SIZE, di)), whole_block((r, p)), whole_block((t,)),
                whole_block((t,))]
    args = [padded_q, index_k_cache, block_table, req_indices, positions]
    if num_valid_pages is not None:
        in_specs.append(whole_block((t,)))
        args.append(num_valid_pages)
    out_specs = [pl.BlockSpec((None, hs, TOPK), lambda i, c: (i, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((t, hs, TOPK), jnp.int32)]
    aliases = {}
    if num_chunks > 1:  # scores of all chunks meet in a scratch row; a ticket per token
        in_specs, args, out_specs, out_shape, aliases = with_ticket(
            in_specs, args, out_specs, out_shape, num_rows=t,
            scratch=[((t, hs, next_pow2(num_chunks * ppp)), jnp.float32)])
    selected, *_ = pl.pallas_call(
        kernel,
        grid=(t, num_chunks),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpreting,
        name="msa_index_select",
    )(*args)
    return selected[:, :h] if hs != h else selected


@functools.partial(jax.jit, static_argnames=("local_blocks", "init_blocks"))
def msa_index_select_reference(index_q: jax.Array, index_k_cache: jax.Array,
                               block_table: jax.Array, req_indices: jax.Array,
                               positions: jax.Array, num_valid_pages: jax.Array | None = None,
                               *, local_blocks: int = 1, init_blocks: int = 0) -> jax.Array:
    """Pure jnp reference of :func:`msa_index_select` (the two references in sequence)."""
    scores = msa_index_scores_reference(index_q, index_k_cache, block_table, req_indices,
                                        positions)
    if num_valid_pages is None:
        num_valid_pages = num_valid_pages_of(positions)
    return sparse_topk_select_reference(scores, num_valid_pages, local_blocks=local_blocks,
                                        init_blocks=init_blocks)


__all__ = ["msa_index_select", "msa_index_select_reference", "num_valid_pages_of"]

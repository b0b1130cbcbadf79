"""Decode context parallelism (DCP) of MSA attention on a JAX device mesh.

W ranks form the mesh axis ``"dcp"``. The context of every request is split page-wise by the
interleave rule (I = 128, one MSA block per unit): global block g lives on rank ``g % W`` as
rank-local block ``g // W``. Each rank holds its own caches

  kv shard      [N_local, Hkv, 128, 2D]   (stacked over ranks: [W, N_local, Hkv, 128, 2D])
  index-K shard [N_local, 128, Di]        (stacked: [W, N_local, 128, Di])

addressed through the staged DCP ``BatchMetadata``: ``block_table[r, j]`` is the physical page
of the request's rank-local page j (the same id on every rank), ``positions``/``seq_lens``/
``kv_lens`` stay global. Everything distributed goes through ``jax.shard_map`` and its
collectives (``all_gather``, ``pmax``, ``psum``); there is no other transport.

One step of ``dcp_msa_attention`` on rank d:
  1. queries: q and index_q arrive sharded over tokens and are all-gathered (tiled), so every
     rank holds all tokens' queries (the DCP group shares the heads);
  2. indexer: block scores of the rank's local blocks (``msa_index_scores_default`` with
     rank-local positions ``local_len(p + 1) - 1``), masked/forced with *global* ids
     ``j * W + d`` (the forced block ``n - 1`` only on its owner, every valid block when
     ``n <= 16``), the rank's 16 best candidates ``(score, global id)``, all-gathered; the
     global top-16 by (score desc, id asc); the rank keeps its own winners as local ids,
     ascending, -1 padded;
  3. rank-local sparse decode over the local lengths ``local_len(kv_len)`` -> (out, lse);
  4. log-sum-exp merge across ranks (pmax + psum): the output is replicated on every rank.
The union of per-rank top-16s contains the global top-16 (the order (score desc, id asc)
restricted to one rank is its local order), so the result equals the single-device
``jax_msa_runner.attention.msa`` on the same global caches.

Cache writes: ``dcp_write_caches`` writes each token only on its owning rank
(``dcp.rank_slot_mapping``: slot -1 on every other rank). Dense layers: rank-local paged
causal attention over the local lengths + the same LSE merge (``dcp_dense_attention``).

Two levels of API:
  * rank level, for a caller that already runs inside ``jax.shard_map`` over "dcp" (a
    runner step): ``rank_write_caches``, ``rank_msa_attention``, ``rank_dense_attention``
    (queries already gathered, rank-local caches, collectives inside);
  * array level (jitted, own shard_map, static mesh): ``dcp_write_caches``,
    ``dcp_index_select``, ``dcp_msa_attention``, ``dcp_dense_attention``; per-rank caches
    are stacks [W, N_local, ...] sharded over "dcp" (``shard_to_mesh``).
The shard_maps run with ``check_vma=False``: the Pallas calls and the dense fori_loop carry
no varying-axis types; replicated outputs come from pmax/psum/all_gather results only.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_msa_runner.config import DCP_INTERLEAVE, PAGE_SIZE, TOPK, RunnerConfig
from jax_msa_runner.batch.dcp import dcp_local_seq_lens, rank_slot_mapping
from jax_msa_runner.attention.dense import paged_causal_attention
from jax_msa_runner.attention.paged_cache import write_index_k, write_kv
from jax_msa_runner.batch.metadata import BatchMetadata
from pallas_kernels.index_scores import msa_index_scores_reference
from pallas_kernels.index_select_default import (msa_index_scores_default,
                                                 sparse_topk_select_default)
from pallas_kernels.sparse_decode import sparse_decode_reference
from pallas_kernels.sparse_decode_default import sparse_decode_default

DCP_AXIS = "dcp"
_NO_ID = np.iinfo(np.int32).max  # sort key of an empty selection slot


class DCPError(ValueError):
    """An invalid DCP setting or input; the message names the setting and the bound."""


# ------------------------------------------------------------------------------ the mesh

def make_dcp_mesh(world_size: int, devices: Sequence[jax.Device] | None = None, *,
                  interleave: int = DCP_INTERLEAVE) -> Mesh:
    """A 1-D ``Mesh`` over the first ``world_size`` devices with the axis ``"dcp"``.

    Raises DCPError if world_size < 1, there are fewer devices than ranks, or interleave is
    not 128 (MSA needs one block per interleave unit).
    """
    devices = list(jax.devices() if devices is None else devices)
    if interleave != DCP_INTERLEAVE:
        raise DCPError(f"dcp_interleave: MSA needs {DCP_INTERLEAVE} (one block per unit), "
                       f"got {interleave}")
    if int(world_size) < 1:
        raise DCPError(f"dcp_world_size: must be >= 1, got {world_size}")
    if int(world_size) > len(devices):
        raise DCPError(f"dcp_world_size: {world_size} ranks need {world_size} devices, only "
                       f"{len(devices)} available ({devices[0].platform if devices else 'none'})")
    return Mesh(np.asarray(devices[:int(world_size)]), (DCP_AXIS,))


def mesh_for_config(config: RunnerConfig,
                    devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The DCP mesh of ``config`` (config.dcp_world_size ranks, interleave checked)."""
    return make_dcp_mesh(config.dcp_world_size, devices, interleave=config.dcp_interleave)


def dcp_world_size(mesh: Mesh) -> int:
    """Ranks of the ``"dcp"`` axis of ``mesh``; DCPError if the mesh has no such axis."""
    if DCP_AXIS not in mesh.shape:
        raise DCPError(f"mesh: needs an axis named {DCP_AXIS!r}, got axes {tuple(mesh.shape)}")
    return int(mesh.shape[DCP_AXIS])


def check_config_mesh(config: RunnerConfig, mesh: Mesh) -> None:
    """DCPError unless config.dcp_world_size equals the mesh's ``"dcp"`` size."""
    w = dcp_world_size(mesh)
    if config.dcp_world_size != w:
        raise DCPError(f"dcp_world_size: config has {config.dcp_world_size} ranks but the mesh "
                       f"axis {DCP_AXIS!r} has {w}")


def shard_to_mesh(stacked: jax.Array, mesh: Mesh) -> jax.Array:
    """Places a per-rank stack [W, ...] with rank d's slice on device d of the mesh."""
    w = dcp_world_size(mesh)
    if stacked.shape[0] != w:
        raise DCPError(f"shards: leading axis must be the {w} ranks, got shape {stacked.shape}")
    return jax.device_put(stacked, NamedSharding(mesh, P(DCP_AXIS)))


# ------------------------------------------------------- cache sharding (tests and tools)

def shard_paged_caches(caches: Sequence[np.ndarray], block_table: np.ndarray,
                       seq_lens: np.ndarray, world_size: int, *,
                       num_local_pages: int | None = None
                       ) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """Splits single-device paged caches into per-rank caches by the interleave rule.

    caches: arrays [N, ...] sharing ``block_table`` (e.g. kv [N, Hkv, 128, 2D] and index-K
    [N, 128, Di]); block_table: int [R, Pg] global pages; seq_lens: int [R] (pages
    ``ceil(L / 128)`` of a row are used). Rank-local page j of row r on rank d gets physical
    page ``1 + r * Pl + j`` (page 0 = null, zero-filled), Pl = max_r ceil(L_r / (128 W)).
    Returns (per cache a stack [W, 1 + R * Pl, ...], local block table int32 [R, Pl]
    with 0 beyond a row's pages); the local table is the same on every rank.
    """
    caches = [np.asarray(c) for c in caches]
    bt = np.asarray(block_table)
    seq = np.asarray(seq_lens, np.int64)
    R = bt.shape[0]
    W = int(world_size)
    need_local = -(-seq // (PAGE_SIZE * W))
    pl_ = max(1, int(need_local.max(initial=0)))
    n_local = 1 + R * pl_ if num_local_pages is None else int(num_local_pages)
    if n_local < 1 + R * pl_:
        raise DCPError(f"num_local_pages: {R} rows of {pl_} local pages need "
                       f"{1 + R * pl_} pages, got {n_local}")
    local_bt = np.zeros((R, pl_), np.int32)
    shards = [np.zeros((W, n_local) + c.shape[1:], c.dtype) for c in caches]
    for r in range(R):
        n_global = -(-int(seq[r]) // PAGE_SIZE)
        for j in range(int(need_local[r])):
            local_bt[r, j] = 1 + r * pl_ + j
        for g in range(n_global):
            d, j = g % W, g // W
            for out, c in zip(shards, caches):
                out[d, local_bt[r, j]] = np.asarray(c[bt[r, g]])
    return tuple(shards), local_bt


def unshard_paged_caches(shards: Sequence[np.ndarray], local_block_table: np.ndarray,
                         seq_lens: np.ndarray, world_size: int, max_pages: int
                         ) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """Inverse view of ``shard_paged_caches``: the single-device caches of per-rank caches.

    shards: stacks [W, N_local, ...]; local_block_table: int [R, Pl] (same on every rank);
    seq_lens: int [R]; max_pages: width Pg of the global block table. Global block g of row r
    gets physical page ``1 + r * Pg + g`` holding ``shards[g % W][local_bt[r, g // W]]``.
    Returns (per cache [1 + R * Pg, ...], global block table int32 [R, Pg]).
    """
    shards = [np.asarray(s) for s in shards]
    lbt = np.asarray(local_block_table)
    seq = np.asarray(seq_lens, np.int64)
    R, W, Pg = lbt.shape[0], int(world_size), int(max_pages)
    gbt = np.zeros((R, Pg), np.int32)
    caches = [np.zeros((1 + R * Pg,) + s.shape[2:], s.dtype) for s in shards]
    for r in range(R):
        n_global = -(-int(seq[r]) // PAGE_SIZE)
        if n_global > Pg:
            raise DCPError(f"max_pages: row {r} with seq_len {seq[r]} needs {n_global} > {Pg}")
        for g in range(n_global):
            gbt[r, g] = 1 + r * Pg + g
            for out, s in zip(caches, shards):
                out[gbt[r, g]] = np.asarray(s[g % W, lbt[r, g // W]])
    return tuple(caches), gbt


# ------------------------------------------------------------------------- cache writes

def rank_write_caches(kv: jax.Array, index_k_cache: jax.Array | None, k: jax.Array,
                      v: jax.Array, index_k: jax.Array | None, md: BatchMetadata,
                      world_size: int) -> tuple[jax.Array, jax.Array | None]:
    """Owner-only cache writes on this rank (call inside a shard_map over "dcp").

    kv [N_local, Hkv, 128, 2D], index_k_cache [N_local, 128, Di] or None (dense layer);
    k, v [T, Hkv, D], index_k [T, Di] or None; md: staged DCP metadata. Token t is written
    iff the rank owns position t (``dcp.rank_slot_mapping``; slot -1 elsewhere).
    """
    slots = rank_slot_mapping(md, world_size, lax.axis_index(DCP_AXIS))
    kv = write_kv(kv, k, v, slots)
    if index_k_cache is not None:
        index_k_cache = write_index_k(index_k_cache, index_k, slots)
    return kv, index_k_cache


@functools.partial(jax.jit, static_argnames=("mesh",))
def dcp_write_caches(kv_shards: jax.Array, index_k_shards: jax.Array, k: jax.Array,
                     v: jax.Array, index_k: jax.Array, md: BatchMetadata, mesh: Mesh
                     ) -> tuple[jax.Array, jax.Array]:
    """Writes one step's new keys into the owning rank's caches only.

    kv_shards [W, N_local, Hkv, 128, 2D], index_k_shards [W, N_local, 128, Di] (sharded over
    "dcp"); k, v [T, Hkv, D] and index_k [T, Di] (replicated: every rank computed them);
    md: staged DCP metadata (``slot_mapping`` = owner slot). Rank d writes token t iff
    ``(positions[t] // 128) % W == d``. Returns the new shards.
    """
    w = dcp_world_size(mesh)
    _check_shards(kv_shards, index_k_shards, w)

    def per_rank(kv, ik, k, v, index_k, md):
        kv, ik = rank_write_caches(kv[0], ik[0], k, v, index_k, md, w)
        return kv[None], ik[None]

    shard = P(DCP_AXIS)
    return jax.shard_map(per_rank, mesh=mesh, in_specs=(shard, shard, P(), P(), P(), P()),
                         out_specs=(shard, shard))(kv_shards, index_k_shards, k, v, index_k, md)


# ----------------------------------------------------------------- per-rank building blocks

def local_query_positions(md: BatchMetadata, world_size: int, rank) -> jax.Array:
    """Rank-local position of each token's last visible key: int32 [T].

    ``dcp_local_seq_lens(positions + 1) - 1``: keys of the rank at global positions <= p_t
    form a prefix of its local sequence. -1 (no page read) on padded tokens and on ranks
    holding none of the token's visible keys.
    """
    visible = dcp_local_seq_lens(md.positions + 1, world_size, rank)
    return jnp.where(md.token_mask, visible - 1, -1).astype(jnp.int32)


def prepare_global_scores(local_scores: jax.Array, num_valid_pages: jax.Array,
                          world_size: int, rank, *, max_pages_global: int,
                          topk: int = TOPK, init_blocks: int = 0
                          ) -> tuple[jax.Array, jax.Array]:
    """Masks/forces rank-local block scores with their global ids.

    local_scores [T, H, Pl] f32 (local block j = global ``j * W + rank``); num_valid_pages [T]
    int32 (global n before clamping to max_pages_global). Returns (x [T, H, Pl] f32, ids
    [Pl] int32 global ids): -inf for ids >= n, +inf on forced valid blocks (the local block
    n - 1, init blocks, every valid block when n <= topk), NaN -> -inf, -0 -> +0.
    """
    pl_ = local_scores.shape[-1]
    gid = jnp.arange(pl_, dtype=jnp.int32) * world_size + jnp.asarray(rank, jnp.int32)
    n = jnp.clip(num_valid_pages, 0, max_pages_global)[:, None, None]
    valid = gid[None, None, :] < n
    forced = valid & ((n <= topk) | (gid[None, None, :] >= n - 1)
                      | (gid[None, None, :] < init_blocks))
    x = jnp.where(jnp.isnan(local_scores), -jnp.inf,
                  jnp.where(local_scores == 0, 0.0, local_scores))
    return jnp.where(forced, jnp.inf, jnp.where(valid, x, -jnp.inf)), gid


def local_candidates(x: jax.Array, gid: jax.Array, *, topk: int = TOPK,
                     use_kernel: bool, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """The rank's ``topk`` best blocks by (score desc, id asc): (scores, global ids) [T, H, topk].

    x [T, H, Pl] prepared scores, gid [Pl] their global ids. use_kernel: the Pallas
    ``sparse_topk_select_default`` (no forcing: every entry of x counts, -inf entries come back
    as -1 / score -inf), else ``lax.top_k``. Empty candidates have score -inf.
    """
    t, h, pl_ = x.shape
    if use_kernel:
        ids = sparse_topk_select_default(x, jnp.full((t,), pl_, jnp.int32), topk=topk,
                                         local_blocks=0, init_blocks=0,
                                         interpret=interpret)  # [T, H, topk] local ids
        vals = jnp.take_along_axis(x, jnp.clip(ids, 0, pl_ - 1), axis=-1)
        vals = jnp.where(ids >= 0, vals, -jnp.inf)
    else:
        xp = x if pl_ >= topk else jnp.pad(x, ((0, 0), (0, 0), (0, topk - pl_)),
                                            constant_values=-jnp.inf)
        vals, ids = lax.top_k(xp, topk)
        ids = jnp.where(ids < pl_, ids, 0)
    return vals, jnp.where(vals > -jnp.inf, gid[jnp.clip(ids, 0, pl_ - 1)], _NO_ID)


def merge_candidates(vals: jax.Array, gids: jax.Array, world_size: int, rank, *,
                     topk: int = TOPK) -> tuple[jax.Array, jax.Array]:
    """Global top-``topk`` of all-gathered candidates and the rank's share of it.

    vals, gids [T, H, C] (C = W * topk; empty candidates: -inf, id _NO_ID). Order:
    (score desc, global id asc); a winner with score -inf is no winner.
    Returns (global ids [T, H, topk] ascending, -1 padded; the rank's winners as local ids
    ``g // W`` [T, H, topk] ascending, -1 padded).
    """
    neg, ids = lax.sort((-vals, gids), dimension=-1, num_keys=2)
    win = jnp.where(neg[..., :topk] < jnp.inf, ids[..., :topk], _NO_ID)
    glob = jnp.sort(win, axis=-1)
    mine = (win != _NO_ID) & (win % world_size == jnp.asarray(rank, jnp.int32))
    local = jnp.sort(jnp.where(mine, win // world_size, _NO_ID), axis=-1)
    as_ids = lambda a: jnp.where(a == _NO_ID, -1, a).astype(jnp.int32)  # noqa: E731
    return as_ids(glob), as_ids(local)


def lse_merge_across(out: jax.Array, lse: jax.Array, axis_name: str = DCP_AXIS
                     ) -> tuple[jax.Array, jax.Array]:
    """Log-sum-exp merge of per-rank partial attention over ``axis_name`` (pmax + psum).

    out [T, Hq, D] (normalised over the rank's keys), lse [T, Hq] f32 (-inf: no keys).
    Returns (out [T, Hq, D] f32, lse [T, Hq] f32), identical on every rank; rows without a
    key anywhere give zeros and -inf. NaN is never dropped: a rank's NaN lse makes the row's
    output and lse NaN, a NaN in a rank's output makes those output elements NaN.
    """
    nan_lse = jnp.isnan(lse)
    m = lax.pmax(jnp.where(nan_lse, -jnp.inf, lse), axis_name)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.where(jnp.isfinite(lse), jnp.exp(lse - m_safe), 0.0)
    w = jnp.where(nan_lse, jnp.nan, w)
    num = lax.psum(w[..., None] * out.astype(jnp.float32), axis_name)
    den = lax.psum(w, axis_name)
    empty = den == 0                                                     # False for NaN
    den_safe = jnp.where(empty, 1.0, den)
    return (jnp.where(empty[..., None], 0.0, num / den_safe[..., None]),
            jnp.where(empty, -jnp.inf, m_safe + jnp.log(den_safe)))


def _rank_select(index_q, index_k, md, *, world_size, use_kernels, interpret, init_blocks):
    """Distributed indexer body on one rank: (global sel, local sel) [T, H, 16] int32."""
    rank = lax.axis_index(DCP_AXIS)
    local_pos = local_query_positions(md, world_size, rank)
    score_fn = (functools.partial(msa_index_scores_default, interpret=interpret) if use_kernels
                else msa_index_scores_reference)
    scores = score_fn(index_q, index_k, md.block_table, md.req_indices, local_pos)
    x, gid = prepare_global_scores(scores, md.num_valid_pages, world_size, rank,
                                   max_pages_global=md.block_table.shape[1] * world_size,
                                   init_blocks=init_blocks)
    vals, gids = local_candidates(x, gid, use_kernel=use_kernels, interpret=interpret)
    vals = lax.all_gather(vals, DCP_AXIS, axis=2, tiled=True)  # [T, H, W * 16]
    gids = lax.all_gather(gids, DCP_AXIS, axis=2, tiled=True)
    return merge_candidates(vals, gids, world_size, rank)


def local_kv_lens(md: BatchMetadata, world_size: int, rank) -> jax.Array:
    """Visible keys of each token held by ``rank``: int32 [T] (0 on padding)."""
    return jnp.where(md.token_mask, dcp_local_seq_lens(md.kv_lens, world_size, rank),
                     0).astype(jnp.int32)


def rank_msa_attention(q: jax.Array, index_q: jax.Array, kv: jax.Array, index_k: jax.Array,
                       md: BatchMetadata, *, world_size: int, scale: float,
                       use_kernels: bool = True, interpret: bool | None = None,
                       init_blocks: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """DCP MSA attention of this rank (call inside a shard_map over "dcp").

    q [T, Hq, D], index_q [T, Hkv, Di]: all tokens' queries (already gathered);
    kv [N_local, Hkv, 128, 2D], index_k [N_local, 128, Di]: this rank's caches; md: staged
    DCP metadata. Collectives: candidate all-gather, pmax/psum LSE merge.
    Returns (out [T, Hq, D] q.dtype, lse [T, Hq] f32, selected [T, Hkv, 16] int32 global
    ids), identical on every rank.
    """
    rank = lax.axis_index(DCP_AXIS)
    glob, local = _rank_select(index_q, index_k, md, world_size=world_size,
                               use_kernels=use_kernels, interpret=interpret,
                               init_blocks=init_blocks)
    decode_fn = (functools.partial(sparse_decode_default, interpret=interpret) if use_kernels
                 else sparse_decode_reference)
    out, lse = decode_fn(q, kv, local, md.block_table, md.req_indices,
                         local_kv_lens(md, world_size, rank), scale=scale)
    out, lse = lse_merge_across(out, lse)
    return out.astype(q.dtype), lse, glob


def rank_dense_attention(q: jax.Array, kv: jax.Array, md: BatchMetadata, *, world_size: int,
                         scale: float) -> tuple[jax.Array, jax.Array]:
    """DCP dense causal attention of this rank (dense layers; inside a shard_map over "dcp").

    Rank-local ``paged_causal_attention`` over the local lengths (local positions keep the
    global order, so the causal prefix stays a prefix), then the LSE merge.
    q [T, Hq, D] (all tokens), kv [N_local, Hkv, 128, 2D]. Returns (out q.dtype, lse f32).
    """
    out, lse = paged_causal_attention(q, kv, md.block_table, md.req_indices,
                                      local_kv_lens(md, world_size,
                                                    lax.axis_index(DCP_AXIS)), scale=scale)
    out, lse = lse_merge_across(out, lse)
    return out.astype(q.dtype), lse


def _gather_tokens(x: jax.Array, num_tokens: int) -> jax.Array:
    """All-gather a token-sharded [T_pad / W, ...] block to [T, ...] (padding dropped)."""
    return lax.all_gather(x, DCP_AXIS, axis=0, tiled=True)[:num_tokens]


def _pad_tokens(x: jax.Array, world_size: int) -> jax.Array:
    """Pads axis 0 to a multiple of world_size (so it can be sharded over "dcp")."""
    extra = -x.shape[0] % world_size
    return jnp.pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1)) if extra else x


def _check_shards(kv_shards, index_k_shards, world_size: int) -> None:
    if kv_shards is not None and (kv_shards.ndim != 5 or kv_shards.shape[0] != world_size):
        raise DCPError(f"kv_shards: expected [W={world_size}, N_local, Hkv, 128, 2D], "
                       f"got shape {kv_shards.shape}")
    if index_k_shards is not None and (index_k_shards.ndim != 4
                                       or index_k_shards.shape[0] != world_size):
        raise DCPError(f"index_k_shards: expected [W={world_size}, N_local, 128, Di], "
                       f"got shape {index_k_shards.shape}")


# ------------------------------------------------------------------------- public entries

@functools.partial(jax.jit, static_argnames=("mesh", "interpret", "use_kernels", "init_blocks"))
def dcp_index_select(index_q: jax.Array, index_k_shards: jax.Array, md: BatchMetadata,
                     mesh: Mesh, *, interpret: bool | None = None, use_kernels: bool = True,
                     init_blocks: int = 0) -> tuple[jax.Array, jax.Array]:
    """The distributed MSA indexer + top-16 select.

    index_q [T, H, Di] (sharded over tokens on entry, all-gathered inside);
    index_k_shards [W, N_local, 128, Di]; md: staged DCP metadata (rank-local block table).
    use_kernels: Pallas kernels (``interpret`` on CPU) or the jnp references.
    Returns (selected [T, H, 16] int32 global block ids, ascending, -1 padded == the
    single-device selection; local_selected [W, T, H, 16] int32: rank d's winners as its
    local block ids, ascending, -1 padded).
    """
    w = dcp_world_size(mesh)
    _check_shards(None, index_k_shards, w)
    t = index_q.shape[0]

    def per_rank(iq, ik, md):
        glob, local = _rank_select(_gather_tokens(iq, t), ik[0], md, world_size=w,
                                   use_kernels=use_kernels, interpret=interpret,
                                   init_blocks=init_blocks)
        return glob, local[None]

    return jax.shard_map(per_rank, mesh=mesh, in_specs=(P(DCP_AXIS), P(DCP_AXIS), P()),
                         out_specs=(P(), P(DCP_AXIS)), check_vma=False,
                         )(_pad_tokens(index_q, w), index_k_shards, md)


@functools.partial(jax.jit, static_argnames=("mesh", "scale", "interpret", "use_kernels",
                                             "init_blocks"))
def dcp_msa_attention(q: jax.Array, index_q: jax.Array, kv_shards: jax.Array,
                      index_k_shards: jax.Array, md: BatchMetadata, mesh: Mesh, *,
                      scale: float, interpret: bool | None = None, use_kernels: bool = True,
                      init_blocks: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """MSA attention of a padded batch with the context split over the mesh's "dcp" ranks.

    Args:
      q [T, Hq, D], index_q [T, Hkv, Di]: queries (sharded over tokens on entry; every rank
        all-gathers them). kv_shards [W, N_local, Hkv, 128, 2D], index_k_shards
        [W, N_local, 128, Di]: per-rank caches (rank d = slice d, placed by
        ``shard_to_mesh``). md: BatchMetadata staged with ``dcp_world_size = W`` (global
        positions / lengths, rank-local block table), replicated.
      mesh: ``make_dcp_mesh(W)`` (static). scale: softmax scale (static).
      interpret: Pallas interpret mode (None: on every backend but a GPU).
      use_kernels: Pallas kernels or jnp references.
    Returns:
      (out [T, Hq, D] q.dtype, lse [T, Hq] f32, selected [T, Hkv, 16] int32 global block
      ids), replicated; equal to ``jax_msa_runner.attention.msa`` on the global caches.
    """
    w = dcp_world_size(mesh)
    _check_shards(kv_shards, index_k_shards, w)
    t = q.shape[0]

    def per_rank(q, iq, kv, ik, md):
        return rank_msa_attention(_gather_tokens(q, t), _gather_tokens(iq, t), kv[0], ik[0], md,
                                  world_size=w, scale=scale, use_kernels=use_kernels,
                                  interpret=interpret, init_blocks=init_blocks)

    shard = P(DCP_AXIS)
    return jax.shard_map(per_rank, mesh=mesh, in_specs=(shard, shard, shard, shard, P()),
                         out_specs=(P(), P(), P()), check_vma=False,
                         )(_pad_tokens(q, w), _pad_tokens(index_q, w), kv_shards,
                           index_k_shards, md)


@functools.partial(jax.jit, static_argnames=("mesh", "scale"))
def dcp_dense_attention(q: jax.Array, kv_shards: jax.Array, md: BatchMetadata, mesh: Mesh, *,
                        scale: float) -> tuple[jax.Array, jax.Array]:
    """Dense causal attention with the context split over the "dcp" ranks.

    q [T, Hq, D] (token-sharded on entry, all-gathered); kv_shards [W, N_local, Hkv, 128, 2D];
    md: staged DCP metadata. Returns (out [T, Hq, D] q.dtype, lse [T, Hq] f32), replicated;
    equal to ``paged_causal_attention`` on the global cache.
    """
    w = dcp_world_size(mesh)
    _check_shards(kv_shards, None, w)
    t = q.shape[0]

    def per_rank(q, kv, md):
        return rank_dense_attention(_gather_tokens(q, t), kv[0], md, world_size=w, scale=scale)

    shard = P(DCP_AXIS)
    return jax.shard_map(per_rank, mesh=mesh, in_specs=(shard, shard, P()),
                         out_specs=(P(), P()), check_vma=False,
                         )(_pad_tokens(q, w), kv_shards, md)


__all__ = [
    "DCP_AXIS", "DCPError", "make_dcp_mesh", "mesh_for_config",
    "dcp_world_size", "check_config_mesh", "shard_to_mesh", "shard_paged_caches",
    "unshard_paged_caches", "rank_write_caches", "dcp_write_caches", "local_query_positions",
    "local_kv_lens", "rank_msa_attention", "rank_dense_attention", "dcp_dense_attention",
    "prepare_global_scores", "local_candidates", "merge_candidates", "lse_merge_across",
    "dcp_index_select", "dcp_msa_attention",
]

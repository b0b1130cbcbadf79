"""One attention layer's cache writes and attention, on one device or one DCP rank.

This is where the model's layers meet decode context parallelism: with
``dcp_world_size == 1`` the calls go to the single-device kernels (``attention.msa``,
``attention.dense``); with ``W > 1`` they must run inside a ``jax.shard_map`` over
``attention.dcp.DCP_AXIS`` with the rank's own caches ``[N_local, ...]`` and DCP-staged
metadata, and go to ``attention.dcp`` (owner-only writes, distributed indexer, LSE merge).
Every function returns the same values on every rank.
"""
from __future__ import annotations

import jax

from jax_msa_runner.attention.dcp import (rank_dense_attention, rank_msa_attention,
                                          rank_write_caches)
from jax_msa_runner.attention.dense import paged_causal_attention
from jax_msa_runner.attention.msa import msa_attention, msa_attention_reference
from jax_msa_runner.attention.paged_cache import write_index_k, write_kv
from jax_msa_runner.batch.metadata import BatchMetadata
from jax_msa_runner.config import ConfigError

ATTENTION_IMPLS = ("pallas", "reference")
ATTENTION_MODES = ("msa", "dense")


def default_attention_impl() -> str:
    """Pallas kernels on a GPU, the jnp references elsewhere (interpret mode is too slow)."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def check_attention_impl(attention_impl: str) -> None:
    """ValueError naming ``attention_impl`` unless it is one of ``ATTENTION_IMPLS``."""
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl: one of {ATTENTION_IMPLS}, got {attention_impl!r}")


def write_layer_caches(kv_cache: jax.Array, index_k_cache: jax.Array | None, k: jax.Array,
                       v: jax.Array, index_k: jax.Array | None, md: BatchMetadata, *,
                       dcp_world_size: int) -> tuple[jax.Array, jax.Array | None]:
    """Writes one step's keys into one layer's caches.

    kv_cache [N, Hkv, PAGE_SIZE, 2D]; index_k_cache [N, PAGE_SIZE, Di] or None (dense layer);
    k, v [T, Hkv, D]; index_k [T, Di] or None. Under DCP only the owning rank writes a token.
    """
    if dcp_world_size > 1:
        return rank_write_caches(kv_cache, index_k_cache, k, v, index_k, md, dcp_world_size)
    kv_cache = write_kv(kv_cache, k, v, md.slot_mapping)
    if index_k_cache is not None:
        index_k_cache = write_index_k(index_k_cache, index_k, md.slot_mapping)
    return kv_cache, index_k_cache


def dense_layer_attention(q: jax.Array, kv_cache: jax.Array, md: BatchMetadata, *, scale: float,
                          dcp_world_size: int = 1) -> jax.Array:
    """Dense paged causal attention of one layer over the (already written) cache.

    q [T, Hq, D]; kv_cache [N, Hkv, PAGE_SIZE, 2D]. Returns [T, Hq, D] in q.dtype.
    """
    if dcp_world_size > 1:
        return rank_dense_attention(q, kv_cache, md, world_size=dcp_world_size, scale=scale)[0]
    out, _ = paged_causal_attention(q, kv_cache, md.block_table, md.req_indices, md.kv_lens,
                                    scale=scale)
    return out


def msa_layer_attention(q: jax.Array, index_q: jax.Array, kv_cache: jax.Array,
                        index_k_cache: jax.Array, md: BatchMetadata, *, scale: float,
                        attention_impl: str, attention_mode: str = "msa",
                        init_blocks: int = 0, local_blocks: int = 1, dcp_world_size: int = 1,
                        interpret: bool = False) -> jax.Array:
    """Attention of one MSA layer over the (already written) caches.

    q [T, Hq, D]; index_q [T, Hkv, Di]; kv_cache [N, Hkv, PAGE_SIZE, 2D]; index_k_cache
    [N, PAGE_SIZE, Di]. ``attention_mode="msa"``: page scores from positions, top-TOPK pages
    per (token, KV group) with the token's own page forced, sparse attention over them with
    kv_len from seq_lens (``md.kv_lens``). ``"dense"``: dense paged causal attention on the
    same caches (what MSA must equal while every position < TOPK * PAGE_SIZE).
    Under DCP ``local_blocks`` must be 1 (the token's own block is the one forced block).
    interpret: Pallas interpret mode (attention_impl "pallas" off the GPU).
    Returns [T, Hq, D] in q.dtype; padded tokens give zeros.
    """
    if attention_mode not in ATTENTION_MODES:
        raise ValueError(f"attention_mode: one of {ATTENTION_MODES}, got {attention_mode!r}")
    check_attention_impl(attention_impl)
    if attention_mode == "dense":
        return dense_layer_attention(q, kv_cache, md, scale=scale, dcp_world_size=dcp_world_size)
    if dcp_world_size > 1:
        if local_blocks != 1:
            raise ConfigError(f"local_blocks: DCP forces exactly the token's own block, needs 1, "
                              f"got {local_blocks}")
        out, _, _ = rank_msa_attention(q, index_q, kv_cache, index_k_cache, md,
                                       world_size=dcp_world_size, scale=scale,
                                       use_kernels=attention_impl == "pallas",
                                       interpret=interpret, init_blocks=init_blocks)
        return out
    if attention_impl == "pallas":
        out, _, _ = msa_attention(q, index_q, kv_cache, index_k_cache, md, scale=scale,
                                  interpret=interpret, local_blocks=local_blocks,
                                  init_blocks=init_blocks)
    else:
        out, _, _ = msa_attention_reference(q, index_q, kv_cache, index_k_cache, md, scale=scale,
                                            local_blocks=local_blocks, init_blocks=init_blocks)
    return out.astype(q.dtype)


__all__ = ["ATTENTION_IMPLS", "ATTENTION_MODES", "default_attention_impl",
           "check_attention_impl", "write_layer_caches", "dense_layer_attention",
           "msa_layer_attention"]

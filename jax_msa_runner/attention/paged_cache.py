"""Paged KV caches on the device: layout, allocation and the slot-mapped writes.

Layout per attention layer (N = num_pages, page = PAGE_SIZE tokens):
  kv       [N, Hkv, PAGE_SIZE, 2*D]  K in [..., :D], V in [..., D:]
  index_k  [N, PAGE_SIZE, Di]        one index-key vector per token (MSA layers only); the
                                     model dtype or float8_e4m3fn (raw fp8 values, no scale:
                                     the indexer upcasts them; writes clip to +-448 first)
Page ``NULL_PAGE_ID`` is what padded block-table entries point at and ``DUMMY_PAGE_ID`` is the
scratch page dummy batches write into; the host allocator never hands out either. Writes go
through ``slot_mapping`` (slot = page * PAGE_SIZE + offset); slot -1 writes nothing. Inside a
jitted step whose cache argument is donated the scatter updates the buffers in place.
"""
from __future__ import annotations

from typing import Sequence

import chex
import jax
import jax.numpy as jnp

from jax_msa_runner.config import FP8_INDEX_CACHE_DTYPE, PAGE_SIZE, RESERVED_PAGES, require

@chex.dataclass(frozen=True)
class KVCaches:
    """All layers' caches (a pytree).

    kv:      tuple over layers of [N, Hkv, 128, 2D]
    index_k: tuple over layers of [N, 128, Di] for MSA layers, None for dense layers
    """

    kv: tuple
    index_k: tuple

    @property
    def num_pages(self) -> int:
        return self.kv[0].shape[0]


def init_kv_caches(num_pages: int, num_kv_heads: int, head_dim: int, index_dim: int,
                   layer_is_msa: Sequence[bool], dtype=jnp.float32,
                   index_dtype=None) -> KVCaches:
    """Zero-filled caches of ``num_pages`` pages (page 0 = null page) for every layer.

    kv pages in ``dtype``; index-K pages in ``index_dtype`` (None: ``dtype``).
    """
    require(num_pages > len(RESERVED_PAGES), "num_pages",
            f"need the reserved pages {RESERVED_PAGES} plus at least one page, got {num_pages}")
    index_dtype = dtype if index_dtype is None else index_dtype
    kv = tuple(jnp.zeros((num_pages, num_kv_heads, PAGE_SIZE, 2 * head_dim), dtype)
               for _ in layer_is_msa)
    index_k = tuple(jnp.zeros((num_pages, PAGE_SIZE, index_dim), index_dtype) if msa else None
                    for msa in layer_is_msa)
    return KVCaches(kv=kv, index_k=index_k)


def _page_and_offset(slot_mapping: jax.Array, num_pages: int) -> tuple[jax.Array, jax.Array]:
    """Slot -> (page, offset); slot < 0 maps to page ``num_pages`` (out of range, dropped)."""
    slot = slot_mapping.astype(jnp.int32)
    page = jnp.where(slot >= 0, slot // PAGE_SIZE, num_pages)
    offset = jnp.where(slot >= 0, slot % PAGE_SIZE, 0)
    return page, offset


def write_kv(kv_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter new keys/values into the paged cache.

    kv_cache [N, Hkv, 128, 2D]; k, v [T, Hkv, D]; slot_mapping [T] int32 (-1 = no write).
    Returns the updated cache (in place when the caller donates the buffer).
    """
    page, offset = _page_and_offset(slot_mapping, kv_cache.shape[0])
    new = jnp.concatenate([k, v], axis=-1).astype(kv_cache.dtype)  # [T, Hkv, 2D]
    return kv_cache.at[page, :, offset].set(new, mode="drop")


def cast_index_k(index_k: jax.Array, dtype) -> jax.Array:
    """index_k (any shape, float) cast to the index-cache ``dtype``. float8_e4m3fn has no inf
    and turns overflow into NaN, so values are clipped to its finite range +-448 first."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.dtype(FP8_INDEX_CACHE_DTYPE):
        fmax = float(jnp.finfo(dtype).max)
        index_k = jnp.clip(index_k, -fmax, fmax)
    return index_k.astype(dtype)


def write_index_k(index_cache: jax.Array, index_k: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter index keys: index_cache [N, 128, Di] (model dtype or float8_e4m3fn),
    index_k [T, Di] (cast by ``cast_index_k``), slot_mapping [T] int32 (-1 = no write)."""
    page, offset = _page_and_offset(slot_mapping, index_cache.shape[0])
    return index_cache.at[page, offset].set(cast_index_k(index_k, index_cache.dtype), mode="drop")


# Stand-alone in-place writers (the runner's step does the same inside its own jit).
write_kv_donated = jax.jit(write_kv, donate_argnums=0)
write_index_k_donated = jax.jit(write_index_k, donate_argnums=0)

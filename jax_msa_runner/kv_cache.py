"""Paged KV caches and the host-side block allocator.

Layout per attention layer (N = num_pages, page = 128 tokens):
  kv       [N, Hkv, 128, 2*D]  K in [..., :D], V in [..., D:]  (vLLM's MSA layout)
  index_k  [N, 128, Di]        one index-key vector per token (MSA layers only); the model
                               dtype or float8_e4m3fn (raw fp8 values, no scale: the indexer
                               upcasts them; writes clip to the finite range +-448 first)
Page 0 is the null page (padded block-table entries point at it) and page 1 is the dummy
scratch page that warm-up / profiling batches write into (``staging.DUMMY_PAGE_ID``); the
allocator never hands out either. Writes go through ``slot_mapping`` (slot = page * 128 + offset); slot -1
writes nothing. Inside a jitted step whose cache argument is donated the scatter updates
the buffers in place.
"""
from __future__ import annotations

from typing import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jax_msa_runner.config import FP8_INDEX_CACHE_DTYPE, PAGE_SIZE

NULL_PAGE = 0
DUMMY_PAGE = 1  # == staging.DUMMY_PAGE_ID: dummy batches' scratch page
RESERVED_PAGES = (NULL_PAGE, DUMMY_PAGE)


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


def _check_num_pages(num_pages: int) -> None:
    if num_pages <= len(RESERVED_PAGES):
        raise ValueError(f"num_pages: need the reserved pages {RESERVED_PAGES} plus at least one "
                         f"page, got {num_pages}")


def init_kv_caches(num_pages: int, num_kv_heads: int, head_dim: int, index_dim: int,
                   layer_is_msa: Sequence[bool], dtype=jnp.float32,
                   index_dtype=None) -> KVCaches:
    """Zero-filled caches of ``num_pages`` pages (page 0 = null page) for every layer.

    kv pages in ``dtype``; index-K pages in ``index_dtype`` (None: ``dtype``).
    """
    _check_num_pages(num_pages)
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


def kv_cache_bytes_per_page(num_kv_heads: int, head_dim: int, index_dim: int,
                            layer_is_msa: Sequence[bool], itemsize: int,
                            index_itemsize: int | None = None) -> int:
    """Bytes one page costs summed over all layers (index-K itemsize: ``itemsize`` if None)."""
    per_layer = num_kv_heads * PAGE_SIZE * 2 * head_dim * itemsize
    index = PAGE_SIZE * index_dim * (itemsize if index_itemsize is None else index_itemsize)
    return sum(per_layer + (index if msa else 0) for msa in layer_is_msa)


class OutOfPagesError(RuntimeError):
    """The allocator has fewer free pages than requested."""


class BlockAllocator:
    """Host-side free list of physical pages 2..num_pages-1 (reserved pages never handed out).

    Deterministic: pages are allocated lowest id first, so identical schedules give
    identical block tables.
    """

    def __init__(self, num_pages: int):
        _check_num_pages(num_pages)
        self.num_pages = num_pages
        first = len(RESERVED_PAGES)
        self._free = list(range(num_pages - 1, first - 1, -1))  # stack, pop() gives the lowest id
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        """Pages a single request could ever hold (all but the reserved pages)."""
        return self.num_pages - len(RESERVED_PAGES)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages; raises OutOfPagesError (and takes nothing) if too few are free."""
        if n < 0:
            raise ValueError(f"n: must be >= 0, got {n}")
        if n > len(self._free):
            raise OutOfPagesError(f"requested {n} pages, {len(self._free)} free of {self.num_usable}")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Return pages; freeing the null page, an unknown or an already free page raises."""
        for p in pages:
            if p in RESERVED_PAGES or p not in self._used:
                raise ValueError(f"page {p} is not allocated (reserved page or double free)")
            self._used.remove(p)
        # keep the free stack sorted so the next allocation is again lowest-id first
        self._free = sorted(set(self._free) | set(pages), reverse=True)


def pages_needed(num_tokens: int, dcp_world_size: int = 1) -> int:
    """Pages covering ``num_tokens`` tokens; under DCP (W ranks, interleave 128) the pages
    each rank holds: ``ceil(num_tokens / (128 W))`` (global block g -> rank g % W, local
    page g // W; rank 0 is the fullest)."""
    return -(-int(num_tokens) // (PAGE_SIZE * int(dcp_world_size)))


def block_table_row(pages: Sequence[int], max_pages: int) -> np.ndarray:
    """One padded block-table row (int32 [max_pages]), unused entries = null page."""
    if len(pages) > max_pages:
        raise ValueError(f"request holds {len(pages)} pages, block table has {max_pages}")
    row = np.full((max_pages,), NULL_PAGE, np.int32)
    row[:len(pages)] = pages
    return row

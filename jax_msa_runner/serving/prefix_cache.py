"""Automatic prefix caching (host side): ref-counted KV pages keyed by a hash chain.

A page unit is ``PAGE_SIZE * dcp_world_size`` tokens: page j of a request's page list holds
its tokens ``[j * unit, (j + 1) * unit)`` (over the W ranks under DCP, where the list is
rank-local and the same on every rank), with their K, V and, on MSA layers, index-K rows.
Once full, a page's content depends only on the tokens up to its end and on what makes the
cache (the weights, the cache dtypes), so its key is a chain:

    key(-1) = cache_identity(...)             (model config, cache dtypes, W, a model tag)
    key(j)  = sha256(key(j - 1) | tokens of page j as int64)

``PagePool`` holds physical pages 2..num_pages-1 (the reserved null and dummy pages never)
in exactly one of three states: *held* (ref count >= 1: in that many running requests'
block tables; a held page may be keyed, then requests share it read-only: nobody writes a
full page), *cached* (ref 0, keyed: found again by its key until evicted) or *free* (ref 0,
no key). ``allocate`` takes free pages lowest id first, then evicts cached pages least
recently released first (a request's pages are released last page first, so a prefix
outlives its tail). Only pages of ref count 0 are ever evicted. ``check`` compares the ref
counts with the running block tables (the scheduler's debug check).
"""
from __future__ import annotations

import collections
import hashlib
import heapq
from typing import Iterable, Sequence

import numpy as np

from jax_msa_runner.config import PAGE_SIZE, RESERVED_PAGES, ModelConfig, require


class OutOfPagesError(RuntimeError):
    """The pool has fewer free (or evictable) pages than requested."""


class PageRefError(RuntimeError):
    """The pool's ref counts or states disagree with the block tables; names the page."""


def cache_identity(mconfig: ModelConfig | None, cache_dtypes: Sequence[str] = (),
                   dcp_world_size: int = 1, model_tag: str = "") -> bytes:
    """Root of every key chain (32 bytes): sha256 of the model config's repr (its shapes,
    dtype and index-K cache dtype), the cache leaves' dtypes, the DCP world size and a tag
    naming the weights."""
    text = f"{mconfig!r}|{','.join(cache_dtypes)}|W={dcp_world_size}|{model_tag}"
    return hashlib.sha256(text.encode()).digest()


def page_unit(dcp_world_size: int) -> int:
    """Tokens of one page of a request's page list (W rank-local pages of 128 tokens)."""
    return PAGE_SIZE * int(dcp_world_size)


def chain_keys(parent: bytes, tokens: Sequence[int], unit: int) -> list[bytes]:
    """Keys of the full pages of ``tokens`` (len // unit of them), chained from ``parent``
    (the key of the page before ``tokens[0]``, or the cache identity)."""
    arr = np.asarray(tokens, np.int64)
    keys = []
    for j in range(arr.size // unit):
        parent = hashlib.sha256(parent + arr[j * unit:(j + 1) * unit].tobytes()).digest()
        keys.append(parent)
    return keys


class PagePool:
    """Ref-counted physical pages 2..num_pages-1 with a key index (module docstring).

    Deterministic: the same calls give the same page ids.
    """

    def __init__(self, num_pages: int):
        require(num_pages > len(RESERVED_PAGES), "num_pages",
                f"need the reserved pages {RESERVED_PAGES} plus at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(len(RESERVED_PAGES), num_pages))  # a heap: lowest id first
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._ref: dict[int, int] = {}  # held pages -> ref count (>= 1)
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self.num_evictions = 0

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        """Pages a single request could ever hold (all but the reserved pages)."""
        return self.num_pages - len(RESERVED_PAGES)

    @property
    def num_free(self) -> int:
        """Pages ``allocate`` can hand out: free plus cached (evictable) ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_held(self) -> int:
        """Pages with ref count >= 1."""
        return len(self._ref)

    @property
    def num_cached(self) -> int:
        """Keyed pages, held or not."""
        return len(self._key_of)

    def ref_count(self, page: int) -> int:
        return self._ref.get(page, 0)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    # ---- pages -------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages at ref count 1: free pages lowest id first, then the least recently
        released cached pages (their keys dropped). Raises ValueError when n < 0 and
        OutOfPagesError (taking nothing) when fewer than n can be handed out."""
        if n < 0:
            raise ValueError(f"n: must be >= 0, got {n}")
        if n > self.num_free:
            raise OutOfPagesError(f"requested {n} pages, {self.num_free} free of "
                                  f"{self.num_usable}")
        pages = []
        for _ in range(n):
            if self._free:
                page = heapq.heappop(self._free)
            else:
                page, _ = self._cached.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
                self.num_evictions += 1
            self._ref[page] = 1
            pages.append(page)
        return pages

    def lookup(self, keys: Iterable[bytes]) -> list[int]:
        """Pages of the longest prefix of ``keys`` that is cached (held or not); takes no
        reference."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, pages: Sequence[int]) -> None:
        """One more reference to each keyed page (a cached one becomes held)."""
        for p in pages:
            if p not in self._key_of:
                raise ValueError(f"page {p}: only a keyed page can be shared")
            if p in self._cached:
                del self._cached[p]
            self._ref[p] = self._ref.get(p, 0) + 1

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page, last page first; at ref 0 a keyed page becomes
        cached (most recently released), an unkeyed one free. Raises ValueError on a page
        that is not held (a reserved page, or a double release)."""
        for p in reversed(pages):
            if p not in self._ref:
                raise ValueError(f"page {p} is not held (reserved page or double release)")
        for p in reversed(pages):
            self._ref[p] -= 1
            if self._ref[p] == 0:
                del self._ref[p]
                if p in self._key_of:
                    self._cached[p] = None
                else:
                    heapq.heappush(self._free, p)

    def insert(self, page: int, key: bytes) -> bool:
        """Key a held, full page. False (nothing changes) when the page is keyed already or
        the key names another page (the same prefix computed twice: the page stays
        unkeyed and is freed on release)."""
        if page not in self._ref:
            raise ValueError(f"page {page}: only a held page can be keyed")
        if page in self._key_of or key in self._page_of:
            return False
        self._key_of[page] = key
        self._page_of[key] = page
        return True

    # ---- the debug check ---------------------------------------------------------------------
    def check(self, block_tables: Iterable[Sequence[int]]) -> None:
        """Raises PageRefError unless every page's ref count equals the number of
        ``block_tables`` (the running requests' page lists) holding it, no list holds a
        page twice or a reserved page, every page is in exactly one state, and the key
        index is one to one."""
        counts: collections.Counter[int] = collections.Counter()
        for i, table in enumerate(block_tables):
            if len(set(table)) != len(table):
                raise PageRefError(f"block table {i} holds a page twice: {list(table)}")
            counts.update(table)
        for p in sorted(set(counts) | set(self._ref)):
            if p in RESERVED_PAGES or not 0 <= p < self.num_pages:
                raise PageRefError(f"page {p}: reserved or outside [2, {self.num_pages}) but "
                                   f"held by {counts[p]} block tables")
            if counts[p] != self._ref.get(p, 0):
                raise PageRefError(f"page {p}: ref count {self._ref.get(p, 0)} but "
                                   f"{counts[p]} running block tables hold it")
        states = (set(self._ref), set(self._cached), set(self._free))
        every = set(range(len(RESERVED_PAGES), self.num_pages))
        if sum(map(len, states)) != len(every) or set().union(*states) != every \
                or len(self._free) != len(states[2]):
            raise PageRefError(f"pages not in exactly one state: {len(states[0])} held, "
                               f"{len(states[1])} cached, {len(self._free)} free of "
                               f"{len(every)}")
        for p in self._cached:
            if p not in self._key_of:
                raise PageRefError(f"page {p}: cached (evictable) without a key")
        for p in states[2]:
            if p in self._key_of:
                raise PageRefError(f"page {p}: free but still keyed")
        if len(self._page_of) != len(self._key_of) or any(
                self._page_of.get(k) != p for p, k in self._key_of.items()):
            raise PageRefError("key index is not one to one")

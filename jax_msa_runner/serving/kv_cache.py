"""The host side of the paged KV cache: the page allocator and per-request page counts.

The device arrays and their writes live in ``attention.paged_cache``. Reserved pages
(``config.RESERVED_PAGES``: the null page and the dummy batches' scratch page) are never
handed out.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from jax_msa_runner.config import NULL_PAGE_ID, PAGE_SIZE, RESERVED_PAGES, require


class OutOfPagesError(RuntimeError):
    """The allocator has fewer free pages than requested."""


class BlockAllocator:
    """Host-side free list of physical pages 2..num_pages-1 (reserved pages never handed out).

    Deterministic: pages are allocated lowest id first, so identical schedules give
    identical block tables.
    """

    def __init__(self, num_pages: int):
        require(num_pages > len(RESERVED_PAGES), "num_pages",
                f"need the reserved pages {RESERVED_PAGES} plus at least one page, got {num_pages}")
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
    row = np.full((max_pages,), NULL_PAGE_ID, np.int32)
    row[:len(pages)] = pages
    return row

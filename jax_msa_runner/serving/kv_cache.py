"""The host side of the paged KV cache: per-request page counts and block-table rows.

The device arrays and their writes live in ``attention.paged_cache``; the page pool (ref
counts, the prefix cache) in ``serving.prefix_cache``. Reserved pages
(``config.RESERVED_PAGES``: the null page and the dummy batches' scratch page) are never
handed out.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from jax_msa_runner.config import NULL_PAGE_ID, PAGE_SIZE


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

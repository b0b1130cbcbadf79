"""Static batch shapes (buckets): JAX's stand-in for CUDA-graph capture sizes.

A bucket fixes the padded shapes of one compiled step: ``num_tokens`` (T), ``num_reqs`` (R)
and ``max_pages`` (P, the block-table width). Each bucket is compiled once at start-up.
"""
from __future__ import annotations

from typing import NamedTuple

from jax_msa_runner.config import RunnerConfig


class BucketError(ValueError):
    """No bucket fits a batch (or the batch size is invalid); the message names the sizes."""


class Bucket(NamedTuple):
    """Padded shapes of one compiled step: T tokens, R request rows, P block-table pages."""

    num_tokens: int
    num_reqs: int
    max_pages: int


def make_buckets(config: RunnerConfig) -> tuple[Bucket, ...]:
    """One bucket per configured size, ascending.

    num_tokens = size, num_reqs = min(size, max_num_seqs), max_pages = config.max_pages.
    """
    return tuple(Bucket(num_tokens=size, num_reqs=min(size, config.max_num_seqs),
                        max_pages=config.max_pages)
                 for size in config.bucket_sizes)


def select_bucket(num_tokens: int, num_reqs: int, config: RunnerConfig) -> Bucket:
    """The smallest bucket holding ``num_tokens`` tokens in ``num_reqs`` request rows.

    Raises BucketError naming the requested and the available sizes when none fits.
    """
    num_tokens, num_reqs = int(num_tokens), int(num_reqs)
    if num_tokens < 0:
        raise BucketError(f"num_tokens: must be >= 0, got {num_tokens}")
    if num_reqs < 0:
        raise BucketError(f"num_reqs: must be >= 0, got {num_reqs}")
    buckets = make_buckets(config)
    for bucket in buckets:
        if num_tokens <= bucket.num_tokens and num_reqs <= bucket.num_reqs:
            return bucket
    sizes = ", ".join(f"(tokens={b.num_tokens}, reqs={b.num_reqs})" for b in buckets)
    raise BucketError(
        f"no bucket fits num_tokens={num_tokens}, num_reqs={num_reqs}: largest bucket holds "
        f"{buckets[-1].num_tokens} tokens and {buckets[-1].num_reqs} requests "
        f"(max_num_seqs={config.max_num_seqs}); buckets: {sizes}")

"""Static configuration: MSA attention geometry and runner limits.

Both configs are frozen dataclasses (hashable, usable as jit static arguments) and
validate themselves at construction: an invalid combination raises ``ConfigError``
naming the field and the bound.
"""
from __future__ import annotations

import dataclasses
import math

PAGE_SIZE = 128  # tokens per KV page == MSA sparse block == index-K page
MSA_TOPK = 16
DCP_INTERLEAVE = 128  # MSA requires one block per DCP interleave unit
# The index-K cache dtype allowed besides the model dtype (ModelConfig.index_cache_dtype):
# raw e4m3 values, no scale; the indexer upcasts them (half the bytes of its O(L) scan).
FP8_INDEX_CACHE_DTYPE = "float8_e4m3fn"


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field and the bound."""


def _require(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field}: {msg}")


@dataclasses.dataclass(frozen=True)
class MSAConfig:
    """MSA attention geometry of one (per-rank) attention layer."""

    num_heads: int = 16  # query heads
    num_kv_heads: int = 1
    head_dim: int = 128
    num_index_heads: int = 1  # one index-query head per KV head
    index_dim: int = 128
    page_size: int = PAGE_SIZE
    topk: int = MSA_TOPK
    local_blocks: int = 1
    init_blocks: int = 0

    def __post_init__(self):
        _require(self.page_size == PAGE_SIZE, "page_size",
                 f"MSA needs page_size == {PAGE_SIZE} (one page per sparse block), got {self.page_size}")
        _require(self.topk == MSA_TOPK, "topk", f"must be {MSA_TOPK}, got {self.topk}")
        for name in ("num_heads", "num_kv_heads", "head_dim", "num_index_heads", "index_dim"):
            _require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _require(self.num_heads % self.num_kv_heads == 0, "num_heads",
                 f"must be a multiple of num_kv_heads={self.num_kv_heads}, got {self.num_heads}")
        _require(self.num_index_heads == self.num_kv_heads, "num_index_heads",
                 f"must equal num_kv_heads={self.num_kv_heads} (one index head per KV group), "
                 f"got {self.num_index_heads}")
        _require(self.local_blocks == 1, "local_blocks", f"must be 1, got {self.local_blocks}")
        _require(0 <= self.init_blocks < self.topk, "init_blocks",
                 f"must be in [0, {self.topk}), got {self.init_blocks}")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    @classmethod
    def minimax_m3(cls) -> "MSAConfig":
        """MiniMax-M3, all heads (64 q / 4 kv, group 16)."""
        return cls(num_heads=64, num_kv_heads=4, head_dim=128, num_index_heads=4, index_dim=128)

    @classmethod
    def minimax_m3_tp4(cls) -> "MSAConfig":
        """MiniMax-M3 per tensor-parallel rank at TP4 (16 q / 1 kv)."""
        return cls(num_heads=16, num_kv_heads=1, head_dim=128, num_index_heads=1, index_dim=128)

    @classmethod
    def tiny(cls) -> "MSAConfig":
        """The built-in small default (one KV group of 16 heads, small index dim)."""
        return cls(num_heads=16, num_kv_heads=1, head_dim=128, num_index_heads=1, index_dim=32)


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """Runner limits and the static bucket sizes (the CUDA-graph capture sizes)."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    max_model_len: int = 8192
    num_spec_tokens: int = 0
    bucket_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    dcp_world_size: int = 1
    dcp_interleave: int = DCP_INTERLEAVE
    page_size: int = PAGE_SIZE

    def __post_init__(self):
        object.__setattr__(self, "bucket_sizes", tuple(sorted(set(int(b) for b in self.bucket_sizes))))
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                 f"must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_model_len >= 1, "max_model_len", f"must be >= 1, got {self.max_model_len}")
        _require(self.num_spec_tokens >= 0, "num_spec_tokens",
                 f"must be >= 0, got {self.num_spec_tokens}")
        _require(self.page_size == PAGE_SIZE, "page_size",
                 f"MSA needs page_size == {PAGE_SIZE}, got {self.page_size}")
        _require(len(self.bucket_sizes) > 0, "bucket_sizes", "must not be empty")
        _require(self.bucket_sizes[0] >= 1, "bucket_sizes",
                 f"every bucket must be >= 1, got {self.bucket_sizes[0]}")
        _require(self.bucket_sizes[-1] <= self.max_num_batched_tokens, "bucket_sizes",
                 f"bucket {self.bucket_sizes[-1]} is larger than "
                 f"max_num_batched_tokens={self.max_num_batched_tokens}")
        _require(self.dcp_world_size >= 1, "dcp_world_size",
                 f"must be >= 1, got {self.dcp_world_size}")
        _require(self.dcp_interleave == DCP_INTERLEAVE, "dcp_interleave",
                 f"MSA needs dcp_interleave == {DCP_INTERLEAVE} (one block per unit), "
                 f"got {self.dcp_interleave}")
        _require(self.dcp_world_size == 1
                 or self.max_model_len > self.dcp_world_size * self.dcp_interleave,
                 "max_model_len",
                 f"must exceed the DCP dummy context dcp_world_size * dcp_interleave = "
                 f"{self.dcp_world_size * self.dcp_interleave} (context plus one query token), "
                 f"got {self.max_model_len}")
        _require(1 + self.num_spec_tokens <= self.max_num_batched_tokens, "num_spec_tokens",
                 f"decode length 1 + {self.num_spec_tokens} exceeds max_num_batched_tokens="
                 f"{self.max_num_batched_tokens}")

    @property
    def dcp_dummy_context_len(self) -> int:
        """Fake context of a DCP dummy batch: W * I tokens (0 without DCP)."""
        return self.dcp_world_size * self.dcp_interleave if self.dcp_world_size > 1 else 0

    @property
    def uniform_decode_len(self) -> int:
        return 1 + self.num_spec_tokens

    @property
    def max_pages(self) -> int:
        """Block-table width: pages of the longest sequence.

        Every staged sequence (the DCP dummy context included) has seq_len <= max_model_len,
        and under DCP a row needs only ceil(seq_len / (128 * W)) rank-local pages, so this
        width covers every row of every batch.
        """
        return math.ceil(self.max_model_len / self.page_size)

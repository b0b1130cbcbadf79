"""The kernel benchmark's shapes, their random inputs, and our two ops on them.

Shapes: Hq/Hkv in HEAD_CONFIGS, B decode tokens (one per request) in BATCHES, every request at
context L in CONTEXTS; head dim and index dim 128. Inputs (``make_inputs``):
  index_q [B, Hkv, Di] bf16, index_k [N, 128, Di] bf16, kv [N, Hkv, 128, 2D] bf16,
  q [B, Hq, D] bf16, block_table [B, L / 128] int32 (a random permutation of pages 1..N-1;
  page 0 is the null page), req_indices [B], positions [B] = L - 1, seq_lens = kv_lens [B] = L.
"""
from __future__ import annotations

import dataclasses

import _common
import jax
import jax.numpy as jnp

from pallas_kernels import PAGE_SIZE, TOPK
from pallas_kernels.sparse_decode_default import sparse_decode_default
from pallas_kernels.index_select_default import msa_index_select_default

HEAD_DIM = 128
INDEX_DIM = 128
HEAD_CONFIGS = ((16, 1), (64, 4))
BATCHES = (1, 16, 64, 128)
CONTEXTS = (8192, 65536)
FP8 = "float8_e4m3fn"  # the fp8 index-K cache dtype


@dataclasses.dataclass(frozen=True)
class Shape:
    hq: int
    hkv: int
    batch: int
    context: int

    @property
    def name(self) -> str:
        return f"{self.hq}/{self.hkv} B={self.batch} L={self.context}"

    def indexer_bytes(self, itemsize: int = 2) -> int:
        """Index-K bytes the indexer must read: every visible row once."""
        return self.batch * self.context * INDEX_DIM * itemsize

    @property
    def decode_bytes(self) -> int:
        """K and V of TOPK pages per (token, KV head), bf16."""
        return self.batch * self.hkv * TOPK * PAGE_SIZE * 2 * HEAD_DIM * 2


def all_shapes() -> list[Shape]:
    return [Shape(hq, hkv, b, l) for hq, hkv in HEAD_CONFIGS for b in BATCHES for l in CONTEXTS]


def make_inputs(shape: Shape, seed: int) -> dict:
    """Random bf16 caches and queries of ``shape`` (see the module docstring)."""
    if shape.context % PAGE_SIZE:
        raise ValueError(f"context: must be a multiple of {PAGE_SIZE}, got {shape.context}")
    pages_per_req = shape.context // PAGE_SIZE
    num_pages = shape.batch * pages_per_req + 1
    ks = jax.random.split(jax.random.key(seed), 5)
    perm = jax.random.permutation(ks[0], num_pages - 1) + 1
    block_table = perm.reshape(shape.batch, pages_per_req).astype(jnp.int32)
    index_k = jax.random.normal(ks[1], (num_pages, PAGE_SIZE, INDEX_DIM), jnp.bfloat16)
    kv = jax.random.normal(ks[2], (num_pages, shape.hkv, PAGE_SIZE, 2 * HEAD_DIM), jnp.bfloat16)
    index_q = jax.random.normal(ks[3], (shape.batch, shape.hkv, INDEX_DIM), jnp.bfloat16)
    q = jax.random.normal(ks[4], (shape.batch, shape.hq, HEAD_DIM), jnp.bfloat16)
    seq_lens = jnp.full((shape.batch,), shape.context, jnp.int32)
    return dict(index_q=index_q, index_k=index_k, kv=kv, q=q, block_table=block_table,
                req_indices=jnp.arange(shape.batch, dtype=jnp.int32),
                positions=seq_lens - 1, seq_lens=seq_lens, kv_lens=seq_lens)


def our_indexer(x: dict) -> jax.Array:
    """Index scores + top-16 select -> [B, Hkv, 16] int32 (x["index_k"] bf16 or fp8)."""
    return msa_index_select_default(x["index_q"], x["index_k"], x["block_table"],
                                    x["req_indices"], x["positions"], **_common.PALLAS_KW)


def our_decode(x: dict, selected: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sparse decode over ``selected`` -> (out [B, Hq, D] bf16, lse [B, Hq] f32)."""
    return sparse_decode_default(x["q"], x["kv"], selected, x["block_table"],
                                 x["req_indices"], x["kv_lens"], scale=HEAD_DIM ** -0.5,
                                 **_common.PALLAS_KW)

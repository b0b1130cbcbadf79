"""Dense paged causal attention (dense layers, and the dense baseline of MSA layers).

Every token attends to keys ``[0, kv_len_t)`` of its request (kv_len from seq_lens). On a
GPU this runs the Mosaic GPU kernels :func:`pallas_kernels.paged_attention_default.
paged_attention_default` picks per static shape (split-KV decode, tiled prefill); elsewhere
the jnp reference. Pages past a token's length are never read.
"""
from __future__ import annotations

import jax

from pallas_kernels.paged_attention_default import paged_attention_default


def paged_causal_attention(q: jax.Array, kv_cache: jax.Array, block_table: jax.Array,
                           req_indices: jax.Array, kv_lens: jax.Array, *, scale: float
                           ) -> tuple[jax.Array, jax.Array]:
    """Dense GQA attention over the paged cache.

    q [T, Hq, D]; kv_cache [N, Hkv, 128, 2D]; block_table [R, P] int32;
    req_indices [T] int32; kv_lens [T] int32 (0 = padded token).
    Returns (out [T, Hq, D] in q.dtype, lse [T, Hq] f32; zeros / -inf where kv_len == 0).
    """
    return paged_attention_default(q, kv_cache, block_table, req_indices, kv_lens, scale=scale)

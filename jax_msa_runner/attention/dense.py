"""Plain jnp paged causal attention (dense layers, and the dense baseline of MSA layers).

Every token attends to keys ``[0, kv_len_t)`` of its request (kv_len from seq_lens), page
by page with an online softmax. The page loop runs only up to the
largest page count in the batch, so cost follows the real context, not max_model_len.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_msa_runner.config import PAGE_SIZE


def paged_causal_attention(q: jax.Array, kv_cache: jax.Array, block_table: jax.Array,
                           req_indices: jax.Array, kv_lens: jax.Array, *, scale: float
                           ) -> tuple[jax.Array, jax.Array]:
    """Dense GQA attention over the paged cache.

    q [T, Hq, D]; kv_cache [N, Hkv, 128, 2D]; block_table [R, P] int32;
    req_indices [T] int32; kv_lens [T] int32 (0 = padded token).
    Returns (out [T, Hq, D] in q.dtype, lse [T, Hq] f32; zeros / -inf where kv_len == 0).
    """
    T, Hq, D = q.shape
    Hkv = kv_cache.shape[1]
    G = Hq // Hkv
    P = block_table.shape[1]
    qg = q.astype(jnp.float32).reshape(T, Hkv, G, D) * scale
    rows = block_table[req_indices]  # [T, P]
    n_pages = jnp.minimum((kv_lens + PAGE_SIZE - 1) // PAGE_SIZE, P)
    num_iters = jnp.max(n_pages, initial=0)
    key_off = jnp.arange(PAGE_SIZE, dtype=jnp.int32)

    def body(p, carry):
        m, l, acc = carry
        page = rows[:, p]  # [T]
        kv = kv_cache[page].astype(jnp.float32)  # [T, Hkv, 128, 2D]
        k, v = kv[..., :D], kv[..., D:]
        s = jnp.einsum("thgd,thkd->thgk", qg, k)  # [T, Hkv, G, 128]
        valid = (p * PAGE_SIZE + key_off)[None, :] < kv_lens[:, None]  # [T, 128]
        s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - m_safe)
        pr = jnp.exp(s - m_safe[..., None])
        l = l * alpha + jnp.sum(pr, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("thgk,thkd->thgd", pr, v)
        return m_new, l, acc

    init = (jnp.full((T, Hkv, G), -jnp.inf, jnp.float32), jnp.zeros((T, Hkv, G), jnp.float32),
            jnp.zeros((T, Hkv, G, D), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, num_iters, body, init)
    has = l > 0
    out = jnp.where(has[..., None], acc / jnp.where(has, l, 1.0)[..., None], 0.0)
    lse = jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)
    return out.reshape(T, Hq, D).astype(q.dtype), lse.reshape(T, Hq)

"""A random dense paged-attention batch for the dense kernels' tests.

Requests of random lengths (not multiples of 128), each contributing a run of consecutive
tokens (a decode row or a prefill chunk at a context offset: kv_lens ``L - n + 1 .. L``),
plus padded tokens (kv_len 0). Every page no token may consume holds NaN, and so do the
keys and values past each request's final length in its last page; block-table entries past
a request's pages are -1, an out-of-range id, or a NaN page. ``dense_specs``: the five
arguments as shapes only, for lowering tests.
"""
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import PAGE_SIZE


def dense_specs(t, hq, hkv, d=128, *, context=131072, rows=None, pages=None,
                dtype=jnp.bfloat16):
    """``jax.ShapeDtypeStruct``s of q ``[t, hq, d]``, the cache ``[pages, hkv, 128, 2d]``, a
    block table of ``ceil(context / 128)`` columns over ``rows`` requests (default ``t``), and
    req_indices / kv_lens ``[t]`` int32."""
    s = jax.ShapeDtypeStruct
    cols = -(-context // PAGE_SIZE)
    rows = t if rows is None else rows
    pages = rows * cols + 1 if pages is None else pages
    return (s((t, hq, d), dtype), s((pages, hkv, PAGE_SIZE, 2 * d), dtype),
            s((rows, cols), jnp.int32), s((t,), jnp.int32), s((t,), jnp.int32))


def build_dense_batch(seed, *, hq, hkv, d, runs, max_len=600, pad_tokens=1,
                      dtype=jnp.bfloat16):
    """``runs``: tokens per request (1 = a decode row). Returns the five arguments (q,
    kv_cache, block_table, req_indices, kv_lens) as numpy arrays (q and the cache in f32,
    to be cast to ``dtype`` by the caller with :func:`as_inputs`)."""
    rng = np.random.default_rng(seed)
    n_req = len(runs)
    lens = np.array([rng.integers(n, max_len + 1) for n in runs])
    blocks = -(-lens // PAGE_SIZE)
    cols = int(blocks.max()) + 2  # at least one column past every request's pages
    n_real = int(blocks.sum())
    n_pages = n_real + 3  # + never-consumed NaN pages
    kv = rng.standard_normal((n_pages, hkv, PAGE_SIZE, 2 * d)).astype(np.float32)
    kv[n_real:] = np.nan
    block_table = np.empty((n_req + 1, cols), np.int32)
    order = rng.permutation(n_real)
    at = 0
    for r in range(n_req + 1):
        n = int(blocks[r]) if r < n_req else 0
        block_table[r, :n] = order[at:at + n]
        at += n
        tail = rng.choice([-1, n_pages + 7, n_real, n_real + 1, 2**30], cols - n)
        block_table[r, n:] = tail
        if r < n_req:
            last = order[at - 1]
            kv[last, :, (lens[r] - 1) % PAGE_SIZE + 1:] = np.nan  # never written
    req, kv_lens = [], []
    for r, n in enumerate(runs):
        req += [r] * n
        kv_lens += list(range(lens[r] - n + 1, lens[r] + 1))
    req += [n_req] * pad_tokens
    kv_lens += [0] * pad_tokens
    t = len(req)
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    return (q, kv, block_table, np.asarray(req, np.int32), np.asarray(kv_lens, np.int32))


def as_inputs(batch, dtype=jnp.bfloat16):
    """The numpy batch as device arrays: q and the cache in ``dtype``, the rest int32."""
    q, kv, bt, req, lens = batch
    return (jnp.asarray(q, dtype), jnp.asarray(kv, dtype), jnp.asarray(bt), jnp.asarray(req),
            jnp.asarray(lens))

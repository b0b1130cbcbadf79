"""A random sparse-decode batch for the decode kernels' tests (the Mosaic GPU kernel's and the
default decode's): random kv lengths (not multiples of 128), padded rows, -1 / out-of-range /
repeated / unconsumed ids, several tokens per request; every block-table entry no token may
consume points at a finite poison page (K = 0, V = 1000), and keys past a request's length
hold NaN. ``decode_specs``: the same six arguments as shapes only, for lowering tests."""
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import PAGE_SIZE, TOPK

POISON_V = 1000.0


def decode_specs(t, hq, hkv, d=128, *, pages=4096, rows=128, cols=512, dtype=jnp.bfloat16):
    """``jax.ShapeDtypeStruct``s of the decode kernels' six arguments: q ``[t, hq, d]``, the
    cache ``[pages, hkv, 128, 2d]`` (``dtype``), selected ``[t, hkv, 16]``, a ``[rows, cols]``
    block table, req_indices and kv_lens ``[t]`` (int32)."""
    s = jax.ShapeDtypeStruct
    return (s((t, hq, d), dtype), s((pages, hkv, PAGE_SIZE, 2 * d), dtype),
            s((t, hkv, TOPK), jnp.int32), s((rows, cols), jnp.int32), s((t,), jnp.int32),
            s((t,), jnp.int32))


def build_batch(seed, *, hq, hkv, d, tokens=3, pad_tokens=1, max_blocks=6, long_first=False,
                dtype=jnp.bfloat16):
    """``tokens`` decode tokens over ``tokens - 1`` requests (the last two share one) plus
    ``pad_tokens`` padded tokens (kv_len 0) on a padded block-table row. Requests hold up to
    ``max_blocks`` blocks; with ``long_first`` the first holds 17-20 (16 consumed slots of a
    real top-16). Returns the six kernel arguments as numpy arrays and the poison page."""
    rng = np.random.default_rng(seed)
    n_req = max(1, tokens - 1)
    seq = rng.integers(1, max_blocks * PAGE_SIZE, n_req)
    if long_first:
        seq[0] = rng.integers(16 * PAGE_SIZE + 1, 20 * PAGE_SIZE)
    blocks = -(-seq // PAGE_SIZE)
    ncols = int(blocks.max()) + 1  # the last column is never valid
    tok_req = [min(i, n_req - 1) for i in range(tokens)]
    kv_lens, sel = [], []
    for i, r in enumerate(tok_req):
        kv_len = int(seq[r]) if i < n_req else int(rng.integers(1, seq[r] + 1))
        n = -(-kv_len // PAGE_SIZE)
        rows = []
        for _ in range(hkv):
            row = rng.integers(0, n, TOPK)                          # repeats allowed
            row[rng.random(TOPK) < 0.2] = -1
            row[rng.integers(TOPK)] = rng.choice([n, n + 3, 100_000, -7])  # out of range
            head = row[:min(n, TOPK)]
            if not ((head >= 0) & (head < n)).any():  # at least one consumed slot
                row[0] = rng.integers(0, n)
            rows.append(row)
        kv_lens.append(kv_len)
        sel.append(np.stack(rows))
    for _ in range(pad_tokens):
        tok_req.append(n_req)
        kv_lens.append(0)
        sel.append(rng.integers(-1, 4, (hkv, TOPK)))
    sel = np.stack(sel).astype(np.int32)
    kv_lens = np.asarray(kv_lens, np.int32)
    t = len(tok_req)
    # Pages only for blocks some token consumes; every other entry is the poison page.
    consumed = set()
    for i in range(t):
        n = -(-int(kv_lens[i]) // PAGE_SIZE)
        for h in range(hkv):
            for j in range(min(n, TOPK)):
                if 0 <= sel[i, h, j] < n:
                    consumed.add((tok_req[i], int(sel[i, h, j])))
    for r in range(n_req):  # the partial last block gets a page too (its NaN tail)
        consumed.add((r, int(blocks[r]) - 1))
    consumed = sorted(consumed)
    n_pages = len(consumed) + 3
    poison = n_pages - 1
    block_table = np.full((n_req + 1, ncols), poison, np.int32)
    for (r, b), page in zip(consumed, rng.permutation(np.arange(1, poison))):
        block_table[r, b] = page
    kv = rng.standard_normal((n_pages, hkv, PAGE_SIZE, 2 * d)).astype(np.float32)
    kv[poison, :, :, :d] = 0.0
    kv[poison, :, :, d:] = POISON_V
    for r in range(n_req):  # never written: keys past the request's length
        tail = int(seq[r]) % PAGE_SIZE
        if tail:
            kv[block_table[r, blocks[r] - 1], :, tail:] = np.nan
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    args = (np.asarray(jnp.asarray(q, dtype)), np.asarray(jnp.asarray(kv, dtype)), sel,
            block_table, np.asarray(tok_req, np.int32), kv_lens)
    return args, poison

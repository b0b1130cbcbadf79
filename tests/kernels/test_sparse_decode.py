"""Sparse decode: kernel vs reference vs an independent numpy oracle.

One mixed batch per configuration keeps the number of compilations small: kv lengths
1, 127, 128, 129, 2047, 2048, 2049 and longer, a spec-decode request (q_len 3), padded
rows, -1 / out-of-range ids inside the consumed range, the stale-position bug row
(kv_len 4096 with [0, -1 x 15]), an all -1 row and a short selection, at whole-page and
half-page loop steps (``keys_per_step`` 128 / 64), and valid ids in slots ``>= n_use``.

Poison is a finite sentinel whose read shows: K = 0 (a score of 0, typical of the real keys)
and V = 1000 (the real values are standard normal), so a key read that should not be moves
the output by far more than the tolerance. It fills the null page 0 (padded rows), the
poison page that every unused block-table column points at (where a clamped slot of a
request that never selects block 0 reads, and where a wrapped -1 lands: the last column is
never valid), and the unwritten tails of partial pages (keys >= seq_len).
NaN placed in a consumed key or value must reach exactly the rows that consume it.
"""
from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _helpers import INTERPRET
from pallas_kernels import PAGE_SIZE, TOPK
from pallas_kernels.sparse_decode import (compact_slots, finalize, merge_splits, sparse_decode,
                                          sparse_decode_reference)
from pallas_kernels.sparse_prefill import sparse_prefill

D_MODEL = 128
SENTINEL_K, SENTINEL_V = 0.0, 1000.0  # poison: a read of it moves the output visibly


def poison(kv, page, tail=0, value=None):
    """Poison ``kv[page, :, tail:]`` in place: K = 0 and V = 1000, or ``value`` in both."""
    d = kv.shape[-1] // 2
    if value is None:
        kv[page, :, tail:, :d] = SENTINEL_K
        kv[page, :, tail:, d:] = SENTINEL_V
    else:
        kv[page, :, tail:] = value


@dataclasses.dataclass(frozen=True)
class Req:
    """One request: ``seq_len``, ``q_len`` (tokens at its causal tail) and a selection edit."""

    seq_len: int
    q_len: int = 1
    edit: str | None = None  # None | minus1 | oob | stale | all_minus1 | short | dup | dcp | beyond


@dataclasses.dataclass
class Batch:
    q: np.ndarray
    kv_cache: np.ndarray
    selected: np.ndarray
    block_table: np.ndarray
    req_indices: np.ndarray
    kv_lens: np.ndarray
    kept: list  # kept[t][h]: the block ids the token really attends (the oracle's set)
    poison_page: int = -1  # the page unused block-table columns point at

    def args(self):
        return tuple(jnp.asarray(a) for a in (self.q, self.kv_cache, self.selected,
                                               self.block_table, self.req_indices, self.kv_lens))


def _selection(rng, kv_len, edit):
    """Selection row ``[16]`` for one (token, head) and the set of block ids it keeps."""
    n = -(-kv_len // PAGE_SIZE)
    n_use = min(TOPK, n)
    if n <= TOPK:
        sel = np.concatenate([np.arange(n), -np.ones(TOPK - n, int)])
    else:  # forced local block n-1, 15 others, ascending
        # block 0 never picked here (init_blocks = 0): a clamped slot then reads the null page
        others = rng.choice(np.arange(1, n - 1), TOPK - 1, replace=False)
        sel = np.sort(np.concatenate([others, [n - 1]]))
    if edit == "minus1":  # -1 inside the consumed range (the original bug's symptom)
        sel[[s for s in (1, 3, n_use - 1) if s < n_use]] = -1
    elif edit == "oob":
        sel[0], sel[n_use // 2], sel[n_use - 1] = n, 100_000, -7
    elif edit == "stale":  # selector saw position 0, consumer sees kv_len
        sel = np.concatenate([[0], -np.ones(TOPK - 1, int)])
    elif edit == "all_minus1":
        sel = -np.ones(TOPK, int)
    elif edit == "short":  # fewer than 16 valid pages in a full consumed range
        sel[10:] = -1
    elif edit == "dup":  # a repeated id counts twice (multiset semantics)
        sel[min(1, n_use - 1)] = sel[0]
    elif edit == "dcp":  # a DCP rank's view: few valid ids scattered among -1s, -1 first
        sel[[s for s in range(n_use) if s % 3 != 1]] = -1
    elif edit == "beyond":  # valid ids in the slots >= n_use: never consumed
        sel[n_use:] = 0
    kept = [int(b) for b in sel[:n_use] if 0 <= b < n]
    return sel.astype(np.int32), kept


def build_batch(seed, reqs, *, hq, hkv, d=D_MODEL, dtype=jnp.float32, pad_tokens=2,
                pad_rows=1, per_token=None):
    """A batch of ``reqs`` plus ``pad_tokens`` padded tokens on ``pad_rows`` padded rows.

    ``per_token(r, off)`` may override the kv_len of token ``off`` of request ``r`` (prefill);
    by default it is ``seq_len - q_len + off + 1``. Pages are unique per used (request,
    block), randomly permuted; unused block-table columns of a request point at the poison
    page ``Batch.poison_page`` (the last page), padded rows at the null page 0, both
    poisoned (see the module docstring), as are the tails of partial last pages.
    """
    rng = np.random.default_rng(seed)
    tok_req, tok_len, sel, kept = [], [], [], []
    for r, req in enumerate(reqs):
        for off in range(req.q_len):
            kv_len = (req.seq_len - req.q_len + off + 1) if per_token is None else per_token(r, off)
            rows = [_selection(rng, kv_len, req.edit) for _ in range(hkv)]
            tok_req.append(r)
            tok_len.append(kv_len)
            sel.append(np.stack([s for s, _ in rows]))
            kept.append([k for _, k in rows])
    for i in range(pad_tokens):
        tok_req.append(len(reqs) + i % pad_rows)
        tok_len.append(0)
        sel.append(np.full((hkv, TOPK), -1, np.int32))
        kept.append([[] for _ in range(hkv)])
    t = len(tok_req)
    max_blocks = max(-(-rq.seq_len // PAGE_SIZE) for rq in reqs)
    ncols = max_blocks + 1  # the last column is never valid: a wrapped -1 lands there
    used = sorted({(tok_req[i], b) for i in range(t) for h in range(hkv) for b in kept[i][h]}
                  | {(r, -(-rq.seq_len // PAGE_SIZE) - 1) for r, rq in enumerate(reqs)})
    n_pages = len(used) + 2
    poison_page = n_pages - 1
    pages = rng.permutation(np.arange(1, poison_page))
    block_table = np.zeros((len(reqs) + pad_rows, ncols), np.int32)
    block_table[:len(reqs)] = poison_page
    for (r, b), pg in zip(used, pages):
        block_table[r, b] = pg
    kv = rng.standard_normal((n_pages, hkv, PAGE_SIZE, 2 * d)).astype(np.float32)
    poison(kv, 0)
    poison(kv, poison_page)
    for r, rq in enumerate(reqs):  # unwritten tail of the last partial page
        tail = rq.seq_len % PAGE_SIZE
        if tail:
            poison(kv, block_table[r, -(-rq.seq_len // PAGE_SIZE) - 1], tail)
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    cast = lambda x: np.array(jnp.asarray(x, dtype))  # noqa: E731
    return Batch(cast(q), cast(kv), np.stack(sel).astype(np.int32), block_table,
                 np.asarray(tok_req, np.int32), np.asarray(tok_len, np.int32), kept,
                 poison_page)


def oracle(batch, scale):
    """Float64 attention of each (token, head) over exactly its kept blocks (keys < kv_len)."""
    q = np.asarray(batch.q, np.float64)
    kv = np.asarray(batch.kv_cache, np.float64)
    t, hq, d = q.shape
    hkv = kv.shape[1]
    g = hq // hkv
    out = np.zeros((t, hq, d))
    lse = np.full((t, hq), -np.inf)
    for i in range(t):
        for h in range(hkv):
            blocks = np.asarray(batch.kept[i][h], np.int64)
            pos = (blocks[:, None] * PAGE_SIZE + np.arange(PAGE_SIZE)).reshape(-1)
            valid = pos < batch.kv_lens[i]
            if not valid.any():
                continue
            pages = batch.block_table[batch.req_indices[i], blocks]
            kv_rows = kv[pages, h].reshape(-1, 2 * d)[valid]                # [keys, 2D]
            s = q[i, h * g:(h + 1) * g] @ kv_rows[:, :d].T * scale
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            out[i, h * g:(h + 1) * g] = (p @ kv_rows[:, d:]) / p.sum(axis=1, keepdims=True)
            lse[i, h * g:(h + 1) * g] = m[:, 0] + np.log(p.sum(axis=1))
    return out, lse


@functools.partial(jax.jit, static_argnames="scale")
def dense_causal_attention(q, kv_cache, block_table, req_indices, kv_lens, *, scale):
    """Dense causal paged attention in jnp: every key ``< kv_len`` of the token's request."""
    t, hq, d = q.shape
    hkv = kv_cache.shape[1]
    g = hq // hkv
    pages = kv_cache[block_table[req_indices]]                         # [T,P,Hkv,128,2D]
    pages = jnp.moveaxis(pages, 2, 1).reshape(t, hkv, -1, 2 * d).astype(jnp.float32)
    valid = jnp.arange(pages.shape[2])[None, :] < kv_lens[:, None]     # [T,L]
    k = jnp.where(valid[:, None, :, None], pages[..., :d], 0.0)
    v = jnp.where(valid[:, None, :, None], pages[..., d:], 0.0)
    s = jnp.einsum("thgd,thld->thgl", q.reshape(t, hkv, g, d).astype(jnp.float32), k,
                   precision="highest") * scale
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    out = jnp.einsum("thgl,thld->thgd", p, v, precision="highest")
    return out.reshape(t, hq, d), lse.reshape(t, hq)


def tolerances(dtype):
    """(out atol, lse atol) for the kernel against f32 math."""
    if jnp.dtype(dtype) == jnp.float32:
        return (2e-5, 2e-5) if INTERPRET else (1e-2, 1e-2)  # TF32 dots on the GPU
    return 3e-2, 2e-3

def assert_matches_reference_and_oracle(batch, out, lse, reference, scale, dtype):
    """Shapes, dtypes and finiteness of (out, lse), then equality with `reference` (the jnp
    reference of the kernel) and with the float64 oracle (each token attends exactly its
    kept blocks), at the dtype's tolerances."""
    t, hq, d = batch.q.shape
    chex.assert_shape(out, (t, hq, d))
    chex.assert_shape(lse, (t, hq))
    assert out.dtype == dtype and lse.dtype == jnp.float32
    chex.assert_tree_all_finite(out)
    atol, lse_atol = tolerances(dtype)
    ref_out, ref_lse = reference(*batch.args(), scale=scale)
    chex.assert_trees_all_close(out.astype(jnp.float32), ref_out.astype(jnp.float32),
                                atol=atol, rtol=atol)
    chex.assert_trees_all_close(lse, ref_lse, atol=lse_atol, rtol=lse_atol)
    o_out, o_lse = oracle(batch, scale)
    np.testing.assert_allclose(np.asarray(out, np.float64), o_out, atol=atol, rtol=atol)
    np.testing.assert_allclose(np.asarray(lse, np.float64), o_lse, atol=lse_atol, rtol=lse_atol)


DECODE_REQS = (
    Req(1), Req(127), Req(128), Req(129), Req(2047), Req(2048), Req(2049), Req(4500),
    Req(300, q_len=3),                       # spec decode: kv_len 298, 299, 300
    Req(1000, edit="minus1"), Req(700, edit="oob"), Req(4096, edit="stale"),
    Req(3000, edit="all_minus1"), Req(5000, edit="short"), Req(250, q_len=2, edit="minus1"),
    Req(600, edit="dup"), Req(300, q_len=2, edit="beyond"),
)
IDENTITY_ROWS = (0, 1, 2, 3, 4, 5, 8, 9, 10)  # tokens of requests with kv_len <= 2048, unedited


@pytest.mark.parametrize("dtype,hkv,d,num_splits,keys_per_step,v_mask", [
    (jnp.float32, 1, 128, None, None, None),  # default splits (8 for these 23 rows), whole pages
    (jnp.bfloat16, 4, 64, None, None, None),  # default splits (2); D = 64 keeps the cache small
    (jnp.bfloat16, 1, 128, 1, None, "select"),  # single split: the kernel writes the output
    (jnp.bfloat16, 1, 128, 1, None, "load"),  # same, V's invalid rows never loaded
    (jnp.bfloat16, 1, 128, 1, 64, None),      # half-page steps, single split
    (jnp.float32, 1, 128, 4, 64, "load"),     # half-page steps over 4 splits, masked V load
])
def test_decode_matches_reference_oracle_and_dense(dtype, hkv, d, num_splits, keys_per_step,
                                                   v_mask):
    batch = build_batch(0, DECODE_REQS, hq=16 * hkv, hkv=hkv, d=d, dtype=dtype)
    scale = d ** -0.5
    args = batch.args()
    out, lse = sparse_decode(*args, scale=scale, interpret=INTERPRET, num_splits=num_splits,
                             keys_per_step=keys_per_step, v_mask=v_mask)
    assert_matches_reference_and_oracle(batch, out, lse, sparse_decode_reference, scale, dtype)
    t = batch.q.shape[0]
    atol, lse_atol = tolerances(dtype)

    # padded rows and the all -1 row: zeros and lse -inf
    empty = [i for i in range(t) if not any(batch.kept[i])]
    assert len(empty) == 3
    np.testing.assert_array_equal(np.asarray(out[np.array(empty)], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(lse[np.array(empty)]), -np.inf)

    # exactness: identity selection while kv_len <= 2048 is dense causal attention
    rows = np.array(IDENTITY_ROWS)
    assert (batch.kv_lens[rows] <= 2048).all()
    d_out, d_lse = dense_causal_attention(args[0][rows], args[1], args[3], args[4][rows],
                                          args[5][rows], scale=scale)
    chex.assert_trees_all_close(out[rows].astype(jnp.float32), d_out, atol=atol, rtol=atol)
    chex.assert_trees_all_close(lse[rows], d_lse, atol=lse_atol, rtol=lse_atol)


@pytest.mark.parametrize("num_splits", [2, 16])
def test_in_kernel_split_merge_is_exact_and_repeatable(num_splits):
    """The splits meet in the kernel (the last program by ticket merges): many rows at once,
    run repeatedly (compiled: programs finish in varying order), give bit-identical outputs
    every time, equal to the reference. A partial read before its program stored it would
    show as a difference."""
    reqs = (Req(4500), Req(2049), Req(129, q_len=2), Req(3000, edit="minus1"),
            Req(4096, edit="stale"), Req(5000, edit="short")) * (1 if INTERPRET else 24)
    batch = build_batch(7, reqs, hq=32, hkv=2, dtype=jnp.bfloat16)
    args = batch.args()
    first = sparse_decode(*args, scale=0.1, interpret=INTERPRET, num_splits=num_splits)
    assert_matches_reference_and_oracle(batch, *first, sparse_decode_reference, 0.1,
                                        jnp.bfloat16)
    for _ in range(1 if INTERPRET else 50):
        chex.assert_trees_all_equal(
            sparse_decode(*args, scale=0.1, interpret=INTERPRET, num_splits=num_splits), first)


@pytest.mark.parametrize("keys_per_step,num_splits,v_mask",
                         [(None, None, None), (64, 1, "select"), (64, 4, "load")])
def test_minus_one_inside_consumed_range_equals_selection_without_it(keys_per_step, num_splits,
                                                                      v_mask):
    """The original bug: -1 (and out-of-range ids) inside the consumed range. Each edited
    token is paired with a clean twin (same q, pages and kv_len) whose selection is just the
    kept ids followed by -1: equal outputs, finite, equal to the oracle over the kept set.
    Long rows never select block 0, so a clamped slot would land on the poison page. The
    DCP rows (valid ids scattered among -1s, -1 first) exercise the compaction of valid slots
    and its chunking over splits."""
    reqs = (Req(1500), Req(1500, edit="minus1"), Req(4096), Req(4096, edit="stale"),
            Req(900), Req(900, edit="oob"), Req(5000), Req(5000, edit="minus1"),
            Req(2600), Req(2600, edit="short"), Req(5000), Req(5000, edit="dcp"),
            Req(1000), Req(1000, edit="dcp"))
    pairs = [(i, i + 1) for i in range(0, len(reqs), 2)]
    batch = build_batch(1, reqs, hq=16, hkv=1, pad_tokens=0)
    for clean, bad in pairs:
        kept = batch.kept[bad][0]
        n_use = min(TOPK, -(-int(batch.kv_lens[bad]) // PAGE_SIZE))
        assert 0 < len(kept) < n_use
        batch.block_table[clean] = batch.block_table[bad]
        batch.q[clean] = batch.q[bad]
        batch.selected[clean, 0] = np.concatenate([kept, -np.ones(TOPK - len(kept))])
        batch.kept[clean] = [kept]
    assert batch.block_table[7, 0] == batch.poison_page and 0 not in batch.kept[7][0]
    scale = D_MODEL ** -0.5
    out, lse = sparse_decode(*batch.args(), scale=scale, interpret=INTERPRET,
                             keys_per_step=keys_per_step, num_splits=num_splits, v_mask=v_mask)
    chex.assert_tree_all_finite(out)
    chex.assert_tree_all_finite(lse)
    atol, lse_atol = tolerances(jnp.float32)
    for clean, bad in pairs:
        chex.assert_trees_all_close(out[bad], out[clean], atol=atol, rtol=atol)
        chex.assert_trees_all_close(lse[bad], lse[clean], atol=lse_atol, rtol=lse_atol)
    o_out, o_lse = oracle(batch, scale)
    np.testing.assert_allclose(np.asarray(out, np.float64), o_out, atol=atol, rtol=atol)
    np.testing.assert_allclose(np.asarray(lse, np.float64), o_lse, atol=lse_atol, rtol=lse_atol)
    ref_out, ref_lse = sparse_decode_reference(*batch.args(), scale=scale)
    chex.assert_trees_all_close(out, ref_out, atol=atol, rtol=atol)
    chex.assert_trees_all_close(lse, ref_lse, atol=lse_atol, rtol=lse_atol)


def test_small_group_and_ids_beyond_block_table_width():
    """GQA group 4 (Hq 8, Hkv 2: padded to 16 dot rows), and kv_len needing 4 blocks while the
    table has 2 columns: ids 2, 3 are masked (never clamped onto a page), so token 0 with
    [0, 1, 2, 3] equals token 1 with [0, 1]."""
    rng = np.random.default_rng(3)
    kv = rng.standard_normal((5, 2, PAGE_SIZE, 2 * 32)).astype(np.float32)
    poison(kv, 4)                                             # past the table's last page
    q = jnp.asarray(np.repeat(rng.standard_normal((1, 8, 32)), 2, axis=0), jnp.float32)
    sel = np.full((2, 2, TOPK), -1, np.int32)
    sel[0, :, :4] = [0, 1, 2, 3]
    sel[1, :, :2] = [0, 1]
    args = (q, jnp.asarray(kv), jnp.asarray(sel), jnp.asarray([[3, 1]], jnp.int32),
            jnp.zeros((2,), jnp.int32), jnp.full((2,), 4 * PAGE_SIZE, jnp.int32))
    ref = sparse_decode_reference(*args, scale=0.2)
    atol, _ = tolerances(jnp.float32)
    for fn in (sparse_decode, sparse_prefill):
        out, lse = fn(*args, scale=0.2, interpret=INTERPRET)
        chex.assert_shape((out, lse), ((2, 8, 32), (2, 8)))
        chex.assert_tree_all_finite((out, lse))
        chex.assert_trees_all_close(out[0], out[1], atol=atol, rtol=atol)
        chex.assert_trees_all_close(lse[0], lse[1], atol=atol, rtol=atol)
        chex.assert_trees_all_close((out, lse), ref, atol=atol, rtol=atol)
    # and the page set really is {3, 1}: dense attention over the 256 keys of pages 3 and 1
    k = np.concatenate([kv[3], kv[1]], axis=1)                # [Hkv, 256, 2D]
    qn = np.asarray(q[0]).reshape(2, 4, 32)
    s = np.einsum("hgd,hkd->hgk", qn, k[..., :32]) * 0.2
    p = np.exp(s - s.max(-1, keepdims=True))
    dense = np.einsum("hgk,hkd->hgd", p / p.sum(-1, keepdims=True), k[..., 32:])
    np.testing.assert_allclose(np.asarray(out[0]).reshape(2, 4, 32), dense, atol=atol, rtol=atol)


def _attend(q_rows, kv_rows, scale):
    """Float64 softmax attention of ``q_rows [G, D]`` over ``kv_rows [L, 2D]``."""
    d = q_rows.shape[-1]
    s = np.asarray(q_rows, np.float64) @ np.asarray(kv_rows[:, :d], np.float64).T * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ np.asarray(kv_rows[:, d:], np.float64)


def test_poison_read_would_show():
    """The sentinel is visible. Each wrong read the safety boundary prevents would move the
    output by far more than the tolerance, while the kernel's output equals the oracle's:
    - the stale-position row (kv_len 4096, selection [0, -1 x 15]) attends block 0 only; a
      -1 wrapped to the last block-table column reads the poison page;
    - a -1 slot of a long row clamped to block 0 (which the row never selected) and consumed
      reads the poison page;
    - a key past kv_len (2600) in the partial last page reads the poisoned tail."""
    batch = build_batch(4, (Req(4096, edit="stale"), Req(5000, edit="minus1"), Req(2600)),
                        hq=16, hkv=1, pad_tokens=0)
    scale = D_MODEL ** -0.5
    out, _ = sparse_decode(*batch.args(), scale=scale, num_splits=1)
    out = np.asarray(out, np.float64)
    atol, _ = tolerances(jnp.float32)
    np.testing.assert_allclose(out, oracle(batch, scale)[0], atol=atol, rtol=atol)
    kv, bt = batch.kv_cache[:, 0], batch.block_table                    # [N, 128, 2D]
    assert bt[0, -1] == batch.poison_page and bt[1, 0] == batch.poison_page
    assert batch.kept[0][0] == [0] and 0 not in batch.kept[1][0]

    def rows(r, blocks, kv_len):
        """K/V rows of ``blocks`` of request r at positions < kv_len."""
        return np.concatenate([kv[bt[r, b]][:max(0, min(PAGE_SIZE, kv_len - b * PAGE_SIZE))]
                               for b in blocks])

    kept1 = batch.kept[1][0]
    wrong = {  # (token, attention over what the wrong read would attend)
        "wrapped -1": (0, np.concatenate([rows(0, [0], 4096), kv[batch.poison_page]])),
        "clamped -1": (1, np.concatenate([rows(1, kept1, 5000), kv[batch.poison_page]])),
        "tail": (2, rows(2, batch.kept[2][0], -(-2600 // PAGE_SIZE) * PAGE_SIZE)),
    }
    for name, (tok, kv_rows) in wrong.items():
        np.testing.assert_allclose(_attend(batch.q[tok], rows(tok, batch.kept[tok][0],
                                                              int(batch.kv_lens[tok])), scale),
                                   out[tok], atol=atol, rtol=atol)   # the right rows: equal
        assert np.abs(_attend(batch.q[tok], kv_rows, scale) - out[tok]).max() > 1.0, name


NAN_REQS = (Req(300, q_len=3), Req(2500), Req(2500, edit="minus1"))


def nan_batch(seed, dtype=jnp.float32):
    """A batch with NaN in consumed keys and values, and in pages nothing consumes.

    Requests: A (seq 300, 3 spec-decode tokens with kv_len 298, 299, 300), B (2500, 16 of 20
    blocks), C (2500 with -1 slots inside its consumed range: they clamp to block 0, which is
    the poison page). Hkv 2, group 2, D 32. NaN at
      - K of key 299, head 1, in A's page of block 2: consumed by A's token 2 only;
      - V of key 298, head 0, same page: consumed by A's tokens 1 and 2, masked for token 0
        (a prefill tile holds all three: a NaN V row must not leak through a p = 0);
      - V of one key of a kept, non-local block of B's head 0;
      - everywhere nothing consumes: the poison page, the null page, the partial-page tails.
    Returns the batch and the NaN rows ``(token, kv head)`` of the float64 oracle.
    """
    d = 32
    batch = build_batch(seed, NAN_REQS, hq=4, hkv=2, d=d, pad_tokens=1)
    kv = np.asarray(batch.kv_cache, np.float32)
    page_a = batch.block_table[0, 2]
    kv[page_a, 1, 299 - 256, 5] = np.nan
    kv[page_a, 0, 298 - 256, d + 7] = np.nan
    blk_b = batch.kept[3][0][3]
    kv[batch.block_table[1, blk_b], 0, 5, d + 11] = np.nan
    poison(kv, batch.poison_page, value=np.nan)
    poison(kv, 0, value=np.nan)
    for r, rq in enumerate(NAN_REQS):
        page = batch.block_table[r, -(-rq.seq_len // PAGE_SIZE) - 1]
        poison(kv, page, rq.seq_len % PAGE_SIZE or PAGE_SIZE, value=np.nan)
    batch.kv_cache = np.array(jnp.asarray(kv, dtype))
    batch.q = np.array(jnp.asarray(batch.q, dtype))
    nan_rows = {(2, 1), (1, 0), (2, 0), (3, 0)}
    assert batch.kv_lens[:3].tolist() == [298, 299, 300] and 2 in batch.kept[0][0]
    return batch, nan_rows


@pytest.mark.parametrize("fn,kw", [
    (sparse_decode, dict(num_splits=1)),
    (sparse_decode, dict(num_splits=4)),                  # NaN in one split's partial state
    (sparse_decode, dict(num_splits=2, keys_per_step=64, v_mask="load")),
    (sparse_prefill, dict(num_splits=1)),                 # A's 3 tokens + B share one tile
    (sparse_prefill, dict(num_splits=2)),
    (sparse_decode_reference, {}),
])
def test_nan_in_consumed_key_or_value_reaches_exactly_its_rows(fn, kw):
    """NaN propagates like dense attention: into the output of each (token, KV head) that
    consumes it (a NaN key also into its lse), never into another row, and NaN in keys or
    pages nothing consumes changes nothing: the other rows equal the float64 oracle."""
    batch, nan_rows = nan_batch(5)
    scale = 32 ** -0.5
    out, lse = fn(*batch.args(), scale=scale, **kw)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    o_out, o_lse = oracle(batch, scale)
    atol, lse_atol = tolerances(jnp.float32)
    t, hq, d = out.shape
    g = hq // 2
    for i in range(t):
        for h in range(2):
            rows = slice(h * g, (h + 1) * g)
            want_nan = (i, h) in nan_rows
            assert np.isnan(o_out[i, rows]).any(axis=-1).all() == want_nan  # the oracle agrees
            if want_nan:
                assert np.isnan(out[i, rows]).any(axis=-1).all(), (i, h)
            else:
                assert np.isfinite(out[i, rows]).all(), (i, h)
                np.testing.assert_allclose(out[i, rows], o_out[i, rows], atol=atol, rtol=atol)
            # a NaN key makes the lse NaN, a NaN value does not (as in dense attention)
            np.testing.assert_allclose(lse[i, rows], o_lse[i, rows], atol=lse_atol,
                                       rtol=lse_atol)
    assert np.isnan(lse[2, g:]).all() and np.isfinite(lse[1]).all()
    np.testing.assert_array_equal(out[-1], 0.0)  # the padded token
    np.testing.assert_array_equal(lse[-1], -np.inf)


def test_finalize_and_merge_keep_nan_and_empty_rows():
    """finalize: l == 0 -> (0, -inf), NaN l or acc -> NaN. merge_splits: empty splits weigh
    0; a NaN lse or a NaN in o of any split (even one of weight 0) reaches the merged row."""
    acc = jnp.asarray([[1.0, 2.0], [0.0, 0.0], [jnp.nan, 1.0], [3.0, 4.0]])
    m = jnp.asarray([0.0, -1e30, 0.0, jnp.nan])
    l = jnp.asarray([2.0, 0.0, 1.0, jnp.nan])
    out, lse = finalize(acc, m, l)
    np.testing.assert_allclose(np.asarray(out[0]), [0.5, 1.0])
    np.testing.assert_allclose(float(lse[0]), np.log(2.0), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
    assert float(lse[1]) == -np.inf
    assert np.isnan(out[2, 0]) and float(out[2, 1]) == 1.0 and np.isfinite(lse[2])
    assert np.isnan(out[3]).all() and np.isnan(lse[3])

    inf = jnp.inf
    lse_s = jnp.asarray([[0.0, -inf, 0.0, jnp.nan, -inf, 0.0],
                         [jnp.log(3.0), -inf, -inf, 0.0, -inf, -200.0]])       # [S=2, 6 rows]
    o_s = jnp.asarray([[[1.0], [0.0], [2.0], [1.0], [0.0], [1.0]],
                       [[5.0], [0.0], [0.0], [1.0], [0.0], [jnp.nan]]])         # [2, 6, 1]
    out, lse = merge_splits(o_s, lse_s)
    np.testing.assert_allclose(float(out[0, 0]), (1.0 + 3 * 5.0) / 4, rtol=1e-6)
    np.testing.assert_allclose(float(lse[0]), np.log(4.0), rtol=1e-6)
    assert float(out[1, 0]) == 0.0 and float(lse[1]) == -np.inf                  # all empty
    assert float(out[2, 0]) == 2.0 and float(lse[2]) == 0.0                      # one empty
    assert np.isnan(out[3, 0]) and np.isnan(lse[3])                              # NaN lse
    assert float(out[4, 0]) == 0.0 and float(lse[4]) == -np.inf
    assert np.isnan(out[5, 0]) and np.isfinite(lse[5])                           # NaN o, w ~ 0


def _small_args(**over):
    t, hq, hkv, d, n, r, p = 2, 16, 1, 32, 4, 2, 3
    args = dict(q=jnp.zeros((t, hq, d), jnp.float32),
                kv_cache=jnp.zeros((n, hkv, PAGE_SIZE, 2 * d), jnp.float32),
                selected=jnp.zeros((t, hkv, TOPK), jnp.int32),
                block_table=jnp.zeros((r, p), jnp.int32),
                req_indices=jnp.zeros((t,), jnp.int32),
                kv_lens=jnp.ones((t,), jnp.int32))
    args.update(over)
    return args


@pytest.mark.parametrize("fn", [sparse_decode, sparse_decode_reference])
@pytest.mark.parametrize("over,exc,match", [
    (dict(q=jnp.zeros((2, 16, 24), jnp.float32)), ValueError, "power of two"),
    (dict(q=jnp.zeros((2, 16, 8), jnp.float32),
          kv_cache=jnp.zeros((4, 1, PAGE_SIZE, 16), jnp.float32)), ValueError, "power of two >= 16"),
    (dict(q=jnp.zeros((2, 12, 32), jnp.float32),
          kv_cache=jnp.zeros((4, 5, PAGE_SIZE, 64), jnp.float32)), ValueError, "multiple of"),
    (dict(kv_cache=jnp.zeros((4, 1, 64, 64), jnp.float32)), ValueError, "page size"),
    (dict(kv_cache=jnp.zeros((4, 1, PAGE_SIZE, 48), jnp.float32)), ValueError, "2\\*D"),
    (dict(kv_cache=jnp.zeros((4, 1, PAGE_SIZE, 64), jnp.bfloat16)), TypeError, "kv_cache dtype"),
    (dict(q=jnp.zeros((2, 16, 32), jnp.int32),
          kv_cache=jnp.zeros((4, 1, PAGE_SIZE, 64), jnp.int32)), TypeError, "q dtype"),
    (dict(selected=jnp.zeros((2, 1, 8), jnp.int32)), ValueError, "selected must be"),
    (dict(selected=jnp.zeros((2, 1, TOPK), jnp.float32)), TypeError, "selected dtype"),
    (dict(block_table=jnp.zeros((3,), jnp.int32)), ValueError, "block_table"),
    (dict(req_indices=jnp.zeros((3,), jnp.int32)), ValueError, "req_indices"),
    (dict(kv_lens=jnp.zeros((2,), jnp.int64 if jax.config.jax_enable_x64 else jnp.uint32)),
     TypeError, "kv_lens dtype"),
    (dict(q=jnp.zeros((2, 256, 32), jnp.float32)), ValueError, "exceeds 128"),
])
def test_bad_inputs_raise_naming_argument(fn, over, exc, match):
    with pytest.raises(exc, match=match):
        fn(**_small_args(**over), scale=1.0)


def test_compact_slots_is_a_stable_rank_of_valid_slots():
    ok = np.zeros(TOPK, bool)
    ok[[1, 4, 5, 15]] = True
    pos, n_valid = compact_slots(jnp.asarray(ok))
    assert int(n_valid) == 4
    want = np.full(TOPK, TOPK)
    want[[1, 4, 5, 15]] = [0, 1, 2, 3]
    np.testing.assert_array_equal(np.asarray(pos), want)
    pos, n_valid = compact_slots(jnp.zeros(TOPK, bool))
    assert int(n_valid) == 0 and (np.asarray(pos) == TOPK).all()
    pos, n_valid = compact_slots(jnp.ones(TOPK, bool))
    assert int(n_valid) == TOPK
    np.testing.assert_array_equal(np.asarray(pos), np.arange(TOPK))


@pytest.mark.parametrize("kw,match", [(dict(num_splits=3), "num_splits"),
                                      (dict(num_warps=3), "num_warps"),
                                      (dict(num_stages=0), "num_stages"),
                                      (dict(keys_per_step=32), "keys_per_step"),
                                      (dict(num_stages=8, keys_per_step=64), "num_stages"),
                                      (dict(v_mask="where"), "v_mask")])
def test_bad_tunables_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        sparse_decode(**_small_args(), scale=1.0, interpret=True, **kw)

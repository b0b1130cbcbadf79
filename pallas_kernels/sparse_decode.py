"""MSA sparse decode: attention of each token over its 16 selected KV pages.

For token t and KV head h: the softmax (scale ``scale``) of the GQA group's queries over the
keys ``blk * 128 + i < kv_len[t]`` of the consumed slots' blocks ``blk = selected[t, h, s]``,
page ``block_table[req_indices[t], blk]``, times the values.

Kernel (Pallas, Triton backend): grid ``(T, Hkv, num_splits)``. A program owns the GQA group of
one token and one KV head (the group's query heads, padded to >= 16, are the dot rows). Before
its loop it loads the 16 block ids as one vector, applies the safety boundary, gathers the 16
page ids from the block table and compacts the valid slots to the front (stable order, a 16x16
rank compare in registers), so the loop has no dependent scalar loads, Triton can pipeline the
page loads, and invalid slots (``-1``, out-of-range ids, slots ``>= n_use``) load nothing. The
``n_valid`` compacted slots are cut into ``num_splits`` contiguous chunks of
``ceil(n_valid / num_splits)``; a loop step loads ``keys_per_step`` keys (a whole page, or a
half page: a smaller pipeline stage) of K and V (``[keys_per_step, D]`` each) and updates an
online softmax (base 2, finite mask value). With one split the program writes the output.
With several, the splits are merged inside the same launch: each program stores its
normalised partial ``(o [M,D], lse [M])`` in f32 scratch outputs and takes a ticket from the
row's counter (``pallas_kernels._ticket``); the program that draws the last ticket reads the
row's partials and writes their log-sum-exp merge. No program waits for another, so the order
in which programs run does not matter.

Safety boundary (in the kernel and in the reference): a slot is consumed iff ``slot < n_use =
min(16, ceil(kv_len / 128))`` and its block id is in ``[0, ceil(kv_len / 128))``. Any other
slot's id is replaced by block 0 before the block-table read and contributes nothing (the
kernel skips it, the reference masks it with selects, never by multiplying with 0), so the
online-softmax state is unchanged by it whatever its page holds. The request row is clamped to
``[0, R)`` and the page id read from the block table to ``[0, N)`` before they form an
address. A block id ``>= P`` (beyond the block table's width, only possible when the table is
narrower than ``kv_len`` needs) is treated like an out-of-range id. Keys ``blk * 128 + i`` are
valid iff ``< kv_len``; invalid keys are removed with selects on the loaded scores and values.

NaN: a NaN in a consumed, valid key or value reaches that row's output as it does in dense
attention (a NaN key also its lse), and no other row's; ``finalize`` and the split merge keep
it. A row without any valid key gives ``(0, -inf)``.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._interpret import resolve_interpret
from pallas_kernels._ticket import last_to_arrive, with_ticket
from pallas_kernels._shapes import (MIN_DOT, NUM_SMS_H200, PAGE_SIZE, SMEM_BYTES, TOPK, next_pow2,
                                    whole_block)

MAX_GROUP_ROWS = 128  # padded GQA group rows of one program (register budget)
FILL_PROGRAMS = 128  # default splits: the smallest with T * Hkv * splits >= this (one wave)
SMEM_SCRATCH = 16 * 1024  # layout conversions and reductions beside the K/V buffers
KEYS_PER_STEP = (64, 128)  # keys of one decode loop step (one pipeline stage)
V_MASKS = ("select", "load")  # how V's invalid rows become 0: select after the load, masked load
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MASK = -1e30  # finite mask value for scores (base-2 units)
_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def padded_group(num_q_heads: int, num_kv_heads: int) -> int:
    """Rows of one program's dot: the GQA group padded to a power of two >= 16."""
    return max(MIN_DOT, next_pow2(num_q_heads // num_kv_heads))


def step_bytes(dtype, head_dim: int, keys_per_step: int = PAGE_SIZE) -> int:
    """Shared-memory bytes of one pipeline stage: K and V, ``[keys_per_step, D]`` each."""
    return keys_per_step * 2 * head_dim * jnp.dtype(dtype).itemsize


def pipeline_smem_bytes(num_stages: int, stage: int) -> int:
    """Shared memory of a Triton loop pipeline of ``num_stages`` over ``stage``-byte K+V loads:
    Triton buffers ``num_stages - 1`` loads in flight, plus :data:`SMEM_SCRATCH`."""
    return max(1, num_stages - 1) * stage + SMEM_SCRATCH


def check_pipeline_fits(fn: str, num_stages: int, stage: int) -> None:
    """ValueError naming ``fn``'s num_stages when its ``num_stages - 1`` K+V stage buffers of
    ``stage`` bytes (+ scratch) exceed :data:`SMEM_BYTES`."""
    if pipeline_smem_bytes(num_stages, stage) > SMEM_BYTES:
        raise ValueError(f"{fn}: num_stages {num_stages} buffers {num_stages - 1} x {stage} "
                         f"bytes of K+V + scratch: more than {SMEM_BYTES} bytes of shared memory")


def max_stages(stage: int) -> int:
    """Deepest pipeline whose buffers fit :data:`SMEM_BYTES` (bf16 D=128 pages: 4)."""
    return max(1, (SMEM_BYTES - SMEM_SCRATCH) // stage + 1)


def default_decode_config(num_rows: int, dtype, head_dim: int) -> dict:
    """Launch defaults of :func:`sparse_decode` for ``num_rows = T * Hkv`` (token, KV head) rows.

    Splits: the smallest power of two <= 16 with ``num_rows * splits >= 128`` programs (the
    merge is inside the kernel, so splitting costs one partial store per program). 3 pipeline
    stages while the programs fit one wave on the H200's 132 SMs, else 2, capped by shared memory;
    4 warps; whole-page steps; V's invalid rows zeroed by a select. Returns a dict of
    ``num_splits, num_warps, num_stages, keys_per_step, v_mask``.
    """
    splits = 1
    while splits < TOPK and num_rows * splits < FILL_PROGRAMS:
        splits *= 2
    stages = 3 if num_rows * splits <= NUM_SMS_H200 else 2
    stages = min(stages, max_stages(step_bytes(dtype, head_dim, PAGE_SIZE)))
    return dict(num_splits=splits, num_warps=4, num_stages=stages, keys_per_step=PAGE_SIZE,
                v_mask="select")


def validate_inputs(q, kv_cache, selected, block_table, req_indices, kv_lens, *, name: str):
    """Raise ``ValueError``/``TypeError`` naming the argument and bound; returns the geometry.

    Returns ``(T, Hq, D, N, Hkv, R, P)``.
    """
    def need(cond, msg, exc=ValueError):
        if not cond:
            raise exc(f"{name}: {msg}")

    need(q.ndim == 3, f"q must be [T, Hq, D], got shape {q.shape}")
    t, hq, d = q.shape
    need(kv_cache.ndim == 4, f"kv_cache must be [N, Hkv, {PAGE_SIZE}, 2*D], got shape {kv_cache.shape}")
    n, hkv, page, two_d = kv_cache.shape
    need(page == PAGE_SIZE, f"kv_cache page size (axis 2) must be {PAGE_SIZE}, got {page}")
    need(d >= MIN_DOT and d & (d - 1) == 0,
         f"head dim D = q.shape[2] must be a power of two >= {MIN_DOT}, got {d}")
    need(two_d == 2 * d, f"kv_cache last axis must be 2*D = {2 * d} (K then V), got {two_d}")
    need(n >= 1, f"kv_cache needs at least 1 page, got {n}")
    need(hkv >= 1 and hq % hkv == 0,
         f"q heads Hq = {hq} must be a multiple of kv_cache heads Hkv = {hkv}")
    need(padded_group(hq, hkv) <= MAX_GROUP_ROWS,
         f"GQA group Hq/Hkv = {hq // hkv} exceeds {MAX_GROUP_ROWS} rows per program")
    need(jnp.dtype(q.dtype) in _FLOATS, f"q dtype must be bf16, f16 or f32, got {q.dtype}",
         TypeError)
    need(kv_cache.dtype == q.dtype,
         f"kv_cache dtype {kv_cache.dtype} must equal q dtype {q.dtype}", TypeError)
    need(selected.shape == (t, hkv, TOPK),
         f"selected must be [T, Hkv, {TOPK}] = {(t, hkv, TOPK)}, got {selected.shape}")
    need(block_table.ndim == 2 and block_table.shape[0] >= 1 and block_table.shape[1] >= 1,
         f"block_table must be [R, P] with R, P >= 1, got shape {block_table.shape}")
    need(req_indices.shape == (t,), f"req_indices must be [T] = {(t,)}, got {req_indices.shape}")
    need(kv_lens.shape == (t,), f"kv_lens must be [T] = {(t,)}, got {kv_lens.shape}")
    for arg, val in (("selected", selected), ("block_table", block_table),
                     ("req_indices", req_indices), ("kv_lens", kv_lens)):
        need(val.dtype == jnp.int32, f"{arg} dtype must be int32, got {val.dtype}", TypeError)
    r, p = block_table.shape
    return t, hq, d, n, hkv, r, p


def _check_tunable(name: str, fn: str, value: int, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{fn}: {name} must be one of {tuple(allowed)}, got {value}")


# --------------------------------------------------------------------------------------------
# Pure jax.numpy reference
# --------------------------------------------------------------------------------------------

def consumed_slots(selected, kv_lens, num_cols):
    """The safety boundary's slot mask: ``selected [..., 16]`` int32 block ids, ``kv_lens``
    int32 of shape ``selected.shape[:-1]`` (or broadcastable to it), block-table width
    ``num_cols`` -> bool ``[..., 16]``, true for a consumed slot (``slot < n_use``) holding a
    block id in ``[0, min(ceil(kv_len/128), num_cols))``. Plain jnp: the reference and both
    kernels use it."""
    n_blocks = (jnp.maximum(kv_lens, 0) + PAGE_SIZE - 1) // PAGE_SIZE
    n_use = jnp.minimum(n_blocks, TOPK)
    slot = jnp.arange(TOPK, dtype=jnp.int32)
    bound = jnp.minimum(n_blocks, num_cols)
    return (slot < n_use[..., None]) & (selected >= 0) & (selected < bound[..., None])


def sanitize_selection(selected, kv_lens, num_cols):
    """The safety boundary. ``selected [T,Hkv,16]``, ``kv_lens [T]`` int32, block-table width
    ``num_cols`` -> ``(blk [T,Hkv,16] int32, ok [T,Hkv,16] bool)``: ``ok`` is
    :func:`consumed_slots`; ``blk`` is the id where ``ok`` and 0 elsewhere."""
    ok = consumed_slots(selected, kv_lens[:, None], num_cols)
    return jnp.where(ok, selected, 0), ok


@functools.partial(jax.jit, static_argnames=("scale",))
def sparse_decode_reference(q, kv_cache, selected, block_table, req_indices, kv_lens, *, scale):
    """Gather + einsum reference of :func:`sparse_decode` (same arguments, same boundary).

    Returns ``(out [T,Hq,D] q.dtype, lse [T,Hq] f32)``; f32 math throughout. Every slot's
    page is gathered (the clamped one for a slot that is not consumed); everything not
    consumed is removed with selects, so only consumed keys' NaNs reach the output.
    """
    t, hq, d, n, hkv, r, p = validate_inputs(q, kv_cache, selected, block_table, req_indices,
                                             kv_lens, name="sparse_decode_reference")
    g = hq // hkv
    blk, ok = sanitize_selection(selected, kv_lens, p)                    # [T,Hkv,16]
    row = jnp.clip(req_indices, 0, r - 1)
    page = jnp.clip(block_table[row[:, None, None], blk], 0, n - 1)     # [T,Hkv,16]
    pages = kv_cache[page, jnp.arange(hkv)[None, :, None]]              # [T,Hkv,16,128,2D]
    k = pages[..., :d].astype(jnp.float32)
    v = pages[..., d:].astype(jnp.float32)
    pos = blk[..., None] * PAGE_SIZE + jnp.arange(PAGE_SIZE, dtype=jnp.int32)     # [T,Hkv,16,128]
    valid = ok[..., None] & (pos < kv_lens[:, None, None, None])
    qg = q.reshape(t, hkv, g, d).astype(jnp.float32)
    s = jnp.einsum("thgd,thskd->thgsk", qg, k, precision="highest") * scale
    s = jnp.where(valid[:, :, None], s, -jnp.inf)
    m = jnp.max(s, axis=(-2, -1), keepdims=True)                        # NaN if a valid s is
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)                            # no valid key: 0
    prob = jnp.where(valid[:, :, None], jnp.exp(s - m_safe), 0.0)
    l = jnp.sum(prob, axis=(-2, -1))                                     # [T,Hkv,G]
    o = jnp.einsum("thgsk,thskd->thgd", prob, jnp.where(valid[..., None], v, 0.0),
                   precision="highest")
    empty = l == 0                                                       # False for NaN
    l_safe = jnp.where(empty, 1.0, l)
    out = jnp.where(empty[..., None], 0.0, o / l_safe[..., None])
    lse = jnp.where(empty, -jnp.inf, m_safe[..., 0, 0] + jnp.log(l_safe))
    return out.reshape(t, hq, d).astype(q.dtype), lse.reshape(t, hq)


# --------------------------------------------------------------------------------------------
# Shared kernel pieces
# --------------------------------------------------------------------------------------------

def online_softmax_step(carry, q, k, v, key_ok, scale_log2, row_weight=None, mask_v=True):
    """One page of the online softmax (base 2, finite mask, masked V).

    carry ``(acc [M,D] f32, m [M] f32, l [M] f32)``; ``q [M,D]``, ``k, v [K,D]`` (input dtype,
    K = 128 keys of a page or fewer); ``key_ok [M,K]`` or ``[1,K]`` bool; ``row_weight [M] f32``
    (optional) multiplies the row's probabilities (a page selected twice counts twice);
    ``mask_v=False`` when the caller already zeroed V's invalid rows (a masked load).

    Invalid keys are removed by selects (scores to the mask value, probabilities and V rows to
    0), so whatever they hold never reaches the state. A NaN score of a valid key makes the
    row's ``l`` NaN (whether or not the max propagates NaN: on a GPU it does not). With a
    per-row ``key_ok [M,K]`` (rows of different tokens) a non-finite V row valid for some rows
    only is zeroed for the dot and the rows that take it get a NaN ``acc`` instead, so a row
    never sees another row's values; with ``[1,K]`` NaN/inf in V reach ``acc`` through the dot.
    """
    acc, m, l = carry
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale_log2
    s = jnp.where(key_ok, s, MASK)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    if row_weight is not None:
        p = p * row_weight[:, None]
    p = jnp.where(key_ok, p, 0.0)
    l_new = alpha * l + jnp.sum(p, axis=1)
    per_row = key_ok.shape[0] > 1
    row_bad = None
    if per_row:  # a non-finite V row must not leak, through p = 0, into rows not taking it
        bad = ~jnp.isfinite(v)                                           # [K,D]
        bad_key = jnp.max(bad.astype(jnp.int32), axis=1) > 0             # [K]
        row_bad = jnp.max(jnp.where(key_ok & bad_key[None, :], 1, 0), axis=1) > 0  # [M]
        v_ok = jnp.max(key_ok.astype(jnp.int32), axis=0) > 0             # [K]
        v = jnp.where(v_ok[:, None] & ~bad, v, jnp.zeros_like(v))
    elif mask_v:
        v_ok = key_ok[0]                                                 # [K]
        v = jnp.where(v_ok[:, None], v, jnp.zeros_like(v))
    acc_new = alpha[:, None] * acc + jnp.dot(p.astype(v.dtype), v,
                                             preferred_element_type=jnp.float32)
    if row_bad is not None:
        acc_new = jnp.where(row_bad[:, None], jnp.nan, acc_new)
    return acc_new, m_new, l_new


def finalize(acc, m, l):
    """Normalised output and natural-log LSE of a finished softmax state ``(acc [M,D], m [M],
    l [M])``; rows without a visible key (``l == 0``) give ``(0, -inf)``; a NaN in ``acc``
    or ``l`` stays NaN in the row's output (and in its lse when ``l`` or ``m`` is NaN)."""
    empty = l == 0                                                       # False for NaN
    l_safe = jnp.where(empty, 1.0, l)
    out = jnp.where(empty[:, None], 0.0, acc / l_safe[:, None])
    lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)
    return out, lse


def merge_splits(o, lse, *, in_kernel=False):
    """LSE merge over axis 0: ``o [S,...,D] f32`` normalised partials, ``lse [S,...] f32``.

    Empty splits (``lse = -inf``, ``o = 0``) weigh 0; when every split is empty the result is
    ``(0, -inf)``. A NaN lse of any split makes the merged row and lse NaN, a NaN in a split's
    ``o`` makes those output elements NaN (its weight, even 0, multiplies it): NaN is never
    dropped. ``in_kernel=True`` inside a Pallas kernel (no XLA optimization barrier there).
    """
    m = jnp.max(jnp.where(jnp.isnan(lse), -jnp.inf, lse), axis=0)        # max of the non-NaN
    if not in_kernel:
        m = jax.lax.optimization_barrier(m)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    w = jnp.exp(lse - m_safe[None])                                      # exp(-inf) = 0; NaN stays
    wsum = jnp.sum(w, axis=0)
    empty = wsum == 0                                                    # False for NaN
    wsum_safe = jnp.where(empty, 1.0, wsum)
    out = jnp.sum(w[..., None] * o, axis=0) / wsum_safe[..., None]
    out = jnp.where(empty[..., None], 0.0, out)
    lse_out = jnp.where(empty, -jnp.inf, m_safe + jnp.log(wsum_safe))
    return out, lse_out


# --------------------------------------------------------------------------------------------
# Pallas kernel
# --------------------------------------------------------------------------------------------

def compact_slots(ok):
    """Stable compaction of valid slots: ``ok [16]`` bool -> ``(pos [16] int32, n_valid int32)``;
    ``pos`` is a valid slot's rank among the valid slots and 16 (picked by no step) for the
    others. Register ops only (a 16x16 compare), usable inside a Triton kernel."""
    slot = jnp.arange(ok.shape[0], dtype=jnp.int32)
    ok_i = ok.astype(jnp.int32)
    before = slot[:, None] < slot[None, :]                                # [i, j]: i before j
    rank = jnp.sum(jnp.where(before, ok_i[:, None], 0), axis=0)          # [16]
    return jnp.where(ok, rank, ok.shape[0]), jnp.sum(ok_i)


def _decode_kernel(req_ref, len_ref, bt_ref, sel_ref, q_ref, kv_ref, *refs, num_splits,
                   keys_per_step, v_mask, head_dim, num_pages, num_rows, num_cols, scale_log2,
                   interpreting):
    """One (token, kv head, split): ``q_ref [M,D]``, ``sel_ref [16]``, whole ``kv_ref``,
    ``bt_ref``, ``req_ref``, ``len_ref``; writes ``o_ref [M,D]``, ``lse_ref [M]``. With
    ``num_splits > 1`` also ``ticket_in_ref`` (whole ``[T*Hkv]`` int32 zeros, aliased to
    ``ticket_ref``) and the whole partials ``part_o_ref [S,T,Hkv,M,D]``, ``part_lse_ref
    [S,T,Hkv,M]`` f32 (see the module docstring); ``interpreting`` as in
    :func:`pallas_kernels._ticket.last_to_arrive`."""
    if num_splits == 1:
        o_ref, lse_ref = refs
    else:
        _, o_ref, lse_ref, part_o_ref, part_lse_ref, ticket_ref = refs
    t = pl.program_id(0)
    h = pl.program_id(1)
    split = pl.program_id(2)
    kv_len = jnp.maximum(len_ref[t], 0)
    row = jnp.clip(req_ref[t], 0, num_rows - 1)
    q = q_ref[...]
    rows = q.shape[0]
    # All 16 slots at once, outside the loop: boundary, one gather of the page ids, compaction
    # of the valid slots, so the loop body holds no dependent scalar loads (its K/V loads can be
    # pipelined) and runs over valid slots only.
    raw = sel_ref[...]                                    # [16]
    ok_vec = consumed_slots(raw, kv_len, num_cols)
    blk_vec = jnp.where(ok_vec, raw, 0)                   # boundary: before the table read
    page_vec = jnp.clip(bt_ref[row, blk_vec], 0, num_pages - 1)
    pos_vec, n_valid = compact_slots(ok_vec)
    chunk = (n_valid + num_splits - 1) // num_splits
    first = split * chunk
    n_slots = jnp.clip(n_valid - first, 0, chunk)
    steps_per_slot = PAGE_SIZE // keys_per_step
    keys = jnp.arange(keys_per_step, dtype=jnp.int32)

    def body(i, carry):
        if steps_per_slot == 1:
            j, start = i, 0
        else:
            j = jax.lax.div(i, steps_per_slot)
            start = (i - j * steps_per_slot) * keys_per_step
        pick = pos_vec == first + j                       # register "indexing": one-hot sum
        page = jnp.sum(jnp.where(pick, page_vec, 0))
        blk = jnp.sum(jnp.where(pick, blk_vec, 0))
        hit = jnp.sum(pick.astype(jnp.int32)) > 0         # always true: no step past n_valid
        key_ok = hit & (blk * PAGE_SIZE + start + keys < kv_len)          # [K]: all rows alike
        k = kv_ref[page, h, pl.ds(start, keys_per_step), pl.ds(0, head_dim)]
        v_at = kv_ref.at[page, h, pl.ds(start, keys_per_step), pl.ds(head_dim, head_dim)]
        if v_mask == "load":  # invalid rows never loaded (zero-filled): V streams to the dot
            v = plt.load(v_at, mask=key_ok[:, None], other=0)
        else:
            v = v_at[...]
        return online_softmax_step(carry, q, k, v, key_ok[None, :], scale_log2,
                                   mask_v=v_mask == "select")

    init = (jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), MASK, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, n_slots * steps_per_slot, body, init)
    out, lse = finalize(acc, m, l)
    if num_splits == 1:
        o_ref[...] = out.astype(o_ref.dtype)
        lse_ref[...] = lse
        return
    part_o_ref[split, t, h] = out
    part_lse_ref[split, t, h] = lse

    @pl.when(last_to_arrive(ticket_ref, t * pl.num_programs(1) + h, num_splits,
                            interpreting=interpreting))
    def _merge():  # the last program of the row: every other partial is visible
        parts_o = plt.load(part_o_ref.at[:, t, h], volatile=True)   # [S, M, D]
        parts_lse = plt.load(part_lse_ref.at[:, t, h], volatile=True)  # [S, M]
        o_all, lse_all = merge_splits(parts_o, parts_lse, in_kernel=True)
        o_ref[...] = o_all.astype(o_ref.dtype)
        lse_ref[...] = lse_all


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "num_splits", "num_warps",
                                             "num_stages", "keys_per_step", "v_mask"))
def sparse_decode(q, kv_cache, selected, block_table, req_indices, kv_lens, *, scale,
                  interpret=None, num_splits=None, num_warps=None, num_stages=None,
                  keys_per_step=None, v_mask=None):
    """MSA sparse decode with the kernel safety boundary (see the module docstring).

    Args:
      q: ``[T, Hq, D]`` bf16/f16/f32, D a power of two >= 16.
      kv_cache: ``[N, Hkv, 128, 2D]`` (K = ``[..., :D]``, V = ``[..., D:]``), q's dtype.
      selected: ``[T, Hkv, 16]`` int32 block ids (-1 or out-of-range ids contribute nothing and
        load nothing).
      block_table: ``[R, P]`` int32 page ids; req_indices ``[T]`` int32 rows of it.
      kv_lens: ``[T]`` int32 visible keys per token (0 = padded row).
      scale: softmax scale (static). interpret: Pallas interpret mode; None (default): on
        every backend but a GPU.
      num_splits: split-K factor in {1, 2, 4, 8, 16}; keys_per_step: keys per loop step (one
        pipeline stage of ``keys_per_step * 2D`` elements) in {64, 128}; num_warps,
        num_stages: Triton launch tunables (``num_stages - 1`` stage buffers must fit 227 KiB);
        v_mask: ``"select"`` (load V, then zero invalid rows) or ``"load"`` (masked load that
        zero-fills invalid rows).
        Each ``None`` takes :func:`default_decode_config` (bf16 D=128, T*Hkv=128: 1 split,
        4 warps, 3 stages, 128 keys).
    Returns:
      ``(out [T, Hq, D] q.dtype, lse [T, Hq] f32)``; lse is the natural-log LSE of the scaled
      scores; rows without a visible key give zeros and -inf; a NaN in a consumed key or
      value makes its row NaN.
    """
    t, hq, d, n, hkv, r, p = validate_inputs(q, kv_cache, selected, block_table, req_indices,
                                             kv_lens, name="sparse_decode")
    g = hq // hkv
    m_rows = padded_group(hq, hkv)
    cfg = default_decode_config(t * hkv, q.dtype, d)
    splits = cfg["num_splits"] if num_splits is None else num_splits
    _check_tunable("num_splits", "sparse_decode", splits, (1, 2, 4, 8, 16))
    kps = cfg["keys_per_step"] if keys_per_step is None else keys_per_step
    _check_tunable("keys_per_step", "sparse_decode", kps, KEYS_PER_STEP)
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    _check_tunable("num_warps", "sparse_decode", num_warps, (1, 2, 4, 8, 16))
    stage = step_bytes(q.dtype, d, kps)
    if num_stages is None:  # the default depth, re-capped for the chosen step size
        num_stages = min(cfg["num_stages"], max_stages(stage))
    _check_tunable("num_stages", "sparse_decode", num_stages, (1, 2, 3, 4, 5, 6, 7))
    check_pipeline_fits("sparse_decode", num_stages, stage)
    if t == 0:
        return jnp.zeros((0, hq, d), q.dtype), jnp.zeros((0, hq), jnp.float32)

    qg = q.reshape(t, hkv, g, d)
    if m_rows != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, m_rows - g), (0, 0)))
    v_mask = cfg["v_mask"] if v_mask is None else v_mask
    _check_tunable("v_mask", "sparse_decode", v_mask, V_MASKS)
    interpreting = resolve_interpret(interpret)
    kernel = functools.partial(_decode_kernel, num_splits=splits, keys_per_step=kps,
                               v_mask=v_mask, head_dim=d, num_pages=n, num_rows=r, num_cols=p,
                               scale_log2=float(scale) * LOG2E, interpreting=interpreting)
    in_specs = [
        whole_block((t,)),                                                 # req_indices
        whole_block((t,)),                                                 # kv_lens
        whole_block(block_table.shape),                                    # block_table
        pl.BlockSpec((None, None, TOPK), lambda i, h, s: (i, h, 0)),       # selected
        pl.BlockSpec((None, None, m_rows, d), lambda i, h, s: (i, h, 0, 0)),  # q
        whole_block(kv_cache.shape),                                       # kv_cache
    ]
    out_specs = [pl.BlockSpec((None, None, m_rows, d), lambda i, h, s: (i, h, 0, 0)),
                 pl.BlockSpec((None, None, m_rows), lambda i, h, s: (i, h, 0))]
    out_shape = [jax.ShapeDtypeStruct((t, hkv, m_rows, d), q.dtype),
                 jax.ShapeDtypeStruct((t, hkv, m_rows), jnp.float32)]
    args = [req_indices, kv_lens, block_table, selected, qg, kv_cache]
    aliases = {}
    if splits > 1:  # the in-kernel merge: the partials in f32, a ticket counter per row
        in_specs, args, out_specs, out_shape, aliases = with_ticket(
            in_specs, args, out_specs, out_shape, num_rows=t * hkv,
            scratch=[((splits, t, hkv, m_rows, d), jnp.float32),
                     ((splits, t, hkv, m_rows), jnp.float32)])
    o, lse, *_ = pl.pallas_call(
        kernel,
        grid=(t, hkv, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpreting,
        name="msa_sparse_decode",
    )(*args)
    out = o[:, :, :g].reshape(t, hq, d).astype(q.dtype)
    return out, lse[:, :, :g].reshape(t, hq)


__all__ = ["sparse_decode", "sparse_decode_reference", "consumed_slots", "sanitize_selection",
           "merge_splits", "check_pipeline_fits",
           "online_softmax_step", "finalize", "validate_inputs", "padded_group",
           "default_decode_config", "step_bytes",
           "compact_slots", "pipeline_smem_bytes", "max_stages", "PAGE_SIZE", "TOPK", "KEYS_PER_STEP"]

"""Batch-metadata staging: scheduler arrays -> padded ``BatchMetadata``.

Flow of one step:
  1. ``pack_host_batch`` (host, numpy): validate the scheduler's compact arrays and pack them
     into ONE int32 buffer of ``packed_size(bucket)`` entries:
     ``[num_scheduled (R) | num_computed (R) | block_table (R*P, row-major)]``, padded rows 0.
  2. one ``jax.device_put`` of that buffer (the single host-to-device transfer);
  3. ``stage_packed`` (pure jnp, bucket/config static) derives every other field on the device.
``stage_batch`` does all three with a module-level jitted ``stage_packed``: one compile per
(bucket, config), reused by every later step.

Dummy batches (profiling, warm-up, bucket compilation) come from ``stage_dummy_batch``; their
host arrays (``dummy_host_batch``) are normalised before they reach the device, so host and
device copies agree. Dummy block-table rows point every page a row covers at the reserved
scratch page ``DUMMY_PAGE_ID`` (non-null, so reads are valid, and dummy KV writes land there
and never in a live request's pages): the KV cache allocator must never hand out pages 0
(null) and 1 (dummy scratch).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_msa_runner.batch.buckets import Bucket, select_bucket
from jax_msa_runner.batch.dcp import dcp_owner_slots
from jax_msa_runner.batch.metadata import BatchMetadata
from jax_msa_runner.config import DUMMY_PAGE_ID, NULL_PAGE_ID, PAGE_SIZE, RunnerConfig

MAX_PAGE_ID = (2**31 - 1) // PAGE_SIZE  # slot = page * PAGE_SIZE + offset must fit in int32
DUMMY_KINDS = ("default", "uniform_decode", "mixed")


class StagingError(ValueError):
    """Invalid scheduler input; the message names the field, the row and the values."""


# ----------------------------------------------------------------------------- host side

def packed_size(bucket: Bucket) -> int:
    """Entries of the packed int32 host buffer of ``bucket``: 2R + R*P."""
    return 2 * bucket.num_reqs + bucket.num_reqs * bucket.max_pages


def _int_vector(name: str, values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise StagingError(f"{name}: must be a 1-D sequence of integers, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros((0,), np.int64)
    if arr.dtype.kind not in "iu":
        raise StagingError(f"{name}: must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64)


def _validated_counts(num_scheduled_tokens, num_computed_tokens,
                      config: RunnerConfig) -> tuple[np.ndarray, np.ndarray]:
    """Checks invariant 3 on the host; returns (num_scheduled, num_computed) as int64 [n]."""
    sched = _int_vector("num_scheduled_tokens", num_scheduled_tokens)
    comp = _int_vector("num_computed_tokens", num_computed_tokens)
    if sched.shape != comp.shape:
        raise StagingError(f"num_computed_tokens: has {comp.size} rows but num_scheduled_tokens "
                           f"has {sched.size}")
    for i in np.flatnonzero(sched < 1)[:1]:
        raise StagingError(f"num_scheduled_tokens[{i}] = {sched[i]}: must be >= 1 "
                           f"(a scheduled request has at least one token)")
    for i in np.flatnonzero(comp < 0)[:1]:
        raise StagingError(f"num_computed_tokens[{i}] = {comp[i]}: must be >= 0")
    seq = comp + sched
    for i in np.flatnonzero(seq > config.max_model_len)[:1]:
        raise StagingError(f"seq_len[{i}] = num_computed {comp[i]} + num_scheduled {sched[i]} = "
                           f"{seq[i]} exceeds max_model_len={config.max_model_len}")
    return sched, comp


def _block_table_rows(block_table, num_rows: int) -> list[np.ndarray]:
    if isinstance(block_table, np.ndarray) or hasattr(block_table, "shape"):
        arr = np.asarray(block_table)
        if arr.ndim != 2 or arr.shape[0] != num_rows:
            raise StagingError(f"block_table: must have shape [{num_rows}, pages] "
                               f"(one row per request), got {arr.shape}")
        rows = list(arr)
    else:
        rows = list(block_table)
        if len(rows) != num_rows:
            raise StagingError(f"block_table: has {len(rows)} rows but there are {num_rows} "
                               f"requests")
    return [_int_vector(f"block_table[{i}]", row) for i, row in enumerate(rows)]


def _pack_arrays(num_scheduled: np.ndarray, num_computed: np.ndarray, block_table: np.ndarray,
                 bucket: Bucket) -> np.ndarray:
    """Packs already-checked arrays ([n], [n], [n, P]) into the int32 buffer; no validation."""
    R, P = bucket.num_reqs, bucket.max_pages
    n = len(num_scheduled)
    sched = np.zeros((R,), np.int32)
    comp = np.zeros((R,), np.int32)
    table = np.zeros((R, P), np.int32)
    sched[:n] = num_scheduled
    comp[:n] = num_computed
    table[:n, :block_table.shape[1]] = block_table
    return np.concatenate([sched, comp, table.reshape(-1)])


def pack_host_batch(num_scheduled_tokens, num_computed_tokens, block_table, bucket: Bucket,
                    config: RunnerConfig) -> np.ndarray:
    """Validates one step's scheduler arrays and packs them into one int32 buffer.

    num_scheduled_tokens, num_computed_tokens: int [n]; block_table: int [n, w] or n rows of
    per-request page ids (rank-local pages under DCP). Returns int32 [packed_size(bucket)].
    Raises StagingError on negative or zero counts, seq_len > max_model_len, too many tokens
    or requests for the bucket, a block-table row too short for its sequence (or longer than
    bucket.max_pages), and page ids that are negative, too large, or the null page inside the
    sequence. Nothing is clamped.
    """
    sched, comp = _validated_counts(num_scheduled_tokens, num_computed_tokens, config)
    n = sched.size
    if bucket.max_pages < config.max_pages:
        raise StagingError(f"bucket.max_pages = {bucket.max_pages} is below config.max_pages = "
                           f"{config.max_pages}")
    if n > bucket.num_reqs:
        raise StagingError(f"num_reqs: {n} requests exceed bucket.num_reqs={bucket.num_reqs}")
    total = int(sched.sum())
    if total > bucket.num_tokens:
        raise StagingError(f"num_tokens: {total} scheduled tokens exceed "
                           f"bucket.num_tokens={bucket.num_tokens}")
    rows = _block_table_rows(block_table, n)
    unit = config.page_size * config.dcp_world_size
    table = np.zeros((n, bucket.max_pages), np.int64)
    for i, row in enumerate(rows):
        seq = int(sched[i] + comp[i])
        need = -(-seq // unit)
        if row.size > bucket.max_pages:
            raise StagingError(f"block_table[{i}]: {row.size} entries exceed "
                               f"bucket.max_pages={bucket.max_pages}")
        if row.size < need:
            raise StagingError(f"block_table[{i}]: {row.size} entries but seq_len={seq} needs "
                               f"{need} pages (page_size={config.page_size}, "
                               f"dcp_world_size={config.dcp_world_size})")
        for j in np.flatnonzero((row < 0) | (row > MAX_PAGE_ID))[:1]:
            raise StagingError(f"block_table[{i}][{j}] = {row[j]}: page ids must be in "
                               f"[0, {MAX_PAGE_ID}]")
        for j in np.flatnonzero(row[:need] == NULL_PAGE_ID)[:1]:
            raise StagingError(f"block_table[{i}][{j}] = {NULL_PAGE_ID} is the null page, inside "
                               f"the {need} pages of seq_len={seq}")
        table[i, :row.size] = row
    return _pack_arrays(sched, comp, table, bucket)


# --------------------------------------------------------------------------- device side

def stage_packed(packed: jax.Array, bucket: Bucket, config: RunnerConfig) -> BatchMetadata:
    """Derives the padded ``BatchMetadata`` from the packed buffer. Pure jnp; jit-friendly.

    packed: int32 [packed_size(bucket)]; bucket and config are static. Rows with
    num_scheduled == 0 are padding (cleared); tokens past query_start_loc[-1] are padding
    (positions 0, slot_mapping -1, kv_lens 0, num_valid_pages 0, masked).
    """
    R, T, P = bucket.num_reqs, bucket.num_tokens, bucket.max_pages
    page = config.page_size
    packed = jnp.asarray(packed, jnp.int32)
    if packed.shape != (packed_size(bucket),):
        raise ValueError(f"packed: expected shape ({packed_size(bucket)},) for {bucket}, "
                         f"got {packed.shape}")
    req_mask = packed[:R] > 0
    num_scheduled = jnp.where(req_mask, packed[:R], 0)
    num_computed = jnp.where(req_mask, packed[R:2 * R], 0)
    block_table = jnp.where(req_mask[:, None], packed[2 * R:].reshape(R, P), 0)
    seq_lens = num_computed + num_scheduled
    query_start_loc = jnp.concatenate(
        [jnp.zeros((1,), jnp.int32), jnp.cumsum(num_scheduled, dtype=jnp.int32)])

    t = jnp.arange(T, dtype=jnp.int32)
    token_mask = t < query_start_loc[R]
    req_indices = jnp.searchsorted(query_start_loc[1:], t, side="right", method="compare_all")
    req_indices = jnp.where(token_mask, req_indices, 0).astype(jnp.int32)
    query_pos = jnp.where(token_mask, t - query_start_loc[req_indices], 0)
    positions = jnp.where(token_mask, num_computed[req_indices] + query_pos, 0)
    kv_lens = jnp.where(
        token_mask, seq_lens[req_indices] - num_scheduled[req_indices] + query_pos + 1, 0)
    num_valid_pages = jnp.where(token_mask, positions // page + 1, 0)
    slot_mapping = dcp_owner_slots(positions, req_indices, token_mask, block_table,
                                   config.dcp_world_size, config.dcp_interleave, page)
    return BatchMetadata(
        query_start_loc=query_start_loc, seq_lens=seq_lens, num_computed_tokens=num_computed,
        num_scheduled_tokens=num_scheduled, block_table=block_table, req_indices=req_indices,
        query_pos=query_pos, positions=positions, slot_mapping=slot_mapping,
        num_valid_pages=num_valid_pages, kv_lens=kv_lens, token_mask=token_mask,
        req_mask=req_mask)


stage_packed_jit = jax.jit(stage_packed, static_argnames=("bucket", "config"))
stage_packed_jit.__doc__ = "``stage_packed`` jitted with static bucket/config (one compile each)."


def stage_batch(num_scheduled_tokens, num_computed_tokens, block_table, config: RunnerConfig,
                *, bucket: Bucket | None = None) -> BatchMetadata:
    """Stages a real batch: host validation + packing, one device_put, jitted staging.

    Inputs as in ``pack_host_batch``; ``bucket`` defaults to the smallest that fits.
    Returns BatchMetadata padded to the bucket.
    """
    if bucket is None:
        sched, _ = _validated_counts(num_scheduled_tokens, num_computed_tokens, config)
        bucket = select_bucket(int(sched.sum()), sched.size, config)
    packed = pack_host_batch(num_scheduled_tokens, num_computed_tokens, block_table, bucket,
                             config)
    return stage_packed_jit(jax.device_put(packed), bucket=bucket, config=config)


# -------------------------------------------------------------------------- dummy batches

class DummyHostBatch(NamedTuple):
    """Normalised host arrays of a dummy batch (n real rows, int64)."""

    num_scheduled: np.ndarray  # [n]
    num_computed: np.ndarray  # [n]
    seq_lens: np.ndarray  # [n]
    block_table: np.ndarray  # [n, config.max_pages]; DUMMY_PAGE_ID on covered pages, else 0


def dummy_query_lens(num_tokens: int, config: RunnerConfig, kind: str) -> np.ndarray:
    """Per-row query lengths of a dummy batch of ``num_tokens`` tokens. int64 [n].

    default: R = min(N, S) rows of N // R, the remainder on the last row.
    uniform_decode: rows of q = 1 + num_spec_tokens, R = min(S, ceil(N / q)); when R is not
      capped by S the last row is ragged (N % q tokens, if nonzero); when capped, S full rows.
    mixed: nd = min(S - 1, N // 2) one-token rows, then one row of N - nd tokens.
    """
    N, S = int(num_tokens), config.max_num_seqs
    if kind == "default":
        R = min(N, S)
        lens = np.full((R,), N // R, np.int64)
        lens[-1] += N % R
    elif kind == "uniform_decode":
        q = config.uniform_decode_len
        R = min(S, math.ceil(N / q))
        real = min(N, R * q)
        lens = np.full((real // q,), q, np.int64)
        if real % q:
            lens = np.append(lens, real % q)
    elif kind == "mixed":
        nd = min(S - 1, N // 2)
        lens = np.append(np.ones((nd,), np.int64), N - nd)
    else:
        raise StagingError(f"kind: must be one of {DUMMY_KINDS}, got {kind!r}")
    return lens


def dummy_host_batch(num_tokens: int, config: RunnerConfig, *, kind: str = "default",
                       profile_seq_len: int | None = None,
                       dcp_context_len: int | None = None) -> DummyHostBatch:
    """Host-normalised dummy batch: seq_len = min(max(target, q), max_model_len).

    target = profile_seq_len if given, else q + dcp_context_len (default: the config's
    W*I DCP dummy context, 0 without DCP); num_computed = seq_len - q.
    """
    N = int(num_tokens)
    largest = config.bucket_sizes[-1]
    if not 1 <= N <= largest:
        raise StagingError(f"num_tokens: must be in [1, {largest}] (largest bucket), got {N}")
    if kind not in DUMMY_KINDS:
        raise StagingError(f"kind: must be one of {DUMMY_KINDS}, got {kind!r}")
    if profile_seq_len is not None and int(profile_seq_len) < 1:
        raise StagingError(f"profile_seq_len: must be >= 1, got {profile_seq_len}")
    ctx = config.dcp_dummy_context_len if dcp_context_len is None else int(dcp_context_len)
    if ctx < 0:
        raise StagingError(f"dcp_context_len: must be >= 0, got {ctx}")
    q = dummy_query_lens(N, config, kind)
    for i in np.flatnonzero(q > config.max_model_len)[:1]:
        raise StagingError(f"num_tokens: dummy row {i} of kind {kind!r} schedules {q[i]} tokens, "
                           f"above max_model_len={config.max_model_len}")
    target = q + ctx if profile_seq_len is None else np.full_like(q, int(profile_seq_len))
    seq = np.minimum(np.maximum(target, q), config.max_model_len)
    comp = seq - q
    unit = config.page_size * config.dcp_world_size
    pages = -(-seq // unit)
    table = np.where(np.arange(config.max_pages)[None, :] < pages[:, None],
                     DUMMY_PAGE_ID, NULL_PAGE_ID).astype(np.int64)
    return DummyHostBatch(num_scheduled=q, num_computed=comp, seq_lens=seq, block_table=table)


def stage_dummy_batch(num_tokens: int, config: RunnerConfig, *, kind: str = "default",
                      profile_seq_len: int | None = None, build_attention: bool = True,
                      dcp_context_len: int | None = None) -> BatchMetadata | None:
    """Stages the dummy batch of ``num_tokens`` tokens in its bucket.

    kind: "default" | "uniform_decode" | "mixed" (see ``dummy_query_lens``).
    profile_seq_len: profiling override L of every row's target sequence length.
    dcp_context_len: fake DCP context; None = config.dcp_dummy_context_len (W*I, 0 w/o DCP).
    build_attention=False: a dummy run that builds no attention metadata. Returns None (the
      arguments are still validated): no BatchMetadata exists that could be consumed with
      stale fields; such a run must not call attention.
    Otherwise returns BatchMetadata padded to the smallest bucket holding the batch.
    """
    host = dummy_host_batch(num_tokens, config, kind=kind, profile_seq_len=profile_seq_len,
                              dcp_context_len=dcp_context_len)
    if not build_attention:
        return None
    bucket = select_bucket(int(num_tokens), host.num_scheduled.size, config)
    return stage_batch(host.num_scheduled, host.num_computed, host.block_table, config,
                       bucket=bucket)

"""Metadata invariant checks: on the host, or under checkify in jit.

``validate_metadata`` (numpy, host) raises ``MetadataInvariantError`` at the first violated
check, naming the field, the row/token and the values. ``checked_validate`` emits the same
checks with ``jax.experimental.checkify`` so a debug-mode step can run them inside jit.

Checks, in order (the first failure is reported):
  rows: num_computed >= 0, num_scheduled >= 0, seq_len <= max_model_len, seq_len >=
  num_scheduled, invariant 1 (the numbered invariants are in docs/DESIGN.md), req_mask ==
  (num_scheduled > 0) as a prefix, padded rows zero
  (lengths and block table), query_start_loc = [0, cumsum(num_scheduled)];
  tokens: token_mask prefix of query_start_loc[-1] tokens, req_indices, query_pos,
  kv_lens = seq_len - q_len + query_pos + 1 (consumer side, from seq_lens), selector/consumer
  page count agreement (positions // 128 + 1 and num_valid_pages == ceil(kv_lens / 128)),
  invariant 2, block-table coverage (rank-local pages under DCP, non-null), slot_mapping.
Padded tokens must carry req_indices = query_pos = positions = kv_lens = num_valid_pages = 0
and slot_mapping = -1.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jax_msa_runner.config import RunnerConfig
from jax_msa_runner.batch.metadata import BatchMetadata

_FIELDS = ("query_start_loc", "seq_lens", "num_computed_tokens", "num_scheduled_tokens",
           "block_table", "req_indices", "query_pos", "positions", "slot_mapping",
           "num_valid_pages", "kv_lens", "token_mask", "req_mask")


class MetadataInvariantError(ValueError):
    """A staged BatchMetadata violates an invariant; names the field, row/token and values."""


class _Check(NamedTuple):
    ok: Any  # bool [N]: per row / token
    message: str  # str.format template over {i} and the keys of values
    values: dict  # name -> array [N]


def _checks(md: BatchMetadata, config: RunnerConfig, xp) -> list[Callable[[], _Check]]:
    """Ordered, lazily built checks over ``xp`` (numpy or jax.numpy) arrays."""
    R, T, P = md.seq_lens.shape[0], md.positions.shape[0], md.block_table.shape[1]
    page, W, I = config.page_size, config.dcp_world_size, config.dcp_interleave
    sched, comp, seq = md.num_scheduled_tokens, md.num_computed_tokens, md.seq_lens
    qsl, bt, req_mask = md.query_start_loc, md.block_table, md.req_mask
    rows = xp.arange(R)
    t = xp.arange(T)
    real_rows = sched > 0
    total = qsl[R]
    real = md.token_mask
    req = xp.clip(md.req_indices, 0, R - 1)
    exp_req = xp.where(t < total, xp.searchsorted(qsl[1:], t, side="right"), 0)
    exp_qpos = xp.where(real, t - qsl[req], 0)
    exp_kv = xp.where(real, seq[req] - sched[req] + md.query_pos + 1, 0)
    sel_pages = md.positions // page + 1
    con_pages = (md.kv_lens + page - 1) // page
    exp_pos = xp.where(real, comp[req] + md.query_pos, 0)
    need = (seq + page * W - 1) // (page * W)
    covered = xp.arange(P)[None, :] < need[:, None]
    bad_cover = xp.where(real_rows[:, None], covered & (bt < 1), bt != 0) | (bt < 0)
    first_bad_page = xp.argmax(bad_cover, axis=1)
    local = (md.positions // (I * W)) * I + md.positions % I
    lpage = local // page
    page_ids = bt[req, xp.clip(lpage, 0, P - 1)]
    exp_slot = xp.where(real, xp.where(lpage < P, page_ids * page + local % page, -2), -1)
    prev_real = xp.concatenate([xp.ones((1,), bool), req_mask[:-1]])
    M = config.max_model_len

    return [
        lambda: _Check(comp >= 0, "num_computed_tokens[{i}] = {c}: must be >= 0 (invariant 3)",
                       dict(c=comp)),
        lambda: _Check(sched >= 0, "num_scheduled_tokens[{i}] = {q}: must be >= 0",
                       dict(q=sched)),
        lambda: _Check(seq <= M, "seq_lens[{i}] = {s}: exceeds max_model_len=%d (invariant 3)" % M,
                       dict(s=seq)),
        lambda: _Check(seq >= sched, "seq_lens[{i}] = {s}: below num_scheduled_tokens = {q} "
                       "(invariant 3)", dict(s=seq, q=sched)),
        lambda: _Check(seq == comp + sched, "seq_lens[{i}] = {s}: != num_computed {c} + "
                       "num_scheduled {q} (invariant 1)", dict(s=seq, c=comp, q=sched)),
        lambda: _Check((req_mask == real_rows) & (~req_mask | prev_real),
                       "req_mask[{i}] = {m}: must be True exactly on the leading rows with "
                       "num_scheduled_tokens > 0 (here {q})", dict(m=req_mask, q=sched)),
        lambda: _Check(req_mask | ((comp == 0) & (seq == 0)),
                       "padded row {i}: num_computed_tokens = {c}, seq_lens = {s}, must be 0",
                       dict(c=comp, s=seq)),
        lambda: _Check(~bad_cover.any(axis=1),
                       "block_table[{i}, {j}] = {b}: a real row needs non-null pages (>= 1) "
                       "on its {n} covered pages and no negative id; padded rows must be all "
                       "the null page 0", dict(j=first_bad_page, b=bt[rows, first_bad_page],
                                               n=xp.where(real_rows, need, 0))),
        lambda: _Check(xp.where(rows == 0, qsl[0] == 0, True) & (qsl[1:] - qsl[:-1] == sched),
                       "query_start_loc[{i}:{i}+2] = ({a}, {b}): must start at 0 and step by "
                       "num_scheduled_tokens = {q}", dict(a=qsl[:-1], b=qsl[1:], q=sched)),
        lambda: _Check(xp.full((T,), total <= T), "num_tokens: query_start_loc[-1] = {n} "
                       "exceeds the %d padded tokens" % T, dict(n=xp.full((T,), total))),
        lambda: _Check(real == (t < total), "token_mask[{i}] = {m}: must be True exactly on the "
                       "first query_start_loc[-1] = {n} tokens",
                       dict(m=real, n=xp.full((T,), total))),
        lambda: _Check(md.req_indices == exp_req, "req_indices[{i}] = {r}: expected {e}",
                       dict(r=md.req_indices, e=exp_req)),
        lambda: _Check(md.query_pos == exp_qpos, "query_pos[{i}] = {p}: expected {e}",
                       dict(p=md.query_pos, e=exp_qpos)),
        lambda: _Check(md.kv_lens == exp_kv, "kv_lens[{i}] = {k}: expected seq_len - q_len + "
                       "query_pos + 1 = {e} (derived from seq_lens; 0 on padding)",
                       dict(k=md.kv_lens, e=exp_kv)),
        lambda: _Check(~real | ((sel_pages == con_pages) & (md.num_valid_pages == con_pages)),
                       "selector/consumer page count mismatch at token {i}: positions = {p} "
                       "gives positions//128+1 = {s} (num_valid_pages = {v}) but the decode "
                       "consumer reads ceil(kv_lens/128) = {c} pages (kv_lens = {k} from "
                       "seq_lens = {L})",
                       dict(p=md.positions, s=sel_pages, v=md.num_valid_pages, c=con_pages,
                            k=md.kv_lens, L=seq[req])),
        lambda: _Check(md.positions == exp_pos, "positions[{i}] = {p}: expected num_computed "
                       "{c} + query_pos {q} = {e} (invariant 2; 0 on padding)",
                       dict(p=md.positions, c=xp.where(real, comp[req], 0), q=md.query_pos,
                            e=exp_pos)),
        lambda: _Check(md.num_valid_pages == xp.where(real, sel_pages, 0),
                       "num_valid_pages[{i}] = {v}: expected positions//128+1 = {e} "
                       "(0 on padding)", dict(v=md.num_valid_pages,
                                              e=xp.where(real, sel_pages, 0))),
        lambda: _Check(~real | (lpage < P), "positions[{i}] = {p}: rank-local page {g} is "
                       "outside the block table of %d pages" % P, dict(p=md.positions, g=lpage)),
        lambda: _Check(md.slot_mapping == exp_slot, "slot_mapping[{i}] = {s}: expected {e} "
                       "(block_table[req, local_pos // 128] * 128 + local_pos % 128; -1 on "
                       "padding)", dict(s=md.slot_mapping, e=exp_slot)),
    ]


def _check_shapes(md: BatchMetadata) -> None:
    R, T = md.seq_lens.shape[0], md.positions.shape[0]
    expected = dict(query_start_loc=(R + 1,), seq_lens=(R,), num_computed_tokens=(R,),
                    num_scheduled_tokens=(R,), req_mask=(R,), req_indices=(T,), query_pos=(T,),
                    positions=(T,), slot_mapping=(T,), num_valid_pages=(T,), kv_lens=(T,),
                    token_mask=(T,))
    for name, shape in expected.items():
        if tuple(getattr(md, name).shape) != shape:
            raise MetadataInvariantError(f"{name}: shape {tuple(getattr(md, name).shape)}, "
                                         f"expected {shape} (R={R}, T={T})")
    if md.block_table.ndim != 2 or md.block_table.shape[0] != R:
        raise MetadataInvariantError(f"block_table: shape {tuple(md.block_table.shape)}, "
                                     f"expected ({R}, P)")


def validate_metadata(md: BatchMetadata, config: RunnerConfig) -> None:
    """Host check of every invariant; raises MetadataInvariantError at the first violation."""
    _check_shapes(md)
    host = {name: np.asarray(jax.device_get(getattr(md, name))) for name in _FIELDS}
    host = {k: (v.astype(bool) if k.endswith("mask") else v.astype(np.int64))
            for k, v in host.items()}
    for build in _checks(BatchMetadata(**host), config, np):
        check = build()
        bad = np.flatnonzero(~np.asarray(check.ok))
        if bad.size:
            i = int(bad[0])
            vals = {k: np.asarray(v)[i] for k, v in check.values.items()}
            raise MetadataInvariantError(check.message.format(i=i, **vals))


def checked_validate(md: BatchMetadata, config: RunnerConfig) -> None:
    """The same checks as ``checkify.check`` calls, for use inside jit (debug mode).

    Call it inside a function wrapped by ``checkify.checkify``; ``err.throw()`` then raises
    with the message of the first failing check (config static).
    """
    _check_shapes(md)
    for build in _checks(md, config, jnp):
        check = build()
        ok = jnp.asarray(check.ok)
        i = jnp.argmin(ok)
        vals = {k: jnp.asarray(v)[i] for k, v in check.values.items()}
        checkify.check(jnp.all(ok), check.message, i=i, **vals)


def validate_jit(md: BatchMetadata, config: RunnerConfig) -> checkify.Error:
    """Runs ``checked_validate`` jitted under checkify; returns the checkify Error."""
    err, _ = _validate_jit_checked(md, config=config)
    return err


_validate_jit_checked = checkify.checkify(jax.jit(checked_validate, static_argnames="config"))

"""Continuous-batching scheduler (host side): token budget, chunked prefill, decode, preemption.

Every step: running requests first, oldest first (a decode takes 1 token, an unfinished
prefill takes a chunk of what the budget leaves); then waiting requests are admitted while
the budget, ``max_num_seqs`` and free pages allow. When a running request needs a page and
none is free, the newest running request is preempted: its pages are freed, its computed
count reset, and it goes back to the front of the waiting queue keeping its generated
tokens, which are recomputed as prompt on resume (preemption by recompute). The oldest
request is never preempted by a newer one, so the system always makes progress. Sampling
keys depend only on (seed, output index), so a recomputed request samples the same tokens.

Requests that can never be served (longer than max_model_len, or needing more pages than
the cache has) are rejected at ``add_request`` with ``RequestRejectedError``.

Decode context parallelism (``dcp_world_size = W > 1``): every rank holds its own cache of
``num_pages`` pages. A request owning L tokens needs ``ceil(L / (128 W))`` rank-local pages
(global block g lives on rank g % W as local block g // W); its page list is rank-local and
the same on every rank (one allocator models the W identical per-rank pools), which is the
block-table row staging expects under DCP.
"""
from __future__ import annotations

import dataclasses
import enum
from collections import deque
from typing import Sequence

import numpy as np

from jax_msa_runner.config import SchedulerConfig
from jax_msa_runner.serving.kv_cache import BlockAllocator, pages_needed


class RequestRejectedError(ValueError):
    """A request that can never be served; the message says which limit it breaks."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class Request:
    """One generation request and its mutable serving state."""

    request_id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    eos_token_id: int | None = None
    output: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output."""
        p = len(self.prompt)
        return list(self.prompt[start:min(stop, p)]) + self.output[max(start - p, 0):max(stop - p, 0)]


@dataclasses.dataclass(frozen=True)
class ScheduledBatch:
    """One step's work, rows in schedule order (n rows, S = sum of scheduled tokens).

    requests: the n Request objects; num_scheduled / num_computed: int32 [n];
    block_table: n lists of page ids; token_ids: int32 [S] (row-major);
    sample: bool [n] (the row reaches the end of its known tokens: its sample is kept);
    sample_index: int32 [n] (= len(output), folded into the sampling key);
    temperature: float32 [n]; seeds: int32 [n]; preempted: ids preempted while scheduling.
    """

    requests: tuple[Request, ...]
    num_scheduled: np.ndarray
    num_computed: np.ndarray
    block_table: tuple[tuple[int, ...], ...]
    token_ids: np.ndarray
    sample: np.ndarray
    sample_index: np.ndarray
    temperature: np.ndarray
    seeds: np.ndarray
    preempted: tuple[int, ...]

    @property
    def num_reqs(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return int(self.num_scheduled.sum())


class Scheduler:
    """Continuous batching over a ``BlockAllocator``; pure host Python, deterministic."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.allocator = BlockAllocator(config.num_pages)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[int, Request] = {}
        self._ids: set[int] = set()
        self.num_preemptions = 0

    # ---- admission -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; raises RequestRejectedError if it can never be served."""
        c = self.config
        if request.request_id in self._ids:
            raise RequestRejectedError(f"request {request.request_id}: duplicate request id")
        if len(request.prompt) < 1:
            raise RequestRejectedError(f"request {request.request_id}: empty prompt")
        if request.max_new_tokens < 1:
            raise RequestRejectedError(f"request {request.request_id}: max_new_tokens must be "
                                       f">= 1, got {request.max_new_tokens}")
        total = len(request.prompt) + request.max_new_tokens
        if total > c.max_model_len:
            raise RequestRejectedError(
                f"request {request.request_id}: prompt {len(request.prompt)} + max_new_tokens "
                f"{request.max_new_tokens} = {total} tokens exceeds max_model_len={c.max_model_len}")
        # the last sampled token is never written to the cache
        need = pages_needed(total - 1, c.dcp_world_size)
        if need > self.allocator.num_usable:
            per_rank = f" per rank (dcp_world_size={c.dcp_world_size})" if c.dcp_world_size > 1 else ""
            raise RequestRejectedError(
                f"request {request.request_id}: needs {need} KV pages{per_rank} but the cache has "
                f"only {self.allocator.num_usable} usable pages (num_pages={c.num_pages}); it can "
                f"never fit")
        request.prompt = tuple(int(t) for t in request.prompt)
        request.status = Status.WAITING
        self._ids.add(request.request_id)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ------------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.allocator.free(req.pages)
        req.pages = []
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _grow(self, req: Request, n: int) -> bool:
        """Give ``req`` the pages for ``n`` more tokens; False if not enough are free."""
        need = pages_needed(req.num_computed + n, self.config.dcp_world_size) - len(req.pages)
        if not self.allocator.can_allocate(need):
            return False
        req.pages.extend(self.allocator.allocate(need))
        return True

    def schedule(self) -> ScheduledBatch:
        """Pick this step's rows (may preempt); raises if nothing at all can run."""
        budget = self.config.max_num_batched_tokens
        rows: list[tuple[Request, int]] = []
        preempted: list[int] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            while not self._grow(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break  # req preempted itself: everything after it is gone too
            rows.append((req, n))
            budget -= n
            i += 1
        if not preempted:
            while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs):
                req = self.waiting[0]
                n = min(req.num_tokens - req.num_computed, budget)
                if not self._grow(req, n):
                    break
                self.waiting.popleft()
                req.status = Status.RUNNING
                self.running.append(req)
                rows.append((req, n))
                budget -= n
        if not rows:
            raise RuntimeError("scheduler: no request could be scheduled (internal invariant broken)")
        reqs = tuple(r for r, _ in rows)
        sched = np.array([n for _, n in rows], np.int32)
        comp = np.array([r.num_computed for r in reqs], np.int32)
        tokens = np.concatenate([np.asarray(r.token_slice(r.num_computed, r.num_computed + n), np.int32)
                                 for r, n in rows])
        return ScheduledBatch(
            requests=reqs, num_scheduled=sched, num_computed=comp,
            block_table=tuple(tuple(r.pages) for r in reqs), token_ids=tokens,
            sample=np.array([r.num_computed + n == r.num_tokens for r, n in rows]),
            sample_index=np.array([len(r.output) for r in reqs], np.int32),
            temperature=np.array([r.temperature for r in reqs], np.float32),
            seeds=np.array([r.seed for r in reqs], np.int32), preempted=tuple(preempted))

    def update(self, batch: ScheduledBatch, sampled: Sequence[int]) -> list[Request]:
        """Apply one step's results (sampled [n] tokens); returns requests finished now."""
        done = []
        for row, req in enumerate(batch.requests):
            req.num_computed += int(batch.num_scheduled[row])
            if not batch.sample[row]:
                continue
            tok = int(sampled[row])
            req.output.append(tok)
            if (len(req.output) >= req.max_new_tokens
                    or (req.eos_token_id is not None and tok == req.eos_token_id)):
                self.running.remove(req)
                self.allocator.free(req.pages)
                req.pages = []
                req.status = Status.FINISHED
                self.finished[req.request_id] = req
                done.append(req)
        return done

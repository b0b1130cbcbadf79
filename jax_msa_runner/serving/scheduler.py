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

Prefix caching (``config.enable_prefix_caching``, ``serving.prefix_cache``): a request's
pages are keyed as they fill (after the step that computed them). A request admitted from
the waiting queue (new, or resumed after preemption) maps the cached pages of its longest
keyed prefix into its page list, counts their tokens as computed and is scheduled from the
first token after them; at least one token is always computed (so a row has logits), so at
most ``(num_tokens - 1) // unit`` pages come from the cache. A waiting request whose next
page is being prefilled by a running request waits for it (admission stops for the step), so
concurrent requests with one prefix (``n`` copies) compute it once and share its pages.
Requests asking for prompt logprobs (which need every prompt token's logits) or with a
presence, frequency or repetition penalty (whose on-device state counts the tokens the
steps feed, from position 0) never read the cache; their pages still join it. Preemption,
abort and finish drop the request's references: its keyed pages stay cached, evictable.

Every running request holds a slot in [0, max_num_seqs): its row of the runner's
on-device penalty state (``sampling.PenaltyState``), taken at admission and given back on
preemption, finish and abort. ``abort`` removes a request wherever it is and frees its pages
and slot; finished requests stay in ``finished`` until ``pop_finished``.

Asynchronous scheduling (``update_pending`` / ``resolve``, the engine's
``async_scheduling``): after launching step N the engine applies it with ``update_pending``
before its tokens are known: every sampling row advances as ``update`` would and appends
``PLACEHOLDER`` to its output (``Request.num_pending`` = 1), so step N+1 can be scheduled
at once; the runner feeds the placeholder position step N's on-device token. A request whose
placeholder makes ``max_new_tokens`` finishes right away ("length"). ``resolve(batch N,
tokens)`` then writes the real tokens over the placeholders and finishes the requests that
sampled a stop token (their extra token of step N+1 is discarded: ``update_pending`` skips
rows that are no longer running). Preemption and abort drop a request's placeholder: its
in-flight token is discarded (a preempted request samples it again on resume, with the same
key). Full pages are keyed only from computed tokens, which ``resolve`` has made real by
then; the in-flight keys of ``_keys_in_flight`` leave the placeholder out.
"""
from __future__ import annotations

import dataclasses
import enum
from collections import deque
from typing import Sequence

import numpy as np

from jax_msa_runner.config import RESERVED_PAGES, SchedulerConfig
from jax_msa_runner.serving.kv_cache import pages_needed
from jax_msa_runner.serving.prefix_cache import PagePool, chain_keys, page_unit
from jax_msa_runner.serving.sampling import SamplingParamError, SamplingParams, SamplingRows

PLACEHOLDER = -1  # an output token sampled on the device but not yet read (async scheduling)


class RequestRejectedError(ValueError):
    """A request that can never be served; the message says which limit it breaks and
    ``field`` names the Request field at fault ("prompt", "max_new_tokens", a sampling
    parameter, "request_id")."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


def check_request_fits(config: SchedulerConfig, num_prompt_tokens: int,
                       max_new_tokens: int) -> None:
    """Raises RequestRejectedError (field "prompt" or "max_new_tokens") unless a request of
    this size can ever be served: a non-empty prompt, max_new_tokens >= 1, prompt +
    max_new_tokens <= max_model_len, and its pages within the cache."""
    c = config
    if num_prompt_tokens < 1:
        raise RequestRejectedError("empty prompt", "prompt")
    if max_new_tokens < 1:
        raise RequestRejectedError(f"max_new_tokens must be >= 1, got {max_new_tokens}",
                                   "max_new_tokens")
    if num_prompt_tokens >= c.max_model_len:
        raise RequestRejectedError(
            f"prompt of {num_prompt_tokens} tokens leaves no room for an output token: "
            f"prompt + max_new_tokens must be <= max_model_len={c.max_model_len}", "prompt")
    total = num_prompt_tokens + max_new_tokens
    if total > c.max_model_len:
        raise RequestRejectedError(
            f"prompt {num_prompt_tokens} + max_new_tokens {max_new_tokens} = {total} tokens "
            f"exceeds max_model_len={c.max_model_len}", "max_new_tokens")
    # the last sampled token is never written to the cache
    need = pages_needed(total - 1, c.dcp_world_size)
    usable = c.num_pages - len(RESERVED_PAGES)
    if need > usable:
        field = "prompt" if pages_needed(num_prompt_tokens, c.dcp_world_size) > usable \
            else "max_new_tokens"
        raise RequestRejectedError(
            f"needs {need} KV pages per rank (dcp_world_size={c.dcp_world_size}) but the cache "
            f"has only {usable} usable pages "
            f"(num_pages={c.num_pages}); it can never fit", field)


@dataclasses.dataclass
class Request:
    """One generation request and its mutable serving state."""

    request_id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    eos_token_id: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    output: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int = -1
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "length" or "stop" (a stop / eos token) once finished
    num_preemptions: int = 0
    prompt_logprobs: bool = False  # the steps return its prompt tokens' logprobs
    num_cached_tokens: int = -1  # tokens its first admission found in the prefix cache
    page_keys: list[bytes] = dataclasses.field(default_factory=list)  # of its full pages so far
    num_keyed: int = 0  # leading pages of ``pages`` already offered to the cache
    num_pending: int = 0  # trailing PLACEHOLDER outputs (0 or 1; async scheduling)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output."""
        p = len(self.prompt)
        return list(self.prompt[start:min(stop, p)]) + self.output[max(start - p, 0):max(stop - p, 0)]

    @property
    def reads_prefix_cache(self) -> bool:
        """False for prompt logprobs (every prompt token's logits) and penalties (the device
        state counts fed tokens from position 0)."""
        s = self.sampling
        return not self.prompt_logprobs and (s.presence_penalty, s.frequency_penalty,
                                             s.repetition_penalty) == (0.0, 0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class ScheduledBatch:
    """One step's work, rows in schedule order (n rows, S = sum of scheduled tokens).

    requests: the n Request objects; num_scheduled / num_computed: int32 [n];
    block_table: n lists of page ids; token_ids: int32 [S] (row-major);
    sample: bool [n] (the row reaches the end of its known tokens: its sample is kept);
    sampling: the rows' sampling inputs (``sample_index`` = len(output), folded into the
    sampling key; ``slot``; ``prompt_len``; the request's parameters);
    preempted: ids preempted while scheduling.
    """

    requests: tuple[Request, ...]
    num_scheduled: np.ndarray
    num_computed: np.ndarray
    block_table: tuple[tuple[int, ...], ...]
    token_ids: np.ndarray
    sample: np.ndarray
    sampling: SamplingRows
    preempted: tuple[int, ...]

    @property
    def num_reqs(self) -> int:
        return len(self.requests)

    @property
    def sample_index(self) -> np.ndarray:
        return self.sampling.sample_index

    @property
    def num_tokens(self) -> int:
        return int(self.num_scheduled.sum())


class Scheduler:
    """Continuous batching over a ``PagePool``; pure host Python, deterministic.

    cache_identity: the root of the prefix-cache keys (``prefix_cache.cache_identity`` of
    the runner's model and caches). ``prefix_queries`` / ``prefix_hits``: tokens looked up
    in the cache at admission, and tokens found.
    """

    def __init__(self, config: SchedulerConfig, cache_identity: bytes = b""):
        self.config = config
        self.pool = PagePool(config.num_pages)
        self.cache_identity = cache_identity
        self.unit = page_unit(config.dcp_world_size)
        self.prefix_queries = self.prefix_hits = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[int, Request] = {}
        self._ids: set[int] = set()  # requests known here: waiting, running or in finished
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))  # pop() = lowest
        self.num_preemptions = 0

    # ---- admission -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; raises RequestRejectedError if it can never be served."""
        rid = request.request_id
        if rid in self._ids:
            raise RequestRejectedError(f"request {rid}: duplicate request id", "request_id")
        try:
            check_request_fits(self.config, len(request.prompt), request.max_new_tokens)
            request.sampling.check(seed=request.seed)
        except RequestRejectedError as e:
            raise RequestRejectedError(f"request {rid}: {e}", e.field) from None
        except SamplingParamError as e:
            raise RequestRejectedError(f"request {rid}: {e}", e.field) from None
        request.prompt = tuple(int(t) for t in request.prompt)
        request.stop_token_ids = frozenset(int(t) for t in request.stop_token_ids)
        request.status = Status.WAITING
        self._ids.add(rid)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_pages_in_use(self) -> int:
        """Pages held by running requests (cached pages of ref count 0 are not in use)."""
        return self.pool.num_held

    def check_pages(self) -> None:
        """Raises prefix_cache.PageRefError unless the pool's ref counts match the running
        requests' page lists (the debug check)."""
        self.pool.check([r.pages for r in self.running])

    # ---- leaving ---------------------------------------------------------------------------
    def _release(self, req: Request) -> None:
        """Frees a running request's pages and slot."""
        self.running.remove(req)
        self.pool.release(req.pages)
        req.pages = []
        req.num_keyed = 0
        self._free_slots.append(req.slot)
        self._free_slots.sort(reverse=True)
        req.slot = -1

    def abort(self, request_id: int) -> Request | None:
        """Removes a request wherever it is (waiting, running or finished), freeing its pages
        and slot; returns it (status ABORTED unless it had finished), or None if unknown."""
        for req in self.running:
            if req.request_id == request_id:
                self._release(req)
                break
        else:
            req = next((r for r in self.waiting if r.request_id == request_id), None)
            if req is not None:
                self.waiting.remove(req)
            else:
                req = self.finished.pop(request_id, None)
        if req is None:
            return None
        self._drop_pending(req)
        self._ids.discard(request_id)
        if req.status is not Status.FINISHED:
            req.status = Status.ABORTED
        return req

    def pop_finished(self, request_id: int) -> Request:
        """Takes a finished request out of ``finished`` (its id may then be reused)."""
        req = self.finished.pop(request_id)
        self._ids.discard(request_id)
        return req

    # ---- scheduling ------------------------------------------------------------------------
    def _drop_pending(self, req: Request) -> None:
        """Discard the request's in-flight token (its placeholder)."""
        if req.num_pending:
            del req.output[-req.num_pending:]
            req.num_pending = 0

    def _preempt(self, req: Request) -> None:
        self._drop_pending(req)
        self._release(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _grow(self, req: Request, n: int) -> bool:
        """Give ``req`` the pages for ``n`` more tokens; False if not enough are free."""
        need = pages_needed(req.num_computed + n, self.config.dcp_world_size) - len(req.pages)
        if not self.pool.can_allocate(need):
            return False
        req.pages.extend(self.pool.allocate(need))
        return True

    # ---- prefix caching --------------------------------------------------------------------
    def _keys(self, req: Request, num_pages: int) -> list[bytes]:
        """Keys of req's first ``num_pages`` full pages (extends ``req.page_keys``)."""
        have = len(req.page_keys)
        if num_pages > have:
            parent = req.page_keys[-1] if have else self.cache_identity
            req.page_keys.extend(chain_keys(parent, req.token_slice(have * self.unit,
                                                                    num_pages * self.unit),
                                            self.unit))
        return req.page_keys[:num_pages]

    def _cached_prefix(self, req: Request) -> list[int] | None:
        """The cached pages of req's longest keyed prefix, at most (num_tokens - 1) // unit;
        None when req waits for a running request to fill its next page."""
        if not (self.config.enable_prefix_caching and req.reads_prefix_cache):
            return []
        keys = self._keys(req, (req.num_tokens - 1) // self.unit)
        hit = self.pool.lookup(keys)
        if len(hit) < len(keys) and keys[len(hit)] in self._keys_in_flight():
            return None
        return hit

    def _keys_in_flight(self) -> set[bytes]:
        """Keys of the pages running requests will fill from the tokens they know."""
        return {k for r in self.running
                for k in self._keys(r, (r.num_tokens - r.num_pending) // self.unit)[r.num_keyed:]}

    def _offer_full_pages(self, req: Request) -> None:
        """Key req's pages that its computed tokens have filled since the last offer."""
        full = req.num_computed // self.unit
        if self.config.enable_prefix_caching and full > req.num_keyed:
            for page, key in zip(req.pages[req.num_keyed:full],
                                 self._keys(req, full)[req.num_keyed:]):
                self.pool.insert(page, key)
        req.num_keyed = max(req.num_keyed, full)

    def _admit(self, req: Request, budget: int) -> int | None:
        """Give waiting ``req`` its cached prefix and the pages of its first chunk; returns
        the chunk's tokens, or None (nothing changes) when it must keep waiting."""
        hit = self._cached_prefix(req)
        if hit is None:
            return None
        computed = len(hit) * self.unit
        n = min(req.num_tokens - computed, budget)
        new = pages_needed(computed + n, self.config.dcp_world_size) - len(hit)
        revived = sum(self.pool.ref_count(p) == 0 for p in hit)  # leave the evictable pool
        if not self.pool.can_allocate(new + revived):
            return None
        self.pool.acquire(hit)
        req.pages = hit + self.pool.allocate(new)
        req.num_computed, req.num_keyed = computed, len(hit)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = computed
        if self.config.enable_prefix_caching and req.reads_prefix_cache:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += computed
        return n

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
                n = self._admit(req, budget)
                if n is None:
                    break
                self.waiting.popleft()
                req.status = Status.RUNNING
                req.slot = self._free_slots.pop()
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
            sampling=_sampling_rows(reqs, sched), preempted=tuple(preempted))

    def update(self, batch: ScheduledBatch, sampled: Sequence[int]) -> list[Request]:
        """Apply one step's results (sampled [n] tokens); returns requests finished now."""
        done = []
        for row, req in enumerate(batch.requests):
            req.num_computed += int(batch.num_scheduled[row])
            self._offer_full_pages(req)
            if not batch.sample[row]:
                continue
            tok = int(sampled[row])
            req.output.append(tok)
            stop = tok == req.eos_token_id or tok in req.stop_token_ids
            if stop or len(req.output) >= req.max_new_tokens:
                self._release(req)
                req.status = Status.FINISHED
                req.finish_reason = "stop" if stop else "length"
                self.finished[req.request_id] = req
                done.append(req)
        return done


    # ---- asynchronous scheduling ----------------------------------------------------------
    def update_pending(self, batch: ScheduledBatch) -> list[Request]:
        """Apply a launched step whose tokens are not known yet: like ``update`` with a
        PLACEHOLDER for every sampled token (rows no longer running are skipped: their
        tokens are discarded); returns requests finished now (max_new_tokens reached,
        finish_reason "length" until ``resolve`` reads a stop token)."""
        done = []
        for row, req in enumerate(batch.requests):
            if req.status is not Status.RUNNING:
                continue  # finished, aborted or preempted since it was scheduled
            req.num_computed += int(batch.num_scheduled[row])
            self._offer_full_pages(req)
            if not batch.sample[row]:
                continue
            if req.num_pending:
                raise RuntimeError(f"request {req.request_id}: a second token in flight "
                                   f"(resolve the previous step first)")
            req.output.append(PLACEHOLDER)
            req.num_pending = 1
            if len(req.output) >= req.max_new_tokens:
                self._release(req)
                req.status = Status.FINISHED
                req.finish_reason = "length"
                self.finished[req.request_id] = req
                done.append(req)
        return done

    def resolve(self, batch: ScheduledBatch, sampled: Sequence[int]) -> np.ndarray:
        """The tokens of a step applied with ``update_pending``: each row's placeholder
        becomes its token, and a stop token finishes its request. Returns bool [n]: the
        rows whose token was kept (False: no sample, or the request was preempted or
        aborted while it was in flight, so the token is discarded)."""
        kept = np.zeros(batch.num_reqs, bool)
        for row, req in enumerate(batch.requests):
            if not batch.sample[row]:
                continue
            idx = int(batch.sample_index[row])
            if (req.status not in (Status.RUNNING, Status.FINISHED) or not req.num_pending
                    or len(req.output) != idx + 1 or req.output[idx] != PLACEHOLDER):
                continue
            tok = int(sampled[row])
            req.output[idx] = tok
            req.num_pending = 0
            kept[row] = True
            if tok == req.eos_token_id or tok in req.stop_token_ids:
                if req.status is Status.RUNNING:
                    self._release(req)
                    req.status = Status.FINISHED
                    self.finished[req.request_id] = req
                req.finish_reason = "stop"
        return kept


def _next_prompt_token(req: Request, num_scheduled: int) -> int:
    end = req.num_computed + num_scheduled
    return req.prompt[end] if end < len(req.prompt) else -1


def _sampling_rows(reqs: Sequence[Request], num_scheduled: np.ndarray) -> SamplingRows:
    def col(f, dtype):
        return np.array([f(r) for r in reqs], dtype)

    return SamplingRows(
        seed=col(lambda r: r.seed, np.int32), sample_index=col(lambda r: len(r.output), np.int32),
        top_k=col(lambda r: r.sampling.top_k, np.int32), slot=col(lambda r: r.slot, np.int32),
        prompt_len=col(lambda r: len(r.prompt), np.int32),
        prompt_logprobs=col(lambda r: r.prompt_logprobs, np.int32),
        next_token=np.array([_next_prompt_token(r, int(n)) for r, n in zip(reqs, num_scheduled)],
                            np.int32),
        temperature=col(lambda r: r.sampling.temperature, np.float32),
        top_p=col(lambda r: r.sampling.top_p, np.float32),
        min_p=col(lambda r: r.sampling.min_p, np.float32),
        presence_penalty=col(lambda r: r.sampling.presence_penalty, np.float32),
        frequency_penalty=col(lambda r: r.sampling.frequency_penalty, np.float32),
        repetition_penalty=col(lambda r: r.sampling.repetition_penalty, np.float32))

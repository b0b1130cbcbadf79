"""The async engine: one thread owns the runner and the scheduler and steps them; asyncio
callers submit requests and read their tokens as they are sampled.

``Engine.submit`` (on an event loop) checks the request, puts it in the inbox and returns
a ``RequestStream`` at once; the engine thread moves the inbox into the scheduler between
steps (continuous batching: a request joins the running batch at the next step), runs
``schedule -> runner.execute_step -> update``, turns each sampled token into text
(``tokenizer_io.TextStream``: stop strings, held-back partial characters) and hands every
request's new tokens to its stream through ``loop.call_soon_threadsafe``. Nothing on the
event loop waits for the device.

``abort(request_id)`` (any thread) removes the request at the next step boundary and frees
its KV pages and penalty slot; a stream's owner calls it when its client goes away. The
inbox is bounded: ``submit`` raises ``QueueFullError`` when ``max_queue`` requests already
wait to run (inbox plus the scheduler's waiting queue).

Asynchronous scheduling (``sconfig.async_scheduling``; the runner warmed up with
``async_scheduling=True``): ``_step_async`` is the one place that pipelines. It schedules
step N+1 against step N's placeholders (``Scheduler.update_pending``), launches it (the
device feeds it step N's sampled tokens), and only then reads step N's tokens, resolves them
(``Scheduler.resolve``: stop tokens finish), turns them into text (stop strings) and
delivers them, while the device runs step N+1. A request finished by step N's token has its
extra token of step N+1 discarded; one preempted or aborted with a token in flight loses
that token (sampled again on resume with the same key: seeds hold). While a request with a
grammar is live, its masks need each token on the host before the next step, so the engine
steps synchronously (draining the in-flight step first).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import random
import threading
import time
from typing import Sequence

import jax
import numpy as np

from jax_msa_runner.config import SchedulerConfig
from jax_msa_runner.serving import structured
from jax_msa_runner.serving.compile_count import compile_count
from jax_msa_runner.serving.metrics import ServerMetrics
from jax_msa_runner.serving.prefix_cache import cache_identity
from jax_msa_runner.serving.runner import ModelRunner, StepHandle
from jax_msa_runner.serving.sampling import (NUM_TOP_LOGPROBS, SamplingParamError,
                                             SamplingParams, StepOutput)
from jax_msa_runner.serving.scheduler import (Request, RequestRejectedError, ScheduledBatch,
                                              Scheduler, Status, check_request_fits)
from jax_msa_runner.serving.tokenizer_io import TextStream, Tokenizer

MAX_STOP_STRINGS = 16


class QueueFullError(RuntimeError):
    """The engine's waiting queue is full (``max_queue``)."""


class EngineDeadError(RuntimeError):
    """The engine thread is not running (not started, stopped, or failed: ``Engine.error``)."""


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    """What to generate for one request (API names; ``check`` validates them).

    sampling: the token-picking knobs (temperature, top_k, top_p, min_p, penalties).
    logprobs: None for no logprobs, else N in [0, 20]: the chosen token's logprob and the
    top N alternatives. prompt_logprobs: the same for the prompt's tokens (each one's logprob
    given the tokens before it; the first has none), computed in the prefill. grammar: an
    llguidance grammar the output must follow (structured outputs, forced tool calls), its
    API field ``grammar_field`` for errors. stop: up to 16 non-empty strings (not part of the output);
    stop_token_ids: ids that end the generation (their text is not part of the output);
    seed None: a random one. ignore_eos: do not stop at the tokenizer's eos tokens.
    """

    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    grammar: str | None = None
    grammar_field: str = "response_format"

    def check(self, vocab_size: int) -> None:
        """Raises SamplingParamError naming the first field outside its bound."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise SamplingParamError("max_tokens", f"must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise SamplingParamError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        self.sampling.check(seed=0 if self.seed is None else self.seed, vocab_size=vocab_size)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamError("stop", f"at most {MAX_STOP_STRINGS} strings, got "
                                             f"{len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamError("stop", f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise SamplingParamError("stop_token_ids", f"ids must be integers in "
                                                           f"[0, {vocab_size}), got {t!r}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int)
                                  or not 0 <= n <= NUM_TOP_LOGPROBS):
                raise SamplingParamError(name, f"must be an integer in [0, {NUM_TOP_LOGPROBS}], "
                                               f"got {n!r}")


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """The model's logprob of a generated token and the top alternatives [(id, logprob)]."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one step added to a request: new text, new token ids (with logprobs if asked),
    and on the last output the finish reason ("stop", "length"). ``prompt_logprobs`` (on the
    first output, if asked): one entry per prompt token, None for the first."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache


def make_request(request_id: int, prompt: Sequence[int], params: GenerationParams, *, seed: int,
                 eos_token_ids: Sequence[int]) -> Request:
    """The scheduler Request the engine serves for ``params``: the eos ids join the stop token
    ids unless ``ignore_eos`` (stop strings and logprobs are the engine's business)."""
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    return Request(request_id, tuple(prompt), params.max_tokens, sampling=params.sampling,
                   seed=seed, stop_token_ids=frozenset(stops),
                   prompt_logprobs=params.prompt_logprobs is not None)


class RequestStream:
    """Async iterator over a request's ``RequestOutput``s, ending after the finished one.

    ``request_id``; ``finished``; ``submitted_at`` (perf_counter). Raises EngineDeadError if
    the engine fails while the request runs.
    """

    def __init__(self, request_id: int, num_prompt_tokens: int, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.loop = loop
        self.finished = False
        self.submitted_at = time.perf_counter()
        self._queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finish_reason is not None:
            self.finished = True
        return item


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after its latest loop iteration (published by the engine thread)."""

    steps: int
    waiting: int
    running: int
    pages_in_use: int
    pages_usable: int
    live_requests: int
    preemptions: int
    cached_pages: int = 0  # keyed pages of the prefix cache, held or not


@dataclasses.dataclass
class _Live:
    """Engine-thread state of one submitted request."""

    request: Request
    stream: RequestStream
    params: GenerationParams
    text: TextStream
    new_ids: list[int] = dataclasses.field(default_factory=list)
    new_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    first_token: bool = True
    prompt_logprobs: list[TokenLogprob | None] = dataclasses.field(
        default_factory=lambda: [None])  # entry i: prompt token i (the first has none)
    matcher: object | None = None  # llguidance.LLMatcher of a constrained request


class Engine:
    """Continuous batching behind an asyncio interface; ``start()`` launches the thread.

    runner: a warmed-up ModelRunner (the engine thread is its only user from then on);
    sconfig: the scheduler's limits within the runner's (max_num_seqs, token budget,
    max_model_len, pages, prefix caching); max_queue >= 1: requests allowed to wait to run;
    model_tag: names the weights in the prefix cache's keys (with the model config and the
    caches' dtypes). With ``runner.debug`` every step also checks the pages' ref counts
    against the running block tables (``Scheduler.check_pages``). ``sconfig.async_scheduling``
    needs a runner made with ``async_scheduling=True``; ``async_steps`` / ``sync_steps``
    count the steps of each kind, ``overlapped_steps`` those launched while the previous
    step's tokens were still unread.
    """

    def __init__(self, runner: ModelRunner, sconfig: SchedulerConfig, tokenizer: Tokenizer, *,
                 max_queue: int, metrics: ServerMetrics | None = None, model_tag: str = ""):
        rc = runner.rconfig
        for field, mine, limit in (("max_num_seqs", sconfig.max_num_seqs, rc.max_num_seqs),
                                   ("max_num_batched_tokens", sconfig.max_num_batched_tokens,
                                    rc.bucket_sizes[-1]),
                                   ("max_model_len", sconfig.max_model_len, rc.max_model_len),
                                   ("num_pages", sconfig.num_pages, runner.num_pages)):
            if mine > limit:
                raise ValueError(f"sconfig.{field}: {mine} exceeds the runner's {limit}")
        if sconfig.dcp_world_size != rc.dcp_world_size:
            raise ValueError(f"sconfig.dcp_world_size: {sconfig.dcp_world_size} differs from the "
                             f"runner's {rc.dcp_world_size}")
        if tokenizer.vocab_size != runner.mconfig.vocab_size:
            raise ValueError(f"tokenizer.vocab_size: {tokenizer.vocab_size} differs from the "
                             f"model's {runner.mconfig.vocab_size} (every id the model can "
                             f"sample must decode)")
        if max_queue < 1:
            raise ValueError(f"max_queue: must be >= 1, got {max_queue}")
        if sconfig.async_scheduling and not runner.async_scheduling:
            raise ValueError("sconfig.async_scheduling needs a runner made (and warmed up) with "
                             "async_scheduling=True")
        self.runner, self.tokenizer = runner, tokenizer
        self.vocab_size = runner.mconfig.vocab_size
        self.scheduler = Scheduler(sconfig, cache_identity=runner_cache_identity(runner,
                                                                                  model_tag))
        self._prefix_seen = (0, 0)  # the scheduler's (queries, hits) already in the metrics
        self.max_queue = max_queue
        self.metrics = metrics or ServerMetrics()
        self.metrics.kv_pages_total.set(self.scheduler.pool.num_usable)
        self.error: BaseException | None = None
        self._inbox: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pending_adds = 0
        self._num_waiting = 0
        self._ids = itertools.count()
        self._live: dict[int, _Live] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self._rng = random.SystemRandom()
        self._steps = 0
        self.async_scheduling = sconfig.async_scheduling
        self._inflight: StepHandle | None = None  # launched, its tokens not yet read
        self.async_steps = self.sync_steps = self.overlapped_steps = 0
        self._lltok = None
        self._compile_base = compile_count()  # the runner is warmed up: serving adds none
        self._compiles_seen = 0
        self.snapshot = self._make_snapshot()

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is not None:
            raise RuntimeError("Engine.start: already started")
        self._thread = threading.Thread(target=self._loop, name="jax-msa-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float | None = 30.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def lltok(self):
        """The tokenizer as llguidance sees it (built on first use)."""
        if self._lltok is None:
            self._lltok = structured.llg_tokenizer(self.tokenizer)
        return self._lltok

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- the asyncio side ----------------------------------------------------------------
    def check(self, prompt_ids: Sequence[int], params: GenerationParams) -> None:
        """Raises SamplingParamError / RequestRejectedError (field set) for a request that is
        invalid or can never be served."""
        params.check(self.vocab_size)
        if params.grammar is not None:
            try:
                structured.check_grammar(self.lltok, params.grammar)
            except ValueError as e:
                raise SamplingParamError(params.grammar_field, f"invalid grammar: {e}") from None
        for i, t in enumerate(prompt_ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise RequestRejectedError(f"prompt[{i}] = {t!r}: token ids must be integers in "
                                           f"[0, {self.vocab_size})", "prompt")
        check_request_fits(self.scheduler.config, len(prompt_ids), params.max_tokens)

    def submit(self, prompt_ids: Sequence[int], params: GenerationParams) -> RequestStream:
        """Queue a request (call on the event loop that reads the stream)."""
        loop = asyncio.get_running_loop()
        self.check(prompt_ids, params)
        if not self.alive:
            raise EngineDeadError(f"engine is not running{f': {self.error!r}' if self.error else ''}")
        with self._lock:
            if self._pending_adds + self._num_waiting >= self.max_queue:
                raise QueueFullError(f"{self._pending_adds + self._num_waiting} requests are "
                                     f"waiting (max_queue={self.max_queue})")
            rid = next(self._ids)
            self._pending_adds += 1
            stream = RequestStream(rid, len(prompt_ids), loop)
            self._inbox.append(("add", stream, tuple(prompt_ids), params))
        self._wake.set()
        return stream

    def abort(self, request_id: int) -> None:
        """Abort a request (no-op if it already finished); thread-safe, non-blocking."""
        with self._lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()

    # ---- the engine thread ---------------------------------------------------------------
    def _loop(self) -> None:
        prev_ready = None  # output time of the previous step, if it ran back to back
        try:
            while not self._stop:
                self._wake.clear()
                self._drain_inbox()
                if not self.scheduler.has_unfinished():
                    if self._inflight is not None:  # its tokens are still to deliver
                        self._finish_inflight()
                        self._publish()
                        continue
                    self._publish()
                    prev_ready = None
                    self._wake.wait(0.5)
                    continue
                if self.async_scheduling:
                    self._step_async(prev_ready)
                else:
                    self._step(prev_ready)
                prev_ready = self.runner.last_ready
                self._publish()
        except BaseException as e:  # noqa: BLE001 -- reported to every waiting stream
            self.error = e
            self._fail_all(EngineDeadError(f"engine failed: {e!r}"))
            raise
        self._fail_all(EngineDeadError("engine shut down"))

    def _drain_inbox(self) -> None:
        with self._lock:
            items = list(self._inbox)
            self._inbox.clear()
        for item in items:
            if item[0] == "add":
                _, stream, prompt, params = item
                self._admit(stream, prompt, params)
                with self._lock:
                    self._pending_adds -= 1
            else:
                self._abort(item[1])
        with self._lock:
            self._num_waiting = len(self.scheduler.waiting)

    def _admit(self, stream: RequestStream, prompt: tuple[int, ...], params: GenerationParams):
        seed = self._rng.randrange(0, 2**31) if params.seed is None else params.seed
        req = make_request(stream.request_id, prompt, params, seed=seed,
                           eos_token_ids=self.tokenizer.eos_token_ids)
        try:
            self.scheduler.add_request(req)
        except RequestRejectedError as e:  # checked at submit; a guard only
            self._send([(stream, e)])
            return
        matcher = (structured.new_matcher(self.lltok, params.grammar)
                   if params.grammar is not None else None)  # checked at submit
        self._live[req.request_id] = _Live(req, stream, params,
                                           TextStream(self.tokenizer, params.stop),
                                           matcher=matcher)
        self.metrics.prompt_tokens.inc(len(prompt))

    def _abort(self, request_id: int) -> None:
        if self._live.pop(request_id, None) is None:
            return  # finished already
        self.scheduler.abort(request_id)
        self.metrics.requests.labels(outcome="abort").inc()

    def _step(self, prev_ready: float | None) -> None:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch.preempted:
            self.metrics.preemptions.inc(len(batch.preempted))
        out = self.runner.execute_step(batch, token_masks=lambda: self._token_masks(batch))
        if prev_ready is not None:
            self.metrics.host_gap.observe(max(0.0, self.runner.last_launch - prev_ready))
        self.scheduler.update(batch, out.tokens)
        if self.runner.debug:
            self.scheduler.check_pages()
        deliveries = self._outputs(batch, out)
        self._steps += 1
        self.sync_steps += 1
        self.metrics.step_latency.observe(time.perf_counter() - t0)
        self._send(deliveries)

    def _needs_sync(self) -> bool:
        """A live request needs each token on the host before its next step (a grammar)."""
        return any(live.matcher is not None for live in self._live.values())

    def _step_async(self, prev_ready: float | None) -> None:
        """One pipelined step: schedule and launch step N+1, then read step N's tokens."""
        if self._needs_sync():
            if self._inflight is not None:
                self._finish_inflight()
                self._drain_inbox()
                if not self.scheduler.has_unfinished():
                    return
            self._step(prev_ready)
            return
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch.preempted:
            self.metrics.preemptions.inc(len(batch.preempted))
        prev = self._inflight
        handle = self.runner.launch_step(batch, prev=prev)  # before reading prev's tokens
        if prev is None and prev_ready is not None:  # overlapped steps: not measurable
            self.metrics.host_gap.observe(max(0.0, self.runner.last_launch - prev_ready))
        if prev is not None:
            self.overlapped_steps += 1
            self._finish_inflight()
        self.scheduler.update_pending(batch)
        self._inflight = handle
        self._steps += 1
        self.async_steps += 1
        self.metrics.step_latency.observe(time.perf_counter() - t0)

    def _finish_inflight(self) -> None:
        """Read the in-flight step's tokens, resolve its placeholders and deliver them."""
        handle, self._inflight = self._inflight, None
        out = self.runner.finish_step(handle)
        kept = self.scheduler.resolve(handle.batch, out.tokens)
        if self.runner.debug:
            self.scheduler.check_pages()
        self._send(self._outputs(handle.batch, out, kept))

    def _token_masks(self, batch: ScheduledBatch) -> np.ndarray | None:
        """The bitmasks of the rows that sample under a grammar this step (None: no such
        row); runs on the host while the device runs the step's forward."""
        rows = []
        for row, req in enumerate(batch.requests):
            live = self._live.get(req.request_id)
            if batch.sample[row] and live is not None and live.matcher is not None:
                rows.append((row, live.matcher))
        if not rows:
            return None
        return structured.fill_masks(rows, batch.num_reqs, self.vocab_size)

    def _collect_prompt_logprobs(self, batch: ScheduledBatch, out: StepOutput) -> None:
        """Each asking row's entries for the prompt tokens after the ones it computed this
        step (a preempted request recomputes entries it already has: they are skipped)."""
        starts = np.concatenate([[0], np.cumsum(batch.num_scheduled)])
        p = out.prompt
        for row, req in enumerate(batch.requests):
            live = self._live.get(req.request_id)
            if live is None or live.params.prompt_logprobs is None:
                continue
            n = live.params.prompt_logprobs
            for j in range(int(batch.num_scheduled[row])):
                pos = int(batch.num_computed[row]) + j + 1  # the prompt token it predicts
                if pos != len(live.prompt_logprobs) or pos >= len(req.prompt):
                    continue
                t = int(starts[row]) + j
                top = tuple((int(i), float(v)) for i, v in zip(p.top_ids[t, :n],
                                                               p.top_logprobs[t, :n]))
                live.prompt_logprobs.append(TokenLogprob(req.prompt[pos], float(p.logprobs[t]),
                                                         top))

    def _outputs(self, batch: ScheduledBatch, out: StepOutput,
                 kept: np.ndarray | None = None) -> list:
        """Deliveries of the rows that sampled (``kept``: only those rows, async)."""
        deliveries = []
        now = time.perf_counter()
        generated = 0
        if out.prompt is not None:
            self._collect_prompt_logprobs(batch, out)
        for row, req in enumerate(batch.requests):
            if not batch.sample[row] or (kept is not None and not kept[row]):
                continue
            live = self._live.get(req.request_id)
            if live is None:
                continue  # aborted
            generated += 1
            tok = int(out.tokens[row])
            prompt_lp = None
            if live.first_token:
                live.first_token = False
                self.metrics.ttft.observe(now - live.stream.submitted_at)
                if live.params.prompt_logprobs is not None:
                    prompt_lp = tuple(live.prompt_logprobs)
            live.new_ids.append(tok)
            n = live.params.logprobs
            if n is not None:
                top = tuple((int(i), float(v)) for i, v in
                            zip(out.top_ids[row, :n], out.top_logprobs[row, :n]))
                live.new_logprobs.append(TokenLogprob(tok, float(out.logprobs[row]), top))
            done = req.status is Status.FINISHED
            ended = False  # the grammar is complete: nothing may follow
            if live.matcher is not None:
                live.matcher.consume_token(tok)
                ended = live.matcher.is_stopped()
            hidden = (done and req.finish_reason == "stop") or (
                ended and tok == self.lltok.eos_token)
            hit = live.text.push(tok, visible=not hidden) or ended
            reason = None
            if hit:
                reason = "stop"
                if done:
                    self.scheduler.pop_finished(req.request_id)
                else:
                    self.scheduler.abort(req.request_id)
            elif done:
                reason = req.finish_reason
                self.scheduler.pop_finished(req.request_id)
            if reason is not None:
                live.text.finish()
                del self._live[req.request_id]
                self.metrics.requests.labels(outcome=reason).inc()
            text = live.text.take(final=reason is not None)
            deliveries.append((live.stream, RequestOutput(
                text=text, token_ids=tuple(live.new_ids),
                logprobs=tuple(live.new_logprobs) if n is not None else None,
                finish_reason=reason, num_prompt_tokens=len(req.prompt),
                num_output_tokens=len(req.output), prompt_logprobs=prompt_lp,
                num_cached_tokens=max(req.num_cached_tokens, 0))))
            live.new_ids, live.new_logprobs = [], []
        self.metrics.generation_tokens.inc(generated)
        return deliveries

    def _send(self, deliveries: list) -> None:
        by_loop: dict = {}
        for stream, item in deliveries:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody is reading
                pass

    def _fail_all(self, err: BaseException) -> None:
        self._send([(live.stream, err) for live in self._live.values()])
        with self._lock:
            pending = [item[1] for item in self._inbox if item[0] == "add"]
            self._inbox.clear()
        self._send([(stream, err) for stream in pending])
        self._live.clear()

    def _make_snapshot(self) -> EngineSnapshot:
        s = self.scheduler
        return EngineSnapshot(steps=self._steps, waiting=len(s.waiting), running=len(s.running),
                              pages_in_use=s.num_pages_in_use, pages_usable=s.pool.num_usable,
                              live_requests=len(self._live), preemptions=s.num_preemptions,
                              cached_pages=s.pool.num_cached)

    def _publish(self) -> None:
        snap = self.snapshot = self._make_snapshot()
        with self._lock:
            self._num_waiting = snap.waiting
        self.metrics.queue_depth.set(snap.waiting + self._pending_adds)
        self.metrics.running.set(snap.running)
        self.metrics.kv_pages_in_use.set(snap.pages_in_use)
        self.metrics.prefix_cache_pages.set(snap.cached_pages)
        queries, hits = self.scheduler.prefix_queries, self.scheduler.prefix_hits
        self.metrics.prefix_cache_queries.inc(queries - self._prefix_seen[0])
        self.metrics.prefix_cache_hits.inc(hits - self._prefix_seen[1])
        self._prefix_seen = (queries, hits)
        compiles = compile_count() - self._compile_base
        if compiles > self._compiles_seen:
            self.metrics.compilations.inc(compiles - self._compiles_seen)
            self._compiles_seen = compiles


def runner_cache_identity(runner: ModelRunner, model_tag: str = "") -> bytes:
    """The prefix cache's key root for ``runner``: its model config, the dtypes of its cache
    leaves (KV, index-K), its DCP world size and ``model_tag``."""
    dtypes = tuple(str(x.dtype) for x in jax.tree_util.tree_leaves(runner.caches))
    return cache_identity(runner.mconfig, dtypes, runner.rconfig.dcp_world_size, model_tag)


def _deliver(items) -> None:
    for stream, item in items:
        stream._queue.put_nowait(item)

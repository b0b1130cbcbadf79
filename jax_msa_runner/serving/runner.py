"""The model runner: compiled steps per bucket, warm-up through dummy batches, serving.

A step takes ONE int32 host buffer per call (``[packed metadata | token ids | per-row
sampling parameters]``, floats bitcast; layout in ``sampling``), stages the
``BatchMetadata`` on the device with ``stage_packed`` inside the compiled step, runs the
model (writing the caches in place: the cache pytree is donated), and samples one token per
request row on the device. A step is two executables per bucket, launched back to back:
``forward_step`` (staging and the model) and ``sampling_step``, whose extra inputs (logit
biases, token masks of structured outputs) the host prepares while the device runs the
forward; steps without biases or masks pass device-resident neutral extras. The sampling
(``sampling.sample_step``): penalties from the donated per-slot penalty state, greedy or
temperature / top-k / top-p / min-p with key ``fold_in(key(seed), output_index)``, the
model's logprobs of the chosen and the top-20 tokens. Its one int32 output array comes back
in one copy.

Asynchronous scheduling (``launch_step`` / ``finish_step``): ``launch_step`` enqueues a
step and returns a ``StepHandle`` without waiting for it; a row whose last token is the
scheduler's ``PLACEHOLDER`` takes it from the previous step's on-device output (``prev``): a
small ``patch_tokens`` executable (compiled at warm-up for every pair of bucket and previous
bucket when ``async_scheduling``) writes those tokens into the step's device buffer before
the forward, so the host never reads them first. ``finish_step`` copies the step's output
to the host (the one blocking point). ``execute_step`` is the two back to back.

Start-up (``warm_up``) compiles every bucket ahead of time on the inputs of a
``stage_dummy_batch`` dummy batch and runs it (the analogue of CUDA-graph capture), then
runs a profiling pass at the largest bucket (mixed dummy batch, every row at
max_model_len) and reports peak memory. Serving calls only those compiled executables, so
it cannot compile; ``compile_count.CompileCounter`` (a ``jax.monitoring`` listener on XLA backend
compiles, process-wide) proves it.

Where the arrays live (one device, or a decode-context-parallel mesh with per-rank caches
of ``num_pages`` pages each) is ``attention.parallel``'s business; the runner passes its
``mesh`` (None on one device) through. The model runs once per rank; sampling runs on its
replicated logits, with the penalty state replicated.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jax_msa_runner.attention.layer import check_attention_impl, default_attention_impl
from jax_msa_runner.attention.paged_cache import KVCaches
from jax_msa_runner.attention.parallel import (init_caches, per_rank_step, place_params,
                                               replicate, step_mesh)
from jax_msa_runner.batch.buckets import Bucket, make_buckets, select_bucket
from jax_msa_runner.batch.metadata import BatchMetadata
from jax_msa_runner.batch.staging import (dummy_host_batch, pack_host_batch, packed_size,
                                          stage_packed)
from jax_msa_runner.batch.validate import validate_metadata
from jax_msa_runner.config import ModelConfig, RunnerConfig, xla_compile_options
from jax_msa_runner.model import compute_logits, forward, init_params
from jax_msa_runner.serving.compile_count import CompileCounter
from jax_msa_runner.serving.memory_report import MemoryReport, memory_report
from jax_msa_runner.serving.sampling import (PenaltyState, SamplingExtras, SamplingRows,
                                             StepOutput, bias_arrays, init_penalty_state,
                                             neutral_extras, next_prompt_tokens, pack_rows,
                                             prompt_logprobs, rows_buffer_size, sample_step,
                                             step_output_width, unpack_rows,
                                             unpack_step_output)
from jax_msa_runner.serving.scheduler import PLACEHOLDER, ScheduledBatch, Scheduler

# ---- the step --------------------------------------------------------------------------------

def host_buffer_size(bucket: Bucket) -> int:
    """int32 entries of a step's host buffer: packed metadata + T tokens + the rows' sampling."""
    return packed_size(bucket) + bucket.num_tokens + rows_buffer_size(bucket.num_reqs)


def pack_step_inputs(packed: np.ndarray, token_ids: np.ndarray, rows: SamplingRows,
                     bucket: Bucket) -> np.ndarray:
    """One int32 buffer [host_buffer_size(bucket)] (tokens zero-padded, rows padded neutral)."""
    T = bucket.num_tokens
    tokens = np.zeros((T,), np.int32)
    tokens[:len(token_ids)] = token_ids
    return np.concatenate([packed.astype(np.int32), tokens, pack_rows(rows, bucket.num_reqs)])


def _model_body(params: dict, caches: KVCaches, host_buf: jax.Array, *, bucket: Bucket,
                rconfig: RunnerConfig, mconfig: ModelConfig, attention_impl: str,
                interpret: bool, attention_mode: str, all_token_logits: bool
                ) -> tuple[jax.Array, tuple[jax.Array, jax.Array], KVCaches, BatchMetadata]:
    """The model on one device or one DCP rank (caches: the rank's own, leaves [N, ...]).

    Returns (logits f32 [R, V] of each row's last token, (the step's logits: the same, or
    [T, V] of every token with all_token_logits; the prompt logprobs int32 [T, 2 + 2K],
    computed only when a row asks, else zeros), caches, metadata): the tuple
    ``per_rank_step`` expects; ``serve_step`` samples from the first.
    """
    T = bucket.num_tokens
    o = packed_size(bucket)
    md = stage_packed(host_buf[:o], bucket, rconfig)
    tokens = host_buf[o:o + T]
    rows = unpack_rows(host_buf[o + T:], bucket.num_reqs)
    hidden, caches = forward(params, caches, tokens, md, config=mconfig,
                             attention_impl=attention_impl, attention_mode=attention_mode,
                             dcp_world_size=rconfig.dcp_world_size, interpret=interpret,
                             tp_size=rconfig.tp_size, ep_size=rconfig.ep_size)
    lm_head = functools.partial(compute_logits, params, config=mconfig,
                                tp_size=rconfig.tp_size)
    K = step_output_width(mconfig.vocab_size) // 2 - 1
    wanted = jnp.any(md.req_mask & (rows.prompt_logprobs > 0))
    prompt = jax.lax.cond(
        wanted, lambda h: prompt_logprobs(lm_head, h, next_prompt_tokens(tokens, md, rows), K),
        lambda h: jnp.zeros((T, 2 + 2 * K), jnp.int32), hidden)
    last = jnp.clip(md.query_start_loc[1:] - 1, 0, T - 1)  # last token of each row
    if all_token_logits:
        logits = lm_head(hidden)
        return logits[last], (logits, prompt), caches, md
    logits = lm_head(hidden[last])
    return logits, (logits, prompt), caches, md


def forward_step(params: dict, caches: KVCaches, host_buf: jax.Array, *, bucket: Bucket,
                 rconfig: RunnerConfig, mconfig: ModelConfig, attention_impl: str,
                 interpret: bool = False, mesh: Mesh | None = None, attention_mode: str = "msa",
                 all_token_logits: bool = False
                 ) -> tuple[jax.Array, jax.Array, KVCaches, BatchMetadata]:
    """The model half of one serving step for ``bucket`` (static). host_buf int32
    [host_buffer_size(bucket)].

    attention_mode (static): "msa" (what the runner serves) or "dense" (every MSA layer on
    dense paged attention over the same caches: the baseline of ``bench/serving.py``).
    Without DCP (rconfig.dcp_world_size == 1, mesh None) caches are leaves [N, ...]. With
    DCP, mesh is the "dcp" mesh of W devices and caches are per-rank stacks [W, N_local, ...]
    sharded over it; the model runs in one shard_map (params, host_buf replicated).
    Returns (logits f32 [R, V] of each row's last token, (the step's logits (with
    all_token_logits (static): [T, V] of every token), the prompt logprobs int32 [T, 2 + 2K]
    of ``sampling.prompt_logprobs``, zeros unless a row asks), updated caches, the staged
    metadata).
    """
    body = functools.partial(_model_body, bucket=bucket, rconfig=rconfig, mconfig=mconfig,
                             attention_impl=attention_impl, interpret=interpret,
                             attention_mode=attention_mode, all_token_logits=all_token_logits)
    return per_rank_step(body, rconfig, mesh)(params, caches, host_buf)


def sampling_step(row_logits: jax.Array, md: BatchMetadata, penalties: PenaltyState,
                  host_buf: jax.Array, extras: SamplingExtras, *, bucket: Bucket
                  ) -> tuple[jax.Array, PenaltyState]:
    """The sampling half of one serving step (``sampling.sample_step`` on the rows of
    ``host_buf``): (the step output int32 [R, 2 + 2K], token -1 on padded rows; the updated
    penalties). A separate executable, so the host can compute token masks while the device
    runs :func:`forward_step`."""
    o = packed_size(bucket) + bucket.num_tokens
    rows = unpack_rows(host_buf[o:], bucket.num_reqs)
    return sample_step(row_logits, rows, md, host_buf[o - bucket.num_tokens:o], penalties,
                       extras)


def serve_step(params: dict, caches: KVCaches, penalties: PenaltyState, host_buf: jax.Array, *,
               bucket: Bucket, rconfig: RunnerConfig, mconfig: ModelConfig, attention_impl: str,
               interpret: bool = False, mesh: Mesh | None = None, attention_mode: str = "msa",
               all_token_logits: bool = False, extras: SamplingExtras | None = None
               ) -> tuple[jax.Array, jax.Array, KVCaches, PenaltyState, BatchMetadata]:
    """:func:`forward_step` then :func:`sampling_step` in one function (benchmarks; the
    runner launches the two separately). ``extras`` None: no biases or masks.
    Returns (step output, logits, caches, penalties, metadata)."""
    row_logits, (logits, _), caches, md = forward_step(
        params, caches, host_buf, bucket=bucket, rconfig=rconfig, mconfig=mconfig,
        attention_impl=attention_impl, interpret=interpret, mesh=mesh,
        attention_mode=attention_mode, all_token_logits=all_token_logits)
    if extras is None:
        extras = SamplingExtras(*map(jnp.asarray, neutral_extras(bucket.num_reqs,
                                                                 mconfig.vocab_size)))
    out, penalties = sampling_step(row_logits, md, penalties, host_buf, extras, bucket=bucket)
    return out, logits, caches, penalties, md


def patch_tokens(buf: jax.Array, prev_out: jax.Array, idx: jax.Array) -> jax.Array:
    """``buf`` int32 [B] with ``buf[idx[0, r]] = prev_out[idx[1, r], 0]`` (the previous
    step's sampled token of row idx[1, r]); idx int32 [2, R], idx[0, r] >= B: nothing."""
    return buf.at[idx[0]].set(prev_out[idx[1], 0], mode="drop")


_patch_jit = jax.jit(patch_tokens)

_forward_jit = jax.jit(forward_step, static_argnames=("bucket", "rconfig", "mconfig",
                                                      "attention_impl", "interpret", "mesh",
                                                      "attention_mode", "all_token_logits"),
                       donate_argnames=("caches",))
_sampling_jit = jax.jit(sampling_step, static_argnames=("bucket",),
                        donate_argnames=("penalties",))


# ---- the runner ------------------------------------------------------------------------------

@dataclasses.dataclass
class WarmupReport:
    buckets: tuple[Bucket, ...]
    compile_seconds: float
    compilations: int
    profile_bucket: Bucket
    profile_seconds: float
    peak_bytes: int | None  # device allocator peak (GPU), None where the backend has no stats
    step_temp_bytes: int | None  # XLA's temp allocation of the largest bucket's step
    cache_bytes: int  # all layers' caches, summed over the DCP ranks
    param_bytes: int


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


@dataclasses.dataclass
class StepHandle:
    """A launched step (``ModelRunner.launch_step``): its batch, bucket, device outputs and
    the row of every request (``row_of``), which the next step's placeholders read."""

    step_id: int
    batch: ScheduledBatch
    bucket: Bucket
    out: jax.Array
    prompt: jax.Array
    md: BatchMetadata
    row_of: dict[int, int]


class ModelRunner:
    """Holds params, caches and one compiled executable per bucket.

    num_pages: KV pages of the cache (per rank under DCP). With rconfig.dcp_world_size W > 1
    the runner serves over the first W devices (``mesh``); raises DCPError when fewer exist.
    With rconfig.tp_size N or ep_size M > 1 it serves over W * N * M devices on the
    ("dcp", "tensor", "expert") mesh, params and caches sharded (``attention.parallel``);
    ConfigError when the model's heads / sizes / experts do not divide or devices are short.
    interpret: Pallas interpret mode; default True exactly for attention_impl "pallas" off
    the GPU. ``last_logits`` holds the latest step's logits f32 [R_bucket, V] (on device;
    with all_token_logits, [T_bucket, V]: one row per token of the step);
    ``penalties`` the per-slot penalty state (max_num_seqs + 1 slots, on device);
    ``last_launch`` / ``last_ready`` the perf_counter times just before the latest step's
    executable was called and when its output had reached the host.
    async_scheduling: warm-up also compiles the ``patch_tokens`` executables that feed a
    step the previous step's on-device tokens (``launch_step(prev=...)``). ``events``: the
    latest ("launch" | "read", step id) pairs, in order (tests check the overlap).
    """

    def __init__(self, mconfig: ModelConfig, rconfig: RunnerConfig, *, num_pages: int,
                 params: dict | None = None, seed: int = 0, attention_impl: str | None = None,
                 debug: bool = False, interpret: bool | None = None,
                 all_token_logits: bool = False, async_scheduling: bool = False):
        self.attention_impl = attention_impl or default_attention_impl()
        check_attention_impl(self.attention_impl)
        self.interpret = (self.attention_impl == "pallas" and jax.default_backend() != "gpu"
                          if interpret is None else bool(interpret))
        self.mesh = step_mesh(rconfig, mconfig)  # DCPError / ConfigError: too few devices
        self.mconfig, self.rconfig, self.debug = mconfig, rconfig, debug
        self.all_token_logits = all_token_logits
        self.buckets = make_buckets(rconfig)
        self.params = place_params(params if params is not None else init_params(mconfig, seed),
                                   self.mesh)
        self.caches = init_caches(mconfig, num_pages, self.mesh)
        self.penalties = replicate(init_penalty_state(rconfig.max_num_seqs, mconfig.vocab_size),
                                   self.mesh)
        self.num_pages = num_pages
        self.last_logits: jax.Array | None = None
        self.last_launch = self.last_ready = 0.0
        self._compiled: dict[Bucket, tuple[Callable, Callable]] = {}  # (forward, sampling)
        self._neutral: dict[Bucket, SamplingExtras] = {}
        self.validated_steps = 0
        self.async_scheduling = bool(async_scheduling)
        self._patches: dict[tuple[Bucket, int], Callable] = {}  # (bucket, previous R) -> exe
        self._step_ids = itertools.count()
        self.events: collections.deque = collections.deque(maxlen=4096)

    # ---- start-up ------------------------------------------------------------------------
    def _dummy_buffer(self, bucket: Bucket, kind: str, profile_seq_len: int | None) -> np.ndarray:
        """Host buffer of the ``kind`` dummy batch of ``bucket.num_tokens`` tokens."""
        host = dummy_host_batch(bucket.num_tokens, self.rconfig, kind=kind,
                                profile_seq_len=profile_seq_len)
        packed = pack_host_batch(host.num_scheduled, host.num_computed, host.block_table, bucket,
                                 self.rconfig)
        return pack_step_inputs(packed, np.zeros(int(host.num_scheduled.sum()), np.int32),
                                SamplingRows.neutral(host.num_scheduled.size), bucket)

    def _put(self, buf: np.ndarray) -> jax.Array:
        """The host buffer on the device (replicated over the mesh under DCP)."""
        return replicate(buf, self.mesh)

    def _neutral_extras(self, bucket: Bucket) -> SamplingExtras:
        """The bucket's device-resident extras without biases or masks (made once)."""
        if bucket not in self._neutral:
            host = neutral_extras(bucket.num_reqs, self.mconfig.vocab_size)
            self._neutral[bucket] = SamplingExtras(*map(self._put, host))
        return self._neutral[bucket]

    def _extras(self, bucket: Bucket, biases, masks: np.ndarray | None) -> SamplingExtras:
        """This step's extras: the neutral device arrays where no row has a bias or a mask,
        else host arrays of the bucket's shape (rows past the batch neutral)."""
        extras = self._neutral_extras(bucket)
        if any(biases):
            ids, vals = bias_arrays(biases, bucket.num_reqs)
            extras = extras._replace(bias_ids=self._put(ids), bias_values=self._put(vals))
        if masks is not None:
            full = np.full((bucket.num_reqs, masks.shape[1]), -1, np.int32)
            full[:masks.shape[0]] = masks
            extras = extras._replace(token_mask=self._put(full))
        return extras

    def _run(self, bucket: Bucket, buf: np.ndarray, biases=(), token_masks=None, feed=None):
        """Launch the bucket's forward, then (while the device runs it) ``token_masks()``
        on the host, then the sampling; returns (step output, metadata) on the device.
        feed: None, or (previous step output on the device, its bucket's R, idx int32
        [2, R]) for ``patch_tokens``."""
        dev_buf = self._put(buf)
        if feed is not None:
            prev_out, prev_r, idx = feed
            dev_buf = self._patches[(bucket, prev_r)](dev_buf, prev_out, self._put(idx))
        forward, sampling = self._compiled[bucket]
        self.last_launch = time.perf_counter()
        row_logits, (self.last_logits, prompt), self.caches, md = forward(
            self.params, self.caches, dev_buf)
        masks = token_masks() if token_masks is not None else None
        out, self.penalties = sampling(row_logits, md, self.penalties, dev_buf,
                                       self._extras(bucket, biases, masks))
        return out, prompt, md

    def compile_bucket(self, bucket: Bucket, command_buffers: str) -> tuple[Callable, Callable]:
        """(forward, sampling) executables of ``bucket`` compiled with the XLA command
        buffers ``command_buffers`` (a key of ``config.COMMAND_BUFFERS``); runs nothing.
        ``warm_up`` compiles with ``rconfig.command_buffers``; a profiler may compile a
        bucket again with "off" to see its kernels one by one."""
        buf = self._put(self._dummy_buffer(bucket, "default", None))
        options = xla_compile_options(command_buffers)
        forward = _forward_jit.lower(self.params, self.caches, buf, bucket=bucket,
                                     rconfig=self.rconfig, mconfig=self.mconfig,
                                     attention_impl=self.attention_impl,
                                     interpret=self.interpret, mesh=self.mesh,
                                     all_token_logits=self.all_token_logits
                                     ).compile(compiler_options=options)
        row_logits, _, _, md = forward.out_info
        sampling = _sampling_jit.lower(row_logits, md, self.penalties, buf,
                                       self._neutral_extras(bucket), bucket=bucket
                                       ).compile(compiler_options=options)
        return forward, sampling

    def warm_up(self) -> WarmupReport:
        """Compile every bucket on its dummy batch and run it; then the profiling pass."""
        t0 = time.perf_counter()
        outs: dict[int, jax.Array] = {}  # a sampling output per R (the patches' inputs)
        with CompileCounter() as cc:
            for bucket in self.buckets:
                forward, sampling = self.compile_bucket(bucket, self.rconfig.command_buffers)
                self._compiled[bucket] = (forward, sampling)
                # the "capture" run on the bucket's dummy batch
                buf = self._put(self._dummy_buffer(bucket, "default", None))
                row_logits, _, self.caches, md = forward(self.params, self.caches, buf)
                nxt, self.penalties = sampling(row_logits, md, self.penalties, buf,
                                               self._neutral_extras(bucket))
                if self.debug:
                    validate_metadata(md, self.rconfig)
                jax.block_until_ready(nxt)
                outs[bucket.num_reqs] = nxt
            if self.async_scheduling:
                for bucket in self.buckets:
                    buf = self._put(self._dummy_buffer(bucket, "default", None))
                    for r, prev in outs.items():
                        idx = self._put(np.zeros((2, bucket.num_reqs), np.int32))
                        exe = _patch_jit.lower(buf, prev, idx).compile()
                        jax.block_until_ready(exe(buf, prev, idx))
                        self._patches[(bucket, r)] = exe
        compile_s = time.perf_counter() - t0
        big = self.buckets[-1]
        buf = self._dummy_buffer(big, "mixed", self.rconfig.max_model_len)
        t1 = time.perf_counter()
        nxt, _, md = self._run(big, buf)
        jax.block_until_ready(nxt)
        profile_s = time.perf_counter() - t1
        validate_metadata(md, self.rconfig)
        stats = jax.local_devices()[0].memory_stats() or {}
        mem = self._compiled[big][0].memory_analysis()
        return WarmupReport(
            buckets=self.buckets, compile_seconds=compile_s, compilations=cc.count,
            profile_bucket=big, profile_seconds=profile_s,
            peak_bytes=stats.get("peak_bytes_in_use"),
            step_temp_bytes=getattr(mem, "temp_size_in_bytes", None) if mem is not None else None,
            cache_bytes=_nbytes(self.caches), param_bytes=_nbytes(self.params))

    def memory_report(self, rep: WarmupReport | None = None) -> MemoryReport:
        """Weights by dtype, the caches and the KV pages that fit on the busiest device
        (``rep``: the warm-up's step temp)."""
        stats = jax.local_devices()[0].memory_stats() or {}
        return memory_report(self.params, self.caches, self.num_pages,
                             step_temp_bytes=rep.step_temp_bytes if rep is not None else None,
                             device_limit_bytes=stats.get("bytes_limit"))

    # ---- serving -------------------------------------------------------------------------
    def execute(self, batch: ScheduledBatch) -> np.ndarray:
        """Run one scheduled batch; returns the sampled token of every row (int32 [n])."""
        return self.execute_step(batch).tokens

    def execute_step(self, batch: ScheduledBatch, token_masks: Callable[[], np.ndarray | None]
                     | None = None) -> StepOutput:
        """Run one scheduled batch; returns every row's token and logprobs (n rows).

        token_masks: called on the host while the device runs the model; returns None or the
        rows' token bitmasks int32 [n, ceil(V / 32)] (``sampling`` module docstring; all ones
        for an unconstrained row). Raises ValueError when a row's slot is outside [0,
        max_num_seqs) or a token id outside [0, vocab_size).
        """
        return self.finish_step(self.launch_step(batch, token_masks))

    def launch_step(self, batch: ScheduledBatch, token_masks: Callable[[], np.ndarray | None]
                    | None = None, prev: StepHandle | None = None) -> StepHandle:
        """Enqueue one scheduled batch on the device and return at once (``execute_step``'s
        checks and ``token_masks``). A row may end with a ``PLACEHOLDER`` token when
        ``prev`` (the previous step, launched and not necessarily read) sampled that
        request's token: the device takes it from ``prev``'s output. Any other placeholder
        raises ValueError."""
        if not self._compiled:
            raise RuntimeError("ModelRunner.execute before warm_up(): buckets are not compiled")
        S, V = self.rconfig.max_num_seqs, self.mconfig.vocab_size
        slots = np.asarray(batch.sampling.slot)
        for i in np.flatnonzero((slots < 0) | (slots >= S))[:1]:
            raise ValueError(f"sampling.slot[{i}] = {slots[i]}: must be in [0, max_num_seqs={S})")
        tokens = np.array(batch.token_ids, np.int32)
        bucket = select_bucket(batch.num_tokens, batch.num_reqs, self.rconfig)
        feeds = []  # (flat token index, row of prev)
        holes = np.flatnonzero(tokens == PLACEHOLDER)
        if holes.size:
            ends = np.cumsum(batch.num_scheduled) - 1
            for row in np.flatnonzero(tokens[ends] == PLACEHOLDER):
                rid = batch.requests[row].request_id
                src = None if prev is None else prev.row_of.get(rid)
                if src is None or not prev.batch.sample[src]:
                    raise ValueError(f"token_ids[{ends[row]}]: a placeholder of request {rid} "
                                     f"that the previous step did not sample")
                feeds.append((int(ends[row]), src))
            if len(feeds) != holes.size:
                raise ValueError(f"token_ids: placeholders {holes.tolist()} must each be the last "
                                 f"token of a row")
            if (bucket, prev.bucket.num_reqs) not in self._patches:
                raise RuntimeError("ModelRunner.launch_step: placeholders need "
                                   "async_scheduling=True at warm-up")
            tokens[holes] = 0
        for i in np.flatnonzero((tokens < 0) | (tokens >= V))[:1]:
            raise ValueError(f"token_ids[{i}] = {tokens[i]}: must be in [0, vocab_size={V})")
        packed = pack_host_batch(batch.num_scheduled, batch.num_computed, batch.block_table, bucket,
                                 self.rconfig)
        buf = pack_step_inputs(packed, tokens, batch.sampling, bucket)
        feed = None
        if feeds:
            idx = np.zeros((2, bucket.num_reqs), np.int32)
            idx[0] = buf.size  # out of range: dropped
            base = packed_size(bucket)
            for j, (t, src) in enumerate(feeds):
                idx[:, j] = (base + t, src)
            feed = (prev.out, prev.bucket.num_reqs, idx)
        biases = [r.sampling.logit_bias for r in batch.requests]
        out, prompt, md = self._run(bucket, buf, biases, token_masks, feed)
        handle = StepHandle(next(self._step_ids), batch, bucket, out, prompt, md,
                            {r.request_id: i for i, r in enumerate(batch.requests)})
        self.events.append(("launch", handle.step_id))
        return handle

    def finish_step(self, handle: StepHandle) -> StepOutput:
        """Wait for a launched step and bring its output to the host."""
        batch = handle.batch
        result = unpack_step_output(np.asarray(handle.out), batch.num_reqs)
        self.events.append(("read", handle.step_id))
        if any(r.prompt_logprobs for r in batch.requests):
            result = result._replace(prompt=unpack_step_output(np.asarray(handle.prompt),
                                                               int(batch.num_tokens)))
        self.last_ready = time.perf_counter()
        if self.debug:
            validate_metadata(handle.md, self.rconfig)
            self.validated_steps += 1
        return result


@dataclasses.dataclass
class ServeStats:
    steps: int
    step_seconds: list[float]
    prompt_tokens: int
    output_tokens: int
    wall_seconds: float
    compilations: int
    preemptions: int


def serve(runner: ModelRunner, scheduler: Scheduler,
          on_step: Callable[[Scheduler, int], None] | None = None,
          max_steps: int | None = None) -> ServeStats:
    """Run scheduler + runner until every request finished (or ``max_steps``); with
    ``runner.debug`` the pages' ref counts are checked against the block tables every step."""
    times: list[float] = []
    prompt = sum(len(r.prompt) for r in list(scheduler.waiting) + scheduler.running)
    t0 = time.perf_counter()
    with CompileCounter() as cc:
        while scheduler.has_unfinished() and (max_steps is None or len(times) < max_steps):
            ts = time.perf_counter()
            batch = scheduler.schedule()
            tokens = runner.execute(batch)
            scheduler.update(batch, tokens)
            if runner.debug:
                scheduler.check_pages()
            times.append(time.perf_counter() - ts)
            if on_step is not None:
                on_step(scheduler, len(times))
    wall = time.perf_counter() - t0
    out = sum(len(r.output) for r in scheduler.finished.values())
    return ServeStats(steps=len(times), step_seconds=times, prompt_tokens=prompt,
                      output_tokens=out, wall_seconds=wall, compilations=cc.count,
                      preemptions=scheduler.num_preemptions)

"""What every bench script shares. Import it first: ``import _common``.

- Preamble: puts the repository root on ``sys.path`` (the scripts run by path, e.g.
  ``python3 bench/kernels.py``) and filters the one known warning (the Pallas Triton
  backend's deprecation), nothing else.
- ``time_jax``: the one timer of our JAX ops, in two L2 modes named in every output:
  ``"cold"``: ONE jitted executable runs ``k`` calls (``CALLS_PER_DISPATCH``, at most ``n``),
  each (512 MiB flush; optimization_barrier; op), as a while loop of known trip count. On a
  GPU it reads the GPU's global timer (``_gpu_clock``) before the loop and after it, so a
  dispatch yields the device time of its ``k`` calls, as CUDA events do on the torch side; it
  is dispatched ``n / k`` times, then the executable of ``k`` flushes alone as often, and a
  sample is the difference of the summed device times over ``n``. The barrier ties each
  iteration's op inputs to its flush, so XLA cannot hoist the op out of the loop; the
  compiled loop body is checked to launch the flush first (``check_flush_first``), so every
  op runs right after a flush. Both executables are compiled with XLA's command buffers off
  (``NO_COMMAND_BUFFERS``, the default ``compiler_options``), so each op's kernels are
  launched on the stream as the op alone compiles: XLA turns a run of 5 or more kernels into
  a CUDA graph (``xla_gpu_graph_min_graph_size``), and the timer's own scalar kernel made
  the indexer's loop body 5 long, a graph in which it lost its programmatic dependent
  launches (bench/RESULTS.md, 2026-12-02). Without the GPU timer (``clock=False``, and on a CPU) the
  sample is wall time of the loops of dispatches instead, each loop behind a pre-roll of
  ``PREROLL_FLUSHES`` flush-only calls so the device is busy when its clock starts.
  ``"warm"``: the op's executable dispatched ``n`` times back to back, no flush: inputs that fit
  may stay in L2; wall time over ``n``, device time only where the op outlasts its dispatch
  (``gpu_bound``).
- ``no_gc``: the garbage collector off inside every timed loop of async dispatches (ours here,
  vLLM's in ``_vllm_timing``), so no collection pause drains the device queue mid-sample.
- ``host_latency_s``: wall time of whole host-driven calls (a serving step, host packing),
  for the scripts that time end-to-end latency rather than device work.
- Arguments (``add_common_args``, ``positive_int``), ``write_json`` (adds date, device,
  jax version), ``copy_bandwidth`` (the roofline), ``matmul_peak`` (the measured bf16 GEMM
  rate), ``hlo_kernel_count``, ``rel_l2``.
- Profiles: ``profile_op_events`` (the XLA op events of ``jax.profiler.trace`` around a
  callable, from its ``*.trace.json.gz``) and ``hlo_ops`` (each HLO instruction's opcode and
  ``op_name`` metadata, which carries the ``jax.named_scope`` path).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from typing import Mapping

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated",
                        category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402
from jax_msa_runner.config import COMMAND_BUFFERS  # noqa: E402
from jax_msa_runner.cli.flags import bounded_int  # noqa: E402

from _gpu_clock import clock_ns, read_clock  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
# Pallas keyword for this backend: compiled on a GPU, interpret mode elsewhere (CPU smoke runs).
PALLAS_KW: dict = {} if ON_GPU else {"interpret": True}

L2_MODES = ("cold", "warm")
# The cold-L2 flush: 10x the H200's 50 MiB L2 (about 255 us of device time).
FLUSH_BYTES = 512 << 20
# Cold calls per executable (a dispatch): their flushes outlast the host's dispatch of the
# executable (190-520 us measured per dispatch on the H200 host) about five times over.
CALLS_PER_DISPATCH = 10
# XLA options of the cold executables (``time_jax(compiler_options=)``): command buffers (CUDA
# graphs) off, the default; or XLA's own defaults.
NO_COMMAND_BUFFERS = COMMAND_BUFFERS["off"]
XLA_COMMAND_BUFFERS = COMMAND_BUFFERS["xla"]
# Flush-only dispatches (each of k flushes) before each cold wall-clock loop: at least 1 ms of
# device work, longer than the host's dispatch of the loop's first call, so the device never
# waits for it.
PREROLL_FLUSHES = 4


def timer_description(l2: str, n: int, calls_per_dispatch: int = CALLS_PER_DISPATCH,
                      clock: bool | None = None) -> str:
    """One line naming how ``time_jax`` measured (for JSON and printed tables)."""
    _check_l2(l2)
    if l2 == "cold":
        k = _calls(n, calls_per_dispatch)
        clock = ON_GPU if clock is None else clock
        how = ("the GPU's global timer read before and after the loop inside the executable"
               if clock else f"wall clock, each loop behind {PREROLL_FLUSHES} dispatches of "
               f"the flush-only executable before its clock starts")
        return (f"cold L2: one XLA executable looping {k} x ({FLUSH_BYTES >> 20} MiB flush; "
                f"optimization_barrier; op), dispatched {n // k} x ({n} calls), minus the "
                f"executable of {k} flushes as often, per call; {how}")
    return (f"warm L2: the op's executable dispatched {n} x back to back (no flush), "
            f"wall time per call")


def _check_l2(l2: str) -> None:
    if l2 not in L2_MODES:
        raise ValueError(f"l2: must be one of {L2_MODES}, got {l2!r}")


def _calls(n: int, calls_per_dispatch: int) -> int:
    """Cold calls per dispatch for a loop of ``n`` calls: ``min(calls_per_dispatch, n)``,
    which must divide ``n``."""
    if calls_per_dispatch < 1:
        raise ValueError(f"calls_per_dispatch must be >= 1, got {calls_per_dispatch}")
    k = min(calls_per_dispatch, n)
    if n % k:
        raise ValueError(f"n = {n} must be a multiple of calls_per_dispatch = {k}")
    return k


@dataclasses.dataclass(frozen=True)
class Timing:
    """``time_jax``'s result: seconds per call, one sample per trial, and the checks."""
    l2: str
    samples_s: list
    host_us_per_dispatch: float  # host time to dispatch one executable (median over trials)
    flush_us: float | None  # cold: time per dispatch of the flush-only loop (k flushes)
    calls_per_dispatch: int = 1  # op calls per executable (cold: k; warm: 1)
    clock: bool = False  # cold: samples from the GPU's timer (else the host's wall clock)

    @property
    def us(self) -> float:
        return median_us(self.samples_s)

    @property
    def gpu_bound(self) -> bool:
        """The samples are device time: read from the GPU's timer (cold, ``clock``), or the
        host dispatched each executable faster than the device ran it (its flushes, when cold;
        the op itself, when warm)."""
        if self.clock:
            return True
        return self.host_us_per_dispatch < (self.flush_us if self.l2 == "cold" else self.us)

    def as_dict(self) -> dict:
        return {"l2": self.l2, "us": round(self.us, 3),
                "samples_us": [round(v * 1e6, 3) for v in self.samples_s],
                "host_us_per_dispatch": round(self.host_us_per_dispatch, 2),
                "flush_us": None if self.flush_us is None else round(self.flush_us, 2),
                "calls_per_dispatch": self.calls_per_dispatch, "gpu_clock": self.clock,
                "gpu_bound": self.gpu_bound}


def _flush(buf: jax.Array, after=0.0) -> jax.Array:
    """Rewrites the whole flush buffer (read + write): evicts the L2. The dirty lines it leaves
    are written back during the timed op (extra DRAM traffic, paid by every side alike). A
    read-only pass left part of the previous inputs in L2 on the H200: not a cold L2.
    ``after``: a zero scalar the flush adds, to order it after the kernel that wrote it."""
    return buf + (1.0 + after)


@functools.lru_cache(maxsize=64)
def _executable(fn, l2: str, calls: int = 1, clock: bool = False):
    """warm: jit of fn. cold: jit of ``(buf, args) -> (buf, out, stamps)`` running ``calls``
    x (flush; optimization_barrier; fn) as a loop (fn None: the flushes alone), buf donated.
    ``clock``: ``stamps`` = the GPU timer read before the loop (after fn's initial outputs are
    written; the loop's flushes read it) and after it (after its last outputs), else None.
    Cached per (fn, l2, calls, clock): pass the same function object to reuse it."""
    if l2 == "warm":
        return jax.jit(fn)

    def timed(buf, args):
        out = None if fn is None else jax.tree.map(
            lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *args))
        t0 = read_clock(buf, out) if clock else None
        after = 0.0 if t0 is None else 0.0 * t0[0].astype(jnp.float32)

        def body(_, carry):
            b, o = carry
            b, a = jax.lax.optimization_barrier((_flush(b, after), args))
            return b, (o if fn is None else fn(*a))
        buf, out = jax.lax.fori_loop(0, calls, body, (buf, out))
        return buf, out, (None if t0 is None else (t0, read_clock(buf, out)))
    return jax.jit(timed, donate_argnums=0)


def cold_loop_body(hlo_text: str) -> tuple[int, str]:
    """(known trip count, body computation text) of the while loop in the optimised HLO of a
    cold executable (``_executable(fn, "cold", k)``, k >= 2): the check that XLA kept the
    calls in a loop and did not hoist the op out of it."""
    entry = hlo_text[hlo_text.index("\nENTRY "):] if "\nENTRY " in hlo_text else ""
    loops = [line for line in entry.splitlines() if " while(" in line]
    loop = loops[-1] if loops else None
    trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', loop or "")
    if loop is None or trip is None:
        raise ValueError("no while loop with a known trip count in the HLO")
    name = re.search(r"body=(%[\w.\-]+)", loop).group(1)
    body = hlo_text[hlo_text.index(f"\n{name} "):]
    return int(trip.group(1)), body[:body.index("\n}")]


def check_flush_first(body_text: str) -> None:
    """Raises ValueError unless the first kernel of a cold loop's body (a scheduled HLO
    computation: fusions and custom calls in launch order, scalar ones such as the loop
    counter aside) is the flush, so each iteration's op runs right after its own flush.
    Fusions without operands (constant fills, e.g. an op's zeroed ticket counters) read
    nothing, so they may come first."""
    for line in body_text.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%[\w.\-]+ = (\S+) (fusion|custom-call)\((\)?)", line)
        if (m is None or re.fullmatch(r"\w+\[\]\S*", m.group(1))
                or (m.group(2) == "fusion" and m.group(3))):
            continue
        if not m.group(1).startswith(f"f32[{FLUSH_BYTES // 4}]"):
            raise ValueError(f"the cold loop's first kernel is not the flush: {line.strip()}")
        return
    raise ValueError("no kernel in the cold loop's body")


@contextlib.contextmanager
def no_gc():
    """Python's garbage collector off inside a timed loop of async dispatches: a collection
    pause there would let the device queue drain and add idle time to the sample."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def time_jax(fn, args: tuple, *, n: int, trials: int, l2: str,
             preroll: int = PREROLL_FLUSHES, calls_per_dispatch: int = CALLS_PER_DISPATCH,
             clock: bool | None = None, compiler_options: Mapping[str, str] = NO_COMMAND_BUFFERS,
             warmup: bool = True) -> Timing:
    """Seconds per call of ``fn(*args)`` (see the module docstring), one sample per trial.

    fn: a jax function of arrays (pytrees allowed); args: its positional arguments.
    n: calls per sample (cold: a multiple of ``min(calls_per_dispatch, n)``).
    l2: "cold" or "warm" (required: every call site names its mode).
    preroll: flush-only calls dispatched before each cold wall-clock loop's clock starts.
    calls_per_dispatch: cold calls looped inside one executable (1: one call per dispatch).
    clock: cold only: time with the GPU's timer read inside each executable (None: on a GPU);
      False: the host's wall clock around the loops of dispatches.
    compiler_options: cold only: XLA options for both executables: ``NO_COMMAND_BUFFERS``
      (no CUDA graphs; the default), ``XLA_COMMAND_BUFFERS`` (XLA's defaults), or others.
    warmup: cold only: one untimed dispatch of each executable before the samples (False: a
      dry run's samples, which make no timing claim, without the extra interpret-mode call).
    """
    _check_l2(l2)
    if n < 1 or trials < 1 or preroll < 0:
        raise ValueError(f"n and trials must be >= 1 and preroll >= 0, got n={n}, "
                         f"trials={trials}, preroll={preroll}")
    if l2 == "warm":
        return _time_warm(fn, args, n=n, trials=trials)
    k = _calls(n, calls_per_dispatch)
    clock = ON_GPU if clock is None else bool(clock)
    buf = jnp.zeros((FLUSH_BYTES // 4,), jnp.float32)
    ex = compiled_cold(fn, k, clock, args, compiler_options)
    fl = compiled_cold(None, k, clock, (), compiler_options)

    def loop(step_args, dispatches, *, before=0) -> tuple[float, float]:
        """(seconds, host dispatch s) of ``dispatches`` async calls; seconds: the stamps'
        device time (clock), else wall time behind ``before`` flush-only calls."""
        nonlocal buf
        step, a = step_args
        with no_gc():
            for _ in range(before):
                buf = fl(buf, ())[0]
            stamps = []
            t0 = time.perf_counter()
            for _ in range(dispatches):
                buf, out, st = step(buf, a)
                stamps.append(st)
            t1 = time.perf_counter()
            jax.block_until_ready((buf, out, stamps))
            wall = time.perf_counter() - t0
        if not clock:
            return wall, t1 - t0
        return sum(clock_ns(b) - clock_ns(s) for s, b in stamps) * 1e-9, t1 - t0

    if warmup:
        loop((ex, args), 1)  # warm-up (each loop blocks on its results)
        loop((fl, ()), 1)
    samples, host, flush_s = [], [], []
    before = 0 if clock else preroll
    for _ in range(trials):
        t_op, h_op = loop((ex, args), n // k, before=before)
        t_fl, _ = loop((fl, ()), n // k, before=before)
        host.append(h_op / (n // k))
        flush_s.append(t_fl / (n // k))
        samples.append(max((t_op - t_fl) / n, 1e-9))
    del buf
    return Timing("cold", samples, median_us(host), median_us(flush_s), k, clock)


_COMPILED: dict = {}


def compiled_cold(fn, calls: int, clock: bool, args: tuple,
                  compiler_options: Mapping[str, str] = NO_COMMAND_BUFFERS):
    """The compiled cold executable of fn (None: the flushes alone) for args' shapes and
    dtypes and the XLA ``compiler_options``, cached; with the GPU timer and a loop, checked
    to launch the flush first."""
    options = tuple(sorted((compiler_options or {}).items()))
    key = (fn, calls, clock, options, jax.tree.structure(args),
           tuple((a.shape, jnp.dtype(a.dtype)) for a in jax.tree.leaves(args)))
    if key not in _COMPILED:
        buf = jax.ShapeDtypeStruct((FLUSH_BYTES // 4,), jnp.float32)
        ex = _executable(fn, "cold", calls, clock).lower(buf, args).compile(
            compiler_options=dict(options) or None)
        if clock and calls > 1 and fn is not None:
            check_flush_first(cold_loop_body(ex.as_text())[1])
        _COMPILED[key] = ex
    return _COMPILED[key]


def _time_warm(fn, args: tuple, *, n: int, trials: int) -> Timing:
    """The warm mode of :func:`time_jax`: wall time of ``n`` dispatches of fn's executable."""
    ex = _executable(fn, "warm")
    jax.block_until_ready(ex(*args))  # compile + warm-up
    samples, host = [], []
    for _ in range(trials):
        with no_gc():
            t0 = time.perf_counter()
            for _ in range(n):
                out = ex(*args)
            t1 = time.perf_counter()
            jax.block_until_ready(out)
            samples.append((time.perf_counter() - t0) / n)
        host.append((t1 - t0) / n)
    return Timing("warm", samples, median_us(host), None)


def host_latency_s(fn, *, repeats: int, warmup: int = 1) -> list[float]:
    """Wall seconds of each of ``repeats`` calls of ``fn()`` after ``warmup`` calls. ``fn``
    must block until its device work is done (e.g. end in ``jax.block_until_ready``); the
    figure includes host work and dispatch: the latency a caller sees, not device time."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


def median_us(samples_s: list[float]) -> float:
    """The median of samples in seconds, in microseconds."""
    return statistics.median(samples_s) * 1e6


# --------------------------------------------------------------------------- roofline

def scale_copy(a: jax.Array) -> jax.Array:
    """The roofline's copy kernel: reads and writes ``a`` once."""
    return a * jnp.asarray(1.0009765625, a.dtype)


def same_traffic_copy_input(nbytes: int) -> jax.Array:
    """A bf16 array whose :func:`scale_copy` moves ``nbytes`` (half read, half written)."""
    return jnp.ones((max(nbytes // 4, 1),), jnp.bfloat16)


def copy_bandwidth(nbytes: int = 2 << 30, *, n: int = 10, trials: int = 3) -> dict:
    """Device copy bandwidth, bytes read + written per second: ``scale_copy`` over
    ``nbytes / 2`` bytes, timed by ``time_jax`` (warm mode: the array is 40x the L2, and one
    copy outlasts its dispatch by far)."""
    x = same_traffic_copy_input(nbytes)
    t = min(time_jax(scale_copy, (x,), n=n, trials=trials, l2="warm").samples_s)
    del x
    return {"copy_Bps": nbytes / t, "bytes": nbytes,
            "method": f"jnp scale copy of {nbytes >> 20} MiB (read + write), "
                      f"{timer_description('warm', n)}, best of {trials}"}


def bf16_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """The peak's matmul: bf16 ``a [n, n] @ b [n, n]`` with f32 accumulation, bf16 out."""
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def matmul_peak(n: int = 8192, *, reps: int = 10, trials: int = 3) -> dict:
    """Measured bf16 matmul throughput, FLOP/s: ``bf16_matmul`` of two random ``[n, n]``
    operands (2 n^3 FLOPs; XLA's library GEMM on a GPU), timed by ``time_jax`` (warm mode: one
    product outlasts its dispatch by far), best of ``trials``."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.float32).astype(jnp.bfloat16)
    t = min(time_jax(bf16_matmul, (a, b), n=reps, trials=trials, l2="warm").samples_s)
    del a, b
    return {"flops_per_s": 2 * n ** 3 / t, "n": n,
            "method": f"bf16 [{n}, {n}] @ [{n}, {n}] (f32 accumulation) by XLA, "
                      f"{timer_description('warm', reps)}, best of {trials}"}


# --------------------------------------------------------------------------- profiles

# lines of a device's trace that XLA's profiler derives from the kernels (counted twice if read)
_DERIVED_LINES = frozenset({"XLA Modules", "XLA Ops", "XLA TraceMe", "TensorFlow Ops",
                            "TensorFlow Name Scope", "Framework Ops", "Framework Name Scope",
                            "Source code", "Steps", "Launch Stats"})


def _trace_files(log_dir: str):
    """Per ``*.trace.json.gz`` file under ``log_dir``: (its trace events, {pid: process
    name})."""
    for path in sorted(glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True)):
        with gzip.open(path, "rt") as f:
            doc = json.load(f)
        evs = doc["traceEvents"] if isinstance(doc, dict) else doc
        yield evs, {e["pid"]: e["args"]["name"] for e in evs
                    if e.get("ph") == "M" and e.get("name") == "process_name"}


def trace_op_events(log_dir: str) -> list[dict]:
    """The XLA op events in the ``*.trace.json.gz`` files under ``log_dir``:
    ``{"module", "op", "us", "device"}`` each (``us``: the event's duration).

    With a device in the trace (a GPU), the events of its streams: kernels and copies, named
    by their ``hlo_op`` / ``hlo_module`` args (None for events without, e.g. memcpys), the
    derived lines (``XLA Ops``, ...) left out. Without one (XLA:CPU), the host threads'
    events that carry ``hlo_op``: the CPU backend's thunks, which may overlap on its threads.
    """
    events, device = [], False
    for evs, pids in _trace_files(log_dir):
        tids = {(e["pid"], e.get("tid")): e["args"]["name"] for e in evs
                if e.get("ph") == "M" and e.get("name") == "thread_name"}
        for e in evs:
            if e.get("ph") != "X":
                continue
            args = e.get("args") or {}
            on_device = str(pids.get(e["pid"], "")).startswith("/device:")
            line = str(tids.get((e["pid"], e.get("tid")), ""))
            if on_device and line in _DERIVED_LINES:
                continue
            if not on_device and "hlo_op" not in args:
                continue
            device |= on_device
            events.append({"module": args.get("hlo_module"), "op": args.get("hlo_op"),
                           "us": float(e.get("dur", 0.0)), "device": on_device,
                           "name": e.get("name")})
    return [e for e in events if e["device"] == device]


def trace_host_events(log_dir: str) -> list[dict]:
    """The host threads' complete events in the ``*.trace.json.gz`` files under ``log_dir``
    (the runtime's TraceMe scopes, driver API calls, Python functions where traced):
    ``{"name", "thread", "ts", "us"}`` each (``ts``, ``us``: start and duration)."""
    events = []
    for evs, pids in _trace_files(log_dir):
        for e in evs:
            if e.get("ph") == "X" and not str(pids.get(e["pid"], "")).startswith("/device:"):
                events.append({"name": str(e.get("name")), "thread": (e["pid"], e.get("tid")),
                               "ts": float(e.get("ts", 0.0)), "us": float(e.get("dur", 0.0))})
    return events


def host_time_by_name(events: list[dict], steps: int, top: int = 12) -> list[dict]:
    """The ``top`` event names of ``trace_host_events`` by self time (an event's duration less
    its children's on the same thread): ``{"name", "calls", "self_ms", "total_ms"}`` per step."""
    stats: dict[str, list[float]] = {}
    by_thread: dict[tuple, list[dict]] = {}
    for e in events:
        by_thread.setdefault(e["thread"], []).append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["us"]))
        stack: list[list] = []  # [end, name, children's time, duration]
        for e in evs + [{"ts": float("inf"), "us": 0.0, "name": None}]:
            while stack and stack[-1][0] <= e["ts"]:
                end, name, child, dur = stack.pop()
                st = stats.setdefault(name, [0, 0.0, 0.0])
                st[0] += 1
                st[1] += dur - child
                st[2] += dur
                if stack:
                    stack[-1][2] += dur
            if e["name"] is not None:
                stack.append([e["ts"] + e["us"], e["name"], 0.0, e["us"]])
    rows = [{"name": k, "calls": v[0] / steps, "self_ms": v[1] / steps / 1e3,
             "total_ms": v[2] / steps / 1e3} for k, v in stats.items()]
    return sorted(rows, key=lambda r: -r["self_ms"])[:top]


def profile_host_events(fn, *, calls: int) -> list[dict]:
    """``trace_host_events`` of ``calls`` calls of ``fn()`` inside ``jax.profiler.trace``:
    the events that start inside the calls' span (a ``TraceAnnotation``, itself left out),
    not the profiler's own start and stop."""
    span = "bench_host_events_span"
    with tempfile.TemporaryDirectory(prefix="jax_trace_") as d:
        with jax.profiler.trace(d):
            with jax.profiler.TraceAnnotation(span):
                for _ in range(calls):
                    fn()
        events = trace_host_events(d)
    (outer,) = [e for e in events if e["name"] == span]
    return [e for e in events if e is not outer
            and outer["ts"] <= e["ts"] < outer["ts"] + outer["us"]]


def profile_op_events(fn, *, calls: int) -> list[dict]:
    """``trace_op_events`` of ``calls`` calls of ``fn()`` inside ``jax.profiler.trace`` (a
    temporary directory). ``fn`` must block until its device work is done."""
    with tempfile.TemporaryDirectory(prefix="jax_trace_") as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                fn()
        return trace_op_events(d)


_HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OP_NAME = re.compile(r'\bop_name="([^"]*)"')
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")


def hlo_ops(hlo_text: str) -> tuple[str, dict[str, dict[str, str]]]:
    """(module name, {instruction name: {"op_name", "opcode"}}) of an optimised HLO module's
    text (``compiled.as_text()``), every computation's instructions included. An instruction
    without ``op_name`` metadata (a fusion, usually) takes its called computation's ROOT's,
    else the first found in that computation, else ""."""
    module = re.search(r"^HloModule\s+([\w.\-]+)", hlo_text, re.M)
    ops, calls, root, first = {}, {}, {}, {}
    comp = None
    for line in hlo_text.splitlines():
        m = _HEADER.match(line)
        if m and not line.startswith(" "):
            comp = m.group(2)
            continue
        m = _HLO_INSTR.match(line)
        if comp is None or m is None:
            continue
        name, op, c = m.group(1), _OP_NAME.search(line), _CALLS.search(line)
        ops[name] = {"op_name": op.group(1) if op else "", "opcode": _opcode(line[m.end():])}
        if op:
            first.setdefault(comp, op.group(1))
            if line.lstrip().startswith("ROOT"):
                root[comp] = op.group(1)
        if c:
            calls[name] = c.group(1)
    for name, comp in calls.items():
        if not ops[name]["op_name"]:
            ops[name]["op_name"] = root.get(comp, first.get(comp, ""))
    return (module.group(1) if module else ""), ops


# --------------------------------------------------------------------------- kernel count

_FREE_OPCODES = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "opt-barrier",
    "call", "while", "conditional", "after-all", "add-dependency", "partition-id",
    "replica-id", "domain", "async-done", "async-update", "copy-done"})
_CALLED = re.compile(r"\b(?:to_apply|body|condition|calls|true_computation|false_computation)"
                     r"=%?([\w.\-]+)|branch_computations=\{([^}]*)\}")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def _opcode(rest: str) -> str:
    """The opcode of an instruction's text after ``name = ``: skip the (maybe tuple) shape."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                rest = rest[i + 1:].lstrip()
                break
    else:
        rest = rest.split(" ", 1)[1] if " " in rest else ""
    m = re.match(r"([\w\-]+)\(", rest)
    return m.group(1) if m else "?"


def hlo_kernel_count(hlo_text: str) -> dict:
    """Kernels in an optimised HLO module's text (``compiled.as_text()``).

    Counted, once each: every instruction of the entry computation, and of the computations it
    reaches through call / while / conditional (command buffers, loop bodies), whose opcode
    launches device work: fusions, custom calls (Pallas/Triton kernels, library calls), and
    unfused copies, sorts etc. Not counted: parameters, constants, tuples, bitcasts, barriers,
    the control-flow instructions themselves, and anything inside a fusion. A loop body's
    kernels count once, not once per iteration (``loops`` says whether there was one).
    Returns {"total": int, "by_opcode": {opcode: count}, "loops": bool}.
    """
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        m = _HEADER.match(line)
        if m and not line.startswith(" "):
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None and _INSTR.match(line):
            comps[current].append(line)
    if entry is None:
        raise ValueError("hlo_text: no ENTRY computation found")
    by_opcode: dict[str, int] = {}
    loops, seen, todo = False, set(), [entry]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            op = _opcode(line[_INSTR.match(line).end():])
            if op in ("call", "while", "conditional"):
                loops |= op == "while"
                for a, b in _CALLED.findall(line):
                    todo += [a] if a else [s.strip().lstrip("%") for s in b.split(",")]
            elif op not in _FREE_OPCODES:
                by_opcode[op] = by_opcode.get(op, 0) + 1
    return {"total": sum(by_opcode.values()), "by_opcode": by_opcode, "loops": loops}


KERNEL_COUNT_DOC = ("XLA kernels: fusions + custom calls (Pallas/Triton) + unfused copies/sorts "
                    "in the op's optimised HLO, each once (bitcasts, tuples, parameters, "
                    "constants not counted; see _common.hlo_kernel_count)")


def compile_op(fn, *args):
    """``jax.jit(fn)`` compiled for ``args``: call it for the outputs, and read its kernel
    count with ``hlo_kernel_count(compiled.as_text())``."""
    return jax.jit(fn).lower(*args).compile()


# --------------------------------------------------------------------------- numbers

def rel_l2(a, b) -> float:
    """||a - b|| / ||b|| in float64 (0 for two empty arrays); NaN or inf anywhere gives inf."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"rel_l2: shapes differ, {a.shape} vs {b.shape}")
    if a.size == 0:
        return 0.0
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def geomean(xs) -> float:
    xs = [float(x) for x in xs]
    return float(np.exp(np.mean(np.log(xs)))) if xs else float("nan")


# --------------------------------------------------------------------------- arguments, output

positive_int = bounded_int(1)  # argparse type: an integer >= 1 (the error names the bound)
non_negative_int = bounded_int(0)  # argparse type: an integer >= 0


def int_list(lo: int = 1, *, allow_empty: bool = False):
    """argparse ``type=``: a comma-separated list of integers, each >= ``lo`` (a tuple); with
    ``allow_empty`` an empty string is the empty tuple."""
    def parse(text: str) -> tuple[int, ...]:
        if allow_empty and not text.strip():
            return ()
        try:
            vals = tuple(int(v) for v in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers, got {text!r}") from None
        bad = [v for v in vals if v < lo]
        if bad:
            raise argparse.ArgumentTypeError(f"every value must be >= {lo}, got {bad[0]}")
        return vals
    return parse


def add_common_args(p: argparse.ArgumentParser, *, reps: int, trials: int,
                    out_required: bool = True) -> argparse.ArgumentParser:
    """--out DIR, --reps (calls per sample), --trials, --seed."""
    if out_required:
        p.add_argument("--out", required=True, help="directory for the results")
    else:
        p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"),
                       help="directory for the results (default $OUT or /tmp/out)")
    p.add_argument("--reps", type=positive_int, default=reps,
                   help=f"calls per sample (cold: a multiple of {CALLS_PER_DISPATCH}, the calls "
                        f"looped in one executable, or fewer; default {reps})")
    p.add_argument("--trials", type=positive_int, default=trials,
                   help=f"samples per timing (default {trials})")
    p.add_argument("--seed", type=non_negative_int, default=0)
    return p


def run_meta() -> dict:
    """Date (UTC), device, backend and versions: stamped on every JSON the scripts write."""
    dev = jax.devices()[0]
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": str(dev.device_kind), "backend": jax.default_backend(),
            "device_count": jax.device_count(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__}


def write_json(path: str, payload: dict) -> None:
    """``payload`` with a ``meta`` entry (run_meta) first; parent directory created."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = {"meta": payload.get("meta") or run_meta(), **{k: v for k, v in payload.items()
                                                         if k != "meta"}}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=_json_default)


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return repr(o)

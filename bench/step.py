"""The serving step of one MiniMax-M3 rank at its real per-rank shapes, split by op family.

    python3 bench/step.py --out DIR                       (GPU; DIR/step.json + DIR/step.md)
    python3 bench/step.py --out DIR --weights fp8 --budget-s 500
    python3 bench/step.py --out DIR --dry-run             (CPU: a tiny 2-layer model, seconds)

Model: ``--model-config`` (default ``bench/configs/minimax_m3.json``, 60 layers: 3 dense
attention + dense MLP, 57 MSA + MoE; ``--num-layers N`` the first N) at the shapes of one rank
of ``--tp 4 --ep 8`` (``jax_msa_runner.rank_shapes.rank_config``: 16/1 query/KV heads, 1
index head, dense MLP 3072, shared expert 768, vocabulary 50016; 16 of the 128 routed experts,
whole (3072), behind the router over all 128, so the rank computes only the token copies routed
to its experts). One device, no collectives: the TP / EP psums of a real rank are not in the
step. Random weights in bf16 or ``--weights fp8`` (every quantizable linear MXFP8, as the
released checkpoint; router, norms, embedding, LM head bf16). ``--layer-weights shared`` (the
default) builds one set of weights per layer kind and every layer of that kind reads the same
arrays: the bytes each layer reads are unchanged (one layer's weights exceed the 50 MB L2
between two reads of them), only the memory held is (60 layers of bf16 experts do not fit one
GPU); ``distinct`` gives every layer its own. Caches: bf16 KV pages and index-K pages for
exactly B x context tokens per layer (plus the 2 reserved pages).

Points: decode of B in ``--batches`` (1, 16, 64, 256) requests, each with one new token after
L - 1 cached ones, L in ``--contexts`` (4K, 32K, 128K); prefill chunks of ``--chunk`` (2048)
tokens of one request after ``--prefill-contexts`` (0, 30720) cached tokens; and the TTFT of a
``--ttft-prompt`` (32768) token prompt: its chunks in order through the same runner, wall time
from the first chunk's launch to the sampled token. A point whose caches do not fit the
device's free memory is skipped, named in the output; ``--budget-s`` starts no new point after
that many seconds.

Each point builds a ``serving.runner.ModelRunner`` with one bucket (decode: T = R = B; prefill:
T = chunk, R = 1; max_model_len = the context), warms it up (compiles the forward and sampling
executables, ``--command-buffers`` as the runner serves), and measures:

- step time: median wall time of ``--steps`` consecutive ``ModelRunner.execute_step`` calls
  on the same scheduled batch (host packing, the transfer of its one int32 buffer, the
  forward and sampling executables, the sampled tokens back on the host): the real step path.
- pipelined step time: median wall time per step of ``--steps`` steps each launched
  (``launch_step``) before the previous one is read (``finish_step``), as the engine's
  asynchronous scheduling serves; launch time: the median host time of ``launch_step`` (the
  host's part of a step before the device runs on its own).
- the split by op family, from XLA's profiler: the bucket is compiled again (once per runner)
  without command buffers (inside a command buffer every kernel carries the buffer's name, not
  its op's), ``--profile-steps`` steps through it inside ``jax.profiler.trace``; every XLA op
  event of the trace (GPU: the kernels and copies on the device's streams; CPU: XLA:CPU's
  thunks) is mapped to its HLO instruction in the two compiled executables, and through the
  instruction's ``op_name`` metadata to the innermost ``jax.named_scope`` of
  ``jax_msa_runner.model``: attention_dense, attention_msa (cache writes, indexer, top-16
  select, sparse attention), moe (router, routed and shared experts), projections (q/k/v/o
  and index linears, the dense MLP, the LM head), norms (RMSNorms with the q/k RoPE), other
  (embedding, residuals, staging, sampling, copies without an HLO op).
  An XLA fusion counts for its root op's scope. Device time = the sum of those events per step;
  on a GPU the kernels of one stream, on XLA:CPU thunks that may overlap on its threads.
  "step_ms_off", "launch_ms_off", "pipelined_ms_off" (JSON; the markdown's "no command
  buffers" lines) are the step, launch and pipelined times through those executables.
- host events: the host threads' trace events of ``--profile-steps`` steps (served
  executables), by self time per step (JSON "host_events"; the markdown's top six): where the
  host gap goes.
- host gap = step time - device time: what the step spends outside device work (host
  packing, dispatch, transfers, launch gaps; negative where CPU thunks overlap); the pipelined
  gap likewise from the pipelined step time.
- the roofline of the same shape (``step_cost``): bytes = weights read (every linear of every
  layer, the routed experts this rank's tokens touch as counted in the point's own routing
  (``model.forward_with_routing`` on the same weights and batch; JSON "routing" also gives
  the expectation under uniform routing, E_local * (1 - (1 - k / E) ^ T)), the router, the
  LM head, embedding rows) + caches read (dense layers: every request's whole K/V; MSA
  layers: the whole index-K cache and the top-16 pages' K/V, at most the request's own) +
  cache writes + activations (each layer reads and writes the [T, H] hidden state for
  attention and for the MLP); FLOPs = 2 x the weights' multiply-adds per token (routed: the
  counted local token copies) + attention (QK and PV over each token's keys, the indexer's
  dot products) + the LM head on the R last tokens. Roofline = max(bytes / copy bandwidth,
  FLOPs / matmul peak), both measured in the same run (``_common.copy_bandwidth``,
  ``_common.matmul_peak``); reported as the step's % of roofline (roofline / step time).
- decode tokens/s = B / step time; prefill tokens/s = chunk / step time.

``--dry-run``: a tiny 2-layer model (one dense, one MSA + MoE layer, TP4 x EP8 rank shapes of
a small config), decode B=2 at 256 tokens, two 64-token prefill chunks and a 4-chunk TTFT on
the CPU (jnp attention references), a small copy and matmul; the same tables, no claims.
"""
from __future__ import annotations

import _common  # noqa: E402  (first: repo root on sys.path, known warnings)
import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_msa_runner.batch.buckets import select_bucket  # noqa: E402
from jax_msa_runner.batch.staging import stage_batch  # noqa: E402
from jax_msa_runner.cli.flags import FlagParser, bounded_int  # noqa: E402
from jax_msa_runner.config import (COMMAND_BUFFERS, ConfigError, ModelConfig,  # noqa: E402
                                   RunnerConfig)
from jax_msa_runner.model import forward_with_routing  # noqa: E402
from jax_msa_runner.rank_shapes import (LAYER_WEIGHTS, WEIGHT_FORMATS,  # noqa: E402
                                        abstract_caches, cache_pages, local_experts,
                                        rank_config, rank_params, tree_bytes, unique_bytes)
from jax_msa_runner.serving.runner import ModelRunner  # noqa: E402
from jax_msa_runner.serving.sampling import SamplingRows  # noqa: E402
from jax_msa_runner.serving.scheduler import Request, ScheduledBatch  # noqa: E402
from pallas_kernels import PAGE_SIZE, TOPK  # noqa: E402

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs",
                              "minimax_m3.json")
BATCHES = (1, 16, 64, 256)
CONTEXTS = (4096, 32768, 131072)
CHUNK = 2048
PREFILL_CONTEXTS = (0, 30720)
TTFT_PROMPT = 32768
# --dry-run: decode B=2 at 256 tokens, 64-token chunks after 0 and 192, a 256-token TTFT
DRY_BATCHES, DRY_CONTEXTS, DRY_CHUNK = (2,), (256,), 64
DRY_PREFILL_CONTEXTS, DRY_TTFT = (0, 192), 256
# the named scopes of jax_msa_runner.model, and the family (table column) of each
SCOPE_FAMILY = {"attention_dense": "attention_dense", "attention_msa": "attention_msa",
                "moe": "moe", "projections": "projections", "dense_mlp": "projections",
                "lm_head": "projections", "norms": "norms"}
FAMILIES = ("attention_dense", "attention_msa", "moe", "projections", "norms", "other")
# instructions whose events enclose other ops' events (XLA:CPU runs loop bodies inside them)
CONTAINER_OPCODES = frozenset({"while", "conditional", "call", "async-start", "async-done"})
HEADROOM_BYTES = 4 << 30  # free device memory kept beyond a point's caches (step temporaries)


# --------------------------------------------------------------------------- points

@dataclasses.dataclass(frozen=True)
class Point:
    """One measured step: ``kind`` "decode" (B requests, 1 token each after L - 1 cached),
    "prefill" (1 request, ``tokens`` after ``context`` cached) or "ttft" (a ``context``-token
    prompt in chunks of ``tokens``)."""
    kind: str
    batch: int
    context: int
    tokens: int

    @property
    def name(self) -> str:
        if self.kind == "decode":
            return f"decode B={self.batch} L={self.context}"
        if self.kind == "prefill":
            return f"prefill {self.tokens} after {self.context}"
        return f"ttft {self.context}-token prompt, chunks of {self.tokens}"

    def scheduled(self) -> tuple[np.ndarray, np.ndarray]:
        """(num_computed, num_scheduled) int64 [R] of the point's step."""
        if self.kind == "decode":
            return np.full(self.batch, self.context - 1), np.ones(self.batch, np.int64)
        return np.array([self.context]), np.array([self.tokens])


@dataclasses.dataclass(frozen=True)
class Group:
    """Points served by one runner: its bucket (T tokens, R rows) and max_model_len."""
    num_tokens: int
    num_reqs: int
    max_model_len: int
    points: tuple[Point, ...]


def plan(batches, contexts, chunk: int, prefill_contexts, ttft_prompt: int) -> list[Group]:
    """The runners and their points, the issue's two headline points first (B=16 and B=1 at
    32K), then the prefill runner (its chunks and the TTFT), then the other decode points by
    cache size."""
    decode = [Group(b, b, c, (Point("decode", b, c, 1),)) for b in batches for c in contexts]
    first = [g for key in ((16, 32768), (1, 32768)) for g in decode
             if (g.num_reqs, g.max_model_len) == key]
    rest = sorted((g for g in decode if g not in first),
                  key=lambda g: (g.num_reqs * g.max_model_len, g.num_reqs))
    groups = first
    prefill = [Point("prefill", 1, c, chunk) for c in prefill_contexts]
    if ttft_prompt:
        prefill.append(Point("ttft", 1, ttft_prompt, chunk))
    if prefill:
        max_len = max([c + chunk for c in prefill_contexts] + [ttft_prompt])
        groups.append(Group(chunk, 1, max_len, tuple(prefill)))
    return groups + rest


# --------------------------------------------------------------------------- roofline model

def _linear_bytes(elems: int, weights: str) -> float:
    """Bytes of a linear of ``elems`` weights: bf16 2 each, MXFP8 1 + a 1-byte scale per 32."""
    return elems * (2.0 if weights == "bf16" else 1.0 + 1.0 / 32)


def touched_experts(num_local: int, num_experts: int, top_k: int, tokens: int) -> float:
    """Expected local experts with at least one of ``tokens`` tokens' top-k copies, under
    uniform routing: E_local * (1 - (1 - k / E) ^ T)."""
    return num_local * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def step_cost(mc: ModelConfig, *, num_local: int, weights: str, computed, scheduled,
              routing: list[tuple[int, int]] | None = None) -> dict:
    """Bytes and FLOPs of one step of a per-rank ``mc`` (the roofline model of the module
    docstring). computed / scheduled: int [R] cached and new tokens per request. routing:
    None (uniform routing's expected counts) or, per MoE layer in order, the measured
    (distinct local experts, local token copies) of ``measured_routing``.
    Returns {"bytes": {part: bytes}, "flops": {part: FLOPs}, "touched_experts": float (the
    mean over MoE layers), "touched_experts_uniform": float}."""
    comp, sched = np.asarray(computed, np.int64), np.asarray(scheduled, np.int64)
    T, R = int(sched.sum()), int(sched.size)
    kv_len = comp + sched  # keys of each request after the step
    # every new token's key count: request r's tokens see comp_r + 1 ... comp_r + sched_r keys
    tok_keys = np.concatenate([c + np.arange(1, s + 1) for c, s in zip(comp, sched)])
    sparse_keys = np.minimum(tok_keys, TOPK * PAGE_SIZE)
    H, D, Hq, Hkv = mc.hidden_size, mc.head_dim, mc.num_heads, mc.num_kv_heads
    Hi, Di = mc.num_index_heads, mc.index_dim
    kvb = np.dtype(mc.jnp_dtype).itemsize
    ib = np.dtype(mc.index_cache_jnp_dtype).itemsize
    kv_tok, idx_tok = 2 * Hkv * D * kvb, Di * ib  # cache bytes per token per layer
    attn = H * Hq * D + 2 * H * Hkv * D + Hq * D * H
    index = H * Hi * Di + H * Di
    uniform = touched_experts(num_local, mc.num_experts, mc.num_experts_per_tok, T)
    moe_layers = sum(mc.layer_is_moe)
    if routing is None:
        routing = [(uniform, T * mc.num_experts_per_tok * num_local / mc.num_experts)
                   ] * moe_layers
    if len(routing) != moe_layers:
        raise ValueError(f"routing: one entry per MoE layer ({moe_layers}), got {len(routing)}")
    layer_routing = iter(routing)
    b = dict.fromkeys(("weights", "kv_cache", "index_cache", "cache_writes", "activations"), 0.0)
    f = dict.fromkeys(("linears", "moe", "attention", "lm_head"), 0.0)
    for msa, moe in zip(mc.layer_is_msa, mc.layer_is_moe):
        lin = attn + (index if msa else 0)
        b["weights"] += _linear_bytes(lin, weights) + 2 * (2 * H + 2 * D + (2 * Di if msa else 0))
        f["linears"] += 2.0 * T * lin
        if moe:
            touched, local_copies = next(layer_routing)
            routed = 3 * H * mc.moe_intermediate_size
            shared = 3 * H * mc.shared_intermediate_size
            b["weights"] += (_linear_bytes(touched * routed + shared, weights)
                             + 4 * (H * mc.num_experts + mc.num_experts))
            f["moe"] += 2.0 * (local_copies * routed + T * shared + T * H * mc.num_experts)
        else:
            b["weights"] += _linear_bytes(3 * H * mc.intermediate_size, weights)
            f["linears"] += 2.0 * T * 3 * H * mc.intermediate_size
        if msa:
            b["index_cache"] += float(kv_len.sum()) * idx_tok
            b["kv_cache"] += float(np.minimum(kv_len, sched * TOPK * PAGE_SIZE).sum()) * kv_tok
            b["cache_writes"] += T * (kv_tok + idx_tok)
            f["attention"] += (2.0 * Hi * Di * tok_keys.sum()
                               + 4.0 * Hq * D * sparse_keys.sum())
        else:
            b["kv_cache"] += float(kv_len.sum()) * kv_tok
            b["cache_writes"] += T * kv_tok
            f["attention"] += 4.0 * Hq * D * tok_keys.sum()
        b["activations"] += 4.0 * T * H * 2
    b["weights"] += 2.0 * (H * mc.vocab_size + T * H + H)  # LM head, embedding rows, final norm
    f["lm_head"] = 2.0 * R * H * mc.vocab_size
    touched_mean = sum(t for t, _ in routing) / moe_layers if moe_layers else 0.0
    return {"bytes": b, "flops": f, "touched_experts": touched_mean,
            "touched_experts_uniform": uniform}


def roofline(cost: dict, copy_Bps: float, flops_per_s: float) -> dict:
    """The step's floor: max(bytes / copy bandwidth, FLOPs / matmul peak), in ms."""
    nbytes, flops = sum(cost["bytes"].values()), sum(cost["flops"].values())
    mem_ms, cmp_ms = nbytes / copy_Bps * 1e3, flops / flops_per_s * 1e3
    return {"bytes": nbytes, "flops": flops, "memory_ms": mem_ms, "compute_ms": cmp_ms,
            "ms": max(mem_ms, cmp_ms), "bound": "memory" if mem_ms >= cmp_ms else "compute"}


# --------------------------------------------------------------------------- the split

def scope_family(op_name: str) -> tuple[str, str]:
    """(scope, family) of an op from its ``op_name`` path: the innermost named scope of
    ``SCOPE_FAMILY``, else ("other", "other")."""
    for part in reversed(op_name.split("/")):
        if part in SCOPE_FAMILY:
            return part, SCOPE_FAMILY[part]
    return "other", "other"


def split_by_family(events: list[dict], modules: dict[str, dict], sampling_module: str,
                    steps: int) -> dict:
    """ms per step of each family and scope from profile ``events`` (``_common``'s
    ``trace_op_events``). modules: {HLO module name: ``_common.hlo_ops``' table} of the step's
    executables; ops of ``sampling_module`` are scope "sampling" (family other); events of
    other modules or without an HLO op are "other" and listed in ``unattributed``."""
    fam = dict.fromkeys(FAMILIES, 0.0)
    scope: dict[str, float] = {}
    loose: dict[str, float] = {}
    for e in events:
        ops = modules.get(str(e["module"]).split("(")[0])  # a module name may carry "(id)"
        info = ops.get(e["op"]) if ops is not None else None
        if info is not None and info["opcode"] in CONTAINER_OPCODES:
            continue
        if info is None:
            s, f = "other", "other"
            key = f"{e['module']}:{e['op'] or e['name']}"
            loose[key] = loose.get(key, 0.0) + e["us"]
        elif str(e["module"]).split("(")[0] == sampling_module:
            s, f = "sampling", "other"
        else:
            s, f = scope_family(info["op_name"])
        fam[f] += e["us"]
        scope[s] = scope.get(s, 0.0) + e["us"]
    per = 1e-3 / steps
    top = sorted(loose.items(), key=lambda kv: -kv[1])[:8]
    return {"family_ms": {k: v * per for k, v in fam.items()},
            "scope_ms": {k: v * per for k, v in sorted(scope.items())},
            "device_ms": sum(fam.values()) * per, "events": len(events),
            "unattributed": [{"op": k, "ms": v * per} for k, v in top]}


# --------------------------------------------------------------------------- runners, batches

def scheduled_batch(point: Point, chunk_start: int | None, pages: int, vocab: int,
                    rng: np.random.Generator) -> ScheduledBatch:
    """The point's batch (``chunk_start``: a TTFT chunk's cached tokens) as the scheduler
    hands it to ``ModelRunner.execute_step``: request r owns pages [2 + r * pages, ...)."""
    if chunk_start is None:
        comp, sched = point.scheduled()
    else:
        comp = np.array([chunk_start])
        sched = np.array([min(point.tokens, point.context - chunk_start)])
    n = comp.size
    table = tuple(tuple(range(2 + r * pages, 2 + (r + 1) * pages)) for r in range(n))
    return ScheduledBatch(
        requests=tuple(Request(r, (1,), 1) for r in range(n)),
        num_scheduled=sched.astype(np.int32), num_computed=comp.astype(np.int32),
        block_table=table, token_ids=rng.integers(0, vocab, int(sched.sum()), dtype=np.int32),
        sample=np.ones(n, bool), sampling=SamplingRows.neutral(n)._replace(
            slot=np.arange(n, dtype=np.int32)), preempted=())


def free_device_bytes() -> int | None:
    """bytes_limit - bytes_in_use of the first device (None where the backend has no stats)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def executable_ops(executables: tuple) -> tuple[dict[str, dict], str]:
    """({module name: hlo_ops table} of a bucket's (forward, sampling) executables, the
    sampling module's name)."""
    forward, sampling = executables
    f_name, f_ops = _common.hlo_ops(forward.as_text())
    s_name, s_ops = _common.hlo_ops(sampling.as_text())
    return {f_name: f_ops, s_name: s_ops}, s_name


def measured_routing(runner: ModelRunner, batches: list[ScheduledBatch], num_local: int
                     ) -> list[list[tuple[int, int]]]:
    """Per batch, per MoE layer: (distinct local experts, local token copies) that the batch's
    real tokens choose, from ``model.forward_with_routing`` on the runner's params and caches
    (its returned caches replace the runner's; their values do not matter to the timing).
    The rank holds experts [0, num_local)."""
    mc, rc = runner.mconfig, runner.rconfig
    fwd = jax.jit(functools.partial(forward_with_routing, config=mc,
                                    attention_impl=runner.attention_impl,
                                    interpret=runner.interpret), donate_argnums=1)
    out = []
    for b in batches:
        T = int(np.sum(b.num_scheduled))
        bucket = select_bucket(T, len(b.num_scheduled), rc)
        md = stage_batch(b.num_scheduled, b.num_computed, b.block_table, rc, bucket=bucket)
        tokens = np.zeros(bucket.num_tokens, np.int32)
        tokens[:T] = b.token_ids
        _, runner.caches, routing = fwd(runner.params, runner.caches, jnp.asarray(tokens), md)
        layers = []
        for r in routing:
            if r is not None:
                chosen = np.asarray(r)[:T]
                local = chosen[chosen < num_local]
                layers.append((int(np.unique(local).size), int(local.size)))
        out.append(layers)
    return out


def launch_and_pipelined_ms(runner: ModelRunner, batches: list[ScheduledBatch], steps: int
                            ) -> tuple[float, float]:
    """(median host ms of ``launch_step`` over ``steps`` rounds of ``batches``: the host's
    part of a step until the device runs on its own; median wall ms per round with each
    step launched before the previous one is read, as the engine's async scheduling runs)."""
    launch, rounds = [], []
    prev = runner.launch_step(batches[0])
    for i in range(steps + 1):
        t0 = time.perf_counter()
        for b in batches:
            t1 = time.perf_counter()
            handle = runner.launch_step(b)
            launch.append(time.perf_counter() - t1)
            runner.finish_step(prev)
            prev = handle
        if i:  # the first round fills the pipeline
            rounds.append(time.perf_counter() - t0)
    runner.finish_step(prev)
    return statistics.median(launch) * 1e3, statistics.median(rounds) * 1e3


def profiled_split(runner: ModelRunner, off: tuple, batches: list[ScheduledBatch],
                   profile_steps: int) -> dict:
    """``split_by_family`` of ``profile_steps`` rounds of ``batches`` run through ``off``:
    the runner's one bucket compiled again without command buffers (so the trace names every
    kernel's HLO op), plus "step_ms_off" / "launch_ms_off" / "pipelined_ms_off": the step,
    launch and pipelined times (``launch_and_pipelined_ms``) through them; the served
    executables are put back after."""
    (bucket,) = runner._compiled
    served = runner._compiled[bucket]
    modules, sampling_module = executable_ops(off)
    runner._compiled[bucket] = off

    def run():
        for b in batches:
            runner.execute_step(b)
    try:
        walls = _common.host_latency_s(run, repeats=max(3, profile_steps), warmup=1)
        launch_ms, pipelined_ms = launch_and_pipelined_ms(runner, batches,
                                                          max(3, profile_steps))
        events = _common.profile_op_events(run, calls=profile_steps)
    finally:
        runner._compiled[bucket] = served
    split = split_by_family(events, modules, sampling_module, profile_steps)
    split.update(step_ms_off=statistics.median(walls) * 1e3, launch_ms_off=launch_ms,
                 pipelined_ms_off=pipelined_ms)
    return split


def measure_point(runner: ModelRunner, off: tuple, point: Point, mc: ModelConfig, *,
                  pages: int, steps: int, profile_steps: int, rng, num_local: int, weights: str,
                  copy_Bps: float, flops_per_s: float) -> dict:
    """One row of the table (module docstring); ``off``: the runner's bucket compiled
    without command buffers, for the split."""
    if point.kind == "ttft":
        batches = [scheduled_batch(point, c, pages, mc.vocab_size, rng)
                   for c in range(0, point.context, point.tokens)]
    else:
        batches = [scheduled_batch(point, None, pages, mc.vocab_size, rng)]

    def run():
        for b in batches:
            runner.execute_step(b)
    walls = _common.host_latency_s(run, repeats=steps, warmup=1)
    launch_ms, pipelined_ms = launch_and_pipelined_ms(runner, batches, steps)
    host = _common.host_time_by_name(_common.profile_host_events(run, calls=profile_steps),
                                     steps=profile_steps * len(batches))
    split = profiled_split(runner, off, batches, profile_steps)
    routings = measured_routing(runner, batches, num_local)
    costs = [step_cost(mc, num_local=num_local, weights=weights, computed=b.num_computed,
                       scheduled=b.num_scheduled, routing=r) for b, r in zip(batches, routings)]
    step_ms = statistics.median(walls) * 1e3
    row = {"name": point.name, "kind": point.kind, "step_ms": step_ms,
           "samples_ms": [w * 1e3 for w in walls], "launch_ms": launch_ms,
           "pipelined_ms": pipelined_ms, "host_events": host, **split,
           "host_gap_ms": step_ms - split["device_ms"],
           "pipelined_gap_ms": pipelined_ms - split["device_ms"]}
    if point.kind == "ttft":
        roof = {k: sum(roofline(c, copy_Bps, flops_per_s)[k] for c in costs)
                for k in ("bytes", "flops", "memory_ms", "compute_ms", "ms")}
        roof["bound"] = "chunks summed"
        row.update(batch=1, context=point.context, tokens=point.tokens, chunks=len(batches),
                   ttft_ms=step_ms, tokens_per_s=point.context / (step_ms / 1e3))
    else:
        (cost,) = costs
        roof = roofline(cost, copy_Bps, flops_per_s)
        tokens = int(batches[0].num_scheduled.sum())
        row.update(batch=point.batch, context=point.context, tokens=tokens, cost=cost,
                   tokens_per_s=tokens / (step_ms / 1e3))
    row["routing"] = {
        "touched_experts": float(np.mean([c["touched_experts"] for c in costs])),
        "touched_experts_uniform": float(np.mean([c["touched_experts_uniform"] for c in costs])),
        "per_batch": routings}
    row.update(roofline=roof, pct_roofline=100 * roof["ms"] / step_ms,
               pct_roofline_pipelined=100 * roof["ms"] / pipelined_ms)
    return row


def build_runner(mc: ModelConfig, params: dict, group: Group, command_buffers: str
                 ) -> tuple[ModelRunner, int]:
    """A warmed-up runner with the group's one bucket and caches for exactly its requests
    (R x ceil(max_model_len / 128) pages + 2); (runner, pages per request)."""
    rc = RunnerConfig(max_num_seqs=group.num_reqs, max_num_batched_tokens=group.num_tokens,
                      max_model_len=group.max_model_len, bucket_sizes=(group.num_tokens,),
                      command_buffers=command_buffers)
    runner = ModelRunner(mc, rc, num_pages=cache_pages(group.num_reqs, group.max_model_len,
                                                       PAGE_SIZE), params=params)
    runner.warm_up()
    return runner, rc.max_pages


# --------------------------------------------------------------------------- output

def _ms(v) -> str:
    return "-" if v is None else (f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}")


def table(rows: list[dict]) -> str:
    """The markdown table: step, device time and its split, host gap, roofline (ms)."""
    head = ("| point | tokens | step ms | pipelined ms | launch ms | device ms | attn dense | "
            "attn MSA | MoE | proj | norms | other | host gap | roofline ms (bound) | "
            "% roofline (step / pipelined) | tokens/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        fam = r["family_ms"]
        lines.append(
            f"| {r['name']} | {r['tokens']} | {_ms(r['step_ms'])} | {_ms(r['pipelined_ms'])} | "
            f"{_ms(r['launch_ms'])} | {_ms(r['device_ms'])} | "
            + " | ".join(_ms(fam[f]) for f in FAMILIES)
            + f" | {_ms(r['host_gap_ms'])} | {_ms(r['roofline']['ms'])} "
              f"({r['roofline']['bound']}) | {r['pct_roofline']:.1f}% / "
              f"{r['pct_roofline_pipelined']:.1f}% | "
              f"{r['tokens_per_s']:.0f} |")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    c = result["config"]
    dry = f" (DRY RUN: tiny model on {result['meta']['backend']}, no claims)"
    out = [f"# bench/step.py{dry if result['dry_run'] else ''}", "",
           f"{result['meta']['date']}, {result['meta']['device']}, jax {result['meta']['jax']}. "
           f"One rank of TP{c['tp']} x EP{c['ep']}: {c['layers']} layers ({c['msa_layers']} MSA, "
           f"{c['moe_layers']} MoE), heads {c['heads']}, {c['local_experts']} of "
           f"{c['num_experts']} experts, {c['weights']} weights, layer weights {c['layer_weights']}"
           f" ({c['param_gib']:.2f} GiB held; {c['weights_note']}), attention "
           f"{c['attention_impl']}, command buffers {c['command_buffers']}.",
           f"Copy {result['copy']['copy_Bps'] / 1e12:.3g} TB/s, matmul "
           f"{result['matmul']['flops_per_s'] / 1e12:.3g} TFLOP/s (measured in this run). "
           f"Times in ms. step: execute_step; pipelined: per step with the next one launched "
           f"before the previous one is read; launch: host time of launch_step. The split is "
           f"the profiled device time per step by op family (executables compiled again "
           f"without command buffers); host gap = step - device; the ttft row sums its "
           f"chunks.", "", table(result["rows"]), ""]
    for r in result["rows"]:
        if r["kind"] == "ttft":
            out.append(f"TTFT of a {r['context']}-token prompt ({r['chunks']} chunks of "
                       f"{r['tokens']}): {_ms(r['ttft_ms'])} ms, "
                       f"{r['pct_roofline']:.1f}% of its roofline {_ms(r['roofline']['ms'])} ms.")
    for r in result["rows"]:
        out.append(f"- {r['name']}, no command buffers: step {_ms(r['step_ms_off'])}, "
                   f"pipelined {_ms(r['pipelined_ms_off'])}, launch {_ms(r['launch_ms_off'])}")
        out.append(f"- {r['name']}, host events by self ms per step: " + ", ".join(
            f"{h['name'][:60]} {_ms(h['self_ms'])} ({h['calls']:.0f}x)"
            for h in r["host_events"][:6]))
    for r in result["rows"]:
        out.append(f"- {r['name']}: local experts touched per MoE layer "
                   f"{r['routing']['touched_experts']:.1f} measured (the roofline's), "
                   f"{r['routing']['touched_experts_uniform']:.1f} under uniform routing")
    for s in result["skipped"]:
        out.append(f"- skipped {s['point']}: {s['why']}")
    return "\n".join(out) + "\n"


def write_markdown(out_dir: str, result: dict) -> str:
    """``markdown(result)`` written to ``out_dir``/step.md; returns it."""
    md = markdown(result)
    with open(os.path.join(out_dir, "step.md"), "w") as f:
        f.write(md)
    return md


# --------------------------------------------------------------------------- main

def dry_config() -> ModelConfig:
    """A small 2-layer M3-like model (dense + MSA/MoE) whose TP4 x EP8 rank is tiny."""
    return ModelConfig(vocab_size=512, hidden_size=128, num_layers=2, num_heads=8,
                       num_kv_heads=4, num_index_heads=4, head_dim=32, rotary_dim=16,
                       index_dim=32, intermediate_size=256, sparse_attention_freq=(0, 1),
                       moe_layer_freq=(0, 1), num_experts=16, num_experts_per_tok=4,
                       moe_intermediate_size=32, shared_intermediate_size=128,
                       dtype="bfloat16")


def parse_args(argv=None) -> argparse.Namespace:
    p = FlagParser(prog="bench/step.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"),
                   help="directory for step.json and step.md (default $OUT or /tmp/out)")
    p.add_argument("--model-config", default=DEFAULT_CONFIG, metavar="FILE",
                   help="a MiniMax-M3 config.json (default bench/configs/minimax_m3.json)")
    p.add_argument("--num-layers", type=bounded_int(1), default=None, metavar="N",
                   help="the first N layers of the config (>= 1; default all)")
    p.add_argument("--tp", type=bounded_int(1), default=4, help="tensor-parallel ranks (default 4)")
    p.add_argument("--ep", type=bounded_int(1), default=8, help="expert-parallel ranks (default 8)")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default="bf16",
                   help="bf16, or MXFP8 fp8 linears (default bf16)")
    p.add_argument("--layer-weights", choices=LAYER_WEIGHTS, default="shared",
                   help="one set of weights per layer kind shared by its layers (default), or "
                        "distinct weights per layer")
    p.add_argument("--batches", type=_common.int_list(1, allow_empty=True), default=BATCHES,
                   help="decode batch sizes, comma-separated, each >= 1; '' for none "
                        "(default 1,16,64,256)")
    p.add_argument("--contexts", type=_common.int_list(2), default=CONTEXTS,
                   help="decode contexts L, each >= 2 (default 4096,32768,131072)")
    p.add_argument("--chunk", type=bounded_int(1), default=CHUNK,
                   help=f"prefill chunk tokens (>= 1; default {CHUNK})")
    p.add_argument("--prefill-contexts", type=_common.int_list(0, allow_empty=True),
                   default=PREFILL_CONTEXTS,
                   help="cached tokens before each prefill chunk, each >= 0; '' for none "
                        "(default 0,30720)")
    p.add_argument("--ttft-prompt", type=bounded_int(0), default=TTFT_PROMPT,
                   help=f"prompt tokens of the TTFT point (0: none; default {TTFT_PROMPT})")
    p.add_argument("--steps", type=bounded_int(1), default=10,
                   help="timed consecutive steps per point (>= 1; default 10)")
    p.add_argument("--profile-steps", type=bounded_int(1), default=3,
                   help="profiled steps per point (>= 1; default 3)")
    p.add_argument("--command-buffers", choices=tuple(COMMAND_BUFFERS), default="xla",
                   help="XLA command buffers of the runner's executables (default xla, as served)")
    p.add_argument("--budget-s", type=bounded_int(1), default=None,
                   help="start no new point after this many seconds (outputs still written)")
    p.add_argument("--seed", type=bounded_int(0), default=0, help="weights and token ids (>= 0)")
    p.add_argument("--dry-run", action="store_true",
                   help="a tiny 2-layer model on the CPU, a few points; the same outputs")
    args = p.parse_args(argv)
    if not _common.ON_GPU and not args.dry_run:
        p.error("argument --dry-run: needed without a GPU backend (the real shapes need an "
                "H200's memory)")
    if not args.dry_run:
        if not os.path.exists(args.model_config):
            p.error(f"argument --model-config: no such file {args.model_config!r}")
        try:
            full = ModelConfig.from_hf_config(args.model_config, dtype="bfloat16")
        except (ConfigError, ValueError, KeyError) as e:
            p.error(f"argument --model-config: {e}")
        if args.num_layers is not None and args.num_layers > full.num_layers:
            p.error(f"argument --num-layers: must be <= the config's {full.num_layers} layers, "
                    f"got {args.num_layers}")
        args.full_config = (full if args.num_layers is None else ModelConfig.from_hf_config(
            args.model_config, dtype="bfloat16", num_layers=args.num_layers))
    else:
        args.full_config = dry_config()
    for flag, sizes in (("--tp", (args.tp, 1)), ("--ep", (1, args.ep))):
        try:
            rank_config(args.full_config, *sizes)
        except ConfigError as e:
            p.error(f"argument {flag}: {str(e).split(': ', 1)[-1]}")
    if args.ttft_prompt and args.ttft_prompt < args.chunk and not args.dry_run:
        p.error(f"argument --ttft-prompt: must be 0 or >= --chunk = {args.chunk}, "
                f"got {args.ttft_prompt}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    if args.dry_run:
        groups = plan(DRY_BATCHES, DRY_CONTEXTS, DRY_CHUNK, DRY_PREFILL_CONTEXTS, DRY_TTFT)
        steps, profile_steps = 3, 1
        copy = _common.copy_bandwidth(16 << 20, n=3, trials=2)
        peak = _common.matmul_peak(256, reps=3, trials=2)
    else:
        groups = plan(args.batches, args.contexts, args.chunk, args.prefill_contexts,
                      args.ttft_prompt)
        steps, profile_steps = args.steps, args.profile_steps
        copy = _common.copy_bandwidth()
        peak = _common.matmul_peak()
    print(f"copy {copy['copy_Bps'] / 1e12:.3f} TB/s; matmul {peak['flops_per_s'] / 1e12:.1f} "
          f"TFLOP/s", flush=True)
    mc = rank_config(args.full_config, args.tp, 1)
    num_local = local_experts(mc, args.ep)
    params = rank_params(mc, num_local_experts=num_local, weights=args.weights,
                         layer_weights=args.layer_weights, seed=args.seed)
    jax.block_until_ready(params)
    impl = "pallas" if _common.ON_GPU else "reference"
    shared = args.layer_weights == "shared"
    result = {
        "meta": _common.run_meta(), "dry_run": args.dry_run, "copy": copy, "matmul": peak,
        "config": {
            "model_config": None if args.dry_run else args.model_config, "tp": args.tp,
            "ep": args.ep, "layers": mc.num_layers, "msa_layers": sum(mc.layer_is_msa),
            "moe_layers": sum(mc.layer_is_moe), "heads": f"{mc.num_heads}/{mc.num_kv_heads}",
            "local_experts": num_local, "num_experts": mc.num_experts,
            "weights": args.weights, "layer_weights": args.layer_weights,
            "param_gib": unique_bytes(params) / 2**30,
            "param_bytes_all_layers": tree_bytes(params),
            "weights_note": ("one set per layer kind, read by every layer of the kind: bytes "
                             "read per layer unchanged" if shared else "every layer its own"),
            "attention_impl": impl, "command_buffers": args.command_buffers,
            "rank_model": dataclasses.asdict(mc)},
        "timing": {"step": f"median wall time of {steps} consecutive ModelRunner.execute_step "
                           f"calls after one warm-up call",
                   "pipelined": f"median wall time per step of {steps} steps, each launched "
                                f"before the previous one is read (launch_step / finish_step)",
                   "launch": "median host time of ModelRunner.launch_step",
                   "split": f"jax.profiler.trace of {profile_steps} more steps through the "
                            f"bucket's executables compiled without command buffers: XLA op "
                            f"events mapped to named scopes through the HLO op_name metadata, "
                            f"per step",
                   "host_gap": "step time - profiled device time per step",
                   "roofline": "max(bytes / copy, FLOPs / matmul peak), bench/step.py's "
                               "step_cost"},
        "rows": [], "skipped": []}
    json_path = os.path.join(args.out, "step.json")
    rng = np.random.default_rng(args.seed)
    print(f"{'point':>40} {'step ms':>9} {'piped':>8} {'launch':>8} {'device':>8} {'gap':>8} "
          f"{'roof':>8} {'%roof':>6}", flush=True)
    for group in groups:
        if args.budget_s and time.perf_counter() - t_start > args.budget_s:
            for pt in group.points:
                result["skipped"].append({"point": pt.name, "why": "over --budget-s"})
            continue
        need = tree_bytes(abstract_caches(mc, cache_pages(group.num_reqs, group.max_model_len,
                                                          PAGE_SIZE)))
        free = free_device_bytes()
        if free is not None and need + HEADROOM_BYTES > free:
            for pt in group.points:
                result["skipped"].append({"point": pt.name, "why": (
                    f"caches {need / 2**30:.1f} GiB + {HEADROOM_BYTES >> 30} GiB headroom > "
                    f"{free / 2**30:.1f} GiB free")})
                print(f"skipped {pt.name}: {result['skipped'][-1]['why']}", flush=True)
            continue
        runner = None
        try:
            t0 = time.perf_counter()
            runner, pages = build_runner(mc, params, group, args.command_buffers)
            warm_s = time.perf_counter() - t0
            (bucket,) = runner._compiled
            off = runner.compile_bucket(bucket, "off")
            for pt in group.points:
                row = measure_point(runner, off, pt, mc, pages=pages, steps=steps,
                                    profile_steps=profile_steps, rng=rng, num_local=num_local,
                                    weights=args.weights, copy_Bps=copy["copy_Bps"],
                                    flops_per_s=peak["flops_per_s"])
                row["warm_up_s"] = warm_s
                result["rows"].append(row)
                print(f"{pt.name:>40} {row['step_ms']:9.3f} {row['pipelined_ms']:8.3f} "
                      f"{row['launch_ms']:8.3f} {row['device_ms']:8.3f} "
                      f"{row['host_gap_ms']:8.3f} {row['roofline']['ms']:8.3f} "
                      f"{row['pct_roofline']:5.1f}%", flush=True)
                _common.write_json(json_path, result)
                write_markdown(args.out, result)  # kept current should a timeout end the run
        except Exception as e:  # noqa: BLE001 - an OOM or a failed compile: record, go on
            if args.dry_run:
                raise
            for pt in group.points:
                result["skipped"].append({"point": pt.name,
                                          "why": f"{type(e).__name__}: {e}"[:500]})
            print(f"failed {group}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        finally:
            del runner
            gc.collect()
    result["wall_s"] = time.perf_counter() - t_start
    _common.write_json(json_path, result)
    print(write_markdown(args.out, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

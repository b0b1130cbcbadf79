"""`jax-msa-runner demo`: the tiny default model serves a synthetic workload end to end.

Mixed prompt lengths (a few longer than 2048 tokens, so MSA's top-16 page selection is
live), dozens of requests, tens of output tokens each; a progress bar (tqdm, on stderr); then
a summary: requests, prompt and output tokens/s, step latency p50/p99, compilations after
warm-up (must be 0) and the metadata validation result (``--debug`` validates every step).
``--index-cache-dtype float8_e4m3fn`` keeps the index-K cache in fp8 (default: the model dtype).

``--checkpoint DIR`` serves a Hugging Face MiniMax-M3 checkpoint instead of the tiny model;
when the folder has a tokenizer, the prompts are text (``--prompt``, repeatable) and the
outputs are printed as text.

Every flag is checked before any work starts (``plan_demo``): a bad value exits with status
2 and one line on stderr naming the flag and its bound.

``--tp N --ep M`` serve on a (dcp, tensor, expert) mesh of W * N * M devices (heads, MLP
intermediate sizes and the vocabulary split over N, experts over M; a ``--checkpoint`` is
loaded straight onto the shards); the same host-device rule applies.

``--coordinator HOST:PORT --num-processes N --process-id I`` join N processes (one per host)
with ``jax.distributed.initialize`` first; the mesh then spans every process's devices and
each process runs the same seeded workload (SPMD).

``--dcp W`` serves with decode context parallelism over W devices: every request's context
is split page-wise over the ranks, ``--num-pages`` counts pages per rank. On CPU the W
devices are host devices: the demo adds ``--xla_force_host_platform_device_count=W`` to
``XLA_FLAGS`` when that flag is absent (effective only if jax has not started its backend
yet); with too few devices it names the flag to set and exits with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import numpy as np
from tqdm import tqdm

from jax_msa_runner.batch.validate import MetadataInvariantError
from jax_msa_runner.config import (DCP_INTERLEAVE, FP8_INDEX_CACHE_DTYPE, MAX_MODEL_LEN,
                                   RESERVED_PAGES, ConfigError, ModelConfig, RunnerConfig, SchedulerConfig)
from jax_msa_runner.cli.flags import FlagError, FlagParser, bounded_float, bounded_int
from jax_msa_runner.cli.mesh_flags import (HOST_DEVICES_FLAG, add_distributed_args, add_mesh_args,
                                       check_mesh_flags, init_distributed)
from jax_msa_runner.serving.kv_cache import pages_needed
from jax_msa_runner.serving.runner import ModelRunner, serve
from jax_msa_runner.serving.sampling import SamplingParams
from jax_msa_runner.serving.scheduler import Request, RequestRejectedError, Scheduler

# The synthetic workload: short prompts drawn from three length ranges (inclusive) with these
# probabilities; long prompts have LONG_PROMPT_MIN..max_model_len - output_len tokens (beyond 16
# pages, so MSA's top-16 page selection is live).
SHORT_PROMPT_RANGES = ((4, 31), (32, 159), (160, 399))
SHORT_PROMPT_P = (0.4, 0.4, 0.2)
SHORT_PROMPT_MAX = SHORT_PROMPT_RANGES[-1][1]
LONG_PROMPT_MIN = 2049
SEED_STRIDE = 100_003  # request i of seed s samples with seed s * SEED_STRIDE + i (int32)
INT32_MAX = 2**31 - 1


def add_demo_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the demo's flags on ``parser`` (the CLI's ``demo`` subcommand).

    Each flag's own bound is checked by its argparse type; the bounds between flags by
    ``plan_demo``.
    """
    g = parser.add_argument_group("demo")
    g.add_argument("--num-requests", type=bounded_int(1), default=32,
                   help="requests in the workload")
    g.add_argument("--long-prompts", type=bounded_int(0), default=2,
                   help=f"prompts longer than {LONG_PROMPT_MIN - 1} tokens (<= --num-requests)")
    g.add_argument("--output-len", type=bounded_int(1), default=20,
                   help="max new tokens per request")
    g.add_argument("--max-model-len", type=bounded_int(1, MAX_MODEL_LEN), default=2560,
                   help=f"at least {SHORT_PROMPT_MAX} + --output-len, and {LONG_PROMPT_MIN} + "
                        f"--output-len with long prompts")
    g.add_argument("--max-num-seqs", type=bounded_int(1), default=16)
    g.add_argument("--max-num-batched-tokens", type=bounded_int(1), default=128,
                   help="token budget per step")
    g.add_argument("--num-pages", type=bounded_int(0), default=0,
                   help="KV pages (0: enough for every request at once); otherwise the reserved "
                        "pages plus at least the longest request's")
    g.add_argument("--temperature", type=bounded_float(0.0), default=0.0, help="0 = greedy")
    g.add_argument("--seed", type=bounded_int(0), default=0)
    g.add_argument("--attention-impl", choices=("pallas", "reference"), default=None,
                   help="default: pallas on a GPU, reference elsewhere")
    g.add_argument("--num-layers", type=bounded_int(1), default=None,
                   help="override the tiny model's layer count (layer 0 dense, others MSA)")
    g.add_argument("--index-cache-dtype", choices=("auto", FP8_INDEX_CACHE_DTYPE), default="auto",
                   help="index-K cache dtype (auto: the model dtype; float8_e4m3fn: raw fp8 keys "
                        "the indexer upcasts)")
    g.add_argument("--debug", action="store_true", help="validate every step's metadata")
    g.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="serve this Hugging Face checkpoint folder instead of the tiny model")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="model dtype with --checkpoint")
    g.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="a text prompt (repeatable; needs a --checkpoint with a tokenizer.json)")
    g.add_argument("--dcp", type=bounded_int(1), default=1, metavar="W",
                   help="decode context parallel ranks (devices); on CPU host devices via "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=W")
    add_mesh_args(g)
    add_distributed_args(g)
    return parser


def request_host_devices(world_size: int) -> None:
    """Adds ``--xla_force_host_platform_device_count=world_size`` to XLA_FLAGS unless the
    flag is already there (it only takes effect before jax initialises its backends)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if world_size > 1 and HOST_DEVICES_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {HOST_DEVICES_FLAG}={world_size}".strip()


def _workload(args: argparse.Namespace, vocab: int) -> list[Request]:
    """The synthetic requests: ``args.long_prompts`` of LONG_PROMPT_MIN..max_model_len -
    output_len tokens, the others of 4..SHORT_PROMPT_MAX tokens, in a seeded random order."""
    rng = np.random.default_rng(args.seed)
    reqs = []
    for i in range(args.num_requests):
        if i < args.long_prompts:
            n = int(rng.integers(LONG_PROMPT_MIN, args.max_model_len - args.output_len + 1))
        else:
            n = int(rng.choice([int(rng.integers(lo, hi + 1)) for lo, hi in SHORT_PROMPT_RANGES],
                               p=SHORT_PROMPT_P))
        reqs.append(Request(i, tuple(int(t) for t in rng.integers(0, vocab, n)), args.output_len,
                            sampling=SamplingParams(temperature=args.temperature),
                            seed=args.seed * SEED_STRIDE + i))
    # long prompts are spread over the arrival order, not all at the front
    order = rng.permutation(len(reqs))
    return [reqs[j] for j in order]


DEFAULT_PROMPTS = ("The quick brown fox", "Sparse attention reads sixteen pages",
                   "Once upon a time", "A mixture of experts")


def _load_checkpoint(args: argparse.Namespace):
    """(ModelConfig, params, tokenizer or None) of ``--checkpoint``; FlagError if unreadable."""
    from jax_msa_runner.checkpoint import CheckpointError, load
    from jax_msa_runner.tokenizer import load_tokenizer
    try:
        mc, params = load(args.checkpoint, dtype=args.dtype, num_layers=args.num_layers)
        tok = load_tokenizer(args.checkpoint, vocab_size=mc.vocab_size)
    except (CheckpointError, ConfigError, ValueError, OSError) as e:
        raise FlagError("--checkpoint", str(e)) from None
    if args.prompt and tok is None:
        raise FlagError("--prompt", f"needs a tokenizer.json in --checkpoint {args.checkpoint}")
    return dataclasses.replace(mc, index_cache_dtype=args.index_cache_dtype), params, tok


def _text_workload(args: argparse.Namespace, tok, vocab: int) -> list[Request]:
    """One request per text prompt (``--prompt``, else DEFAULT_PROMPTS)."""
    reqs = []
    for i, text in enumerate(args.prompt or DEFAULT_PROMPTS):
        ids = tok.encode(text)
        if not ids or max(ids) >= vocab:
            raise FlagError("--prompt", f"{text!r} tokenizes to {ids[:8]}: needs at least one "
                                        f"token, every id < the model's vocab_size={vocab}")
        reqs.append(Request(i, tuple(ids), args.output_len,
                            sampling=SamplingParams(temperature=args.temperature),
                            seed=args.seed * SEED_STRIDE + i,
                            stop_token_ids=frozenset(tok.eos_token_ids)))
    return reqs


@dataclasses.dataclass(frozen=True)
class DemoPlan:
    """Everything the demo needs, built and checked from the flags before any work starts.

    scheduler: holds every request of the workload (all accepted).
    """

    model: ModelConfig
    runner: RunnerConfig
    num_pages: int
    requests: tuple[Request, ...]
    scheduler: Scheduler
    seed: int
    attention_impl: str | None
    debug: bool
    params: dict | None = None  # a checkpoint's weights (None: random, from seed)
    tokenizer: object | None = None  # a checkpoint's tokenizer: text prompts and outputs


def plan_demo(args: argparse.Namespace) -> DemoPlan:
    """Checks the bounds between the demo's flags and builds the configs and the workload.

    Raises FlagError naming the flag and the bound. Under ``--dcp W`` it first asks for W
    host devices (``request_host_devices``) and then checks that W devices exist.
    """
    W = args.dcp
    params, tok = None, None
    if args.num_processes is None:
        request_host_devices(W * args.tp * args.ep)  # before any weight reaches a device
    init_distributed(args)  # multi-process: every process runs the same (seeded) workload
    if args.checkpoint is not None:
        mc, params, tok = _load_checkpoint(args)
    elif args.prompt:
        raise FlagError("--prompt", "needs --checkpoint DIR with a tokenizer.json")
    if tok is None:  # the synthetic workload's bounds
        if args.long_prompts > args.num_requests:
            raise FlagError("--long-prompts", f"must be <= --num-requests = {args.num_requests}, "
                                              f"got {args.long_prompts}")
        if args.output_len > args.max_model_len - SHORT_PROMPT_MAX:
            raise FlagError("--output-len", f"must be <= --max-model-len - {SHORT_PROMPT_MAX} = "
                            f"{args.max_model_len - SHORT_PROMPT_MAX} (short prompts have up to "
                            f"{SHORT_PROMPT_MAX} tokens), got {args.output_len}")
        if args.long_prompts and args.max_model_len < LONG_PROMPT_MIN + args.output_len:
            raise FlagError("--max-model-len", f"must be >= {LONG_PROMPT_MIN} + --output-len = "
                            f"{LONG_PROMPT_MIN + args.output_len} when --long-prompts > 0 (long "
                            f"prompts have at least {LONG_PROMPT_MIN} tokens), "
                            f"got {args.max_model_len}")
    if W > 1 and args.max_model_len <= W * DCP_INTERLEAVE:
        raise FlagError("--max-model-len", f"must be > --dcp * {DCP_INTERLEAVE} = "
                        f"{W * DCP_INTERLEAVE} (the DCP dummy context), got {args.max_model_len}")
    max_seed = (INT32_MAX - (args.num_requests - 1)) // SEED_STRIDE
    if args.seed > max_seed:
        raise FlagError("--seed", f"must be <= {max_seed} (request seeds seed * {SEED_STRIDE} + "
                        f"index are int32 for {args.num_requests} requests), got {args.seed}")
    layers = {} if args.num_layers is None else dict(
        num_layers=args.num_layers, sparse_attention_freq=(0,) + (1,) * (args.num_layers - 1))
    budget = args.max_num_batched_tokens
    # few buckets keep start-up short; decode batches pad up to the next one
    sizes = tuple(s for s in (8, 32, 128, 512) if s < budget) + (budget,)
    try:
        if params is None:
            mc = ModelConfig.tiny(index_cache_dtype=args.index_cache_dtype, **layers)
        rc = RunnerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=args.max_model_len, bucket_sizes=sizes, dcp_world_size=W,
                          tp_size=args.tp, ep_size=args.ep)
    except ConfigError as e:  # not reachable with the checks above; kept one line all the same
        raise FlagError("--max-num-seqs/--max-num-batched-tokens/--max-model-len/--dcp/"
                        "--num-layers", str(e)) from None
    reqs = _text_workload(args, tok, mc.vocab_size) if tok else _workload(args, mc.vocab_size)
    # the scheduler's need: the last sampled token is never written to the cache
    longest = max(pages_needed(len(r.prompt) + r.max_new_tokens - 1, W) for r in reqs)
    min_pages = len(RESERVED_PAGES) + longest
    per_rank = " per rank" if W > 1 else ""
    if args.num_pages and args.num_pages < min_pages:
        raise FlagError("--num-pages", f"must be 0 (enough for every request at once) or >= "
                        f"{min_pages} ({len(RESERVED_PAGES)} reserved pages plus the longest "
                        f"request's {longest}{per_rank}), got {args.num_pages}")
    num_pages = args.num_pages or (
        len(RESERVED_PAGES) + sum(pages_needed(len(r.prompt) + r.max_new_tokens, W) for r in reqs))
    sched = Scheduler(SchedulerConfig.from_runner(rc, num_pages))
    try:
        for r in reqs:
            sched.add_request(r)
    except RequestRejectedError as e:  # not reachable with the checks above
        raise FlagError("--max-model-len/--output-len/--num-pages", str(e)) from None
    devices = jax.devices()
    if W > len(devices):
        raise FlagError("--dcp", f"{W} ranks need {W} devices, only {len(devices)} available "
                        f"({devices[0].platform}); on CPU start the process with "
                        f"XLA_FLAGS={HOST_DEVICES_FLAG}={W} (set before jax initialises)")
    check_mesh_flags(mc, args.tp, args.ep, W)
    return DemoPlan(model=mc, runner=rc, num_pages=num_pages, requests=tuple(reqs),
                    scheduler=sched, seed=args.seed, attention_impl=args.attention_impl,
                    debug=args.debug, params=params, tokenizer=tok)


def run_demo(plan: DemoPlan) -> int:
    """Serve the planned workload and print the summary; returns a process exit code."""
    mc, rc, num_pages = plan.model, plan.runner, plan.num_pages
    reqs, sched = plan.requests, plan.scheduler
    W = rc.dcp_world_size
    runner = ModelRunner(mc, rc, num_pages=num_pages, seed=plan.seed, params=plan.params,
                         attention_impl=plan.attention_impl, debug=plan.debug)
    print(f"model: {mc.num_layers} layers ({sum(mc.layer_is_msa)} MSA, "
          f"{mc.num_layers - sum(mc.layer_is_msa)} dense), hidden {mc.hidden_size}, heads "
          f"{mc.num_heads}/{mc.num_kv_heads} x {mc.head_dim}, index dim {mc.index_dim} "
          f"({mc.index_cache_jnp_dtype} index-K cache); attention impl: {runner.attention_impl}")
    print(f"runner: {len(runner.buckets)} buckets {[b.num_tokens for b in runner.buckets]}, "
          f"max_num_seqs {rc.max_num_seqs}, max_model_len {rc.max_model_len}, {num_pages} KV pages"
          + (" per rank" if W > 1 else ""))
    if rc.tp_size * rc.ep_size > 1:
        print(f"mesh: dcp {W} x tensor {rc.tp_size} x expert {rc.ep_size} over "
              f"{runner.mesh.devices.size} devices")
    elif W > 1:
        devs = runner.mesh.devices.ravel()
        print(f"dcp: {W} ranks over {[str(d) for d in devs]} (interleave {rc.dcp_interleave}: "
              f"block g on rank g % {W})")
    rep = runner.warm_up()
    peak = f"{rep.peak_bytes / 2**20:.1f} MiB" if rep.peak_bytes else "n/a on this backend"
    print(f"warm-up: compiled {len(rep.buckets)} buckets ({rep.compilations} XLA compilations) in "
          f"{rep.compile_seconds:.1f}s; profiling pass at bucket {tuple(rep.profile_bucket)} "
          f"{rep.profile_seconds * 1e3:.0f} ms, peak device memory {peak}, step temp "
          f"{(rep.step_temp_bytes or 0) / 2**20:.1f} MiB, caches {rep.cache_bytes / 2**20:.1f} MiB")
    for line in runner.memory_report(rep).lines():
        print(line)
    sys.stdout.flush()  # the progress bar goes to stderr
    total = len(reqs)
    validation = "not run (use --debug)"
    with tqdm(total=total, unit="req", desc="serving", dynamic_ncols=True) as bar:
        def progress(s: Scheduler, step: int) -> None:
            bar.set_postfix(step=step, refresh=False)
            bar.update(len(s.finished) - bar.n)

        try:
            stats = serve(runner, sched, on_step=progress)
            if plan.debug:
                validation = f"passed on all {runner.validated_steps} steps"
        except MetadataInvariantError as e:
            bar.close()
            print(f"metadata validation FAILED: {e}")
            return 1
    lat = np.asarray(stats.step_seconds) * 1e3
    longest = max(len(r.prompt) for r in reqs)
    print("summary:")
    print(f"  requests            {len(sched.finished)}/{total} finished "
          f"(longest prompt {longest} tokens, {stats.preemptions} preemptions)")
    print(f"  prompt tokens       {stats.prompt_tokens} ({stats.prompt_tokens / stats.wall_seconds:.1f} tok/s)")
    print(f"  output tokens       {stats.output_tokens} ({stats.output_tokens / stats.wall_seconds:.1f} tok/s)")
    print(f"  steps               {stats.steps} in {stats.wall_seconds:.1f}s; step latency p50 "
          f"{np.percentile(lat, 50):.1f} ms, p99 {np.percentile(lat, 99):.1f} ms")
    print(f"  compilations after warm-up: {stats.compilations}")
    print(f"  metadata validation: {validation}")
    for r in (reqs if plan.tokenizer else ()):
        tok = plan.tokenizer
        print(f"  {tok.decode(r.prompt)!r} -> {tok.decode(sched.finished[r.request_id].output)!r}")
    ok = stats.compilations == 0 and len(sched.finished) == total
    return 0 if ok else 1


def run_demo_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Plans the demo from parsed ``args`` (a bad flag: ``parser.error``, exit 2) and runs it."""
    try:
        plan = plan_demo(args)
    except FlagError as e:
        parser.error(str(e))
    return run_demo(plan)


def main(argv: list[str] | None = None) -> int:
    """``python -m jax_msa_runner.cli.demo [flags]``: the same as ``jax-msa-runner demo``."""
    parser = add_demo_args(FlagParser(prog="python -m jax_msa_runner.cli.demo", description=__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter))
    return run_demo_command(parser, parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

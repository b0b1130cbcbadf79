"""`jax-msa-runner demo`: the tiny default model serves a synthetic workload end to end.

Mixed prompt lengths (a few longer than 2048 tokens, so MSA's top-16 page selection is
live), dozens of requests, tens of output tokens each; a text progress bar; then a summary:
requests, prompt and output tokens/s, step latency p50/p99, compilations after warm-up
(must be 0) and the metadata validation result (``--debug`` validates every step).
``--index-cache-dtype float8_e4m3fn`` keeps the index-K cache in fp8 (default: the model dtype).

``--checkpoint DIR`` serves a Hugging Face MiniMax-M3 checkpoint instead of the tiny model;
when the folder has a tokenizer, the prompts are text (``--prompt``, repeatable) and the
outputs are printed as text.

``--dcp W`` serves with decode context parallelism over W devices (spec section 7): every
request's context is split page-wise over the ranks, ``--num-pages`` counts pages per
rank. On CPU the W devices are host devices: the demo adds
``--xla_force_host_platform_device_count=W`` to ``XLA_FLAGS`` when that flag is absent
(effective only if jax has not started its backend yet); with too few devices it prints
which flag to set and exits with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

from jax_msa_runner.config import (FP8_INDEX_CACHE_DTYPE, RESERVED_PAGES, ModelConfig, RunnerConfig,
                                   SchedulerConfig)
from jax_msa_runner.attention.dcp import DCPError
from jax_msa_runner.serving.kv_cache import pages_needed
from jax_msa_runner.serving.runner import ModelRunner, serve
from jax_msa_runner.serving.scheduler import Request, Scheduler
from jax_msa_runner.batch.validate import MetadataInvariantError


def add_demo_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the demo's flags on ``parser`` (the CLI's ``demo`` subcommand)."""
    g = parser.add_argument_group("demo")
    g.add_argument("--num-requests", type=int, default=32, help="requests in the workload")
    g.add_argument("--long-prompts", type=int, default=2, help="prompts longer than 2048 tokens")
    g.add_argument("--output-len", type=int, default=20, help="max new tokens per request")
    g.add_argument("--max-model-len", type=int, default=2560)
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--max-num-batched-tokens", type=int, default=128, help="token budget per step")
    g.add_argument("--num-pages", type=int, default=0,
                   help="KV pages (0: enough for every request at once)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--attention-impl", choices=("pallas", "reference"), default=None,
                   help="default: pallas on a GPU, reference elsewhere")
    g.add_argument("--num-layers", type=int, default=None,
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
                   help="a text prompt (repeatable; needs a checkpoint with a tokenizer)")
    g.add_argument("--dcp", type=int, default=1, metavar="W",
                   help="decode context parallel ranks (devices); on CPU host devices via "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=W")
    return parser


HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def request_host_devices(world_size: int) -> None:
    """Adds ``--xla_force_host_platform_device_count=world_size`` to XLA_FLAGS unless the
    flag is already there (it only takes effect before jax initialises its backends)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if world_size > 1 and HOST_DEVICES_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {HOST_DEVICES_FLAG}={world_size}".strip()


def _workload(args, vocab: int) -> list[Request]:
    rng = np.random.default_rng(args.seed)
    reqs = []
    long_lo = min(2049, args.max_model_len - args.output_len - 1)
    for i in range(args.num_requests):
        if i < args.long_prompts:
            n = int(rng.integers(long_lo, args.max_model_len - args.output_len + 1))
        else:
            n = int(rng.choice([int(rng.integers(4, 32)), int(rng.integers(32, 160)),
                                int(rng.integers(160, 400))], p=[0.4, 0.4, 0.2]))
        reqs.append(Request(i, tuple(int(t) for t in rng.integers(0, vocab, n)), args.output_len,
                            temperature=args.temperature, seed=args.seed * 100_003 + i))
    # long prompts are spread over the arrival order, not all at the front
    order = rng.permutation(len(reqs))
    return [reqs[j] for j in order]


DEFAULT_PROMPTS = ("The quick brown fox", "Sparse attention reads sixteen pages",
                   "Once upon a time", "A mixture of experts")


def _text_workload(args, tok, vocab: int) -> list[Request]:
    """One greedy request per text prompt (``--prompt``, else DEFAULT_PROMPTS)."""
    reqs = []
    for i, text in enumerate(args.prompt or DEFAULT_PROMPTS):
        ids = tok.encode(text)
        if not ids or max(ids) >= vocab:
            raise ValueError(f"--prompt {text!r}: tokenizes to ids {ids[:8]}..., which must be "
                             f"non-empty and < the model's vocab_size={vocab}")
        reqs.append(Request(i, tuple(ids), args.output_len, temperature=args.temperature,
                            seed=args.seed * 100_003 + i,
                            eos_token_id=tok.eos_token_ids[0] if tok.eos_token_ids else None))
    return reqs


def _bar(done: int, total: int, step: int, width: int = 30) -> str:
    filled = width * done // max(total, 1)
    return f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests, step {step}"


def run_demo(args: argparse.Namespace) -> int:
    """Serve the synthetic workload and print the summary; returns a process exit code."""
    layers = {} if args.num_layers is None else dict(
        num_layers=args.num_layers, sparse_attention_freq=(0,) + (1,) * (args.num_layers - 1))
    params, tok = None, None
    if args.checkpoint:
        from jax_msa_runner.checkpoint import load
        from jax_msa_runner.tokenizer import load_tokenizer
        mc, params = load(args.checkpoint, dtype=args.dtype, num_layers=args.num_layers)
        mc = dataclasses.replace(mc, index_cache_dtype=args.index_cache_dtype)
        tok = load_tokenizer(args.checkpoint)
    else:
        mc = ModelConfig.tiny(index_cache_dtype=args.index_cache_dtype, **layers)
    if args.prompt and tok is None:
        print("error: --prompt needs --checkpoint DIR with a tokenizer.json")
        return 2
    budget = args.max_num_batched_tokens
    # few buckets keep start-up short; decode batches pad up to the next one
    sizes = tuple(s for s in (8, 32, 128, 512) if s < budget) + (budget,)
    W = args.dcp
    request_host_devices(W)
    rc = RunnerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
                      max_model_len=args.max_model_len, bucket_sizes=sizes, dcp_world_size=W)
    try:
        reqs = _text_workload(args, tok, mc.vocab_size) if tok else _workload(args, mc.vocab_size)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    num_pages = args.num_pages or (
        len(RESERVED_PAGES) + sum(pages_needed(len(r.prompt) + r.max_new_tokens, W) for r in reqs))
    try:
        runner = ModelRunner(mc, rc, num_pages=num_pages, seed=args.seed, params=params,
                             attention_impl=args.attention_impl, debug=args.debug)
    except DCPError as e:
        print(f"error: --dcp {W}: {e}. On CPU start the process with "
              f"XLA_FLAGS={HOST_DEVICES_FLAG}={W} (set before jax initialises).")
        return 2
    print(f"model: {mc.num_layers} layers ({sum(mc.layer_is_msa)} MSA, "
          f"{mc.num_layers - sum(mc.layer_is_msa)} dense), hidden {mc.hidden_size}, heads "
          f"{mc.num_heads}/{mc.num_kv_heads} x {mc.head_dim}, index dim {mc.index_dim} "
          f"({mc.index_cache_jnp_dtype} index-K cache); attention impl: {runner.attention_impl}")
    print(f"runner: {len(runner.buckets)} buckets {[b.num_tokens for b in runner.buckets]}, "
          f"max_num_seqs {rc.max_num_seqs}, max_model_len {rc.max_model_len}, {num_pages} KV pages"
          + (" per rank" if W > 1 else ""))
    if W > 1:
        devs = runner.mesh.devices.ravel()
        print(f"dcp: {W} ranks over {[str(d) for d in devs]} (interleave {rc.dcp_interleave}: "
              f"block g on rank g % {W})")
    rep = runner.warm_up()
    peak = f"{rep.peak_bytes / 2**20:.1f} MiB" if rep.peak_bytes else "n/a on this backend"
    print(f"warm-up: compiled {len(rep.buckets)} buckets ({rep.compilations} XLA compilations) in "
          f"{rep.compile_seconds:.1f}s; profiling pass at bucket {tuple(rep.profile_bucket)} "
          f"{rep.profile_seconds * 1e3:.0f} ms, peak device memory {peak}, step temp "
          f"{(rep.step_temp_bytes or 0) / 2**20:.1f} MiB, caches {rep.cache_bytes / 2**20:.1f} MiB")

    sched = Scheduler(SchedulerConfig.from_runner(rc, num_pages))
    for r in reqs:
        sched.add_request(r)
    total = len(reqs)

    def progress(s: Scheduler, step: int) -> None:
        sys.stdout.write(_bar(len(s.finished), total, step))
        sys.stdout.flush()

    validation = "not run (use --debug)"
    try:
        stats = serve(runner, sched, on_step=progress)
        if args.debug:
            validation = f"passed on all {runner.validated_steps} steps"
    except MetadataInvariantError as e:
        print(f"\nmetadata validation FAILED: {e}")
        return 1
    print()
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
    for r in (reqs if tok else ()):
        print(f"  {tok.decode(r.prompt)!r} -> {tok.decode(sched.finished[r.request_id].output)!r}")
    ok = stats.compilations == 0 and len(sched.finished) == total
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = add_demo_args(argparse.ArgumentParser(description=__doc__))
    return run_demo(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

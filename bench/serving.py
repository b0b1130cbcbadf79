"""Decode throughput of the serving step: MSA sparse attention vs dense attention.

    python3 bench/serving.py --out DIR        (H200; defaults below; JSON to DIR/serving.json)

Each point runs the runner's compiled step (``runner.serve_step``: on-device staging via
``stage_packed``, the model, on-device sampling (greedy rows, penalty-state bookkeeping,
top-20 logprobs), in-place cache writes) on a pure decode batch:
B requests, each with L - 1 cached tokens and one new token. Shapes are MiniMax-M3's per
rank at TP4: Hq 16, Hkv 1, head dim 128, index heads 1, index dim 128, hidden 6144, bf16.
A few layers are enough (attention cost is per layer): ``--layers`` (default 4), all MSA in
the sparse loop; the dense loop runs the same weights with every layer on dense paged
attention (``attention_mode="dense"``). The LM head uses a 32768-token vocabulary (its cost
is context independent). Reported: step time (median of ``--iters``), decode tokens/s = B /
step time, the sparse step time at each context relative to the smallest context, and the
pipelined step time (``--iters`` steps dispatched back to back, wall time / iters, median of 3).

``--index-cache-dtype`` (default bfloat16) is a comma-separated list of index-K cache dtypes,
bfloat16 and/or float8_e4m3fn (raw fp8 keys, half the bytes of the indexer's O(L) scan):
the MSA points run once per dtype, the dense points (which never read the index-K cache)
once, with the first dtype listed. Every result row carries its ``index_cache_dtype``; MSA
rows of later dtypes also get ``ratio_vs_first_dtype`` (step time / the first dtype's at the
same B and context). Besides DIR/serving.json the same rows go to DIR/serving.md (a table).

``--command-buffers`` (default xla) is a comma-separated list of names of
``config.COMMAND_BUFFERS``: XLA's command buffers (CUDA graphs) for the step's executable. Each
point runs once per name, the names back to back; every row carries its ``command_buffers``.

    python3 bench/serving.py --out DIR --index-cache-dtype bfloat16,float8_e4m3fn
"""
from __future__ import annotations

import _common  # first: repo root on sys.path, known warnings
import argparse
import dataclasses
import functools
import itertools
import os
import sys
import time

import jax
import numpy as np

from _common import host_latency_s, write_json
from jax_msa_runner.attention.layer import default_attention_impl
from jax_msa_runner.attention.parallel import init_caches
from jax_msa_runner.batch.buckets import Bucket
from jax_msa_runner.batch.staging import pack_host_batch
from jax_msa_runner.config import (COMMAND_BUFFERS, FP8_INDEX_CACHE_DTYPE, RESERVED_PAGES,
                                   ModelConfig, RunnerConfig, xla_compile_options)
from jax_msa_runner.model import init_params
from jax_msa_runner.serving.runner import pack_step_inputs, serve_step
from jax_msa_runner.serving.sampling import SamplingRows, init_penalty_state
from pallas_kernels import PAGE_SIZE

INDEX_CACHE_DTYPES = ("bfloat16", FP8_INDEX_CACHE_DTYPE)


def bench_config(layers: int, index_cache_dtype: str = "bfloat16") -> ModelConfig:
    return ModelConfig(vocab_size=32768, hidden_size=6144, num_layers=layers, num_heads=16,
                       num_kv_heads=1, head_dim=128, rotary_dim=64, rope_theta=5e6,
                       intermediate_size=3072, num_index_heads=1, index_dim=128,
                       sparse_attention_freq=(1,) * layers, moe_layer_freq=(0,) * layers,
                       dtype="bfloat16",
                       index_cache_dtype=index_cache_dtype)


def make_step(bucket, rconfig, mconfig, impl, mode, command_buffers="xla"):
    """The runner's step (``runner.serve_step``) for ``bucket`` with the attention mode exposed
    (the runner serves MSA): (params, caches, penalties, host_buf) -> (step output, caches,
    penalties), caches and penalty state donated, compiled with
    ``COMMAND_BUFFERS[command_buffers]``."""
    step = functools.partial(serve_step, bucket=bucket, rconfig=rconfig, mconfig=mconfig,
                             attention_impl=impl, attention_mode=mode)

    def tokens_and_caches(params, caches, penalties, host_buf):
        out, _, caches, penalties, _ = step(params, caches, penalties, host_buf)
        return out, caches, penalties

    return jax.jit(tokens_and_caches, donate_argnums=(1, 2),
                   compiler_options=xla_compile_options(command_buffers))


def run_point(params, mconfig, batch, context, impl, mode, iters, command_buffers="xla"):
    pages_per_req = context // PAGE_SIZE
    rconfig = RunnerConfig(max_num_seqs=batch, max_num_batched_tokens=batch,
                           max_model_len=context, bucket_sizes=(batch,))
    bucket = Bucket(batch, batch, rconfig.max_pages)
    first = len(RESERVED_PAGES)  # the null and dummy pages come first
    num_pages = first + batch * pages_per_req
    caches = init_caches(mconfig, num_pages, None)
    table = (first + np.arange(batch * pages_per_req)).reshape(batch, pages_per_req)
    packed = pack_host_batch(np.ones(batch, np.int64), np.full(batch, context - 1), table, bucket,
                             rconfig)
    penalties = init_penalty_state(batch, mconfig.vocab_size)
    rows = SamplingRows.neutral(batch)._replace(slot=np.arange(batch, dtype=np.int32))
    buf = jax.device_put(pack_step_inputs(packed, np.arange(batch) % mconfig.vocab_size, rows,
                                          bucket))
    step = make_step(bucket, rconfig, mconfig, impl, mode, command_buffers)
    t0 = time.perf_counter()
    nxt, caches, penalties = step(params, caches, penalties, buf)
    jax.block_until_ready(nxt)
    compile_s = time.perf_counter() - t0
    state = {"caches": caches, "penalties": penalties}
    del caches

    def one_step():
        nxt, state["caches"], state["penalties"] = step(params, state["caches"],
                                                         state["penalties"], buf)
        jax.block_until_ready(nxt)

    times = host_latency_s(one_step, repeats=iters, warmup=2)

    def steps_back_to_back():  # no wait between steps: the device's pace, or the host's
        for _ in range(iters):
            nxt, state["caches"], state["penalties"] = step(params, state["caches"],
                                                             state["penalties"], buf)
        jax.block_until_ready(nxt)

    pipelined = host_latency_s(steps_back_to_back, repeats=3, warmup=0)
    state.clear()
    ms = float(np.median(times) * 1e3)
    return {"mode": mode, "command_buffers": command_buffers,
            "index_cache_dtype": mconfig.index_cache_dtype, "batch": batch,
            "context": context, "step_ms": ms,
            "step_ms_min": float(np.min(times) * 1e3), "tokens_per_s": batch / (ms / 1e3),
            "pipelined_step_ms": float(np.median(pipelined) * 1e3 / iters),
            "compile_s": compile_s, "kv_pages": num_pages}


def parse_names(text: str, allowed, what: str) -> list[str]:
    """'a,b' -> the listed names (each once, in order), all of them in ``allowed``; else an
    argparse error naming ``what`` and the allowed names."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names or any(n not in allowed for n in names):
        raise argparse.ArgumentTypeError(f"{what} must be from {tuple(allowed)}, got {text!r}")
    return names


def parse_index_cache_dtypes(text: str) -> list[str]:
    """'bfloat16,float8_e4m3fn' -> the listed index-K cache dtypes."""
    return parse_names(text, INDEX_CACHE_DTYPES, "index cache dtypes")


def parse_command_buffers(text: str) -> list[str]:
    """'xla,off' -> the listed names of ``COMMAND_BUFFERS``."""
    return parse_names(text, COMMAND_BUFFERS, "command buffers")


def markdown_table(results: list[dict]) -> str:
    """The result rows as a markdown table (one line per point, errors included)."""
    lines = ["| index cache | mode | command buffers | B | context | step ms | tok/s | "
             "vs smallest ctx | vs first dtype | vs first command buffers |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        head = (f"| {r['index_cache_dtype']} | {r['mode']} | {r.get('command_buffers', 'xla')} "
                f"| {r['batch']} | {r['context']} |")
        if "error" in r:
            lines.append(f"{head} ERROR {r['error'][:80].replace('|', '/')} | | | | |")
            continue
        cells = [format(r[key], fmt) if key in r else "-" for key, fmt in (
            ("step_ms", ".3f"), ("tokens_per_s", ".1f"), ("ratio_vs_smallest_context", ".2f"),
            ("ratio_vs_first_dtype", ".2f"), ("ratio_vs_first_command_buffers", ".3f"))]
        lines.append(f"{head} {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["--layer", "real"]:  # the real-shaped layers: bench/real_layer.py's flags
        import real_layer
        return real_layer.main(argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer", choices=("tiny",), default="tiny",
                    help="tiny (this script's layers); `--layer real` as the first flag runs "
                         "bench/real_layer.py with the flags that follow")
    ap.add_argument("--out", required=True, help="directory for serving.json and serving.md")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--layers", type=_common.positive_int, default=4)
    ap.add_argument("--iters", type=_common.positive_int, default=20)
    ap.add_argument("--impl", default=None, choices=("pallas", "reference"))
    ap.add_argument("--modes", default="msa,dense")
    ap.add_argument("--index-cache-dtype", type=parse_index_cache_dtypes, default="bfloat16",
                    help=f"comma-separated index-K cache dtypes from {INDEX_CACHE_DTYPES} "
                         f"(MSA points run once per dtype; dense once, with the first)")
    ap.add_argument("--command-buffers", type=parse_command_buffers, default="xla",
                    help=f"comma-separated names from {', '.join(COMMAND_BUFFERS)}: XLA's "
                         f"command buffers for the step (each point runs once per name)")
    args = ap.parse_args(argv)
    try:
        batches = [_common.positive_int(b) for b in args.batches.split(",")]
        contexts = [_common.positive_int(c) for c in args.contexts.split(",")]
    except argparse.ArgumentTypeError as e:
        ap.error(f"--batches / --contexts: comma-separated integers >= 1: {e}")
    if any(c % PAGE_SIZE for c in contexts):
        ap.error(f"--contexts: each must be a multiple of {PAGE_SIZE}, got {args.contexts}")
    modes = args.modes.split(",")
    if not modes or any(m not in ("msa", "dense") for m in modes):
        ap.error(f"--modes: comma-separated from msa, dense, got {args.modes!r}")
    impl = args.impl or default_attention_impl()
    dtypes = args.index_cache_dtype
    mconfigs = {d: bench_config(args.layers, d) for d in dtypes}
    params = init_params(mconfigs[dtypes[0]], seed=0)  # the same weights for every dtype
    dev = jax.devices()[0]
    results = []
    print(f"device {dev.device_kind}, impl {impl}, {args.layers} layers, bf16, per-rank Hq 16 / Hkv 1 / "
          f"D 128 / Di 128, index cache {','.join(dtypes)}")
    print(f"{'index cache':>13} {'mode':>6} {'cmd buffers':>15} {'B':>4} {'ctx':>7} "
          f"{'step ms':>9} {'tok/s':>10} {'pipelined ms':>14}")
    for mode in modes:
        for dtype in (dtypes if mode == "msa" else dtypes[:1]):
            for b in batches:
                for c, cb in itertools.product(contexts, args.command_buffers):
                    try:
                        r = run_point(params, mconfigs[dtype], b, c, impl, mode, args.iters, cb)
                    except Exception as e:  # noqa: BLE001 - record (e.g. OOM) and keep going
                        r = {"mode": mode, "command_buffers": cb, "index_cache_dtype": dtype,
                             "batch": b, "context": c, "error": f"{type(e).__name__}: {e}"[:500]}
                        print(f"{dtype:>13} {mode:>6} {cb:>15} {b:>4} {c:>7}  "
                              f"ERROR {r['error'][:120]}")
                    else:
                        print(f"{dtype:>13} {mode:>6} {cb:>15} {b:>4} {c:>7} "
                              f"{r['step_ms']:9.3f} {r['tokens_per_s']:10.1f} "
                              f"{r['pipelined_step_ms']:14.3f}")
                    results.append(r)
                    sys.stdout.flush()

    def msa_row(dtype, b, c, cb):
        return next((r for r in results if r["mode"] == "msa" and r["index_cache_dtype"] == dtype
                     and r["batch"] == b and r["context"] == c and r["command_buffers"] == cb
                     and "step_ms" in r), None)

    for r in results:
        if r["mode"] != "msa" or "step_ms" not in r:
            continue
        # flatness of the sparse step: step time at each context / at the smallest context
        cb = r["command_buffers"]
        base = msa_row(r["index_cache_dtype"], r["batch"], contexts[0], cb)
        if base:
            r["ratio_vs_smallest_context"] = r["step_ms"] / base["step_ms"]
        first = msa_row(dtypes[0], r["batch"], r["context"], cb)
        if first and r["index_cache_dtype"] != dtypes[0]:
            r["ratio_vs_first_dtype"] = r["step_ms"] / first["step_ms"]
        first = msa_row(r["index_cache_dtype"], r["batch"], r["context"], args.command_buffers[0])
        if first and cb != args.command_buffers[0]:
            r["ratio_vs_first_command_buffers"] = r["step_ms"] / first["step_ms"]
    out = {"timer": "step latency: wall time of one serving step, block_until_ready each, "
                    f"median of {args.iters} after 2 warm-up steps (host staging included)",
           "impl": impl, "layers": args.layers, "dtype": "bfloat16", "index_cache_dtypes": dtypes,
           "model": dataclasses.asdict(mconfigs[dtypes[0]]), "iters": args.iters,
           "results": results}
    path = os.path.join(args.out, "serving.json")
    write_json(path, out)
    md_path = os.path.join(args.out, "serving.md")
    with open(md_path, "w") as f:
        f.write(f"{dev.device_kind}, impl {impl}, {args.layers} layers, bf16 model, median of "
                f"{args.iters} steps\n\n" + markdown_table(results))
    print(f"wrote {path} and {md_path}")

if __name__ == "__main__":
    main()

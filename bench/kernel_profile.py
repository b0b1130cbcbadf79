"""Kernel durations of ours and vLLM's indexer and decode under Nsight Compute (H200).

Subcommands (driven by `bench/kernel_profile.sh` on the GPU machine):
  target  runs, for each shape of --shapes (indices into bench/_shapes_inputs.all_shapes), our
          fused indexer+select, our separate scores and select kernels, the Mosaic GPU
          indexer+select (--mgpu-ctas: its scores kernel's grid), our decode, then
          vLLM's indexer and decode, each --launches times, in that order; writes the plan to
          --out/plan.json. Run it under ncu with the kernel filter of kernel_profile.sh.
  table   reads ncu's CSV (--csv --page raw) and the plan, and writes a markdown table of the
          median duration of each kernel per (shape, side, op) plus the sums per op.

ncu replays each kernel alone with cold caches (its default cache control), so the sums are
GPU work without the gaps between dependent kernels and without launch overlap (vLLM's
programmatic dependent launch); the wall-clock comparison is bench/kernels.py.
"""
from __future__ import annotations

import _common  # noqa: F401  (first: repo root on sys.path, known warnings)
import argparse
import csv
import io
import json
import os
import statistics
import sys

import jax

from _shapes_inputs import all_shapes, make_inputs, our_decode, our_indexer
from pallas_kernels import TOPK
from pallas_kernels.index_scores import msa_index_scores
from pallas_kernels.topk_select import sparse_topk_select
from pallas_kernels.index_select import num_valid_pages_of
from pallas_kernels.index_select_mgpu import msa_index_select_mgpu

# kernel name (as ncu prints it, a prefix) -> (side, op)
KERNELS = {  # first match wins: the Mosaic GPU names extend the Triton ones
    "msa_index_scores_mgpu": ("ours", "indexer mgpu"),
    "msa_topk_select_mgpu": ("ours", "indexer mgpu"),
    "msa_index_select": ("ours", "indexer"), "msa_index_scores": ("ours", "scores+select"),
    "sparse_topk_select": ("ours", "scores+select"), "msa_sparse_decode": ("ours", "decode"),
    "_decode_index_score_kernel": ("vllm", "indexer"),
    "_topk_index_partial_kernel": ("vllm", "indexer"),
    "_topk_index_merge_kernel": ("vllm", "indexer"),
    "_gqa_sparse_decode_kernel": ("vllm", "decode"),
    "_merge_topk_attn_out_kernel": ("vllm", "decode"),
}
MARKER = "profile_marker"  # one tiny kernel launched before each shape's kernels
NCU_FILTER = "regex:" + "|".join([MARKER, *KERNELS])


def _marker():
    """A jitted one-element Pallas kernel named MARKER (splits ncu's stream into shapes)."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    def kernel(o_ref):
        o_ref[...] = jnp.ones_like(o_ref)

    out_shape = jax.ShapeDtypeStruct((16,), jnp.float32)
    return jax.jit(lambda: pl.pallas_call(kernel, out_shape=out_shape, name=MARKER,
                                          **_common.PALLAS_KW)())


def target(args) -> int:
    import torch

    import _vllm_timing as vt
    from kernels import vllm_calls

    ops = vt.load_ops(args.vllm_ops)
    shapes = [all_shapes()[int(i)] for i in args.shapes.split(",")]
    scores_fn = jax.jit(lambda x: msa_index_scores(x["index_q"], x["index_k"], x["block_table"],
                                                   x["req_indices"], x["positions"],
                                                   **_common.PALLAS_KW))
    select_fn = jax.jit(lambda s, pos: sparse_topk_select(s, num_valid_pages_of(pos),
                                                          topk=TOPK, **_common.PALLAS_KW))
    mgpu_fn = jax.jit(lambda x: msa_index_select_mgpu(
        x["index_q"], x["index_k"], x["block_table"], x["req_indices"], x["positions"],
        num_ctas=args.mgpu_ctas))
    indexer, decode = jax.jit(our_indexer), jax.jit(our_decode)
    n = args.launches
    marker = _marker()
    for shape in shapes:  # after the marker, every kernel of a shape launches n times (vLLM's
        x = make_inputs(shape, args.seed)  # autotuned kernels more, the first time)
        jax.block_until_ready(marker())
        for _ in range(n):
            selected = jax.block_until_ready(indexer(x))
        for _ in range(n):
            scores = jax.block_until_ready(scores_fn(x))
            jax.block_until_ready(select_fn(scores, x["positions"]))
        for _ in range(n):
            jax.block_until_ready(mgpu_fn(x))
        for _ in range(n):
            jax.block_until_ready(decode(x, selected))
        calls, tensors = vllm_calls(vt, ops, x, None, selected, shape)
        for op in ("indexer", "decode"):
            _label, fn = calls[op][0]
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
        del x, selected, scores, calls, tensors
    os.makedirs(args.out, exist_ok=True)
    plan = {"shapes": [s.name for s in shapes], "launches": n}
    with open(os.path.join(args.out, "plan.json"), "w") as f:
        json.dump(plan, f)
    print(json.dumps(plan))
    return 0


def _num(text: str) -> float:
    """ncu's CSV number ("9,312" has a thousands separator)."""
    return float(text.replace(",", ""))


def _rows(csv_text: str) -> list[dict]:
    start = csv_text.find('"ID"')
    reader = csv.DictReader(io.StringIO(csv_text[start:]))
    return [r for r in reader if r.get("ID", "").isdigit()]


def table(args) -> int:
    with open(args.plan) as f:
        plan = json.load(f)
    with open(args.csv) as f:
        rows = _rows(f.read())
    per = plan["launches"]
    data: dict = {}
    shape_i = -1
    for r in sorted(rows, key=lambda r: int(r["ID"])):
        name = r["Kernel Name"]
        if name.startswith(MARKER):
            shape_i += 1
            continue
        key = next((k for k in KERNELS if name.startswith(k)), None)
        if key is None or shape_i < 0:
            continue
        side, op = KERNELS[key]
        cell = data.setdefault(plan["shapes"][shape_i], {}).setdefault((side, op), {}).setdefault(
            key, {"us": [], "grid": r.get("launch__grid_size"),
                  "regs": r.get("launch__registers_per_thread"), "dram_mb": []})
        cell["us"].append(_num(r["gpu__time_duration.sum"]) / 1e3)  # ns -> us
        if r.get("dram__bytes.sum"):
            cell["dram_mb"].append(_num(r["dram__bytes.sum"]) / 1e6)
    for ops in data.values():  # the last `per` launches: autotuning runs come first
        for kernels in ops.values():
            for c in kernels.values():
                c["us"], c["dram_mb"] = c["us"][-per:], c["dram_mb"][-per:]
    lines = ["| shape | side | op | kernel | grid | regs | median us | DRAM MB |",
             "|---|---|---|---|---|---|---|---|"]
    summary = {}
    for shape, ops in data.items():
        for (side, op), kernels in ops.items():
            total = 0.0
            for key, c in kernels.items():
                med = statistics.median(c["us"])
                total += med
                mb = statistics.median(c["dram_mb"]) if c["dram_mb"] else float("nan")
                lines.append(f"| {shape} | {side} | {op} | {key} | {c['grid']} | {c['regs']} | "
                             f"{med:.2f} | {mb:.2f} |")
            summary.setdefault(shape, {})[f"{side} {op}"] = round(total, 2)
    lines += ["", "| shape | " + " | ".join(
        ["ours indexer", "ours scores+select", "ours indexer mgpu", "vllm indexer",
         "ours decode", "vllm decode"]) + " |", "|---" * 7 + "|"]
    for shape, s in summary.items():
        lines.append(f"| {shape} | " + " | ".join(
            f"{s.get(k, float('nan')):.2f}" for k in (
                "ours indexer", "ours scores+select", "ours indexer mgpu", "vllm indexer",
                "ours decode", "vllm decode")) + " |")
    text = "\n".join(lines)
    print(text)
    with open(args.md, "w") as f:
        f.write(text + "\n")
    with open(os.path.splitext(args.md)[0] + ".json", "w") as f:
        json.dump({"plan": plan, "sum_us": summary}, f, indent=1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("target")
    t.add_argument("--shapes", default="0,1,2,5,7,9")
    t.add_argument("--launches", type=_common.positive_int, default=3)
    t.add_argument("--vllm-ops", default=".vllm_ops")
    t.add_argument("--mgpu-ctas", type=_common.positive_int, default=None)
    t.add_argument("--seed", type=_common.non_negative_int, default=0)
    t.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    s = sub.add_parser("table")
    s.add_argument("--csv", required=True)
    s.add_argument("--plan", required=True)
    s.add_argument("--md", required=True)
    args = p.parse_args(argv)
    return target(args) if args.cmd == "target" else table(args)


if __name__ == "__main__":
    sys.exit(main())

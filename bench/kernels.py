"""H200 benchmark of the MSA kernels against vLLM 0.33.0's Triton ops, both timed as GPU work.

Shapes (bench/_shapes_inputs.py): Hq/Hkv 16/1 and 64/4, B decode tokens in 1/16/64/128, every
request at context L in 8192/65536; random bf16 data, random page permutation. Per shape, on
the same device buffers (DLPack) in one process:
  * indexer + select, bf16: ours `msa_index_select_default` (Mosaic GPU at B <= 16, the
    Triton scores + the Mosaic select at B=16 L=65536, Triton above) vs vLLM's
    `minimax_m3_index_decode`;
    bytes = the visible index-K rows, B*L*128*2;
  * indexer + select, fp8 (ours the same default): the same e4m3 index queries (bf16 rounded
    to e4m3) over the same e4m3 index-K cache on both sides, an fp8 x fp8 dot on each;
    bytes B*L*128 (on the L=65536 shapes unless --fp8 all);
  * sparse decode: ours `sparse_decode_default` (Mosaic GPU at every shape) vs
    vLLM's `minimax_m3_sparse_attn_decode`, both on OUR selection; bytes = K and V of 16
    pages per KV head, B*Hkv*16*128*256*2;
  * the copy bandwidth (the roofline) in the same process.

Timing (every figure GPU work after a 512 MiB L2 flush, medians over --rounds x --trials):
  * ours: (flush; optimization_barrier; op) looped 10 x inside ONE XLA executable, the GPU's
    global timer read inside it before and after the loop, dispatched --reps / 10 x, minus
    the executable of 10 flushes as often (bench/_common.time_jax, cold L2);
  * vLLM: the faster of (graph) a CUDA graph of (flush; op) replayed --reps times minus a
    flush-only graph, and (eager) --reps x (flush x k; op) issued asynchronously minus
    --reps x (flush x k), valid only where the host time per iteration stayed under the flush
    time (printed and recorded per op). bench/_vllm_timing.py.
Ratios are vLLM time / our time (> 1: ours faster). Each of our ops also gets its XLA kernel
count (bench/_common.hlo_kernel_count).

Usage (GPU machine, carry .vllm_ops):  python3 bench/kernels.py --out DIR [--vllm-ops .vllm_ops]
CPU check of the JAX side (interpret mode, one tiny shape, no vLLM):  --cpu-smoke
Writes DIR/kernels.json, DIR/kernels.md (tables for RESULTS.md) and DIR/roofline.png.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import _common  # noqa: E402  (first: repo root on sys.path, known warnings)
import argparse  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Mapping  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from _common import (FLUSH_BYTES, KERNEL_COUNT_DOC, compile_op, geomean,  # noqa: E402
                     hlo_kernel_count, median_us, rel_l2, time_jax, timer_description)
from _shapes_inputs import (FP8, HEAD_DIM, Shape, all_shapes, make_inputs,  # noqa: E402
                            our_decode, our_indexer)
from pallas_kernels import TOPK  # noqa: E402
from pallas_kernels.index_select import msa_index_select, msa_index_select_reference  # noqa: E402
from pallas_kernels.sparse_decode import sparse_decode, sparse_decode_reference  # noqa: E402
from pallas_kernels.sparse_decode_default import decode_backend  # noqa: E402

OPS = ("indexer", "indexer_fp8", "decode")
OP_LABEL = {"indexer": "idx+sel bf16", "indexer_fp8": "idx+sel fp8", "decode": "decode"}
SMOKE_SHAPE = Shape(16, 1, 2, 4096)


def selection_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of (token, head) rows whose selected sets (ignoring -1) are equal."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise ValueError(f"selections: shapes differ, {a.shape} vs {b.shape}")
    rows = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    same = [set(x[x >= 0].tolist()) == set(y[y >= 0].tolist()) for x, y in zip(*rows)]
    return float(np.mean(same))


def selection_overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over (token, head) rows of |A & B| / |A| (valid ids of a and b; 1 for empty A)."""
    a, b = np.asarray(a), np.asarray(b)
    rows = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    fr = [len(set(x[x >= 0].tolist()) & set(y[y >= 0].tolist())) / max((x >= 0).sum(), 1)
          for x, y in zip(*rows)]
    return float(np.mean(fr))


def op_bytes(shape: Shape) -> dict:
    return {"indexer": shape.indexer_bytes(2), "indexer_fp8": shape.indexer_bytes(1),
            "decode": shape.decode_bytes}


# --------------------------------------------------------------------------- vLLM side

def best_valid(graph: dict | None, eager: dict | None) -> tuple[float | None, str]:
    """The faster of the valid vLLM medians: (seconds, "graph" | "eager"), or (None, why).
    Each is valid only where it stayed GPU-bound (host time per iteration < flush time)."""
    cands = []
    if graph is not None and graph["gpu_bound"]:
        cands.append((statistics.median(graph["samples_s"]), "graph"))
    if eager is not None and eager["gpu_bound"]:
        cands.append((statistics.median(eager["samples_s"]), "eager"))
    if not cands:
        return None, "no valid timing (graph not captured or host-bound, eager host-bound)"
    return min(cands)


def fp8_inputs(x: dict) -> dict:
    """``x`` with e4m3 index queries and an e4m3 index-K cache (the same values both sides)."""
    return dict(x, index_q=x["index_q"].astype(FP8), index_k=x["index_k"].astype(FP8))


def vllm_calls(vt, ops, x: dict, x8: dict | None, selected, shape: Shape) -> tuple[dict, dict]:
    """Per op, candidate (label, zero-argument closure) pairs of vLLM's ops on our inputs, the
    first that runs is timed; and the torch tensors they hold. The fp8 indexer runs vLLM's
    native e4m3 x e4m3 path, falling back to bf16 queries over the e4m3 cache (its upcast
    path) only if that fails."""
    import torch

    t = {k: vt.to_torch(v) for k, v in x.items()}
    sel = vt.to_torch(selected).transpose(0, 1).contiguous()  # [Hkv, B, 16], as vLLM's
    t["out"] = torch.empty_like(t["q"])
    t["sel"] = sel

    def index(iq, ik):
        return ops.index_decode(iq, ik, t["block_table"], t["seq_lens"], shape.context, TOPK,
                                0, 1, shape.hkv, 1, 1)

    calls = {"indexer": [("bf16", lambda: index(t["index_q"], t["index_k"]))],
             "decode": [("bf16", lambda: ops.sparse_attn_decode(
                 t["q"], t["kv"], sel, t["block_table"], t["seq_lens"], shape.hkv,
                 HEAD_DIM ** -0.5, t["out"], 1))]}
    if x8 is not None:
        t["index_q_fp8"] = vt.to_torch(x8["index_q"])
        t["index_k_fp8"] = vt.to_torch(x8["index_k"])
        calls["indexer_fp8"] = [
            ("e4m3 queries, e4m3 cache", lambda: index(t["index_q_fp8"], t["index_k_fp8"])),
            ("bf16 queries, e4m3 cache", lambda: index(t["index_q"], t["index_k_fp8"]))]
    return calls, t


def vllm_prepare(vt, timer, calls: dict) -> dict:
    """Per op: the first candidate that runs (its output, graphs, host time per eager call),
    or the errors of all."""
    import torch

    state = {}
    for name, candidates in calls.items():
        s, failed = None, []
        for label, call in candidates:
            try:
                result = call()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - recorded per op, the run goes on
                failed.append(f"{label}: {type(e).__name__}: {e}"[:400])
                continue
            s = {"call": call, "variant": label, "result": result}
            break
        if s is None:
            state[name] = {"err": " | ".join(failed)}
            continue
        if failed:
            s["failed"] = failed
        try:
            s["graphs"] = timer.capture(s["call"])
        except Exception as e:  # noqa: BLE001 - eager timing may still be valid
            s["graph_err"] = f"{type(e).__name__}: {e}"[:400]
            torch.cuda.synchronize()
        s["host_us"] = timer.host_us(s["call"])
        state[name] = s
    return state


def vllm_time(timer, state: dict, *, n: int, trials: int, acc: dict) -> None:
    """One round of graph and eager samples per op, appended to acc[op]."""
    for name, s in state.items():
        if "err" in s:
            continue
        a = acc.setdefault(name, {"graph": [], "eager": [], "graph_host_us": [],
                                  "eager_host_us": [], "flush_us": [], "flush_repeats": []})
        if "graphs" in s:
            g = timer.time_graph(s["graphs"], n=n, trials=trials)
            a["graph"] += g["samples_s"]
            a["graph_host_us"].append(g["host_us_per_replay"])
        e = timer.time_eager(s["call"], n=n, trials=trials, host_us=s["host_us"])
        a["eager"] += e["samples_s"]
        a["eager_host_us"].append(e["host_us_per_iter"])
        a["flush_us"].append(e["flush_us"])
        a["flush_repeats"].append(e["flush_repeats"])


def vllm_summary(acc: dict, state: dict, flush_us: float) -> dict:
    """Per op: both timings with their GPU-bound checks and the figure used."""
    out = {}
    for name, s in state.items():
        if "err" in s:
            out[name] = {"err": s["err"]}
            continue
        a = acc[name]
        graph = ({"samples_s": a["graph"],
                  "host_us_per_replay": max(a["graph_host_us"]),
                  "gpu_bound": max(a["graph_host_us"]) < flush_us} if a["graph"] else None)
        eager_host = max(a["eager_host_us"])
        flush_k = min(a["flush_us"])
        eager = {"samples_s": a["eager"], "op_host_us": s["host_us"],
                 "host_us_per_iter": eager_host, "flush_us": flush_k,
                 "flush_repeats": max(a["flush_repeats"]), "gpu_bound": eager_host < flush_k}
        best, method = best_valid(graph, eager)
        r = {"us": None if best is None else best * 1e6, "method": method,
             "variant": s.get("variant"), **({"failed": s["failed"]} if "failed" in s else {})}
        if graph:
            r["graph"] = {"us": median_us(graph["samples_s"]),
                          "samples_us": [round(v * 1e6, 2) for v in graph["samples_s"]],
                          "host_us_per_replay": round(graph["host_us_per_replay"], 2),
                          "gpu_bound": graph["gpu_bound"]}
        else:
            r["graph"] = {"err": s.get("graph_err", "not captured")}
        r["eager"] = {"us": median_us(eager["samples_s"]),
                      "samples_us": [round(v * 1e6, 2) for v in eager["samples_s"]],
                      **{k: (round(v, 2) if isinstance(v, float) else v)
                         for k, v in eager.items() if k != "samples_s"}}
        out[name] = r
    return out


# --------------------------------------------------------------------------- one shape

def ours_summary(timings: list) -> dict:
    """Median over every round's samples, and the dispatch check of the worst round."""
    samples = [x for t in timings for x in t.samples_s]
    return {"l2": "cold", "us": median_us(samples),
            "samples_us": [round(x * 1e6, 2) for x in samples],
            "host_us_per_dispatch": round(max(t.host_us_per_dispatch for t in timings), 2),
            "flush_us": round(min(t.flush_us for t in timings), 2),
            "calls_per_dispatch": timings[0].calls_per_dispatch,
            "gpu_clock": all(t.clock for t in timings),
            "gpu_bound": all(t.gpu_bound for t in timings)}


def bench_shape(shape: Shape, vllm, *, reps: int, trials: int, rounds: int, seed: int,
                fp8: bool, reference_check: bool,
                xla_options: Mapping[str, str] = _common.NO_COMMAND_BUFFERS) -> dict:
    """Both sides on the same inputs, interleaved over ``rounds``; medians of all samples.
    ``xla_options``: XLA compiler options of our timed executables (``time_jax``'s)."""
    x = make_inputs(shape, seed)
    x8 = fp8_inputs(x) if fp8 else None
    ours = {"indexer": (our_indexer, (x,))}
    if fp8:
        ours["indexer_fp8"] = (our_indexer, (x8,))
    row = {"hq": shape.hq, "hkv": shape.hkv, "batch": shape.batch, "context": shape.context,
           "bytes": {k: v for k, v in op_bytes(shape).items() if k in OPS},
           "decode_backend": decode_backend(shape.batch * shape.hkv, shape.hq, shape.hkv,
                                            HEAD_DIM, x["q"].dtype,
                                            interpreting=not _common.ON_GPU)}
    compiled, results = {}, {}
    for name, (f, a) in ours.items():
        compiled[name] = compile_op(f, *a)
        results[name] = jax.block_until_ready(compiled[name](*a))
    selected = results["indexer"]
    ours["decode"] = (our_decode, (x, selected))
    compiled["decode"] = compile_op(our_decode, x, selected)
    results["decode"] = jax.block_until_ready(compiled["decode"](x, selected))
    row["kernels"] = {k: hlo_kernel_count(c.as_text()) for k, c in compiled.items()}
    del compiled
    if reference_check:  # CPU smoke: our outputs against the jnp references
        ref_sel = msa_index_select_reference(x["index_q"], x["index_k"], x["block_table"],
                                             x["req_indices"], x["positions"])
        ref_out, _ = sparse_decode_reference(x["q"], x["kv"], selected, x["block_table"],
                                             x["req_indices"], x["kv_lens"],
                                             scale=HEAD_DIM ** -0.5)
        row["reference_check"] = {
            "selection_agree": selection_agreement(selected, ref_sel),
            "decode_rel_l2": rel_l2(np.asarray(results["decode"][0], np.float32),
                                    np.asarray(ref_out, np.float32))}

    calls = state = tensors = None
    acc: dict = {}
    if vllm is not None:
        vt, ops, timer = vllm
        try:
            calls, tensors = vllm_calls(vt, ops, x, x8, selected, shape)
            state = vllm_prepare(vt, timer, calls)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: the row records it
            row["vllm_err"] = f"{type(e).__name__}: {e}"[:400]
            calls = None
    timings = {k: [] for k in ours}
    for _ in range(rounds):  # interleaved: each round times every op on both sides
        for name, (f, a) in ours.items():
            timings[name].append(time_jax(f, a, n=reps, trials=trials, l2="cold",
                                          compiler_options=xla_options))
        if calls is not None:
            vllm_time(timer, state, n=reps, trials=trials, acc=acc)
    row["ours"] = {k: ours_summary(v) for k, v in timings.items()}
    if calls is not None:
        row["vllm"] = vllm_summary(acc, state, timer.flush_us)
        agree, overlap = {}, {}
        for name in ("indexer", "indexer_fp8"):
            if name in state and "result" in state[name]:
                theirs = vt.transpose_selection(state[name]["result"])
                agree[name] = selection_agreement(np.asarray(results[name]), theirs)
                overlap[name] = selection_overlap(np.asarray(results[name]), theirs)
        row["selection_agree"] = agree  # rows with identical sets
        row["selection_overlap"] = overlap  # mean share of common picks per row
        if "decode" in state and "result" in state["decode"]:
            row["decode_rel_l2_vs_vllm"] = rel_l2(
                np.asarray(results["decode"][0], np.float32),
                tensors["out"].float().cpu().numpy())
        row["ratio"] = {k: row["vllm"][k]["us"] / row["ours"][k]["us"] for k in row["ours"]
                        if row["vllm"].get(k, {}).get("us")}
    del calls, state, tensors, x, x8, results, selected, ours
    gc.collect()
    if vllm is not None:
        import torch
        torch.cuda.empty_cache()
    return row


SWEEP_KERNELS = ("decode", "index_select", "index_select_fp8")


def sweep_shape(shape: Shape, *, reps: int, trials: int, seed: int,
                kernels: tuple = SWEEP_KERNELS) -> list[dict]:
    """Our kernels' launch tunables on one shape (median us per config, cold L2); ``kernels``
    picks among SWEEP_KERNELS (index_select_fp8: e4m3 queries over the e4m3 cache)."""
    x = make_inputs(shape, seed)
    selected = jax.block_until_ready(jax.jit(our_indexer)(x))
    rows = []

    def timed(kernel, f, args, kw):
        try:
            us = time_jax(f, args, n=reps, trials=trials, l2="cold").us
            rows.append({"kernel": kernel, **kw, "us": round(us, 2)})
        except Exception as e:  # noqa: BLE001 - e.g. a configuration over shared memory
            rows.append({"kernel": kernel, **kw, "err": repr(e)[:200]})

    # (keys_per_step, num_splits, num_warps, num_stages). Stages must fit 227 KiB:
    # 128 keys = 64 KiB/stage (<= 3), 64 keys = 32 KiB/stage (<= 6).
    decode_grid = ([(128, sp, 4, st) for sp in (1, 2, 4, 8, 16) for st in (2, 3)]
                   + [(64, sp, 4, 4) for sp in (2, 8)])
    for kps, splits, warps, stages in decode_grid if "decode" in kernels else ():
        kw = dict(keys_per_step=kps, num_splits=splits, num_warps=warps, num_stages=stages)
        timed("decode", lambda x, sel, kw=kw: sparse_decode(
            x["q"], x["kv"], sel, x["block_table"], x["req_indices"], x["kv_lens"],
            scale=HEAD_DIM ** -0.5, **kw, **_common.PALLAS_KW), (x, selected), kw)
    index_grid = [(ppp, w, st) for ppp in (1, 2, 4, 8, 16, 32)
                  for w, st in ((2, 3), (4, 2), (4, 3))]
    fp8_grid = [(ppp, w, st) for ppp in (4, 8, 16, 32, 64)
                for w, st in ((4, 3), (4, 4), (8, 3), (8, 4))]
    x8 = fp8_inputs(x) if "index_select_fp8" in kernels else None
    for kernel, inputs, grid in (("index_select", x, index_grid),
                                 ("index_select_fp8", x8, fp8_grid)):
        for ppp, warps, stages in grid if kernel in kernels else ():
            kw = dict(pages_per_program=ppp, num_warps=warps, num_stages=stages)
            timed(kernel, lambda x, kw=kw: msa_index_select(
                x["index_q"], x["index_k"], x["block_table"], x["req_indices"],
                x["positions"], **kw, **_common.PALLAS_KW), (inputs,), kw)
    del x, x8
    return rows


# --------------------------------------------------------------------------- output

def _us(v) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def _ratio(r: dict, op: str) -> str:
    v = r.get("ratio", {}).get(op)
    return "n/a" if v is None else f"{v:.2f}x"


def markdown(result: dict) -> str:
    meta, bw = result["meta"], result["copy"]["copy_Bps"]
    vs = result.get("vllm_versions", {})
    lines = [
        f"Date {meta['date']}; device {meta['device']}; jax {meta['jax']}"
        + (f", torch {vs['torch']}, triton {vs['triton']}, vLLM 0.33.0 ops" if vs else "")
        + f"; copy bandwidth {bw / 1e12:.2f} TB/s (read + write, same run).", "",
        f"- Ours: {result['timing']['ours']}.",
        f"- vLLM: {result['timing']['vllm']}.",
        f"- Ratio = vLLM time / our time (> 1: ours faster). {KERNEL_COUNT_DOC}.",
        "- Selections compared as sets per (token, KV head): agree = share of identical rows; "
        "fp8 overlap = mean share of common picks (both sides: e4m3 queries over the e4m3 "
        "cache).", "",
        "| Hq/Hkv | B | L | idx+sel us ours | vLLM | ratio | % copy | fp8 idx+sel us ours "
        "| vLLM fp8 | ratio | decode us ours | vLLM | ratio | % copy | XLA kernels idx/fp8/dec "
        "| sel agree bf16/fp8 (overlap fp8) | decode rel-L2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        o, v, k = r["ours"], r.get("vllm", {}), r["kernels"]
        get = lambda d, op: (d.get(op) or {}).get("us")  # noqa: E731
        pct = lambda op: (f"{100 * r['bytes'][op] / (o[op]['us'] * 1e-6) / bw:.0f}%"  # noqa: E731
                          if op in o else "n/a")
        agree, overlap = r.get("selection_agree", {}), r.get("selection_overlap", {})
        fmt = lambda v: "n/a" if v is None else f"{v:.3g}"  # noqa: E731
        lines.append(
            f"| {r['hq']}/{r['hkv']} | {r['batch']} | {r['context']} "
            f"| {_us(get(o, 'indexer'))} | {_us(get(v, 'indexer'))} | {_ratio(r, 'indexer')} "
            f"| {pct('indexer')} "
            f"| {_us(get(o, 'indexer_fp8'))} | {_us(get(v, 'indexer_fp8'))} "
            f"| {_ratio(r, 'indexer_fp8')} "
            f"| {_us(get(o, 'decode'))} | {_us(get(v, 'decode'))} | {_ratio(r, 'decode')} "
            f"| {pct('decode')} "
            f"| {'/'.join(str(k[op]['total']) if op in k else '-' for op in OPS)} "
            f"| {fmt(agree.get('indexer'))}/{fmt(agree.get('indexer_fp8'))} "
            f"({fmt(overlap.get('indexer_fp8'))}) "
            f"| {r.get('decode_rel_l2_vs_vllm', float('nan')):.1e} |")
    for op in OPS:
        ratios = [r["ratio"][op] for r in result["rows"] if op in r.get("ratio", {})]
        if ratios:
            lines.append(f"\n{OP_LABEL[op]}: geometric-mean ratio {geomean(ratios):.2f}x, "
                         f"min {min(ratios):.2f}x, {sum(x >= 1 for x in ratios)}/{len(ratios)} "
                         f"shapes >= 1.0x.")
    fallback = [f"{r['hq']}/{r['hkv']} B={r['batch']} L={r['context']}" for r in result["rows"]
                if "failed" in r.get("vllm", {}).get("indexer_fp8", {})]
    if fallback:
        lines.append(f"\nvLLM's e4m3 x e4m3 indexer failed at {', '.join(fallback)} (errors in "
                     f"the JSON); its fp8 figures there time bf16 queries over the e4m3 cache.")
    if any("vllm" in r for r in result["rows"]):
        lines += ["", "vLLM timing per op: graph and eager medians (us); eager is valid only "
                  "where its host time per iteration < its flush time (GPU-bound).", "",
                  "| shape | op | graph us | graph host us/replay | eager us | eager host us/iter "
                  "| flush us (x k) | eager GPU-bound | used |", "|---|---|---|---|---|---|---|---|---|"]
        for r in result["rows"]:
            for op, d in sorted(r.get("vllm", {}).items(), key=lambda kv: OPS.index(kv[0])):
                name = f"{r['hq']}/{r['hkv']} B={r['batch']} L={r['context']}"
                if "err" in d:
                    lines.append(f"| {name} | {op} | error: {d['err'][:80]} | | | | | | |")
                    continue
                g, e = d["graph"], d["eager"]
                lines.append(
                    f"| {name} | {op} | {_us(g.get('us'))} | {g.get('host_us_per_replay', 'n/a')} "
                    f"| {_us(e['us'])} | {e['host_us_per_iter']:.1f} "
                    f"| {e['flush_us']:.1f} (x{e['flush_repeats']}) "
                    f"| {'yes' if e['gpu_bound'] else 'NO'} | {d['method']} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> str:
    """Achieved GB/s against bytes per call, both sides, with the copy roofline."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no roofline plot: {e}"
    bw = result["copy"]["copy_Bps"] / 1e9
    fig, ax = plt.subplots(figsize=(8, 5))
    markers = {"indexer": "o", "indexer_fp8": "^", "decode": "s"}
    for side, fill in (("ours", "full"), ("vllm", "none")):
        for op in OPS:
            pts = [(r["bytes"][op], r["bytes"][op] / (r[side][op]["us"] * 1e-6) / 1e9)
                   for r in result["rows"] if (r.get(side, {}).get(op) or {}).get("us")]
            if pts:
                ax.plot(*zip(*pts), ls="", marker=markers[op], fillstyle=fill,
                        label=f"{'ours' if side == 'ours' else 'vLLM'} {OP_LABEL[op]}")
    ax.axhline(bw, color="k", ls="--", label=f"copy roofline {bw:.0f} GB/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes moved per call")
    ax.set_ylabel("achieved GB/s")
    ax.set_title(f"MSA kernels vs vLLM 0.33.0 on {result['meta']['device']} "
                 f"({result['meta']['date']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def print_row(r: dict) -> None:
    parts = [f"{r['hq']}/{r['hkv']} B={r['batch']} L={r['context']}:"]
    for op in OPS:
        if op not in r["ours"]:
            continue
        o = r["ours"][op]
        s = (f"{op} ours {o['us']:.1f} us [{r['kernels'][op]['total']} XLA kernels; dispatch "
             f"{o['host_us_per_dispatch']:.1f} us per executable of {o['calls_per_dispatch']} "
             f"calls vs its flushes {o['flush_us']:.1f} us"
             f"{'; GPU clock' if o.get('gpu_clock') else ''}"
             f"{'' if o['gpu_bound'] else ': HOST-BOUND'}"
             f"{'; ' + r['decode_backend'] if op == 'decode' and 'decode_backend' in r else ''}]")
        v = r.get("vllm", {}).get(op)
        if v and v.get("us"):
            e = v["eager"]
            s += (f" vLLM {v['us']:.1f} ({v['method']}, {v.get('variant')}; "
                  f"graph {_us(v['graph'].get('us'))}, "
                  f"eager {e['us']:.1f} host {e['host_us_per_iter']:.1f} us/iter vs flush "
                  f"{e['flush_us']:.1f} us: {'GPU-bound' if e['gpu_bound'] else 'HOST-BOUND'})"
                  f" ratio {r['ratio'][op]:.2f}x")
        elif v:
            s += f" vLLM: {v['err'] if 'err' in v else v['method']}"
        parts.append(s)
    if "vllm_err" in r:
        parts.append(f"vLLM error {r['vllm_err']}")
    if "reference_check" in r:
        parts.append(f"vs jnp references {r['reference_check']}")
    print("\n  ".join(parts), flush=True)


# --------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_common_args(p, reps=100, trials=3)
    p.add_argument("--rounds", type=_common.positive_int, default=2,
                   help="interleaved rounds of both sides (default 2)")
    p.add_argument("--vllm-ops", default=".vllm_ops",
                   help="the op folder of `make compare-env` ('' = ours only)")
    p.add_argument("--require-vllm", action="store_true",
                   help="fail when the vLLM ops cannot be loaded (default: ours only, noted)")
    p.add_argument("--shapes", default="all",
                   help="'all' or a comma list of shape indices 0-15 (16/1 first, B, then L)")
    p.add_argument("--fp8", choices=("long", "all", "none"), default="long",
                   help="shapes that also run the fp8 indexer: L=65536 (default), all, none")
    p.add_argument("--xla-command-buffers", action="store_true",
                   help="compile our timed executables with XLA's default command buffers "
                        "(CUDA graphs); default: off, each op's kernels launched on the stream")
    p.add_argument("--budget-s", type=_common.positive_int, default=None,
                   help="start no new shape after this many seconds (outputs still written)")
    p.add_argument("--sweep", default="", help="comma list of shape indices to sweep tunables on")
    p.add_argument("--sweep-kernels", default=",".join(SWEEP_KERNELS),
                   help=f"comma list of what --sweep times, of {', '.join(SWEEP_KERNELS)}")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="off the GPU: one tiny shape in interpret mode, no vLLM, our outputs "
                        "checked against the jnp references (exercises the script)")
    args = p.parse_args(argv)
    unknown = set(args.sweep_kernels.split(",")) - set(SWEEP_KERNELS)
    if unknown:
        p.error(f"--sweep-kernels: {sorted(unknown)} not among {', '.join(SWEEP_KERNELS)}")
    n = len(all_shapes())
    for flag, text in (("--shapes", args.shapes), ("--sweep", args.sweep)):
        if text in ("all", ""):
            continue
        try:
            idx = [int(i) for i in text.split(",")]
        except ValueError:
            p.error(f"{flag}: expected 'all' or comma-separated integers, got {text!r}")
        if any(not 0 <= i < n for i in idx):
            p.error(f"{flag}: shape indices must be in [0, {n}), got {text!r}")
    if not _common.ON_GPU and not args.cpu_smoke:
        p.error("no GPU backend: run on the GPU machine, or pass --cpu-smoke")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    if args.cpu_smoke:
        shapes, reps, trials, rounds = [SMOKE_SHAPE], 2, 1, 1
    else:
        shapes = all_shapes()
        if args.shapes != "all":
            shapes = [shapes[int(i)] for i in args.shapes.split(",")]
        reps, trials, rounds = args.reps, args.trials, args.rounds
    vllm, vllm_note = None, "not requested"
    if args.vllm_ops and not args.cpu_smoke:
        try:
            import _vllm_timing as vt
            vllm = (vt, vt.load_ops(args.vllm_ops), vt.OpTimer())
            vllm_note = "loaded"
        except Exception as e:  # noqa: BLE001 - ours are still timed, the JSON says why
            if args.require_vllm:
                raise
            vllm_note = f"not loaded: {type(e).__name__}: {e}"[:400]
    print(f"vLLM ops: {vllm_note}", flush=True)
    copy = _common.copy_bandwidth(8 << 20 if args.cpu_smoke else 2 << 30)
    print(f"copy bandwidth {copy['copy_Bps'] / 1e12:.3f} TB/s ({copy['method']})", flush=True)
    result = {
        "meta": _common.run_meta(), "copy": copy, "vllm_ops": vllm_note,
        "timing": {
            "ours": timer_description("cold", reps) + f"; median of {rounds} x {trials} samples"
                    + ("; XLA's default command buffers" if args.xla_command_buffers
                       else "; XLA command buffers off"),
            "vllm": (f"faster of graph (CUDA graph of ({FLUSH_BYTES >> 20} MiB flush; op) "
                     f"replayed {reps} x minus a flush-only graph) and eager ({reps} x "
                     f"(flush x k; op) issued asynchronously minus {reps} x flush x k, used only where host time per "
                     f"iteration < flush time); median of {rounds} x {trials} samples; vLLM's "
                     f"decode runs on our selection"),
            "kernel_count": KERNEL_COUNT_DOC},
        "reps": reps, "trials": trials, "rounds": rounds, "rows": []}
    if vllm is not None:
        result["vllm_versions"] = vllm[0].versions()
        result["vllm_flush_us"] = vllm[2].flush_us
        print(f"torch flush ({FLUSH_BYTES >> 20} MiB add_) {vllm[2].flush_us:.1f} us on the GPU",
              flush=True)
    json_path = os.path.join(args.out, "kernels.json")
    for shape in shapes:
        if args.budget_s and time.perf_counter() - t_start > args.budget_s:
            result.setdefault("skipped_over_budget", []).append(shape.name)
            print(f"over --budget-s {args.budget_s}: skipped {shape.name}", flush=True)
            continue
        t0 = time.perf_counter()
        fp8 = args.fp8 == "all" or (args.fp8 == "long" and shape.context == max(
            s.context for s in all_shapes())) or (args.cpu_smoke and args.fp8 != "none")
        row = bench_shape(shape, vllm, reps=reps, trials=trials, rounds=rounds, seed=args.seed,
                          fp8=fp8, reference_check=args.cpu_smoke,
                          xla_options=(_common.XLA_COMMAND_BUFFERS if args.xla_command_buffers
                                       else _common.NO_COMMAND_BUFFERS))
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        result["rows"].append(row)
        print_row(row)
        _common.write_json(json_path, result)
    if args.sweep:
        result["sweep"] = {}
        for i in args.sweep.split(","):
            sh = all_shapes()[int(i)]
            rows = sweep_shape(sh, reps=reps, trials=trials, seed=args.seed,
                               kernels=tuple(args.sweep_kernels.split(",")))
            result["sweep"][sh.name] = rows
            _common.write_json(json_path, result)
            for kernel in SWEEP_KERNELS:
                ok = sorted((r for r in rows if r["kernel"] == kernel and "us" in r),
                            key=lambda r: r["us"])
                print(f"sweep {sh.name} {kernel} best 3: {ok[:3]}", flush=True)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    _common.write_json(json_path, result)
    md = markdown(result)
    print(md)
    with open(os.path.join(args.out, "kernels.md"), "w") as f:
        f.write(md)
    print(plot(result, os.path.join(args.out, "roofline.png")), flush=True)
    if args.cpu_smoke:
        check = result["rows"][0]["reference_check"]
        if check["selection_agree"] < 1.0 or not check["decode_rel_l2"] < 1e-2:
            print(f"CPU smoke: outputs differ from the references: {check}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

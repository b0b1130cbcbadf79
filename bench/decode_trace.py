"""H200 diagnostic: where each CTA of the Mosaic GPU sparse decode spends its time.

Runs ``sparse_decode_mgpu`` with Mosaic GPU's on-device profiler (``profile_dir``): every call
writes a trace of the kernel's named regions (``pdl_wait``, ``metadata``, ``issue``, ``q_wait``,
then per page ``k_wait``, ``qk_dot``, ``softmax``, ``p_store``, ``v_wait``, ``pv``, then
``exchange``, ``receive_wait``, ``merge`` (or through global memory ``publish``,
``cluster_wait``, ``merge_issue``, ``merge``, ``store``)) per CTA. The traced calls
run inside the benches' cold-L2 executable (``_common.time_jax``: 512 MiB flush; op), so the
kernel sees what it sees there.

Per shape and variant it reports, as the median over calls of each call's median (and max) over
CTAs: when a region first starts after the CTA's first event, its total duration per CTA, and
the CTA's span; plus the spread of CTA start times (global timer) and the kernel span (first
CTA start to last CTA end). Region times are SM clock cycles converted at ``--sm-mhz``; the
profiler's per-event cost (a shared-memory store) is subtracted by Mosaic GPU's dump.

Usage (GPU machine): python3 bench/decode_trace.py --out results.json [--calls 5]
  [--shapes 16/1/1/8192,...] [--sm-mhz 1980]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

import _common  # noqa: F401  (imported first for its preamble)
import jax  # noqa: E402
from _common import positive_int, time_jax  # noqa: E402

from decode_mgpu import SCALE, make_inputs, parse_shapes, shape_id  # noqa: E402
from pallas_kernels.sparse_decode_mgpu import sparse_decode_mgpu  # noqa: E402

DEFAULT_SHAPES = "16/1/1/8192,16/1/16/8192,64/4/1/65536,64/4/16/8192,16/1/128/8192"
VARIANTS = {"default": {}, "precise_math": dict(approx_math=False),
            "stages_3": dict(num_stages=3), "global_exchange": dict(exchange="global")}


def cta_timelines(trace: dict, sm_mhz: float) -> list[dict]:
    """Per CTA (trace thread): its start (global timer, us) and its regions as
    ``(name, begin_us, dur_us)`` relative to that start."""
    by_tid: dict[int, list[dict]] = {}
    for ev in trace["traceEvents"]:
        by_tid.setdefault(ev["tid"], []).append(ev)
    ctas = []
    for evs in by_tid.values():
        t0 = evs[0]["ts"]  # us of the global timer; later events add clock cycles / 1e3
        to_us = lambda ts: (ts - t0) * 1e3 / sm_mhz  # noqa: E731  (k-cycles -> us)
        stack, regions = [], []
        for ev in evs:
            if ev["ph"] == "B":
                stack.append(ev)
            else:
                b = stack.pop()
                regions.append((b["name"], to_us(b["ts"]), to_us(ev["ts"]) - to_us(b["ts"])))
        end = max((b + dur for _, b, dur in regions), default=0.0)
        ctas.append(dict(start_us=t0, end_us=end, regions=regions))
    return ctas


def summarise_call(ctas: list[dict]) -> dict:
    starts = [c["start_us"] for c in ctas]
    first = min(starts)
    names = sorted({n for c in ctas for n, _, _ in c["regions"]})
    out = dict(ctas=len(ctas), start_spread_us=max(starts) - first,
               kernel_span_us=max(c["start_us"] - first + c["end_us"] for c in ctas),
               cta_span_us=statistics.median(c["end_us"] for c in ctas), regions={})
    for n in names:
        begins = [min(b for m, b, _ in c["regions"] if m == n) for c in ctas
                  if any(m == n for m, _, _ in c["regions"])]
        totals = [sum(d for m, _, d in c["regions"] if m == n) for c in ctas]
        out["regions"][n] = dict(begin_us=statistics.median(begins),
                                 total_us=statistics.median(totals), total_max_us=max(totals))
    return out


def median_over_calls(calls: list[dict]) -> dict:
    med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    out = {k: med([c[k] for c in calls]) for k in ("start_spread_us", "kernel_span_us",
                                                  "cta_span_us")}
    out["ctas"] = calls[0]["ctas"]
    out["regions"] = {n: {k: med([c["regions"][n][k] for c in calls if n in c["regions"]])
                          for k in ("begin_us", "total_us", "total_max_us")}
                      for n in calls[0]["regions"]}
    return out


def trace_shape(shape, variant: dict, *, calls: int, sm_mhz: float, seed: int) -> dict:
    args = make_inputs(shape, seed)
    jax.block_until_ready(args)
    summaries, times = [], []
    with tempfile.TemporaryDirectory() as d:
        def fn(q, kv, sel, bt, req, lens):
            return sparse_decode_mgpu(q, kv, sel, bt, req, lens, scale=SCALE, interpret=False,
                                      profile_dir=d, **variant)
        for _ in range(calls):
            # The executable writes its trace to one fixed file name and skips the write while
            # that file exists: each sample (its first call) writes it, and it is read and
            # removed before the next sample.
            times.append(time_jax(fn, args, n=1, trials=1, l2="cold").us)
            jax.effects_barrier()  # the trace dumps are host callbacks
            for f in glob.glob(os.path.join(d, "*-trace.json")):
                with open(f) as fh:
                    summaries.append(summarise_call(cta_timelines(json.load(fh), sm_mhz)))
                os.remove(f)
    if not summaries:
        raise RuntimeError("the profiler wrote no trace")
    return dict(us_with_profiler=round(statistics.median(times), 2), calls=len(summaries),
                **median_over_calls(summaries))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--calls", type=positive_int, default=5)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list Hq/Hkv/B/L")
    ap.add_argument("--sm-mhz", type=float, default=1980.0, help="SM clock for cycles -> us")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default="default",
                    help=f"comma list of {', '.join(VARIANTS)}")
    a = ap.parse_args(argv)
    if unknown := set(a.variants.split(",")) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M:%S"), sm_mhz=a.sm_mhz, rows=[])
    for sh in parse_shapes(a.shapes):
        for name in a.variants.split(","):
            variant = VARIANTS[name]
            try:
                row = trace_shape(sh, variant, calls=a.calls, sm_mhz=a.sm_mhz, seed=a.seed)
            except Exception as e:  # one failing shape must not hide the others
                row = dict(error=f"{type(e).__name__}: {str(e)[:1000]}")
            row = dict(shape=shape_id(sh), variant=name, **row)
            result["rows"].append(row)
            regions = row.get("regions", {})
            order = sorted(regions, key=lambda n: regions[n]["begin_us"])
            print(f"{row['shape']:>14} {name:11s} "
                  + (row["error"] if "error" in row else
                     f"{row['us_with_profiler']:6.1f} us timed, span {row['kernel_span_us']:5.2f}"
                     f" (CTA {row['cta_span_us']:5.2f}, start spread "
                     f"{row['start_spread_us']:4.2f}) | "
                     + " ".join(f"{n}@{regions[n]['begin_us']:.2f}+{regions[n]['total_us']:.2f}"
                                for n in order)), flush=True)
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

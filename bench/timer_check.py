"""H200 check of ``_common.time_jax``'s cold-L2 timer, three ways in one process.

- ``before`` (``preroll=0``, one call per dispatch): each loop's clock starts on an idle
  device, so a sample carries (host time of the op executable's first dispatch - that of the
  flush's) / n: a bias that shrinks as 1 / n.
- ``per-call`` (the pre-roll, one call per dispatch): the timer until the sixteenth session.
  The device is busy when the clock starts, but the host's dispatch of each executable comes
  close to the flush's device time, so host jitter can drain the queue mid-loop.
- ``default`` (the pre-roll, ``CALLS_PER_DISPATCH`` calls looped in one executable): the
  host dispatches an executable in a fraction of its flushes' device time.
For each op, timer and n in ``--ns``, this prints the median and the spread of ``--trials``
samples; the figure should depend on neither n nor the timer where the timer is GPU-bound.

Ops: the default sparse decode (``sparse_decode_default``) at ``--shapes`` (Hq/Hkv/B/L, inputs
of ``decode_mgpu.make_inputs``) and ``tiny``, a 4 KiB elementwise op.

Usage (GPU machine): python3 bench/timer_check.py --out results.json [--ns 100,200]
  [--trials 6] [--shapes 16/1/1/8192,...]
"""
from __future__ import annotations

import argparse
import statistics

import _common  # noqa: F401  (imported first for its preamble)
import jax.numpy as jnp  # noqa: E402
from _common import (CALLS_PER_DISPATCH, FLUSH_BYTES, PREROLL_FLUSHES,  # noqa: E402
                     _executable, cold_loop_body, positive_int, time_jax, write_json)

from decode_mgpu import SCALE, make_inputs, parse_shapes, shape_id  # noqa: E402
from pallas_kernels.sparse_decode_default import sparse_decode_default  # noqa: E402


TIMERS = {"before": dict(preroll=0, calls_per_dispatch=1),
          "per-call": dict(preroll=PREROLL_FLUSHES, calls_per_dispatch=1),
          "default": dict(preroll=PREROLL_FLUSHES, calls_per_dispatch=CALLS_PER_DISPATCH)}


def decode_op(q, kv, sel, bt, req, lens):
    return sparse_decode_default(q, kv, sel, bt, req, lens, scale=SCALE)


def tiny_op(x):
    return x + 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ns", type=lambda text: [positive_int(v) for v in text.split(",")],
                    default="100,200", help="loop lengths n, comma-separated")
    ap.add_argument("--trials", type=positive_int, default=6)
    ap.add_argument("--shapes", default="16/1/1/8192,16/1/16/8192,16/1/128/8192")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    ns = a.ns
    ops = [(f"decode {shape_id(sh)}", decode_op, make_inputs(sh, a.seed))
           for sh in parse_shapes(a.shapes)]
    ops.append(("tiny", tiny_op, (jnp.zeros((1024,), jnp.float32),)))
    loops = {}
    for name, fn, args in ops:  # the default timer's executable keeps the op in its loop
        buf = jnp.zeros((FLUSH_BYTES // 4,), jnp.float32)
        hlo = _executable(fn, "cold", CALLS_PER_DISPATCH).lower(buf, args).compile().as_text()
        trip, body = cold_loop_body(hlo)
        loops[name] = dict(trip_count=trip, custom_calls=body.count(" custom-call("),
                           fusions=body.count(" fusion("))
        print(f"{name}: loop of {trip} (+1 peeled), body: {loops[name]}", flush=True)
        del buf
    rows = []
    print("| op | timer | n | median us | min-max us | host us/dispatch |")
    print("|---|---|---|---|---|---|")
    for name, fn, args in ops:
        for timer, kw in TIMERS.items():
            for n in ns:
                t = time_jax(fn, args, n=n, trials=a.trials, l2="cold", **kw)
                us = [v * 1e6 for v in t.samples_s]
                rows.append(dict(op=name, timer=timer, n=n, preroll=kw["preroll"], **t.as_dict()))
                print(f"| {name} | {timer} | {n} | {statistics.median(us):.2f} | "
                      f"{min(us):.2f}-{max(us):.2f} | {t.host_us_per_dispatch:.0f} |", flush=True)
    write_json(a.out, dict(ns=ns, trials=a.trials, loops=loops, rows=rows))


if __name__ == "__main__":
    main()

"""H200 check of ``_common.time_jax``'s cold-L2 timer, four ways in one process.

- ``per-call wall``: one call per executable, the host's wall clock around each loop of
  dispatches behind a pre-roll of flushes (the timer of the first fifteen sessions). The host's
  dispatch of an executable comes close to one flush's device time, so host jitter can drain
  the queue mid-loop; the wall clock also carries the host's wake-up at the end.
- ``looped wall``: ``CALLS_PER_DISPATCH`` calls looped in one executable, the same wall clock.
- ``default``: the same loop, timed by the GPU's global timer read inside the executable
  before and after the loop; XLA's command buffers off (``_common.NO_COMMAND_BUFFERS``).
- ``default, XLA graphs``: the default timer with XLA's default command buffers, which turn a
  loop body of 5 or more kernels into a CUDA graph (the indexer's, with the timer's scalar
  kernel), to see what a graph does to the op's programmatic dependent launches.
The wall-clock timers compile with XLA's command buffers off too.
For each op and n in ``--ns``, this prints the median and the spread of ``--trials`` samples,
and checks that each op's default executable keeps the calls in a loop with the flush first
(``_common.compiled_cold``, whose executables the timers then reuse).
Its JSON lists the kernels of each loop's compiled body and entry computation (the
flush-only loop's too).

Usage (GPU machine): python3 bench/timer_check.py --out results.json [--ns 100,200]
  [--trials 6] [--shapes 16/1/1/8192,...]
"""
from __future__ import annotations

import argparse
import re
import statistics

import _common  # noqa: F401  (imported first for its preamble)
import jax.numpy as jnp  # noqa: E402
from _common import (CALLS_PER_DISPATCH, NO_COMMAND_BUFFERS, ON_GPU,  # noqa: E402
                     XLA_COMMAND_BUFFERS, cold_loop_body, compiled_cold, positive_int, time_jax,
                     write_json)

from _shapes_inputs import make_inputs as shape_inputs  # noqa: E402
from decode_mgpu import SCALE, make_inputs, parse_shapes, shape_id  # noqa: E402
from pallas_kernels.index_select_default import msa_index_select_default  # noqa: E402
from pallas_kernels.sparse_decode_default import sparse_decode_default  # noqa: E402


TIMERS = {"per-call wall": dict(calls_per_dispatch=1, clock=False),
          "looped wall": dict(calls_per_dispatch=CALLS_PER_DISPATCH, clock=False),
          "default": dict(calls_per_dispatch=CALLS_PER_DISPATCH),
          "default, XLA graphs": dict(calls_per_dispatch=CALLS_PER_DISPATCH,
                                      compiler_options=XLA_COMMAND_BUFFERS)}


def decode_op(q, kv, sel, bt, req, lens):
    return sparse_decode_default(q, kv, sel, bt, req, lens, scale=SCALE)


def tiny_op(x):
    return x + 1.0


def indexer_inputs(shape, seed: int) -> tuple:
    """The default indexer's arguments at ``shape`` (bench/_shapes_inputs, bf16)."""
    x = shape_inputs(shape, seed)
    return (x["index_q"], x["index_k"], x["block_table"], x["req_indices"], x["positions"])


def indexer_op(index_q, index_k, block_table, req, positions):
    return msa_index_select_default(index_q, index_k, block_table, req, positions)


def _kernel_lines(hlo_text: str) -> list[str]:
    """The fusion, custom-call, while and call lines of HLO text in order (a call is how XLA
    outlines a command buffer: a CUDA graph), each cut to 240 characters (Mosaic GPU calls
    carry their whole module)."""
    return [line.strip()[:240] for line in hlo_text.splitlines()
            if re.search(r" (fusion|custom-call|while|call)\(", line)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ns", type=lambda text: [positive_int(v) for v in text.split(",")],
                    default="100,200", help="loop lengths n, comma-separated")
    ap.add_argument("--trials", type=positive_int, default=6)
    ap.add_argument("--shapes", default="16/1/1/8192,16/1/16/8192,16/1/128/8192")
    ap.add_argument("--indexer-shapes", default="",
                    help="the default indexer too, at these Hq/Hkv/B/L shapes")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    ns = a.ns
    ops = [(f"decode {shape_id(sh)}", decode_op, make_inputs(sh, a.seed))
           for sh in parse_shapes(a.shapes)]
    ops += [(f"indexer {shape_id(sh)}", indexer_op, indexer_inputs(sh, a.seed))
            for sh in (parse_shapes(a.indexer_shapes) if a.indexer_shapes else [])]
    ops.append(("tiny", tiny_op, (jnp.zeros((1024,), jnp.float32),)))
    loops = {}
    for name, fn, args in [("flush-only", None, ()), *ops]:  # the default timers' loops
        for graphs, options in (("", NO_COMMAND_BUFFERS), (" (XLA graphs)", XLA_COMMAND_BUFFERS)):
            text = compiled_cold(fn, CALLS_PER_DISPATCH, ON_GPU, args, options).as_text()
            trip, body = cold_loop_body(text)
            loops[name + graphs] = dict(
                trip_count=trip, custom_calls=body.count(" custom-call("),
                fusions=body.count(" fusion("), body_kernels=_kernel_lines(body),
                entry_kernels=_kernel_lines(text[text.index("\nENTRY "):]))
            print(f"{name}{graphs}: loop of {trip}, body: " + str(
                {k: v for k, v in loops[name + graphs].items() if not k.endswith("_kernels")}),
                flush=True)
    rows = []
    print("| op | timer | n | median us | min-max us | host us/dispatch |")
    print("|---|---|---|---|---|---|")
    for name, fn, args in ops:
        for timer, kw in TIMERS.items():
            for n in ns:
                t = time_jax(fn, args, n=n, trials=a.trials, l2="cold", **kw)
                us = [v * 1e6 for v in t.samples_s]
                rows.append(dict(op=name, timer=timer, n=n, **t.as_dict()))
                print(f"| {name} | {timer} | {n} | {statistics.median(us):.2f} | "
                      f"{min(us):.2f}-{max(us):.2f} | {t.host_us_per_dispatch:.0f} |", flush=True)
    write_json(a.out, dict(ns=ns, trials=a.trials, loops=loops, rows=rows))


if __name__ == "__main__":
    main()

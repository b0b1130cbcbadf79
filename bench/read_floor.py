"""H200 diagnostic: the decode against a plain read of its bytes, after the benches' flush and
after a flush whose dirty lines were already written back.

The cold timer (``_common.time_jax``) runs each op right after a 512 MiB read-modify-write
flush, so the L2 is full of dirty lines that DRAM takes back while the op reads. Per shape
this times the Mosaic GPU decode (defaults), ``decode_empty`` (the same call with every
``kv_len`` 0: it reads its metadata and writes zeros, no page) and ``read`` (an XLA row sum
over a bf16 array of exactly the decode's bytes, ``[rows * 16, 128 * 2D]``, a page per row):
- ``dirty``: the op as every bench times it;
- ``clean``: (256 MiB read-only pass; op) minus the read-only pass alone, both through the
  same timer: the pass evicts the flush's dirty lines (their write-back falls in the pass), so
  the op reads into an L2 of clean lines.
Each op's figure is the median of ``--trials`` samples of ``--reps`` calls.

Usage (GPU machine): python3 bench/read_floor.py --out results.json
  [--shapes 16/1/64/8192,...] [--reps 100] [--trials 4]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import _common  # noqa: F401  (imported first for its preamble)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _common import positive_int  # noqa: E402

from decode_mgpu import make_inputs, mgpu_fn, parse_shapes, shape_id, time_op  # noqa: E402
from _shapes_inputs import HEAD_DIM  # noqa: E402
from pallas_kernels import PAGE_SIZE, TOPK  # noqa: E402

DEFAULT_SHAPES = ("16/1/1/8192,64/4/1/65536,16/1/16/8192,16/1/64/8192,64/4/16/8192,"
                  "16/1/128/8192,64/4/64/8192")
PASS_BYTES = 256 << 20  # the read-only pass: 5x the L2


def read(x):
    return jnp.sum(x, axis=1, dtype=jnp.float32)


def pass_only(pass_buf):
    """The read-only pass: a sum over ``pass_buf``."""
    return jnp.sum(pass_buf, dtype=jnp.float32)


def after_pass(fn):
    """``(pass_buf, *args) -> fn(*args)`` run after :func:`pass_only` over ``pass_buf``."""
    def run(pass_buf, *args):
        s, args = jax.lax.optimization_barrier((pass_only(pass_buf), args))
        return s, fn(*args)
    return run


def us(fn, args, reps, trials) -> float:
    return time_op(fn, args, reps=reps, trials=trials)["us"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list Hq/Hkv/B/L")
    ap.add_argument("--reps", type=positive_int, default=100)
    ap.add_argument("--trials", type=positive_int, default=4)
    a = ap.parse_args(argv)
    decode = mgpu_fn()
    result = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M:%S"), reps=a.reps, trials=a.trials,
                  method=f"_common.time_jax, {_common.timer_description('cold', a.reps)}; "
                         f"clean = (read-only pass of {PASS_BYTES >> 20} MiB; op) - pass",
                  rows=[])
    pbuf = jnp.ones((PASS_BYTES // 2,), jnp.bfloat16)
    t_pass = us(pass_only, (pbuf,), a.reps, a.trials)
    print(f"{result['device']}: read-only pass {t_pass:.1f} us", flush=True)
    names = ("decode", "decode_empty", "read")
    print("| shape | rows | MiB | " + " | ".join(f"{n} dirty | {n} clean" for n in names) + " |")
    print("|---|---|---|" + "---|---|" * len(names))
    for sh in parse_shapes(a.shapes):
        args = make_inputs(sh, 0)
        rows = sh.batch * sh.hkv
        x = jnp.ones((rows * TOPK, PAGE_SIZE * 2 * HEAD_DIM), jnp.bfloat16)
        row = dict(shape=shape_id(sh), rows=rows, mib=x.nbytes / 2**20, pass_us=t_pass)
        empty = (*args[:5], jnp.zeros_like(args[5]))
        ops = [("decode", decode, args), ("decode_empty", decode, empty), ("read", read, (x,))]
        for name, fn, op_args in ops:
            row[f"{name}_dirty"] = us(fn, op_args, a.reps, a.trials)
            row[f"{name}_clean"] = us(after_pass(fn), (pbuf, *op_args), a.reps,
                                      a.trials) - t_pass
        result["rows"].append(row)
        cells = [f"{row[f'{n}_{c}']:.1f}" for n in names for c in ("dirty", "clean")]
        print(f"| {row['shape']} | {rows} | {row['mib']:.1f} | " + " | ".join(cells) + " |",
              flush=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        del args, x
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""H200 probe: does a cluster of 16 CTAs (a non-portable cluster size) launch and pay off for
the Mosaic GPU sparse decode at B=1, where each CTA then reads one page?

For each shape: the error against ``sparse_decode_reference`` and the cold-L2 time
(``_common.time_jax``, median of 3) of ``num_splits`` 8 and 16, each with 1 and 2 stages. A
launch failure is recorded as the error text.

Usage (GPU machine): python3 bench/decode_cluster_probe.py --out probe.json
  [--shapes 16/1/1/8192,...]
"""
from __future__ import annotations

import argparse
import json
import time

import _common  # noqa: F401  (preamble: repository on sys.path, one warning filter)
import jax  # noqa: E402
from decode_mgpu import (SCALE, errors, make_inputs, mgpu_fn, parse_shapes,  # noqa: E402
                         shape_id, time_op)
from pallas_kernels.sparse_decode import sparse_decode_reference  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="16/1/1/8192,16/1/1/65536,64/4/1/8192,64/4/1/65536")
    ap.add_argument("--reps", type=int, default=100)
    a = ap.parse_args(argv)
    rows = []
    for shape in parse_shapes(a.shapes):
        args = make_inputs(shape, 0)
        ref = sparse_decode_reference(*args, scale=SCALE)
        row = dict(shape=shape_id(shape), runs=[])
        for splits in (8, 16):
            for stages in (1, 2):
                run = dict(num_splits=splits, num_stages=stages)
                fn = mgpu_fn(num_splits=splits, num_stages=stages)
                try:
                    run["err"] = errors(*jax.jit(fn)(*args), *ref)
                    run["time"] = time_op(fn, args, reps=a.reps, trials=3)
                except Exception as e:  # the launch of a non-portable cluster may be refused
                    run["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
                row["runs"].append(run)
                print(json.dumps(dict(shape=row["shape"], **run)), flush=True)
        rows.append(row)
    with open(a.out, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                       date=time.strftime("%Y-%m-%d %H:%M:%S"), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

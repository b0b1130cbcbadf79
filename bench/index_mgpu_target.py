"""Runs the Mosaic GPU indexer + select once per shape, for a profiler to attach to
(``bench/sass_profile.sh msa_topk_select_mgpu python3 bench/index_mgpu_target.py 1``).

Usage (GPU machine): python3 bench/index_mgpu_target.py SHAPES [NUM_CTAS]
  SHAPES: indices into bench/_shapes_inputs.all_shapes, e.g. 0,1
"""
from __future__ import annotations

import sys

import _common  # noqa: F401  (preamble: repository on sys.path, one warning filter)
import jax  # noqa: E402
from _shapes_inputs import all_shapes, make_inputs  # noqa: E402
from pallas_kernels.index_select_mgpu import msa_index_select_mgpu  # noqa: E402


def main(argv: list[str]) -> int:
    ctas = int(argv[1]) if len(argv) > 1 else None
    for i in argv[0].split(","):
        x = make_inputs(all_shapes()[int(i)], 0)
        out = msa_index_select_mgpu(x["index_q"], x["index_k"], x["block_table"],
                                    x["req_indices"], x["positions"], num_ctas=ctas)
        print(all_shapes()[int(i)].name, jax.block_until_ready(out).shape, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""H200 probe: another bench's run with every Mosaic GPU TMA load tagged with an L2 eviction
policy (``createpolicy.fractional.L2::<policy>.b64`` with ``--fraction``, default 1.0).

The benches' cold timer runs each op right after a 512 MiB read-modify-write flush, so the
op reads into an L2 full of dirty lines. A load tagged ``evict_first`` marks its own lines
as the first to go, so the lines it brings in replace each other instead of the flush's
dirty lines, which then need no write-back during the op. This probe patches the Mosaic GPU
lowering of the whole process (jax 0.11.2 has no per-copy option), then runs another
bench's ``main`` with the remaining arguments. It is an experiment: the decode's own switch,
for its page loads only, is ``sparse_decode_mgpu(l2_evict_first=...)``.

Usage (GPU machine): python3 bench/l2_policy_probe.py --policy evict_first
  [--fraction 1.0] [--ranks 5] {read_floor,decode_mgpu,index_select_mgpu,kernels}
  [that bench's arguments]
"""
from __future__ import annotations

import argparse
import importlib
import sys

import _common  # noqa: F401  (imported first for its preamble)
from jax.experimental.mosaic.gpu import launch_context  # noqa: E402
from pallas_kernels._l2_hint import NvvmWithL2Hint  # noqa: E402

POLICIES = ("none", "evict_first", "evict_normal", "evict_last", "evict_unchanged")
BENCHES = ("read_floor", "decode_mgpu", "index_select_mgpu", "kernels")


class _TaggedNvvm(NvvmWithL2Hint):
    """The kernels' hinting ``nvvm`` (:mod:`pallas_kernels._l2_hint`) for any policy, and
    only for TMA loads of ``ranks`` (None: all)."""

    def __init__(self, nvvm, policy: str, fraction: float, ranks: frozenset[int] | None):
        super().__init__(nvvm, f"createpolicy.fractional.L2::{policy}.b64 $0, {fraction};")
        self._ranks = ranks

    def cp_async_bulk_tensor_shared_cluster_global(self, *args, **kwargs):
        if self._ranks is not None and len(args[2]) not in self._ranks:  # args[2]: coordinates
            return self._nvvm.cp_async_bulk_tensor_shared_cluster_global(*args, **kwargs)
        return super().cp_async_bulk_tensor_shared_cluster_global(*args, **kwargs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", choices=POLICIES, required=True)
    ap.add_argument("--fraction", type=float, default=1.0, help="createpolicy's fraction")
    ap.add_argument("--ranks", default="", help="tag only TMA loads of these ranks (comma "
                    "list, as in the PTX's cp.async.bulk.tensor.<rank>d); default all")
    ap.add_argument("bench", choices=BENCHES)
    a, rest = ap.parse_known_args(argv)
    ranks = frozenset(int(r) for r in a.ranks.split(",")) if a.ranks else None
    if a.policy != "none":
        launch_context.nvvm = _TaggedNvvm(launch_context.nvvm, a.policy, a.fraction, ranks)
    print(f"TMA loads' L2 policy: {a.policy}, fraction {a.fraction}, ranks "
          f"{sorted(ranks) if ranks else 'all'}", flush=True)
    return importlib.import_module(a.bench).main(rest)


if __name__ == "__main__":
    sys.exit(main())

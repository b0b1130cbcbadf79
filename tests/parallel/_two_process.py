"""One process of the 2-process CPU run: ``python _two_process.py PROCESS_ID PORT OUT.json``.

Each process owns 2 host CPU devices; ``jax.distributed.initialize`` joins them into 4
global devices, over which the runner serves ``_workload.SHORT_LENS`` with TP 2 x EP 2
(every process runs the same scheduler steps: SPMD). Writes the greedy outputs as JSON.
"""
import json
import os
import sys

# 2 host devices; the caller's other XLA flags (tests/conftest.py's) are kept
os.environ["XLA_FLAGS"] = " ".join(
    ["--xla_force_host_platform_device_count=2"]
    + [f for f in os.environ.get("XLA_FLAGS", "").split()
       if not f.startswith("--xla_force_host_platform_device_count")])
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

pid, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid, initialization_timeout=120)
assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload as wl  # noqa: E402

rec = wl.serve_recording(wl.runner(2, 2, lens=wl.SHORT_LENS), lens=wl.SHORT_LENS)
with open(out, "w") as f:
    json.dump(dict(outputs={str(k): v for k, v in rec["outputs"].items()},
                   logits=[x.tolist() for x in rec["logits"]],
                   compilations=rec["compilations"], process=pid,
                   devices=[str(d) for d in jax.devices()]), f)

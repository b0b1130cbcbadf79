"""A 2-process CPU run: two processes (started here) of 2 host devices each join through
``jax.distributed.initialize`` (gloo CPU collectives) into one 4-device TP 2 x EP 2 mesh and
serve the short workload; both report the greedy outputs of one process on one device
(conftest's ``single_device`` recording, shared with test_tp_ep_serving), and logits within
``_workload.LOGIT_TOL``."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import _workload as wl
from _cli import TINY_DEMO

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.xdist_group(wl.SINGLE_DEVICE_GROUP)  # the recording test_tp_ep_serving's EP tests use
def test_two_processes_serve_like_one_device(single_device, tmp_path):
    single = single_device(wl.SHORT_LENS)
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "_two_process.py"), str(i),
                               str(port), str(tmp_path / f"p{i}.json")], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=400)[0])
    finally:
        for p in procs:  # only the two processes this test started
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i}:\n" + (logs[i][-3000:] if i < len(logs) else "")
    for i in range(2):
        rec = json.loads((tmp_path / f"p{i}.json").read_text())
        assert rec["process"] == i and len(rec["devices"]) == 4
        assert {int(k): v for k, v in rec["outputs"].items()} == single["outputs"]
        assert rec["compilations"] == 0
        assert len(rec["logits"]) == len(single["logits"])
        for a, b in zip(single["logits"], rec["logits"]):
            np.testing.assert_allclose(np.asarray(b, np.float32).reshape(a.shape), a,
                                       atol=wl.LOGIT_TOL, rtol=0)


@pytest.mark.slow
def test_two_process_demo_over_an_expert_parallel_mesh():
    """``jax-msa-runner demo --ep 4 --coordinator ... --num-processes 2 --process-id I`` in
    two processes of 2 host devices each: one EP 4 mesh over both, every request finished
    in both processes, nothing compiled after warm-up."""
    port = _free_port()
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()  # the suite's others kept
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XLA_FLAGS=" ".join(["--xla_force_host_platform_device_count=2", *flags]),
               JAX_PLATFORMS="cpu")
    argv = [*TINY_DEMO, "--ep", "4", "--coordinator", f"127.0.0.1:{port}",
            "--num-processes", "2", "--process-id"]
    procs = [subprocess.Popen([sys.executable, "-m", "jax_msa_runner.cli", *argv, str(i)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=400)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i}:\n{log[-3000:]}"
        assert "mesh: dcp 1 x tensor 1 x expert 4 over 4 devices" in log, log[-3000:]
        assert "requests            3/3 finished" in log
        assert "compilations after warm-up: 0" in log

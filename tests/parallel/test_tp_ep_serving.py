"""Tensor and expert parallelism (``attention.parallel``'s ("dcp", "tensor", "expert") mesh)
on the conftest's 4 host devices, and TP x EP = 2 x 4 and EP 8 on 8 host devices in a
subprocess.

The workload (``_workload``: a dense-attention + dense-MLP layer and an MSA + MoE layer, a
2200-token prompt so the MSA top-16 drops pages) is greedy-served by the single-device
runner and by sharded runners. Every kept sample's f32 logits agree within
``LOGIT_TOL`` = 1e-4 (measured max |diff| <= 3e-6: the psums over ranks only reorder f32
sums), every kept greedy sample's top-1/top-2 margin is far above it, and the greedy outputs
are identical. Per-device parameter bytes, read from the arrays' addressable shards, are
the expected fraction; the caches' KV heads are split over "tensor". Nothing compiles after
warm-up. Meshes with EP > 1 serve a shorter workload in 32-token steps: attention is
replicated over "expert", so on host CPU devices sharing two cores every expert rank repeats it.
"""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import _workload as wl
from jax_msa_runner.attention.parallel import (EXPERT_AXIS, MESH_AXES, TENSOR_AXIS,
                                               check_parallel, param_bytes_per_device,
                                               tp_layout)
from jax_msa_runner.config import ConfigError, RunnerConfig
from jax_msa_runner.model import init_params
from jax_msa_runner.serving.runner import ModelRunner

MIN_MARGIN = wl.MIN_MARGIN
# params split over "tensor" only / over "expert" and "tensor"; every other one replicated
TP_PARAMS = ("q_proj", "k_proj", "v_proj", "index_q_proj", "o_proj", "gate_up_proj",
             "down_proj", "shared_gate_up", "shared_down", "embed", "lm_head")
EXPERT_PARAMS = ("experts_gate_up", "experts_down")


# the tests of conftest's session-scoped ``single_device`` on one xdist worker: its recordings
# (the long workload's 2200-token prompt served on one device) are made once per test run
SINGLE_DEVICE_GROUP = pytest.mark.xdist_group(wl.SINGLE_DEVICE_GROUP)


def _expected_param_bytes(params, tp, ep):
    """Bytes per device: replicated params whole, TP params / tp, expert params / (tp * ep)."""
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        name = str(path[-1].key)
        n = x.size * x.dtype.itemsize
        total += n // (tp * ep) if name in EXPERT_PARAMS else n // tp if name in TP_PARAMS else n
    return total


@SINGLE_DEVICE_GROUP
@pytest.mark.parametrize("tp,ep,dcp", [(2, 1, 1), (4, 1, 1), (2, 1, 2), (1, 2, 1), (1, 4, 1),
                                       (2, 2, 1)])
def test_sharded_serving_equals_single_device(single_device, tp, ep, dcp):
    """TP meshes serve the long workload (sparse MSA selection on per-rank heads); meshes
    with EP the short one (the sharded experts are what they test)."""
    lens = wl.LENS if ep == 1 else wl.SHORT_LENS
    r = wl.runner(tp, ep, dcp, lens=lens)
    assert r.mesh.axis_names == MESH_AXES and dict(r.mesh.shape) == {
        "dcp": dcp, TENSOR_AXIS: tp, EXPERT_AXIS: ep}
    # params: each device holds the expected fraction, read from the shards themselves
    per_dev = param_bytes_per_device(r.params)
    assert len(per_dev) == tp * ep * dcp
    host = init_params(wl.MC, seed=1)
    assert set(per_dev.values()) == {_expected_param_bytes(host, tp, ep)}
    layer = r.params["layers"][1]
    assert layer["experts_gate_up"].addressable_shards[0].data.shape == (
        wl.MC.num_experts // ep, wl.MC.hidden_size, 2 * wl.MC.moe_intermediate_size // tp)
    assert layer["q_proj"].addressable_shards[0].data.shape == (
        wl.MC.hidden_size, wl.MC.num_heads * wl.MC.head_dim // tp)
    # the TP layout: rank r's gate_up chunk is [gate_r | up_r] of the original weight
    chunk = np.asarray(r.params["layers"][0]["gate_up_proj"].addressable_shards[-1].data)
    i, rank = wl.MC.intermediate_size, tp - 1
    g = np.asarray(host["layers"][0]["gate_up_proj"])
    np.testing.assert_array_equal(chunk, np.concatenate(
        [g[:, rank * i // tp:(rank + 1) * i // tp], g[:, i + rank * i // tp:i + (rank + 1) * i // tp]],
        axis=1))
    # caches: KV heads split over "tensor", index-K (no head axis) whole on every rank
    kv_shard = r.caches.kv[1].addressable_shards[0].data
    assert kv_shard.shape[:3] == (1, r.num_pages, wl.MC.num_kv_heads // tp)
    assert r.caches.index_k[1].addressable_shards[0].data.shape[:2] == (1, r.num_pages)

    single = single_device(lens)
    dist = wl.serve_recording(r, lens=lens)
    assert len(dist["logits"]) == len(single["logits"])
    for step, (a, b) in enumerate(zip(single["logits"], dist["logits"])):
        np.testing.assert_allclose(b, a, atol=wl.LOGIT_TOL, rtol=0, err_msg=f"step {step}")
    assert dist["outputs"] == single["outputs"]
    assert dist["compilations"] == 0


@pytest.mark.slow
def test_tp_pallas_kernels_interpret_equal_single_device_reference():
    """TP 2: the Pallas kernels (interpret mode on CPU) run on each rank's head shard and
    match the single-device reference runner (small buckets keep interpret mode cheap)."""
    kw = dict(lens=(300, 7), new=3, budget=16, max_len=384)
    single = wl.serve_recording(wl.runner(**kw), lens=kw["lens"], new=kw["new"], seed=4)
    r = wl.runner(2, 1, 1, "pallas", **kw)
    assert r.interpret == (jax.default_backend() != "gpu")
    dist = wl.serve_recording(r, lens=kw["lens"], new=kw["new"], seed=4)
    for a, b in zip(single["logits"], dist["logits"]):
        np.testing.assert_allclose(b, a, atol=wl.LOGIT_TOL, rtol=0)
    assert dist["outputs"] == single["outputs"] and dist["compilations"] == 0


def test_tp_layout_puts_gate_and_up_of_a_rank_together():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 5, 12)).astype(np.float32)  # [E, H, 2I], I = 6
    y = tp_layout("experts_gate_up", x, 3)
    for r in range(3):
        np.testing.assert_array_equal(y[..., 4 * r:4 * r + 2], x[..., 2 * r:2 * r + 2])
        np.testing.assert_array_equal(y[..., 4 * r + 2:4 * r + 4], x[..., 6 + 2 * r:6 + 2 * r + 2])
    assert tp_layout("q_proj", x, 3) is x and tp_layout("experts_gate_up", x, 1) is x


@pytest.mark.parametrize("overrides,tp,ep,match", [
    (dict(num_heads=6, num_kv_heads=3, num_index_heads=3), 4, 1, "tp_size: 4 must divide num_heads=6"),
    (dict(num_kv_heads=2, num_index_heads=2), 4, 1, "tp_size: 4 must divide num_kv_heads=2"),
    (dict(vocab_size=383), 2, 1, "tp_size: 2 must divide vocab_size=383"),
    (dict(moe_intermediate_size=30), 4, 1, "tp_size: 4 must divide moe_intermediate_size=30"),
    (dict(num_experts=6), 1, 4, "ep_size: 4 must divide num_experts=6"),
])
def test_indivisible_shapes_are_rejected(overrides, tp, ep, match):
    import dataclasses
    mc = dataclasses.replace(wl.MC, **overrides)
    with pytest.raises(ConfigError, match=match):
        check_parallel(mc, wl.rconfig(tp, ep))
    with pytest.raises(ConfigError, match=match):
        ModelRunner(mc, wl.rconfig(tp, ep), num_pages=8)


def test_more_ranks_than_devices_is_rejected():
    n = len(jax.devices())
    with pytest.raises(ConfigError, match=f"= {2 * n} ranks need {2 * n} devices, only {n}"):
        ModelRunner(wl.MC, wl.rconfig(2, n), num_pages=8)
    with pytest.raises(ConfigError, match="tp_size: must be >= 1, got 0"):
        RunnerConfig(tp_size=0)
    with pytest.raises(ConfigError, match="ep_size: must be >= 1, got -1"):
        RunnerConfig(ep_size=-1)


@SINGLE_DEVICE_GROUP
def test_eight_devices_tp2_ep4_and_ep8_in_a_subprocess(single_device, tmp_path):
    """TP x EP = 2 x 4 and EP 8 (one expert per rank) over 8 host devices, in a fresh
    process (the device count is fixed when jax initialises), against this process's
    single-device recording of the short workload (the one the EP tests above compare with;
    one device's program does not depend on how many host devices exist)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    wl.save_recording(single_device(wl.SHORT_LENS), tmp_path / "single.json")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "_workload.py"),
                           "--single", str(tmp_path / "single.json"), "2x4", "1x8"],
                          capture_output=True, text=True, env=env, timeout=540, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for mesh in ("2x4", "1x8"):
        assert res[mesh]["same_outputs"], res
        assert res[mesh]["max_logit_diff"] <= wl.LOGIT_TOL, res
        assert res[mesh]["compilations"] == 0, res
        assert res[mesh]["min_margin"] > MIN_MARGIN, res

"""``--tp`` / ``--ep`` on the command line: bad values refused before any work (one stderr
line naming the flag and the bound, exit status 2), the demo served over an expert-parallel
mesh, and ``logits`` of a checkpoint loaded straight onto its TP x EP shards equal to one
device (f32, within 1e-4)."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from _checkpoint_writer import write_checkpoint
from _cli import TINY_DEMO, refused
from jax_msa_runner.attention.parallel import param_bytes_per_device, param_spec, tp_layout
from jax_msa_runner.cli.main import main
from jax_msa_runner.config import ModelConfig
from jax_msa_runner.cli.mesh_flags import load_checkpoint_sharded
from jax_msa_runner.model import init_params
from jax_msa_runner.cli.serve import main as serve_main

# MSA + MoE and dense layers; 4 q / 2 kv / 2 index heads, 4 experts: TP 2 x EP 2 divides it
CFG = ModelConfig.tiny(num_layers=3, sparse_attention_freq=(0, 1, 1), moe_layer_freq=(0, 1, 0),
                       vocab_size=96, hidden_size=40, num_heads=4, num_kv_heads=2,
                       num_index_heads=2, head_dim=16, rotary_dim=8, index_dim=16,
                       intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=12, shared_intermediate_size=20)


@pytest.mark.parametrize("flags, expected", [
    (["--tp", "2"], "argument --tp: 2 must divide num_kv_heads=1"),  # the tiny model: 1 KV head
    (["--ep", "3"], "argument --ep: 3 must divide num_experts=8"),
    (["--tp", "0"], "argument --tp: must be >= 1, got 0"),
    (["--ep", "x"], "argument --ep: must be an integer >= 1, got 'x'"),
])
def test_demo_bad_mesh_flag_is_one_line_exit_2_before_any_work(flags, expected, capsys, no_work):
    line = refused(["demo", "--num-requests", "2", *flags], capsys)
    assert line == f"jax-msa-runner demo: error: {expected}", line


def test_demo_more_ranks_than_devices_isrefused(capsys, no_work):
    n = len(jax.devices())
    line = refused(["demo", "--num-requests", "2", "--ep", str(2 * n)], capsys)
    assert line.startswith(f"jax-msa-runner demo: error: argument --tp/--ep: dcp_world_size * "
                           f"tp_size * ep_size = 1 * 1 * {2 * n} = {2 * n} ranks need {2 * n} "
                           f"devices, only {n} available"), line


def test_logits_and_serve_refuse_bad_mesh_flags(tmp_path, capsys):
    line = refused(["logits", "--checkpoint", str(tmp_path), "--token-ids", "x.npy", "--out",
                     "y.npy", "--tp", "-1"], capsys)
    assert line.endswith("argument --tp: must be >= 1, got -1"), line
    assert serve_main(["--ep", "3", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --ep: 3 must divide num_experts=8", err
    write_checkpoint(tmp_path, init_params(CFG, seed=2), CFG, scheme="transformers")
    np.save(tmp_path / "ids.npy", np.arange(5))
    assert main(["logits", "--checkpoint", str(tmp_path), "--token-ids",
                 str(tmp_path / "ids.npy"), "--out", str(tmp_path / "o.npy"), "--tp", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "jax-msa-runner logits: error: argument --tp: 4 must divide num_kv_heads=2", err


def test_demo_serves_over_an_expert_parallel_mesh(capsys):
    rc = main([*TINY_DEMO, "--ep", "2", "--debug"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "mesh: dcp 1 x tensor 1 x expert 2 over 2 devices" in out
    assert "requests            3/3 finished" in out
    assert "compilations after warm-up: 0" in out


@pytest.mark.slow
def test_checkpoint_lands_on_its_shards_and_logits_equal_one_device(tmp_path, capsys):
    params = init_params(CFG, seed=3)
    write_checkpoint(tmp_path / "ckpt", params, CFG, scheme="released", num_shards=2)
    mc, sharded = load_checkpoint_sharded(str(tmp_path / "ckpt"), dtype="float32",
                                          num_layers=None, tp=2, ep=2)
    assert mc == CFG
    for path, x in jax.tree_util.tree_leaves_with_path(sharded):
        name = str(path[-1].key)
        assert isinstance(x.sharding, NamedSharding), name
        assert x.sharding.spec == param_spec(name, x.ndim), name
    gu = sharded["layers"][1]["experts_gate_up"]
    want = tp_layout("experts_gate_up", np.asarray(params["layers"][1]["experts_gate_up"]), 2)
    for s in gu.addressable_shards:
        assert s.data.shape == (2, CFG.hidden_size, CFG.moe_intermediate_size)
        np.testing.assert_array_equal(np.asarray(s.data), want[s.index])
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    per_dev = param_bytes_per_device(sharded)
    assert len(per_dev) == 4 and max(per_dev.values()) < total / 2  # nowhere a full copy

    rng = np.random.default_rng(5)
    np.save(tmp_path / "ids.npy", rng.integers(0, CFG.vocab_size, 300))
    outs = {}
    for mesh in (("1", "1"), ("2", "2"), ("2", "1"), ("1", "4")):
        out = tmp_path / f"logits_{'x'.join(mesh)}.npy"
        assert main(["logits", "--checkpoint", str(tmp_path / "ckpt"), "--token-ids",
                     str(tmp_path / "ids.npy"), "--out", str(out), "--max-num-batched-tokens",
                     "128", "--tp", mesh[0], "--ep", mesh[1]]) == 0
        outs[mesh] = np.load(out)
    capsys.readouterr()
    for mesh, got in outs.items():
        assert got.shape == (300, CFG.vocab_size)
        np.testing.assert_allclose(got, outs[("1", "1")], atol=1e-4, rtol=0, err_msg=str(mesh))


@pytest.mark.parametrize("flags, expected", [
    (["--coordinator", "h:1"], "argument --coordinator/--num-processes/--process-id: give all "
                               "three for a multi-process run, or none"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"],
     "argument --process-id: must be in [0, --num-processes=2), got 2"),
    (["--coordinator", "h", "--num-processes", "2", "--process-id", "0"],
     "argument --coordinator: must be HOST:PORT with a port in [1, 65535], got 'h'"),
    (["--num-processes", "0"], "argument --num-processes: must be >= 1, got 0"),
])
def test_demo_bad_distributed_flags_arerefused(flags, expected, capsys, no_work):
    line = refused(["demo", "--num-requests", "2", *flags], capsys)
    assert line == f"jax-msa-runner demo: error: {expected}", line

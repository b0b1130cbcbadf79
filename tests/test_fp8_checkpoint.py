"""fp8 checkpoints (MXFP8 and 128x128 fp8 blocks): the loader keeps them in fp8, the model
runs them, TP shards them, and bad ones are refused with one line naming the tensor."""
import dataclasses
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from safetensors.numpy import save_file

from _checkpoint_writer import quant_config, write_checkpoint
from jax_msa_runner.attention.parallel import check_fp8_split, param_spec, tp_layout
from jax_msa_runner.checkpoint import CheckpointError, load
from jax_msa_runner.cli.main import main
from jax_msa_runner.cli.mesh_flags import load_checkpoint_sharded
from jax_msa_runner.config import ConfigError, ModelConfig
from jax_msa_runner.model import init_params
from pallas_kernels.fp8_matmul import (Fp8Weight, dequantize, quantize_block128,
                                       quantize_mxfp8)

# every linear input a multiple of 32 (MXFP8 groups); block128 needs no alignment except
# where gate and up halves are joined (the transformers scheme stores them fused)
CFG = ModelConfig.tiny(num_layers=3, sparse_attention_freq=(0, 1, 1), moe_layer_freq=(0, 1, 1),
                       vocab_size=98, hidden_size=64, num_heads=4, num_kv_heads=2,
                       num_index_heads=2, head_dim=16, rotary_dim=8, index_dim=16,
                       intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=64, shared_intermediate_size=64)
QUANTIZERS = {"mxfp8": quantize_mxfp8, "block128": quantize_block128}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "index_q_proj", "index_k_proj",
           "gate_up_proj", "down_proj", "shared_gate_up", "shared_down", "experts_gate_up",
           "experts_down")


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=11)


def dequantized(params: dict, dtype=jnp.float32) -> dict:
    """``params`` with every Fp8Weight replaced by its exact dense ``[..., in, out]`` value."""
    return jax.tree_util.tree_map(
        lambda w: jnp.swapaxes(dequantize(w, dtype), -1, -2) if isinstance(w, Fp8Weight) else w,
        params, is_leaf=lambda x: isinstance(x, Fp8Weight))


@pytest.mark.parametrize("fmt, scheme, vl, shards", [
    ("mxfp8", "released", True, 2), ("mxfp8", "transformers", False, 1),
    ("block128", "transformers", True, 3), ("block128", "transformers", False, 1)])
def test_round_trip_keeps_fp8_values_and_scales(tmp_path, params, fmt, scheme, vl, shards):
    write_checkpoint(tmp_path, params, CFG, scheme=scheme, vl=vl, num_shards=shards, fp8=fmt)
    config, loaded = load(tmp_path, dtype="bfloat16")
    assert config == dataclasses.replace(CFG, dtype="bfloat16")
    for i, (want_layer, layer) in enumerate(zip(params["layers"], loaded["layers"])):
        for name, dense in want_layer.items():
            got = layer[name]
            if name not in LINEARS:
                assert not isinstance(got, Fp8Weight), name
                assert got.dtype in (jnp.bfloat16, jnp.float32), name
                continue
            assert isinstance(got, Fp8Weight), f"layer {i} {name}"
            want = QUANTIZERS[fmt](np.swapaxes(np.asarray(dense, np.float32), -1, -2))
            assert got.values.dtype == jnp.float8_e4m3fn
            chex.assert_trees_all_equal(Fp8Weight(*map(np.asarray, got)),
                                        Fp8Weight(*map(np.asarray, want)))
    assert loaded["embed"].dtype == jnp.bfloat16


@pytest.mark.parametrize("fmt", ["mxfp8", "block128"])
def test_logits_equal_the_dequantized_dense_checkpoint(tmp_path, params, capsys, fmt):
    """``logits`` on an fp8 folder == on a dense f32 folder of its exact dequantization."""
    write_checkpoint(tmp_path / "fp8", params, CFG, scheme="transformers", fp8=fmt)
    _, loaded = load(tmp_path / "fp8", dtype="float32")
    write_checkpoint(tmp_path / "dense", dequantized(loaded), CFG, scheme="transformers")
    np.save(tmp_path / "ids.npy", np.random.default_rng(3).integers(0, CFG.vocab_size, 150))
    outs = {}
    for name in ("fp8", "dense"):  # full-precision f32 dots on a GPU too (not TF32)
        with jax.default_matmul_precision("highest"):
            rc = main(["logits", "--checkpoint", str(tmp_path / name), "--token-ids",
                       str(tmp_path / "ids.npy"), "--out", str(tmp_path / f"{name}.npy"),
                       "--dtype", "float32", "--max-num-batched-tokens", "64"])
        assert rc == 0
        outs[name] = np.load(tmp_path / f"{name}.npy")
    capsys.readouterr()
    chex.assert_tree_all_finite(outs["fp8"])
    chex.assert_trees_all_close(outs["fp8"], outs["dense"], rtol=2e-5, atol=2e-5)


def test_excluded_module_stays_dense(tmp_path, params):
    excluded = ("model.layers.0.self_attn.o_proj", "model.layers.1.block_sparse_moe.shared_experts")
    write_checkpoint(tmp_path, params, CFG, scheme="released", fp8="mxfp8",
                     fp8_excluded=excluded)
    _, loaded = load(tmp_path, dtype="float32")
    layer0, layer1 = loaded["layers"][0], loaded["layers"][1]
    assert not isinstance(layer0["o_proj"], Fp8Weight)
    chex.assert_trees_all_equal(layer0["o_proj"], params["layers"][0]["o_proj"])
    assert not isinstance(layer1["shared_gate_up"], Fp8Weight)
    assert isinstance(layer0["q_proj"], Fp8Weight) and isinstance(layer1["o_proj"], Fp8Weight)


def test_modelopt_config_form(tmp_path, params):
    write_checkpoint(tmp_path, params, CFG, scheme="released", fp8="mxfp8")
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quantization": {
        "quant_algo": "MXFP8", "exclude_modules": ["lm_head"]}}
    path.write_text(json.dumps(cfg))
    _, loaded = load(tmp_path, dtype="float32")
    assert loaded["layers"][2]["experts_down"].scales.dtype == jnp.uint8


# ---- bad checkpoints: one stderr line naming the tensor, exit 2 ------------------------------

def _rewrite(folder, tensors: dict, config_edit=None) -> None:
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    if config_edit is not None:
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        config_edit(cfg)
        with open(path, "w") as f:
            json.dump(cfg, f)


Q = "model.layers.1.self_attn.q_proj.weight"
QS = Q + "_scale_inv"
GU = "model.layers.1.mlp.experts.gate_up_proj"


def _bad_scale_shape(t, fmt):
    t[QS] = t[QS][:, :-1]


def _bad_scale_dtype(t, fmt):
    t[QS] = t[QS].astype(np.float16)


def _missing_scale(t, fmt):
    del t[QS]


def _e8m0_nan(t, fmt):
    t[QS] = t[QS].copy()
    t[QS][3, 1] = 255


def _bad_block_scale(t, fmt):
    t[QS] = t[QS].copy()
    t[QS][0, 0] = -1.0


def _scale_of_a_dense_weight(t, fmt):
    key = "model.layers.1.mlp.gate.weight"
    t[key + "_scale_inv"] = np.ones((t[key].shape[0], t[key].shape[1] // 32), np.uint8)


def _fp8_router(t, fmt):
    key = "model.layers.1.mlp.gate.weight"
    w = quantize_mxfp8(t[key].astype(np.float32))
    t[key], t[key + "_scale_inv"] = np.asarray(w.values), np.asarray(w.scales)


def _half_fp8(t, fmt):  # one expert tensor quantized, its param's other source dense
    key = "model.layers.2.block_sparse_moe.experts.1.w3.weight"
    t[key] = np.asarray(dequantize(Fp8Weight(t[key], t[key + "_scale_inv"])))
    del t[key + "_scale_inv"]


BAD = [
    ("mxfp8", "transformers", _bad_scale_shape, None, [QS, "scale shape"]),
    ("block128", "transformers", _bad_scale_shape, None, [QS, "scale shape"]),
    ("mxfp8", "transformers", _bad_scale_dtype, None, [QS, "F16", "U8"]),
    ("block128", "transformers", _bad_scale_dtype, None, [QS, "F16", "F32"]),
    ("mxfp8", "transformers", _missing_scale, None, [Q, "without its scale"]),
    ("mxfp8", "transformers", _e8m0_nan, None, [QS, "exponent 255", "(3, 1)"]),
    ("block128", "transformers", _bad_block_scale, None, [QS, "finite and > 0"]),
    ("mxfp8", "transformers", _scale_of_a_dense_weight, None,
     ["model.layers.1.mlp.gate.weight_scale_inv", "not float8_e4m3fn"]),
    ("mxfp8", "transformers", _fp8_router, None,
     ["model.layers.1.mlp.gate.weight", "never quantized"]),
    ("mxfp8", "released", _half_fp8, None,
     ["model.layers.2.block_sparse_moe.experts.1.w3.weight", "float8_e4m3fn"]),
    ("mxfp8", "transformers", None,
     lambda c: c["quantization_config"]["ignored_layers"].append("model.layers.1.self_attn.q_proj"),
     [Q, "leaves unquantized"]),
    ("mxfp8", "transformers", None, lambda c: c.pop("quantization_config"),
     ["no quantization_config"]),
    ("block128", "transformers", None,
     lambda c: c["quantization_config"].update(weight_block_size=[64, 64]),
     ["weight_block_size", "[128, 128]"]),
    ("mxfp8", "transformers", None,
     lambda c: c["quantization_config"].update(quant_method="awq"),
     ["quant_method", "'awq'"]),
]


@pytest.mark.parametrize("fmt, scheme, edit, config_edit, needles", BAD,
                         ids=[f"{b[0]}-{b[2].__name__.strip('_') if b[2] else 'config'}-{i}"
                              for i, b in enumerate(BAD)])
def test_bad_checkpoint_is_refused_naming_the_tensor(tmp_path, params, capsys, fmt, scheme, edit,
                                                     config_edit, needles):
    tensors = dict(write_checkpoint(tmp_path, params, CFG, scheme=scheme, fp8=fmt))
    if edit is not None:
        edit(tensors, fmt)
    _rewrite(tmp_path, tensors, config_edit)
    np.save(tmp_path / "ids.npy", np.arange(5))
    rc = main(["logits", "--checkpoint", str(tmp_path), "--token-ids", str(tmp_path / "ids.npy"),
               "--out", str(tmp_path / "out.npy")])
    out, err = capsys.readouterr()
    assert rc == 2 and not (tmp_path / "out.npy").exists()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    with pytest.raises(CheckpointError):
        load(tmp_path, dtype="float32")


def test_block_scales_cannot_join_gate_and_up_halves_of_odd_rows(tmp_path, params, capsys):
    """Released names store gate and up apart; 128x128 blocks of a 64-row half cannot be
    joined into one ``[2I, H]`` block-scaled weight."""
    write_checkpoint(tmp_path, params, CFG, scheme="released", fp8="block128")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight: 64 "
                                              r"rows, not a multiple of the 128-row"):
        load(tmp_path, dtype="float32")


# ---- tensor parallelism ---------------------------------------------------------------------

# TP=2 shards fall on scale blocks: MXFP8 (inputs per shard % 32) everywhere; 128x128 blocks
# need 128-row output shards and 128-wide input shards
TP_CFGS = {
    "mxfp8": CFG,
    "block128": ModelConfig.tiny(num_layers=2, sparse_attention_freq=(0, 1), moe_layer_freq=(0, 1),
                                 vocab_size=96, hidden_size=128, num_heads=2, num_kv_heads=2,
                                 num_index_heads=2, head_dim=128, rotary_dim=64, index_dim=128,
                                 intermediate_size=256, num_experts=2, num_experts_per_tok=1,
                                 moe_intermediate_size=256, shared_intermediate_size=256),
}


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 2, reason="TP 2 needs two devices (the CPU suite has "
                                                   "four host devices; a one-GPU machine one)")
@pytest.mark.parametrize("fmt", ["mxfp8", "block128"])
def test_tp2_shards_fp8_params_and_logits_equal_one_device(tmp_path, capsys, fmt):
    cfg = TP_CFGS[fmt]
    write_checkpoint(tmp_path / "ckpt", init_params(cfg, seed=5), cfg, scheme="transformers",
                     fp8=fmt)
    _, single = load(tmp_path / "ckpt", dtype="float32")
    _, sharded = load_checkpoint_sharded(str(tmp_path / "ckpt"), dtype="float32", num_layers=None,
                                         tp=2, ep=1)
    for path, x in jax.tree_util.tree_leaves_with_path(sharded):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        fp8 = names[-1] in ("values", "scales")
        name = names[-2] if fp8 else names[-1]
        assert isinstance(x.sharding, NamedSharding), names
        assert x.sharding.spec == param_spec(name, x.ndim, fp8=fp8), names
    gu = sharded["layers"][1]["experts_gate_up"]
    want = single["layers"][1]["experts_gate_up"]
    for field in ("values", "scales"):  # each rank: its gate and its up rows, with their scales
        laid = tp_layout("experts_gate_up", np.asarray(getattr(want, field)), 2, axis=-2)
        for s in getattr(gu, field).addressable_shards:
            np.testing.assert_array_equal(np.asarray(s.data), laid[s.index])
    rng = np.random.default_rng(9)
    np.save(tmp_path / "ids.npy", rng.integers(0, cfg.vocab_size, 140))
    outs = {}
    for tp in ("1", "2"):  # full-precision f32 dots on a GPU too (not TF32)
        with jax.default_matmul_precision("highest"):
            rc = main(["logits", "--checkpoint", str(tmp_path / "ckpt"), "--token-ids",
                       str(tmp_path / "ids.npy"), "--out", str(tmp_path / f"tp{tp}.npy"),
                       "--dtype", "float32", "--max-num-batched-tokens", "64", "--tp", tp])
        assert rc == 0
        outs[tp] = np.load(tmp_path / f"tp{tp}.npy")
    capsys.readouterr()
    chex.assert_trees_all_close(outs["2"], outs["1"], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("fmt, name, shape, match", [
    ("block128", "layers.0.q_proj", (256, 128), "output dim 256 into 64-wide shards"),
    ("block128", "layers.0.o_proj", (128, 256), "input dim 256 into 64-wide shards"),
    ("block128", "layers.1.experts_gate_up", (2, 256, 64), "output dim 128 into 32-wide"),
    ("mxfp8", "layers.0.o_proj", (64, 64), "input dim 64 into 16-wide shards, not on the "
                                           "32-element scale blocks of MXFP8"),
])
def test_tp_split_off_the_scale_blocks_is_a_config_error(fmt, name, shape, match):
    w = QUANTIZERS[fmt](np.ones(shape, np.float32))
    with pytest.raises(ConfigError, match=f"{name}: tp_size=4 splits its {match}"):
        check_fp8_split(name, w, 4)
    check_fp8_split(name, w, 1)


def test_tp_misaligned_checkpoint_is_refused_by_the_cli(tmp_path, capsys):
    """A shared expert of 32 inputs split in two 16-wide halves misses MXFP8's groups of 32."""
    cfg = dataclasses.replace(CFG, shared_intermediate_size=32)
    write_checkpoint(tmp_path, init_params(cfg, seed=2), cfg, scheme="transformers", fp8="mxfp8")
    np.save(tmp_path / "ids.npy", np.arange(5))
    rc = main(["logits", "--checkpoint", str(tmp_path), "--token-ids", str(tmp_path / "ids.npy"),
               "--out", str(tmp_path / "out.npy"), "--tp", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert ("layers.1.shared_down: tp_size=2 splits its input dim 32 into 16-wide shards, not "
            "on the 32-element scale blocks of MXFP8") in err, err


# ---- front ends -------------------------------------------------------------------------------

def test_demo_and_serve_take_an_fp8_folder(tmp_path, capsys):
    """``demo --checkpoint`` serves an fp8 folder with zero compilations after warm-up and
    reports fp8 weights at start-up; ``serve``'s loader keeps them fp8."""
    import argparse

    from _cli import TINY_DEMO
    from jax_msa_runner.cli.serve import add_serve_args, build_model

    cfg = dataclasses.replace(CFG, vocab_size=320)  # room for the byte tokenizer
    write_checkpoint(tmp_path, init_params(cfg, seed=4), cfg, scheme="released", fp8="mxfp8")
    i = TINY_DEMO.index("--num-layers")
    argv = TINY_DEMO[:i] + TINY_DEMO[i + 2:]  # all three layers of the checkpoint
    assert main([*argv, "--checkpoint", str(tmp_path), "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "requests            3/3 finished" in out and "compilations after warm-up: 0" in out
    weights = next(line for line in out.splitlines() if line.startswith("memory: weights"))
    assert "float8_e4m3fn" in weights and "uint8" in weights and "bfloat16" in weights, weights
    assert "memory: KV cache" in out
    args = add_serve_args(argparse.ArgumentParser()).parse_args(
        ["--checkpoint", str(tmp_path), "--dtype", "bfloat16"])
    _, loaded, _ = build_model(args)
    assert isinstance(loaded["layers"][2]["experts_down"], Fp8Weight)

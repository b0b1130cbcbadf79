"""fp8 checkpoints: parity with transformers 5.23.0 on the exactly dequantized weights.

``tools/hf_reference/hf_side.py --fp8`` (reference venv, CPU torch) builds a tiny random
model, rounds it to bf16 and quantizes every quantizable linear with its own torch
quantizers into two folders: MXFP8 under the released VL names (uint8 E8M0 scales, layer 0's
o_proj in ``ignored_layers`` and stored bf16) and 128x128 fp8 blocks under transformers'
names (f32 scales, fused experts). It records HF's f32 prefill logits of each format's exact
dequantization and of the unquantized bf16 model. Here:

- ``jax-msa-runner logits --dtype float32`` on each folder: rel L2 <= 2e-3 against HF on the
  dequantized weights; the unquantized logits differ by far more (negative control);
- the loaded params: quantized linears are ``Fp8Weight`` leaves of 1 byte per element, and
  all params take at most 1.15x the ideal bytes (quantized elements x 1 B + scales + every
  other tensor in bf16) counted from the safetensors headers;
- the excluded layer-0 o_proj of the MXFP8 folder is a plain dense param.
"""
import json
import os
import struct
import subprocess
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_msa_runner.checkpoint import load
from jax_msa_runner.cli.main import main as cli_main
from pallas_kernels.fp8_matmul import Fp8Weight

from _hf_env import HF_SIDE, REF_PYTHON, check_reference_env

PROMPT_LENS = (100, 300)
FORMATS = ("mxfp8", "block128")
REL_L2 = 2e-3
MAX_BYTES_RATIO = 1.15
SAFETENSORS_BYTES = {"F8_E4M3": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4}


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory):
    """The folder hf_side.py --fp8 wrote (fp8_mxfp8/, fp8_block128/, reference_fp8.npz)."""
    check_reference_env()
    out = tmp_path_factory.mktemp("hf_fp8")
    t0 = time.perf_counter()
    proc = subprocess.run([REF_PYTHON, HF_SIDE, "--out", str(out), "--num-kv-heads", "2",
                           "--seed", "31", "--prompt-lens", "100", "--decode-steps", "1",
                           "--fp8", "--fp8-prompt-lens", ",".join(map(str, PROMPT_LENS))],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    print(f"\nHF side (fp8): {time.perf_counter() - t0:.1f}s\n{proc.stdout.strip()}")
    return out


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", PROMPT_LENS)
def test_fp8_logits_match_hf_on_dequantized_weights(ref_dir, fmt, n, tmp_path):
    ref = np.load(ref_dir / "reference_fp8.npz")
    want, unquantized = ref[f"fp8_{fmt}_logits_{n}"], ref[f"fp8_unquantized_logits_{n}"]
    np.save(tmp_path / "ids.npy", ref[f"fp8_ids_{n}"])
    rc = cli_main(["logits", "--checkpoint", str(ref_dir / f"fp8_{fmt}"), "--token-ids",
                   str(tmp_path / "ids.npy"), "--out", str(tmp_path / "logits.npy"),
                   "--dtype", "float32", "--max-num-batched-tokens", "128"])
    assert rc == 0
    got = np.load(tmp_path / "logits.npy")
    chex.assert_shape(got, want.shape)
    chex.assert_tree_all_finite(got)
    err, control = rel_l2(got, want), rel_l2(unquantized, want)
    print(f"\n{fmt}, {n} tokens: rel L2 vs HF (dequantized) {err:.2e}; unquantized vs "
          f"dequantized {control:.2e}")
    assert err <= REL_L2, err
    assert control > 10 * REL_L2, control  # the quantization is visible at this tolerance


def _ideal_bytes(folder) -> tuple[int, int]:
    """(ideal loaded bytes, quantized elements): fp8 weights 1 B, their scales as stored,
    every other text-model tensor 2 B per element (vision / MTP tensors are not loaded)."""
    ideal = quantized = 0
    for name in os.listdir(folder):
        if not name.endswith(".safetensors"):
            continue
        with open(folder / name, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        for key, info in header.items():
            if "vision_tower" in key or "multi_modal_projector" in key or ".mtp." in key:
                continue
            elems = int(np.prod(info["shape"]))
            if info["dtype"] == "F8_E4M3":
                quantized += elems
                ideal += elems
            elif key.endswith("_scale_inv"):
                ideal += elems * SAFETENSORS_BYTES[info["dtype"]]
            else:
                ideal += elems * 2
    return ideal, quantized


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_params_stay_one_byte_and_within_the_memory_bound(ref_dir, fmt):
    folder = ref_dir / f"fp8_{fmt}"
    config, params = load(folder, dtype="bfloat16")
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, Fp8Weight))
    fp8 = [w for w in leaves if isinstance(w, Fp8Weight)]
    assert all(w.values.dtype == jnp.float8_e4m3fn and w.values.dtype.itemsize == 1 for w in fp8)
    assert {w.scales.dtype for w in fp8} == {jnp.dtype(jnp.uint8 if fmt == "mxfp8"
                                                       else jnp.float32)}
    ideal, quantized = _ideal_bytes(folder)
    assert sum(w.values.size for w in fp8) == quantized  # every fp8 tensor stays fp8
    loaded = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    print(f"\n{fmt}: loaded {loaded} B, ideal {ideal} B ({loaded / ideal:.3f}x), "
          f"{quantized} fp8 elements")
    assert loaded <= MAX_BYTES_RATIO * ideal, (loaded, ideal)
    layer0, layer1 = params["layers"][0], params["layers"][1]
    for name in ("q_proj", "k_proj", "v_proj", "gate_up_proj", "down_proj"):
        assert isinstance(layer0[name], Fp8Weight), name
    for name in ("q_proj", "index_q_proj", "index_k_proj", "experts_gate_up", "experts_down",
                 "shared_gate_up", "shared_down"):
        assert isinstance(layer1[name], Fp8Weight), name
    assert not isinstance(layer1["router"], Fp8Weight)
    assert not isinstance(params["embed"], Fp8Weight)
    if fmt == "mxfp8":  # in ignored_layers, stored bf16: a dense [in, out] param
        assert not isinstance(layer0["o_proj"], Fp8Weight)
        chex.assert_shape(layer0["o_proj"], (config.num_heads * config.head_dim,
                                             config.hidden_size))
    else:
        assert isinstance(layer0["o_proj"], Fp8Weight)

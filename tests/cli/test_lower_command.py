"""`jax-msa-runner lower` on the CPU: the StableHLO of a real-shaped step (MiniMax-M3's
config, the first 4 layers: 3 dense + 1 MSA/MoE, one TP4 x EP8 rank) for an abstract H200,
the kernels it runs per step, and the refusals (one stderr line naming the flag, status 2)."""
from __future__ import annotations

import os

import pytest

from _cli import refused
from jax_msa_runner.cli.main import main

M3 = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "bench",
                  "configs", "minimax_m3.json")
RANK = ["--model-config", M3, "--num-layers", "4", "--tp", "4", "--ep", "8"]
L = "jax-msa-runner lower: error: argument "


def _lower(tmp_path, capsys, *extra):
    out = tmp_path / "step.mlir"
    assert main(["lower", *RANK, "--out", str(out), *extra]) == 0
    return out.read_text(), capsys.readouterr().out


def test_decode_step_runs_mosaic_kernels_only(tmp_path, capsys):
    """B=16 decode at 4K: each dense layer compiles both paged-attention kernels (decode and
    prefill, picked at run time), the MSA layer its 3 (scores, select, sparse decode), the MoE
    layer's routed experts the fused decode kernel (64 copies); no ragged_dot."""
    text, out = _lower(tmp_path, capsys, "--num-tokens", "16", "--context", "4096")
    assert text.startswith("module @jit_") and "func.func public @main" in text
    assert "tensor<514x1x128x256xbf16>" in text  # KV pages of 16 x 4K tokens + 2, 1 KV head
    assert "tensor<16x6144x6144xbf16>" in text  # 16 local experts, gate|up of 3072 each
    assert "tensor<6144x50016xbf16>" in text  # the LM head's vocabulary slice
    assert "bucket T=16 R=16 P=32, 4 layers (1 MSA, 1 MoE), heads 16/1, 16 local experts" in out
    assert out.splitlines()[-1] == ("kernels per step: mosaic_gpu=10 triton=0 "
                                    "other_custom_calls=0 ragged_dot=0")


def test_decode_step_at_1m_context_runs_mosaic_kernels_only(tmp_path, capsys):
    """B=16 decode at 1M tokens (8192 pages a row): the MSA layer's select is the chunked
    select's two launches, still no Triton."""
    _, out = _lower(tmp_path, capsys, "--num-tokens", "16", "--context", str(2 ** 20))
    assert "bucket T=16 R=16 P=8192" in out
    assert out.splitlines()[-1] == ("kernels per step: mosaic_gpu=11 triton=0 "
                                    "other_custom_calls=0 ragged_dot=0")


def test_fp8_prefill_chunk(tmp_path, capsys):
    """A 2048-token chunk of one request at 32K: one paged-attention kernel per dense layer,
    3 MSA kernels; fp8 linears above 256 tokens run on XLA (no fp8 kernel); the routed experts
    the two prefill kernels on their fp8 weights."""
    text, out = _lower(tmp_path, capsys, "--num-tokens", "2048", "--num-reqs", "1",
                       "--context", "32768", "--weights", "fp8")
    assert "f8E4M3FN" in text
    assert "bucket T=2048 R=1 P=256" in out and "fp8 weights" in out
    assert out.splitlines()[-1] == ("kernels per step: mosaic_gpu=8 triton=0 "
                                    "other_custom_calls=0 ragged_dot=0")


@pytest.mark.parametrize("extra,line", [
    (["--num-tokens", "0", "--context", "64"], L + "--num-tokens: must be >= 1, got 0"),
    (["--num-tokens", "4", "--context", "0"], L + "--context: must be >= 1, got 0"),
    (["--num-tokens", "4", "--num-reqs", "5", "--context", "64"],
     L + "--num-reqs: must be <= --num-tokens = 4, got 5"),
    (["--num-tokens", "4", "--context", "64", "--num-layers", "61"],
     L + "--num-layers: must be <= the config's 60 layers, got 61"),
    (["--num-tokens", "4", "--context", "64", "--tp", "3"],
     L + "--tp: 3 must divide num_heads=64"),
    (["--num-tokens", "4", "--context", "64", "--ep", "3"],
     L + "--ep: 3 must divide num_experts=128"),
    (["--num-tokens", "4", "--context", "64", "--weights", "fp4"],
     L + "--weights: invalid choice: 'fp4'"),
])
def test_bad_flags_are_refused(tmp_path, capsys, extra, line):
    argv = ["lower", "--model-config", M3, "--out", str(tmp_path / "x.mlir"), *extra]
    assert refused(argv, capsys).startswith(line)
    assert not (tmp_path / "x.mlir").exists()


def test_missing_config_and_output_folder(tmp_path, capsys):
    base = ["lower", "--num-tokens", "4", "--context", "64"]
    assert refused(base + ["--model-config", str(tmp_path / "none.json"), "--out",
                           str(tmp_path / "x.mlir")], capsys).startswith(
        L + f"--model-config: no such file '{tmp_path / 'none.json'}'")
    assert refused(base + ["--model-config", M3, "--out", str(tmp_path / "no" / "x.mlir")],
                   capsys).startswith(L + f"--out: no such directory '{tmp_path / 'no'}'")

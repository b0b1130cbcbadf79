"""bench/fp8_matmul.py off the GPU: ``--smoke`` end to end (tiny shapes, the kernel in
interpret mode, outputs checked against the reference, JSON and markdown written), ``--help``,
and the refusals (no GPU without ``--smoke``, bad flags) with exit status 2."""
from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import _common  # noqa: E402
import fp8_matmul  # noqa: E402


def test_smoke_writes_rows_for_both_formats(tmp_path):
    assert fp8_matmul.main(["--out", str(tmp_path), "--smoke"]) == 0
    doc = json.loads((tmp_path / "fp8_matmul.json").read_text())
    assert doc["interpret"] == (not _common.ON_GPU) and doc["meta"]["jax"]
    rows = doc["rows"]
    assert sorted(r["format"] for r in rows) == ["block128", "mxfp8"]
    for r in rows:
        assert (r["n"], r["k"], r["tokens"]) == (200, 384, 3)
        assert r["rel_l2"]["ours"] < 1e-2 and r["rel_l2"]["xla"] < 1e-2
        assert all(r[s]["us"] > 0 and r[s]["pct_copy"] >= 0 for s in ("ours", "xla", "bf16"))
        assert r["bytes"]["fp8"] < r["bytes"]["bf16"]
        assert set(r["config"]) == {"tile_t", "tile_n", "tile_k", "num_stages", "k_splits"}
    md = (tmp_path / "fp8_matmul.md").read_text()
    assert "| tiny | 200 | 384 | mxfp8 | 3 |" in md and "| tiny | 200 | 384 | block128 | 3 |" in md


def _exit_code(argv):
    with pytest.raises(SystemExit) as e:
        fp8_matmul.parse_args(argv)
    return e.value.code


def test_help_and_refusals(capsys):
    assert _exit_code(["--help"]) == 0
    assert "--smoke" in capsys.readouterr().out
    if not _common.ON_GPU:
        assert _exit_code(["--out", "/tmp/x"]) == 2
        assert "no GPU backend: run on the GPU machine, or pass --smoke" in capsys.readouterr().err
    assert _exit_code(["--out", "/tmp/x", "--smoke", "--tokens", "0"]) == 2
    assert "--tokens: every value must be >= 1" in capsys.readouterr().err
    assert _exit_code(["--out", "/tmp/x", "--smoke", "--layers", "qkv,mlp"]) == 2
    assert "--layers: ['mlp'] not among" in capsys.readouterr().err
    assert _exit_code(["--out", "/tmp/x", "--smoke", "--tile-n", "96"]) == 2
    assert "--tile-n: invalid choice: 96" in capsys.readouterr().err
    assert _exit_code(["--out", "/tmp/x", "--smoke", "--reps", "0"]) == 2

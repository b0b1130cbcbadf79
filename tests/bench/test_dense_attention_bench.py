"""bench/dense_attention.py off the GPU: ``--dry-run`` end to end in a subprocess (two tiny
cases, ours in interpret mode checked against the jnp reference, the cold timer exercised,
JSON and markdown written), the shape list and its figures, vLLM's kernel choice, ``--help``
and the refusals (no GPU without ``--dry-run``, bad flags) with exit status 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import _common  # noqa: E402
import dense_attention as da  # noqa: E402


def test_dry_run_writes_rows_for_decode_and_prefill(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(BENCH, "dense_attention.py"), "--out",
                        str(tmp_path), "--dry-run"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((tmp_path / "dense_attention.json").read_text())
    assert doc["dry_run"] is True and doc["vllm_ops"] == "not requested" and doc["meta"]["jax"]
    assert "cold L2" in doc["timing"]["ours"] and doc["skipped"] == []
    rows = {r["kind"]: r for r in doc["rows"]}
    assert sorted(rows) == ["decode", "prefill"]
    for case in da.DRY_CASES:
        row = rows[case.kind]
        assert (row["hq"], row["hkv"], row["context"], row["tokens"]) == (
            case.hq, case.hkv, case.context, case.num_tokens)
        assert row["bytes"] == case.bytes and row["flops"] == case.flops
        assert row["ours_finite"] and row["reference_check"]["out_rel_l2"] < 1e-2
        assert row["reference_check"]["lse_rel_l2"] < 1e-2
        assert row["kernels"]["total"] >= 1
        assert row["ours"]["us"] > 0 and row["ours"]["samples_us"]
        assert "vllm" not in row and "ratio" not in row
    md = (tmp_path / "dense_attention.md").read_text()
    assert "DRY RUN" in md
    assert "| 16/1 | 2 | 300 |" in md and "| 4/2 | 48 | 200 |" in md


def test_cases_skips_and_figures():
    cases = da.all_cases()
    assert len(cases) == 2 * 4 * 3 + 2 * 3
    too_big = [c.name for c in cases if c.cache_bytes > da.MAX_CACHE_GIB << 30]
    assert too_big == ["decode 64/4 B=256 L=131072"]  # 64 GiB
    d = da.Case("decode", 64, 4, 4096, batch=16)
    assert d.bytes == 16 * 4096 * 4 * 256 * 2 and d.flops == 4 * 16 * 64 * 128 * 4096
    assert d.num_pages == 16 * 32 + 1
    p = da.Case("prefill", 16, 1, 30720, tokens=2048)
    assert p.seq_len == 32768 and p.kv_lens()[0] == 30721 and p.kv_lens()[-1] == 32768
    assert p.flops == 4 * 16 * 128 * (2048 * 30720 + 2048 * 2049 // 2)
    assert p.bytes == 32768 * 256 * 2


def test_vllm_kernel_choice_follows_its_backend():
    """vLLM's split-K (3D) decode up to 128 // Hkv requests, its 2D kernel above and for the
    chunk (query length > 8)."""
    is_3d = lambda c: da.vllm_path(c).startswith("3D")  # noqa: E731
    assert is_3d(da.Case("decode", 16, 1, 4096, batch=64))
    assert not is_3d(da.Case("decode", 16, 1, 4096, batch=256))
    assert is_3d(da.Case("decode", 64, 4, 4096, batch=16))
    assert not is_3d(da.Case("decode", 64, 4, 4096, batch=64))
    assert not is_3d(da.Case("prefill", 16, 1, 0, tokens=2048))


def _exit_code(argv):
    with pytest.raises(SystemExit) as e:
        da.parse_args(argv)
    return e.value.code


def test_help_and_refusals(capsys):
    assert _exit_code(["--help"]) == 0
    assert "--dry-run" in capsys.readouterr().out
    if not _common.ON_GPU:
        assert _exit_code(["--out", "/tmp/x"]) == 2
        err = capsys.readouterr().err
        assert "no GPU backend: run on the GPU machine, or pass --dry-run" in err
    assert _exit_code(["--out", "/tmp/x", "--dry-run", "--batches", "0"]) == 2
    assert "--batches: every value must be >= 1" in capsys.readouterr().err
    assert _exit_code(["--out", "/tmp/x", "--dry-run", "--heads", "16/3"]) == 2
    assert "--heads: Hq must be a positive multiple of Hkv" in capsys.readouterr().err
    assert _exit_code(["--out", "/tmp/x", "--dry-run", "--kinds", "decode,verify"]) == 2
    assert "--kinds: ['verify'] not among" in capsys.readouterr().err
    assert _exit_code(["--out", "/tmp/x", "--dry-run", "--reps", "0"]) == 2
    args = da.parse_args(["--out", "/tmp/x", "--dry-run", "--heads", "16/1",
                          "--chunk-contexts", "0,30720"])
    assert args.heads == ((16, 1),) and args.chunk_contexts == (0, 30720)

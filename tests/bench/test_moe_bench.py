"""bench/moe.py off the GPU: ``--dry-run`` end to end in a subprocess (tiny shapes: ours in
interpret mode against the jnp reference, the XLA path, the cold timer; vLLM's fused MoE in
Triton's interpreter in the comparison venv, its output against ours and its
moe_align_block_size stand-in against vLLM's contract; JSON and markdown written), the shape
list and its byte / FLOP figures, ``--help`` and the refusals with exit status 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "bench")
REPO = os.path.dirname(BENCH)
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import _common  # noqa: E402
import moe  # noqa: E402


@pytest.mark.slow
def test_dry_run_checks_ours_xla_and_vllm(tmp_path):
    if not os.path.exists(moe.VLLM_PYTHON):
        pytest.fail(f"no comparison Python {moe.VLLM_PYTHON}: run `make compare-env` (or set "
                    f"VLLM_PYTHON)")
    if not os.path.isfile(os.path.join(REPO, ".vllm_ops", "MANIFEST.json")):
        pytest.fail("no .vllm_ops: run `make compare-env`")
    r = subprocess.run([sys.executable, os.path.join(BENCH, "moe.py"), "--out", str(tmp_path),
                        "--dry-run"], capture_output=True, text=True, timeout=400, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((tmp_path / "moe.json").read_text())
    assert doc["dry_run"] is True and doc["meta"]["jax"] and doc["skipped"] == []
    assert doc["copy"]["copy_Bps"] > 0 and doc["peak"]["flops_per_s"] > 0
    assert doc["vllm_versions"]["triton"] and "err" not in doc["vllm_dry"]
    rows = {r["name"]: r for r in doc["rows"]}
    assert sorted(rows) == sorted(c.name for c in moe.DRY_CASES)
    for case in moe.DRY_CASES:
        row = rows[case.name]
        assert row["finite"] and row["backend"] == case.kind  # 16 copies: decode; 80: prefill
        assert row["rel_l2"]["ours_vs_reference"] < 1e-2
        assert row["rel_l2"]["xla_vs_reference"] < 1e-2
        assert row["ours"]["us"] > 0 and row["xla"]["us"] >= 0
        assert row["bytes"]["ours"] == row["touched_experts"] * moe.expert_bytes(case.fmt, moe.DRY)
        assert row["flops"] == 6 * moe.DRY.h * moe.DRY.i * row["local_copies"] > 0
        assert row["rates"]["ours"]["pct_copy"] is None and row.get("ratio") is None  # no claims
        if case.kind == "decode":
            assert row["other_backend"] == "prefill" and row["ours_other"]["us"] > 0
        if case.fmt in moe.VLLM_FORMATS:
            assert row["rel_l2"]["vllm_vs_ours"] < moe.vllm_bound(case.fmt)
            assert all(row["vllm_alignment"].values()), row["vllm_alignment"]
            assert row["vllm_config"].startswith("BLOCK_M/N/K")
        else:
            assert "vllm_vs_ours" not in row["rel_l2"] and row["bytes"]["vllm"] is None
    # w8a8 (vLLM) vs weight-only fp8 (ours) differ by the activation rounding, bf16 barely
    assert rows["prefill block128 B=40"]["rel_l2"]["vllm_vs_ours"] > 1e-2
    assert rows["prefill bf16 B=40"]["rel_l2"]["vllm_vs_ours"] < 1e-2
    md = (tmp_path / "moe.md").read_text()
    assert "DRY RUN" in md and "vLLM's Triton fused MoE has no MXFP8 path" in md
    assert "| decode | 8 | " in md and "| prefill | 40 | " in md


def test_cases_bytes_and_routing():
    cases = moe.all_cases()
    assert len(cases) == 3 * (4 + 2)
    assert [c.batch for c in cases[:6]] == [1, 16, 64, 256, 2048, 4096]
    d = moe.SERVING
    assert (d.h, d.i, d.e, d.g, d.k) == (6144, 3072, 16, 128, 4)
    n = 3 * 6144 * 3072
    assert moe.expert_bytes("bf16", d) == 2 * n
    assert moe.expert_bytes("mxfp8", d) == n + n // 32
    assert moe.expert_bytes("block128", d) == n + 4 * (48 * 48 + 48 * 24)
    a, draws = moe.make_routing(1, d, 3)
    ex = np.asarray(a["experts"])
    assert ex.shape == (1, 4) and len(set(ex[0])) == 4 and draws >= 1
    assert ((ex >= 0) & (ex < 16)).any()  # redrawn until a copy is local
    f = moe.routing_figures(np.array([[0, 1, 20, 3], [1, 40, 50, 60]]), d)
    assert f == {"local_copies": 4, "touched_experts": 3, "flops": 4 * 6 * 6144 * 3072}


def _exit_code(argv):
    with pytest.raises(SystemExit) as e:
        moe.parse_args(argv)
    return e.value.code


def test_help_and_refusals(capsys):
    assert _exit_code(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--dry-run" in out and "--budget-s" in out and "--formats" in out
    if not _common.ON_GPU:
        assert _exit_code(["--out", "/tmp/x"]) == 2
        assert "no GPU backend" in capsys.readouterr().err
    assert _exit_code(["--out", "/tmp/x", "--dry-run", "--batches", "0"]) == 2
    assert "--batches: every value must be >= 1" in capsys.readouterr().err
    assert _exit_code(["--out", "/tmp/x", "--dry-run", "--formats", "bf16,int4"]) == 2
    assert "--formats: ['int4'] not among" in capsys.readouterr().err
    assert _exit_code(["--out", "/tmp/x", "--dry-run", "--kinds", "verify"]) == 2
    args = moe.parse_args(["--out", "/tmp/x", "--dry-run", "--formats", "block128",
                           "--prefill-batches", "2048"])
    assert args.formats == ("block128",) and args.prefill_batches == (2048,)
    assert [c.name for c in moe.all_cases(("prefill",), (1,), (2048,), ("block128",))] == [
        "prefill block128 B=2048"]

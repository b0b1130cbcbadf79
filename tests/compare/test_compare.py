"""Comparison against vLLM 0.33.0's own MiniMax-M3 ops, on the CPU (never skipped).

vLLM's Triton kernels run under Triton's interpreter in the comparison venv (`make
compare-env`, a prerequisite of `make test`); ours are the Pallas kernels in interpret mode.
Selections must agree as sets per (token, KV head) outside exact score ties, outputs to a
relative L2 error <= 1e-2; a perturbed index-K page on one side must be detected. The fp8
cases run vLLM's fp8 indexer (e4m3 index queries x e4m3 index-K cache) against our
float8_e4m3fn index-K cache. Bad CLI flag values exit with status 2 and one error line.
"""
import subprocess

import ml_dtypes
import numpy as np
import numpy.testing as npt
import pytest

from tools.vllm_compare import compare

TOL = 1e-2
# every test of the module-scoped ``rows`` on one xdist worker: the comparison runs once per
# test run, not once in each worker that draws one of its tests
ROWS_GROUP = pytest.mark.xdist_group("vllm_compare_rows")


@pytest.fixture(scope="module")
def rows():
    """One run of every case plus the negative control (ours = Pallas kernels, interpret)."""
    out = compare.run_comparison(compare.CASES, ours="kernels", device="cpu", negative_control=True)
    print("\n" + compare.markdown_table(out))
    return {r["case"]: r for r in out}


def test_cases_cover_the_issue_list():
    cases = compare.CASES
    assert len(cases) >= 12
    assert len({c.seed for c in cases}) == len(cases)
    assert {c.num_kv_heads for c in cases} == {1, 4}
    seqs = [s for c in cases for s in c.seq_lens]
    assert min(seqs) < 2048 and 2048 in seqs and max(seqs) > 2048
    assert any(s % compare.PAGE for s in seqs)  # partial last pages
    assert any(len(set(c.seq_lens)) > 1 for c in cases)  # several requests, different lengths
    assert {c.query_lens[0] for c in cases if c.mode == "decode"} == {1, 2, 3, 4}
    assert any(c.mode == "prefill" and min(np.subtract(c.seq_lens, c.query_lens)) > 0 for c in cases)
    assert any(c.zero_index_q_reqs for c in cases)
    fp8 = [c for c in cases if c.index_dtype == "fp8_e4m3"]
    assert {c.mode for c in fp8} == {"decode", "prefill"} and {c.num_kv_heads for c in fp8} == {1, 4}
    assert any(max(c.seq_lens) > 2048 for c in fp8)
    for c in cases:  # bf16 (or e4m3 index) inputs, deterministic from the seed
        a, b = compare.make_inputs(c), compare.make_inputs(c)
        assert a["q"].dtype == np.uint16 and a["kv"].dtype == np.uint16
        index_bits = np.uint8 if c.index_dtype == "fp8_e4m3" else np.uint16
        assert a["index_q"].dtype == index_bits and a["index_k"].dtype == index_bits
        assert str(a["index_dtype"]) == c.index_dtype
        for k in a:
            npt.assert_array_equal(a[k], b[k])


def test_index_bits_decode_exactly():
    """e4m3 and bf16 bit patterns decode to float64 exactly (all 256 e4m3 patterns, a spread
    of finite bf16 ones)."""
    bits8 = np.arange(256, dtype=np.uint8)
    want8 = bits8.view(ml_dtypes.float8_e4m3fn).astype(np.float32).astype(np.float64)
    npt.assert_array_equal(compare.index_to_f64(bits8), want8)
    assert compare.index_to_f64(np.array([0x38, 0xC0, 0x7E], np.uint8)).tolist() == [1.0, -2.0, 448.0]
    bits16 = np.arange(0, 65536, 97, dtype=np.uint16)
    bits16 = bits16[(bits16 & 0x7F80) != 0x7F80]  # finite bf16 values (NaN casts warn)
    want16 = bits16.view(ml_dtypes.bfloat16).astype(np.float32).astype(np.float64)
    npt.assert_array_equal(compare.index_to_f64(bits16), want16)
    # the e4m3 values our side feeds as bf16 queries are exact in bf16
    finite = want8[np.isfinite(want8)]
    npt.assert_array_equal(finite.astype(ml_dtypes.bfloat16).astype(np.float64), finite)


@ROWS_GROUP
@pytest.mark.parametrize("name", [c.name for c in compare.CASES])
def test_case_agrees_with_vllm(rows, name):
    r = rows[name]
    assert r["error"] is None, r["error"]
    assert r["invalid"] == 0, r
    assert r["mismatch"] == 0, r["mismatch_rows"]
    assert r["tie_strict_violations"] == 0, r
    assert r["agree"] + r["tie_disagree"] == r["rows"]
    assert r["tokens_compared"] >= 1
    assert r["out_rel_err"] <= TOL, r
    assert r["out_rel_err_vllm_sel"] <= TOL, r
    assert r["ours_vs_oracle"] <= TOL and r["vllm_vs_oracle"] <= TOL, r
    assert r["passed"]
    assert r["index_dtype"] == next(c.index_dtype for c in compare.CASES if c.name == name)


@ROWS_GROUP
def test_exact_ties_are_counted_not_hidden(rows):
    r = rows["dec_h1_ties"]
    assert r["ties"] >= 1  # request 0 has all-zero index queries: every block scores 0
    assert r["agree"] + r["tie_disagree"] == r["rows"]
    assert r["tokens_compared"] == r["tokens"] - r["tie_disagree"]


@ROWS_GROUP
def test_negative_control_is_detected(rows):
    r = rows[compare.NEGATIVE_CONTROL.name]
    assert r["error"] is None, r["error"]
    assert r["detected"] and r["mismatch"] >= 1 and r["passed"]
    m = next(m for m in r["mismatch_rows"] if (m["token"], m["head"]) == (0, 0))
    assert m["only_vllm"] == [r["negative_control"]["block"]]


def test_a_failing_side_fails_the_case(tmp_path):
    spec = compare.CASES[0]
    (broken,) = compare.run_comparison([spec], ours="reference", device="cpu", ops_dir=tmp_path)
    assert not broken["passed"] and broken["error"].startswith("vllm: FileNotFoundError")
    with pytest.raises(FileNotFoundError):
        compare.run_comparison([spec], vllm_python=str(tmp_path / "no-python"))


def test_selection_accounting_on_synthetic_rows():
    # one token at position 20*128 (21 visible pages), one head; exact scores per page
    scores = np.arange(21, dtype=np.float64)[None, None, :].copy()  # page 20 is local (forced)
    positions = np.array([20 * 128], np.int32)
    best = np.array([[list(range(5, 21))]], np.int32)  # local 20 + the 15 best 5..19
    stats = compare.compare_selections(best, best.copy(), scores, positions)
    assert (stats["agree"], stats["ties"], stats["mismatch"], stats["invalid"]) == (1, 0, 0, 0)
    other = best.copy()
    other[0, 0, 0] = 4  # a worse page instead of 5: a real mismatch
    stats = compare.compare_selections(best, other, scores, positions)
    assert stats["mismatch"] == 1 and stats["mismatch_rows"][0]["only_vllm"] == [4]
    tied = scores.copy()
    tied[0, 0, 4] = tied[0, 0, 5]  # 15th and 16th best non-local pages now tie exactly
    stats = compare.compare_selections(best, other, tied, positions)
    assert (stats["ties"], stats["tie_disagree"], stats["mismatch"]) == (1, 1, 0)
    assert stats["tie_strict_violations"] == 0
    short = np.array([[[0, 1, 2] + [-1] * 13]], np.int32)  # 3 pages visible: identity
    stats = compare.compare_selections(short, short, scores, np.array([2 * 128 + 5], np.int32))
    assert (stats["rows_le16"], stats["agree"], stats["invalid"]) == (1, 1, 0)


@pytest.mark.parametrize("argv,flag,bound", [
    (["--tol", "-1"], "--tol", "> 0"), (["--tol", "0"], "--tol", "> 0"),
    (["--tol", "nan"], "--tol", "> 0"), (["--tol", "inf"], "--tol", "> 0"),
    (["--tol", "x"], "--tol", "> 0"),
    (["--vllm-workers", "-1"], "--vllm-workers", ">= 1"),
    (["--vllm-workers", "0"], "--vllm-workers", ">= 1"),
    (["--time-iters", "-1"], "--time-iters", ">= 0"),
    (["--time-iters", "2.5"], "--time-iters", ">= 0"),
])
def test_bad_numeric_flags_exit_2_with_one_line(capsys, argv, flag, bound):
    with pytest.raises(SystemExit) as exc:
        compare.main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert f"argument {flag}:" in lines[0] and bound in lines[0], lines[0]
    assert captured.out == ""


def test_numeric_flag_parsers_accept_their_bounds():
    assert compare.int_at_least(0)("0") == 0 and compare.int_at_least(1)("3") == 3
    assert compare.positive_float("1e-9") == 1e-9


@pytest.mark.parametrize("kw,match", [(dict(tol=-1.0), "tol must be a finite number > 0"),
                                      (dict(tol=float("nan")), "tol must be"),
                                      (dict(time_iters=-1), "time_iters must be an integer >= 0"),
                                      (dict(vllm_workers=0), "vllm_workers must be an integer >= 1")])
def test_run_comparison_rejects_bad_numbers(kw, match):
    with pytest.raises(ValueError, match=match):
        compare.run_comparison([compare.CASES[0]], **kw)


def test_vllm_side_rejects_negative_time_iters():
    """The vLLM-side script (run in the comparison venv) validates its numeric flag too."""
    if not compare.DEFAULT_VLLM_PYTHON.exists():
        pytest.fail("no .venv-vllm: run `make compare-env`")
    r = subprocess.run([str(compare.DEFAULT_VLLM_PYTHON), str(compare.VLLM_SIDE), "--ops-dir", "x",
                        "--cases", "y", "--time-iters", "-1"], capture_output=True, text=True)
    assert r.returncode == 2
    [line] = r.stderr.strip().splitlines()
    assert "argument --time-iters:" in line and ">= 0" in line

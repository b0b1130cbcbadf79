"""Comparison against vLLM 0.33.0's own MiniMax-M3 ops, on the CPU (never skipped).

vLLM's Triton kernels run under Triton's interpreter in the comparison venv (`make
compare-env`, a prerequisite of `make test`); ours are the Pallas kernels in interpret mode.
Selections must agree as sets per (token, KV head) outside exact score ties, outputs to a
relative L2 error <= 1e-2; a perturbed index-K page on one side must be detected.
"""
import numpy as np
import numpy.testing as npt
import pytest

from tools.vllm_compare import compare

TOL = 1e-2


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
    for c in cases:  # bf16 inputs, deterministic from the seed
        a, b = compare.make_inputs(c), compare.make_inputs(c)
        assert a["q"].dtype == np.uint16 and a["kv"].dtype == np.uint16
        for k in a:
            npt.assert_array_equal(a[k], b[k])


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


def test_exact_ties_are_counted_not_hidden(rows):
    r = rows["dec_h1_ties"]
    assert r["ties"] >= 1  # request 0 has all-zero index queries: every block scores 0
    assert r["agree"] + r["tie_disagree"] == r["rows"]
    assert r["tokens_compared"] == r["tokens"] - r["tie_disagree"]


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

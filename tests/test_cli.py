"""The command line: every bad flag is refused before any work starts, in one line that names
the flag and its bound, with exit status 2; the bounds are tight; the demo and the bucket
table run end to end on tiny settings."""
import argparse
import os

import jax
import pytest

import jax_msa_runner.cli.demo as demo
from _cli import TINY_DEMO, refused
from jax_msa_runner.batch.buckets import make_buckets
from jax_msa_runner.batch.staging import DUMMY_KINDS
from jax_msa_runner.cli.main import build_parser, main
from jax_msa_runner.config import RESERVED_PAGES, RunnerConfig
from jax_msa_runner.serving.kv_cache import pages_needed


D = "jax-msa-runner demo: error: argument "
B = "jax-msa-runner buckets: error: argument "
T = "jax-msa-runner: error: "
# (argv, how the error line starts: the parser, the flag's name and its bound)
BAD_FLAGS = [
    (["demo", "--dcp", "0"], D + "--dcp: must be >= 1, got 0"),
    (["demo", "--seed", "-1"], D + "--seed: must be >= 0, got -1"),
    (["demo", "--seed", "x"], D + "--seed: must be an integer >= 0, got 'x'"),
    (["demo", "--num-pages", "-1"], D + "--num-pages: must be >= 0, got -1"),
    (["demo", "--max-model-len", "-1"], D + "--max-model-len: must be in [1, 8388608], got -1"),
    (["demo", "--num-requests", "-1"], D + "--num-requests: must be >= 1, got -1"),
    (["demo", "--num-requests", "0"], D + "--num-requests: must be >= 1, got 0"),
    (["demo", "--num-layers", "0"], D + "--num-layers: must be >= 1, got 0"),
    (["demo", "--output-len", "-1"], D + "--output-len: must be >= 1, got -1"),
    (["demo", "--output-len", "0"], D + "--output-len: must be >= 1, got 0"),
    (["demo", "--long-prompts", "-1"], D + "--long-prompts: must be >= 0, got -1"),
    (["demo", "--temperature", "-1"], D + "--temperature: must be >= 0, got -1"),
    (["demo", "--temperature", "nan"], D + "--temperature: must be finite, got nan"),
    (["demo", "--temperature", "inf"], D + "--temperature: must be finite, got inf"),
    (["demo", "--max-num-seqs", "0"], D + "--max-num-seqs: must be >= 1, got 0"),
    (["demo", "--max-num-batched-tokens", "0"],
     D + "--max-num-batched-tokens: must be >= 1, got 0"),
    (["demo", "--attention-impl", "cuda"], D + "--attention-impl: invalid choice: 'cuda'"),
    # bounds between flags
    (["demo", "--num-requests", "4", "--long-prompts", "5"],
     D + "--long-prompts: must be <= --num-requests = 4, got 5"),
    (["demo", "--output-len", "2162"],
     D + "--output-len: must be <= --max-model-len - 399 = 2161 "),
    (["demo", "--max-model-len", "2068"],
     D + "--max-model-len: must be >= 2049 + --output-len = 2069 when --long-prompts > 0 "),
    (["demo", "--max-model-len", "8388609"],
     D + "--max-model-len: must be in [1, 8388608], got 8388609"),
    (["demo", "--dcp", "30", "--max-model-len", "3840"],
     D + "--max-model-len: must be > --dcp * 128 = 3840 "),
    (["demo", "--num-pages", "2"],
     D + "--num-pages: must be 0 (enough for every request at once) or >= "),
    (["demo", "--seed", "21475"], D + "--seed: must be <= 21474 "),
    # buckets
    (["buckets", "--repeats", "0"], B + "--repeats: must be >= 1, got 0"),
    (["buckets", "--profile-seq-len", "0"],
     B + "--profile-seq-len: must be in [1, 8192], got 0"),
    (["buckets", "--profile-seq-len", "8193"],
     B + "--profile-seq-len: must be in [1, 8192], got 8193"),
    # the top level
    (["--bogus"], T + "unrecognized arguments: --bogus"),
    (["demo", "--bogus", "3"], T + "unrecognized arguments: --bogus 3"),
    ([], T + "a command is required: demo, serve, buckets, logits or lower"),
    (["compare"], T + "argument command: invalid choice: 'compare'"),
]


@pytest.mark.parametrize("argv, expected", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_exit_2_before_any_work(argv, expected, capsys, no_work):
    line = refused(argv, capsys)
    assert line.startswith(expected), line
    # never the names of the config fields behind the flags, nor a Python exception's
    for name in ("num_pages", "sparse_attention_freq", "max_model_len", "StatisticsError"):
        assert name not in line, line


def test_too_few_devices_for_dcp_is_refused_before_any_work(monkeypatch, capsys, no_work):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored afterwards
    n = len(jax.devices())
    line = refused(["demo", "--dcp", str(n + 1), "--num-requests", "2"], capsys)
    assert line.startswith(f"jax-msa-runner demo: error: argument --dcp: {n + 1} ranks need "
                           f"{n + 1} devices, only {n} available"), line
    assert f"XLA_FLAGS={demo.HOST_DEVICES_FLAG}={n + 1}" in line


def _plan(*flags: str) -> demo.DemoPlan:
    _, commands = build_parser()
    return demo.plan_demo(commands["demo"].parse_args(list(flags)))


def test_default_plan_is_the_advertised_workload(no_work):
    plan = _plan()
    reqs = plan.requests
    assert len(reqs) == 32 and len(plan.scheduler.waiting) == 32
    lengths = sorted(len(r.prompt) for r in reqs)
    assert sum(n > 2048 for n in lengths) == 2
    assert lengths[0] >= 4 and lengths[-3] <= demo.SHORT_PROMPT_MAX
    assert all(len(r.prompt) + r.max_new_tokens <= 2560 for r in reqs)
    assert sorted(r.request_id for r in reqs) == list(range(32))
    assert plan.num_pages == len(RESERVED_PAGES) + sum(
        pages_needed(len(r.prompt) + r.max_new_tokens, 1) for r in reqs)


def test_bounds_between_flags_are_tight(capsys, no_work):
    """The values at each bound are accepted (and plan a servable workload); one past is not
    (test_bad_flag_is_one_line_exit_2_before_any_work)."""
    plan = _plan("--long-prompts", "0", "--output-len", "2161")
    assert plan.runner.max_model_len == 2560 and len(plan.scheduler.waiting) == 32
    plan = _plan("--max-model-len", "2069")
    assert max(len(r.prompt) for r in plan.requests) <= 2049
    assert sum(len(r.prompt) == 2049 for r in plan.requests) == 2  # long prompts: exactly 2049
    assert _plan("--num-requests", "4", "--long-prompts", "4").requests
    assert _plan("--seed", "21474").scheduler.waiting[0].seed <= 2**31 - 1
    assert _plan("--dcp", "2", "--max-model-len", "2561").runner.dcp_world_size == 2
    # --num-pages: the reserved pages plus the longest request's pages is enough, one less is not
    reqs = _plan().requests
    need = len(RESERVED_PAGES) + max(pages_needed(len(r.prompt) + r.max_new_tokens - 1, 1)
                                     for r in reqs)
    assert _plan("--num-pages", str(need)).num_pages == need
    line = refused(["demo", "--num-pages", str(need - 1)], capsys)
    assert f"or >= {need} (2 reserved pages plus the longest request's {need - 2}), " \
           f"got {need - 1}" in line


def test_flag_types_name_their_bounds():
    from jax_msa_runner.cli.flags import bounded_float, bounded_int

    assert bounded_int(1, 3)("3") == 3
    assert bounded_float(0.0)("0.5") == 0.5
    for parse, text, msg in [(bounded_int(1, 3), "4", "must be in [1, 3], got 4"),
                             (bounded_int(hi=3), "4", "must be <= 3, got 4"),
                             (bounded_int(1), "1.5", "must be an integer >= 1, got '1.5'"),
                             (bounded_float(0.0), "-0.5", "must be >= 0, got -0.5"),
                             (bounded_float(0.0), "x", "must be a number, got 'x'")]:
        with pytest.raises(argparse.ArgumentTypeError) as exc:
            parse(text)
        assert str(exc.value) == msg


def test_demo_serves_a_tiny_workload(capsys):
    """End to end on tiny settings: every request finishes, no compilation after warm-up,
    every step's metadata validated, the summary printed on stdout (the progress bar on
    stderr)."""
    rc = main([*TINY_DEMO, "--temperature", "0.5", "--debug"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "requests            3/3 finished" in out
    assert "output tokens       9 " in out
    assert "compilations after warm-up: 0" in out
    assert "metadata validation: passed on all" in out
    assert "3/3" in err  # tqdm's bar reached every request


def test_buckets_stages_and_validates_every_bucket_and_kind(capsys):
    assert main(["buckets", "--repeats", "1", "--profile-seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.rstrip().endswith(" ok")]
    assert len(rows) == len(make_buckets(RunnerConfig())) * len(DUMMY_KINDS)
    assert "all buckets valid" in out

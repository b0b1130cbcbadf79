"""The bench scripts' shared helpers (bench/_common.py), kernels.py's report logic and
every script's command line, on CPU.

The GPU-only paths of bench/kernels.py (vLLM timing) are exercised through their pure parts:
the summary of recorded samples, the choice of the valid figure, the printed row and the
markdown table, on made-up records.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import _common  # noqa: E402
import kernels  # noqa: E402

HLO = """HloModule jit_f, is_scheduled=true

%fused_computation (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  %c = f32[] constant(1)
  %b = f32[8]{0} broadcast(%c), dimensions={}
  ROOT %add = f32[8]{0} add(%param_0, %b)
}

%fused_computation.1 (param_0.1: f32[8]) -> f32[8] {
  %param_0.1 = f32[8]{0} parameter(0)
  ROOT %neg = f32[8]{0} negate(%param_0.1)
}

%command_buffer (p: f32[8]) -> (f32[8], f32[8]) {
  %p = f32[8]{0} parameter(0)
  %f1 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused_computation
  %f2 = f32[8]{0} fusion(%f1), kind=kLoop, calls=%fused_computation.1
  ROOT %t = (f32[8]{0}, f32[8]{0}) tuple(%f1, %f2)
}

%body (arg: (s32[], f32[8])) -> (s32[], f32[8]) {
  %arg = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[8]{0} get-tuple-element(%arg), index=1
  %k = f32[8]{0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %k)
}

%cond (arg.1: (s32[], f32[8])) -> pred[] {
  %arg.1 = (s32[], f32[8]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%arg.1), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (x.1: f32[8]) -> (f32[8], f32[8]) {
  %x.1 = f32[8]{0} parameter(0)
  %cb = (f32[8]{0}, f32[8]{0}) call(%x.1), to_apply=%command_buffer
  %g = f32[8]{0} get-tuple-element(%cb), index=1
  %s = f32[8]{0} custom-call(%g), custom_call_target="__gpu$xla.gpu.triton"
  %cp = f32[8]{0} copy(%s)
  %bc = f32[8]{0} bitcast(%cp)
  %z = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%z, %bc)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  %o = f32[8]{0} get-tuple-element(%w), index=1
  ROOT %out = (f32[8]{0}, f32[8]{0}) tuple(%o, %g)
}
"""


def test_hlo_kernel_count_descends_calls_and_loops_not_fusions():
    count = _common.hlo_kernel_count(HLO)
    # command buffer: 2 fusions; entry: custom-call + copy; loop body: 1 custom-call; loop
    # condition: 1 compare (device work too); nothing inside the fusions' own computations
    assert count["by_opcode"] == {"fusion": 2, "custom-call": 2, "copy": 1, "compare": 1}
    assert count["total"] == 6
    assert count["loops"] is True


def test_hlo_kernel_count_of_a_compiled_function():
    x = jnp.ones((64,), jnp.float32)
    one = _common.hlo_kernel_count(_common.compile_op(lambda a: a * 2.0 + 1.0, x).as_text())
    two = _common.hlo_kernel_count(
        _common.compile_op(lambda a: (jnp.sort(a * 2.0), jnp.sum(a * a)), x).as_text())
    assert one["total"] >= 1
    assert two["total"] > one["total"]  # a sort and a reduction cannot share one kernel


def test_hlo_kernel_count_needs_an_entry():
    with pytest.raises(ValueError, match="ENTRY"):
        _common.hlo_kernel_count("HloModule m\n")


@pytest.mark.parametrize("l2", _common.L2_MODES)
def test_time_jax_samples_and_checks(l2):
    x = jax.random.normal(jax.random.key(3), (513, 7), jnp.float32)
    t = _common.time_jax(lambda a, b: jnp.tanh(a) @ b, (x, x.T), n=3, trials=2, l2=l2)
    assert t.l2 == l2 and len(t.samples_s) == 2
    chex.assert_tree_all_finite(np.asarray(t.samples_s))
    assert all(s > 0 for s in t.samples_s) and t.us > 0 and t.host_us_per_dispatch > 0
    assert (t.flush_us is not None) == (l2 == "cold")
    d = t.as_dict()
    assert d["l2"] == l2 and len(d["samples_us"]) == 2 and isinstance(d["gpu_bound"], bool)
    assert l2 in _common.timer_description(l2, 3)


def test_time_jax_rejects_bad_arguments():
    f, a = (lambda v: v + 1), (jnp.ones(3),)
    with pytest.raises(ValueError, match="l2"):
        _common.time_jax(f, a, n=2, trials=1, l2="lukewarm")
    with pytest.raises(ValueError, match="n and trials"):
        _common.time_jax(f, a, n=0, trials=1, l2="warm")
    with pytest.raises(ValueError, match="preroll >= 0"):
        _common.time_jax(f, a, n=2, trials=1, l2="cold", preroll=-1)


def test_time_jax_without_preroll():
    """preroll=0 (no flush-only dispatches before the wall-clock loop) still times."""
    t = _common.time_jax(lambda v: v * 2.0, (jnp.ones(64),), n=2, trials=2, l2="cold",
                         preroll=0)
    chex.assert_tree_all_finite(np.asarray(t.samples_s))
    assert len(t.samples_s) == 2 and all(s > 0 for s in t.samples_s) and t.flush_us > 0


def test_time_jax_with_compiler_options():
    """XLA options reach both cold executables and key the cache: no command buffers by
    default, XLA's defaults when asked."""
    f, a = (lambda v: v * 3.0), (jnp.ones(64),)
    for options in (None, _common.XLA_COMMAND_BUFFERS):
        kw = {} if options is None else dict(compiler_options=options)
        t = _common.time_jax(f, a, n=2, trials=1, l2="cold", **kw)
        chex.assert_tree_all_finite(np.asarray(t.samples_s))
    keys = [k for k in _common._COMPILED if k[0] is f]
    assert [k[3] for k in keys] == [(("xla_gpu_enable_command_buffer", ""),), ()]


def test_rel_l2():
    rng = np.random.default_rng(5)
    b = rng.standard_normal((3, 11))
    d = rng.standard_normal((3, 11))
    np.testing.assert_allclose(_common.rel_l2(b + d, b), np.linalg.norm(d) / np.linalg.norm(b))
    assert _common.rel_l2(b, b) == 0.0
    bad = b.copy()
    bad[1, 2] = np.nan
    assert _common.rel_l2(bad, b) == math.inf
    with pytest.raises(ValueError, match="shapes"):
        _common.rel_l2(b, b[:, :3])


def test_positive_int_names_the_bound():
    assert _common.positive_int("7") == 7
    for text in ("0", "-2", "x"):
        with pytest.raises(Exception, match=">= 1"):
            _common.positive_int(text)


def test_int_list_bounds_every_value_and_takes_empty_only_when_allowed():
    parse = _common.int_list(2)
    assert parse("4096,32768") == (4096, 32768)
    for text, match in (("4096,1", "every value must be >= 2, got 1"),
                        ("", "expected comma-separated integers, got ''"),
                        ("1k", "expected comma-separated integers")):
        with pytest.raises(argparse.ArgumentTypeError, match=match):
            parse(text)
    assert _common.int_list(0, allow_empty=True)("") == ()
    assert _common.int_list(0, allow_empty=True)("0,30720") == (0, 30720)


def test_write_json_stamps_meta(tmp_path):
    path = tmp_path / "sub" / "r.json"
    _common.write_json(str(path), {"rows": [np.float32(1.5), np.int64(3)]})
    import json
    doc = json.loads(path.read_text())
    assert list(doc)[0] == "meta" and doc["rows"] == [1.5, 3]
    assert {"date", "device", "jax"} <= set(doc["meta"])


def test_selection_agreement_compares_sets():
    a = np.array([[[3, 1, 2, -1]], [[0, 1, 2, 5]]])
    b = np.array([[[1, 2, 3, -1]], [[0, 1, 2, 6]]])
    assert kernels.selection_agreement(a, b) == 0.5
    assert kernels.selection_agreement(a, a[:, :, ::-1]) == 1.0
    np.testing.assert_allclose(kernels.selection_overlap(a, b), (1.0 + 0.75) / 2)


def _vllm_records(eager_host_us: float, flush_us: float = 120.0):
    """Made-up per-op samples as vllm_time accumulates them."""
    acc = {"decode": {"graph": [8e-6, 7e-6], "eager": [6e-6, 6.5e-6],
                      "graph_host_us": [4.0], "eager_host_us": [eager_host_us],
                      "flush_us": [flush_us], "flush_repeats": [1]}}
    return acc, {"decode": {"host_us": eager_host_us - 5.0},
                 "indexer": {"err": "RuntimeError: boom"}}


def test_vllm_summary_uses_eager_only_when_gpu_bound():
    acc, state = _vllm_records(eager_host_us=40.0)
    s = kernels.vllm_summary(acc, state, flush_us=120.0)
    assert s["decode"]["method"] == "eager" and s["decode"]["eager"]["gpu_bound"]
    np.testing.assert_allclose(s["decode"]["us"], 6.25)
    assert s["indexer"] == {"err": "RuntimeError: boom"}
    acc, state = _vllm_records(eager_host_us=300.0)
    s = kernels.vllm_summary(acc, state, flush_us=120.0)
    assert s["decode"]["method"] == "graph" and not s["decode"]["eager"]["gpu_bound"]
    np.testing.assert_allclose(s["decode"]["us"], 7.5)


def test_best_valid_without_a_valid_timing():
    assert kernels.best_valid(None, {"samples_s": [1e-6], "gpu_bound": False})[0] is None
    graph = {"samples_s": [2e-6], "gpu_bound": False}
    assert kernels.best_valid(graph, None)[0] is None


def _fake_result():
    acc, state = _vllm_records(eager_host_us=300.0)
    ours = {"us": 5.0, "samples_us": [5.0], "host_us_per_dispatch": 20.0, "flush_us": 1200.0,
            "calls_per_dispatch": 10, "gpu_bound": True}
    kc = {"total": 2, "by_opcode": {"custom-call": 2}, "loops": False}
    row = {"hq": 16, "hkv": 1, "batch": 1, "context": 8192,
           "bytes": {"indexer": 2 << 20, "decode": 1 << 20},
           "kernels": {"indexer": kc, "decode": kc},
           "ours": {"indexer": dict(ours, us=9.0), "decode": ours},
           "vllm": kernels.vllm_summary(acc, state, flush_us=120.0),
           "selection_agree": {"indexer": 1.0}, "decode_rel_l2_vs_vllm": 2.5e-3}
    row["ratio"] = {"decode": row["vllm"]["decode"]["us"] / ours["us"]}
    return {"meta": {"date": "2026-12-01 00:00 UTC", "device": "NVIDIA H200", "jax": "0.11.2"},
            "copy": {"copy_Bps": 4.28e12}, "vllm_versions": {"torch": "2.11", "triton": "3.6"},
            "timing": {"ours": "ours-method", "vllm": "vllm-method"}, "rows": [row]}


def test_markdown_and_printed_row(capsys):
    result = _fake_result()
    md = kernels.markdown(result)
    assert "2026-12-01" in md and "NVIDIA H200" in md and "ours-method" in md
    assert "vllm-method" in md and "torch 2.11" in md
    assert "| 16/1 | 1 | 8192 | 9.0 | n/a | n/a |" in md  # the indexer's vLLM side failed
    assert "1.50x" in md  # decode: vLLM 7.5 us (graph) / ours 5.0 us
    assert "decode: geometric-mean ratio 1.50x" in md
    assert "| NO | graph |" in md  # eager host-bound, graph used
    assert "error: RuntimeError: boom" in md
    kernels.print_row(result["rows"][0])
    out = capsys.readouterr().out
    assert "HOST-BOUND" in out and "ratio 1.50x" in out and "2 XLA kernels" in out
    assert isinstance(kernels.plot(result, os.devnull + ".png"), str)


def test_scripts_cli_help_and_bad_flags():
    """Every script's --help runs on CPU (imports guarded), and bad flags exit 2 naming them."""
    code = r"""
import os, runpy, sys
bench = sys.argv[1]
sys.path.insert(0, bench)
def run(name, *argv):
    sys.argv = [name, *argv]
    try:
        runpy.run_path(os.path.join(bench, name), run_name="__main__")
    except SystemExit as e:
        return e.code
    return 0
for name in ("kernels.py", "prefill.py", "dcp.py", "serving.py", "staging.py",
             "real_layer.py", "serve_load.py"):
    assert run(name, "--help") == 0, name
assert run("kernels.py", "--out", "/tmp/x") == 2  # no GPU and no --cpu-smoke
assert run("kernels.py", "--out", "/tmp/x", "--cpu-smoke", "--shapes", "16") == 2
assert run("kernels.py", "--out", "/tmp/x", "--cpu-smoke", "--reps", "0") == 2
assert run("prefill.py", "--chunk", "-1") == 2
assert run("prefill.py", "--trials", "0") == 2
assert run("dcp.py", "--out", "/tmp/x", "--world-size", "0") == 2
assert run("serving.py", "--out", "/tmp/x", "--command-buffers", "xla,graphs") == 2
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code, BENCH], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
    assert "--shapes: shape indices must be in [0, 16)" in r.stderr
    assert "--reps: must be >= 1" in r.stderr
    assert "--trials: must be >= 1" in r.stderr
    assert "--world-size: must be >= 1, got 0" in r.stderr
    assert ("command buffers must be from ('xla', 'off', 'no-custom-calls', 'control-flow')"
            in r.stderr)


def test_kernels_cpu_smoke(tmp_path):
    """kernels.py end to end off the GPU: one tiny shape in interpret mode, our outputs checked
    against the jnp references, JSON and markdown written."""
    import json
    assert kernels.main(["--out", str(tmp_path), "--cpu-smoke"]) == 0
    doc = json.loads((tmp_path / "kernels.json").read_text())
    (row,) = doc["rows"]
    assert set(row["ours"]) == {"indexer", "indexer_fp8", "decode"}
    assert row["reference_check"]["selection_agree"] == 1.0
    assert row["reference_check"]["decode_rel_l2"] < 1e-2
    assert all(k["total"] >= 1 for k in row["kernels"].values())
    assert all(o["us"] > 0 and o["samples_us"] for o in row["ours"].values())
    assert doc["vllm_ops"] == "not requested" and "cold L2" in doc["timing"]["ours"]
    assert "| 16/1 | 2 | 4096 |" in (tmp_path / "kernels.md").read_text()


def test_cold_executable_loops_flush_and_op():
    """The cold timer's executable: k calls in a while loop of known trip count whose body
    holds both the flush and the op (not hoisted out); the flush-first check on its text."""
    x = jnp.ones((64,), jnp.float32)
    buf = jnp.zeros((_common.FLUSH_BYTES // 4,), jnp.float32)
    hlo = _common._executable(jnp.sort, "cold", 4).lower(buf, (x,)).compile().as_text()
    trip, body = _common.cold_loop_body(hlo)
    assert trip == 4
    assert " sort(" in body and "add" in body  # the op and the flush, each iteration
    with pytest.raises(ValueError, match="multiple of calls_per_dispatch"):
        _common.time_jax(jnp.sort, (x,), n=15, trials=1, l2="cold")


def test_check_flush_first():
    flush = f"f32[{_common.FLUSH_BYTES // 4}]{{0}}"
    ok = (f"%body (p: s32[]) -> s32[] {{\n  %add = s32[] fusion(%a), kind=kLoop\n"
          f"  %flush = {flush} fusion(%b), kind=kLoop\n"
          f"  %op = bf16[4,8]{{1,0}} custom-call(%c), custom_call_target=\"mosaic_gpu\"")
    _common.check_flush_first(ok)
    fill = "  %zeros = s32[16]{0} fusion(), kind=kLoop, calls=%fused_broadcast\n"
    _common.check_flush_first(ok.replace("  %flush", fill + "  %flush"))
    with pytest.raises(ValueError, match="not the flush"):
        _common.check_flush_first(ok.replace("  %flush", fill.replace("fusion()", "fusion(%b)")
                                             + "  %flush"))
    bad = ok.replace("%flush", "%tmp").replace("%op =", "%flush =")
    bad = "\n".join([bad.splitlines()[0], bad.splitlines()[1], bad.splitlines()[3],
                     bad.splitlines()[2]])
    with pytest.raises(ValueError, match="not the flush"):
        _common.check_flush_first(bad)
    with pytest.raises(ValueError, match="no kernel"):
        _common.check_flush_first("%body () -> () {")


def test_gpu_clock_lowers_and_joins_words():
    """The timer kernel lowers for an abstract H200 as one Mosaic GPU call that takes its
    dependencies as operands; clock_ns joins its two int32 words (the low one may read
    negative) into the 64-bit count."""
    import _gpu_clock
    from pallas_kernels._lowering import custom_call_counts, lower_for_cuda
    deps = (jnp.ones((1024,), jnp.float32), {"out": jnp.zeros((3, 16), jnp.int32)})
    text = lower_for_cuda(_gpu_clock.read_clock, *deps)
    assert custom_call_counts(text) == {"mosaic": 1, "triton": 0, "other": 0}
    ns = (7 << 32) | 0xFFFFFFF0
    words = np.array([np.int32(np.uint32(ns & 0xFFFFFFFF).view(np.int32)), 7], np.int32)
    assert _gpu_clock.clock_ns(words) == ns
    assert _gpu_clock.clock_ns(np.array([5, 0], np.int32)) == 5

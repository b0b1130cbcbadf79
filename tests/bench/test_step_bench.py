"""bench/step.py off the GPU: ``--dry-run`` end to end in a subprocess (a tiny 2-layer model
through the runner's real step path, the profile split by op family, JSON and markdown), the
roofline model on hand-computed figures, the split and the trace reader on made-up events, the
plan of the real run, ``--help`` and the refusals."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import _common  # noqa: E402
import step  # noqa: E402
from jax_msa_runner.config import ModelConfig  # noqa: E402


@pytest.mark.slow
def test_dry_run_measures_every_family_through_the_runner(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(BENCH, "step.py"), "--dry-run", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((tmp_path / "step.json").read_text())
    assert doc["dry_run"] is True and doc["skipped"] == [] and doc["meta"]["jax"]
    c = doc["config"]
    assert (c["tp"], c["ep"], c["layers"], c["heads"], c["local_experts"]) == (4, 8, 2, "2/1", 2)
    assert c["layer_weights"] == "shared" and "bytes read per layer unchanged" in c["weights_note"]
    assert [row["name"] for row in doc["rows"]] == [
        "prefill 64 after 0", "prefill 64 after 192", "ttft 256-token prompt, chunks of 64",
        "decode B=2 L=256"]
    for row in doc["rows"]:
        fam = row["family_ms"]
        assert set(fam) == set(step.FAMILIES)
        # every family of a dense + MSA/MoE step shows up in the profile, measured
        assert all(fam[f] > 0 for f in step.FAMILIES), (row["name"], fam)
        assert sum(fam.values()) == pytest.approx(row["device_ms"])
        assert sum(row["scope_ms"].values()) == pytest.approx(row["device_ms"])
        assert row["scope_ms"]["sampling"] > 0 and row["scope_ms"]["lm_head"] > 0
        assert row["unattributed"] == []  # every CPU thunk maps to an HLO op of the step
        assert row["host_gap_ms"] == pytest.approx(row["step_ms"] - row["device_ms"])
        assert row["pipelined_gap_ms"] == pytest.approx(row["pipelined_ms"] - row["device_ms"])
        assert row["launch_ms"] > 0 and row["pipelined_ms"] > 0 and row["step_ms_off"] > 0
        assert row["launch_ms_off"] > 0 and row["pipelined_ms_off"] > 0
        host = row["host_events"]
        assert host and all(h["total_ms"] >= h["self_ms"] >= 0 and h["calls"] > 0 for h in host)
        assert [h["self_ms"] for h in host] == sorted((h["self_ms"] for h in host), reverse=True)
        assert row["pct_roofline_pipelined"] == pytest.approx(
            100 * row["roofline"]["ms"] / row["pipelined_ms"])
        assert row["step_ms"] == pytest.approx(float(np.median(row["samples_ms"])))
        assert 0 < row["roofline"]["ms"] and row["pct_roofline"] > 0
        k = c["rank_model"]["num_experts_per_tok"]
        for batch_routing, tokens in zip(row["routing"]["per_batch"], _row_tokens(row)):
            assert len(batch_routing) == c["moe_layers"]  # one (distinct, copies) per layer
            for distinct, copies in batch_routing:
                assert 0 <= distinct <= min(c["local_experts"], copies) and copies <= tokens * k
    decode = doc["rows"][-1]
    assert decode["tokens"] == 2 and decode["tokens_per_s"] == pytest.approx(
        2 / (decode["step_ms"] / 1e3))
    mc = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v
                        for k, v in c["rank_model"].items()})
    want = step.step_cost(mc, num_local=2, weights="bf16", computed=[255, 255], scheduled=[1, 1],
                          routing=decode["routing"]["per_batch"][0])
    assert decode["cost"]["bytes"] == pytest.approx(want["bytes"])
    ttft = doc["rows"][2]
    assert ttft["chunks"] == 4 and ttft["ttft_ms"] == ttft["step_ms"]
    md = (tmp_path / "step.md").read_text()
    assert "DRY RUN" in md and "| decode B=2 L=256 | 2 |" in md
    assert "- decode B=2 L=256, no command buffers: step " in md
    assert "- decode B=2 L=256: local experts touched per MoE layer " in md
    assert "TTFT of a 256-token prompt (4 chunks of 64)" in md


def _row_tokens(row: dict) -> list[int]:
    """Real tokens of each of a row's batches (a TTFT row: its chunks)."""
    if row["kind"] == "ttft":
        return [min(row["tokens"], row["context"] - c)
                for c in range(0, row["context"], row["tokens"])]
    return [row["tokens"]]


def _tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                num_index_heads=1, head_dim=16, rotary_dim=8, index_dim=16,
                intermediate_size=8, sparse_attention_freq=(0, 1), moe_layer_freq=(0, 1),
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4,
                shared_intermediate_size=4, dtype="bfloat16")
    return ModelConfig(**{**base, **kw})


class _Recorder:
    """A stand-in runner that logs launch_step / finish_step calls."""

    def __init__(self):
        self.log, self._n = [], 0

    def launch_step(self, batch):
        self._n += 1
        self.log.append(("launch", batch, self._n))
        return self._n

    def finish_step(self, handle):
        self.log.append(("read", handle))


def test_pipelined_steps_launch_before_reading_the_previous_one():
    rec = _Recorder()
    launch_ms, piped_ms = step.launch_and_pipelined_ms(rec, ["a", "b"], steps=2)
    assert launch_ms >= 0 and piped_ms >= 0
    launches = [e[2] for e in rec.log if e[0] == "launch"]
    reads = [e[1] for e in rec.log if e[0] == "read"]
    assert reads == launches  # every step read once, in launch order
    for i, e in enumerate(rec.log):
        if e[0] == "read" and e[1] < launches[-1]:  # step n is read after step n + 1 launched
            assert ("launch", ) == rec.log[i - 1][:1] and rec.log[i - 1][2] == e[1] + 1
    # a warm-up launch, then 3 rounds (one fills the pipeline) of the two batches
    assert [e[1] for e in rec.log if e[0] == "launch"] == ["a"] + ["a", "b"] * 3


def test_step_cost_by_hand():
    """Decode of 2 requests at 3000 keys: hidden 32, heads 2/1 of 16, index 1 x 16, dense MLP
    8, 2 of 8 experts of 4 (top 2), shared 4, vocab 64."""
    mc = _tiny()
    cost = step.step_cost(mc, num_local=2, weights="bf16", computed=[2999, 2999],
                          scheduled=[1, 1])
    attn = 32 * 32 + 2 * 32 * 16 + 32 * 32  # q, k, v, o
    index = 32 * 16 + 32 * 16
    touched = 2 * (1 - (1 - 2 / 8) ** 2)
    weights = (2 * attn + 2 * (64 + 32)  # dense layer: linears and norms
               + 2 * 3 * 32 * 8  # dense MLP
               + 2 * (attn + index) + 2 * (64 + 32 + 32)  # MSA layer
               + 2 * (touched * 3 * 32 * 4 + 3 * 32 * 4) + 4 * (32 * 8 + 8)  # MoE, router
               + 2 * (32 * 64 + 2 * 32 + 32))  # LM head, embedding rows, final norm
    b = cost["bytes"]
    assert cost["touched_experts"] == pytest.approx(touched)
    assert b["weights"] == pytest.approx(weights)
    kv_tok = 2 * 16 * 2
    assert b["kv_cache"] == 2 * 3000 * kv_tok + 2 * 2048 * kv_tok  # dense all, MSA top-16 pages
    assert b["index_cache"] == 2 * 3000 * 16 * 2
    assert b["cache_writes"] == 2 * kv_tok + 2 * (kv_tok + 32)
    assert b["activations"] == 2 * 4 * 2 * 32 * 2
    f = cost["flops"]
    assert f["attention"] == 4 * 2 * 16 * 6000 + 2 * 16 * 6000 + 4 * 2 * 16 * 4096
    assert f["lm_head"] == 2 * 2 * 32 * 64
    assert f["moe"] == pytest.approx(2 * (2 * 2 * 2 / 8 * 3 * 32 * 4 + 2 * 3 * 32 * 4 + 2 * 32 * 8))
    fp8 = step.step_cost(mc, num_local=2, weights="fp8", computed=[2999, 2999], scheduled=[1, 1])
    assert fp8["bytes"]["weights"] < b["weights"] and fp8["flops"] == f
    roof = step.roofline(cost, copy_Bps=1e9, flops_per_s=1e15)
    assert roof["bound"] == "memory" and roof["ms"] == pytest.approx(sum(b.values()) / 1e6)


def test_host_self_time_excludes_children():
    """A 10 us parent holding a 4 us child on one thread, a 3 us event on another, 2 steps."""
    ev = [{"name": "parent", "thread": 1, "ts": 0.0, "us": 10.0},
          {"name": "child", "thread": 1, "ts": 2.0, "us": 4.0},
          {"name": "other", "thread": 2, "ts": 1.0, "us": 3.0}]
    rows = {r["name"]: r for r in _common.host_time_by_name(ev, steps=2)}
    assert rows["parent"]["self_ms"] == pytest.approx(3e-3) and rows["parent"]["total_ms"] == 5e-3
    assert rows["child"]["self_ms"] == pytest.approx(2e-3) and rows["other"]["calls"] == 0.5


def test_step_cost_reads_the_measured_experts():
    """Measured routing replaces uniform routing's expectation, layer by layer: 1 expert and
    2 copies read 1 expert's bytes and compute 2 copies; the uniform count stays reported."""
    mc = _tiny()
    uniform = step.step_cost(mc, num_local=2, weights="bf16", computed=[2999, 2999],
                             scheduled=[1, 1])
    cost = step.step_cost(mc, num_local=2, weights="bf16", computed=[2999, 2999],
                          scheduled=[1, 1], routing=[(1, 2)])
    routed = 3 * 32 * 4
    touched = 2 * (1 - (1 - 2 / 8) ** 2)
    assert cost["touched_experts"] == 1
    assert cost["touched_experts_uniform"] == pytest.approx(touched)
    assert uniform["bytes"]["weights"] - cost["bytes"]["weights"] == pytest.approx(
        2 * (touched - 1) * routed)
    assert uniform["flops"]["moe"] - cost["flops"]["moe"] == pytest.approx(
        2 * (2 * 2 * 2 / 8 - 2) * routed)
    with pytest.raises(ValueError, match="one entry per MoE layer"):
        step.step_cost(mc, num_local=2, weights="bf16", computed=[1], scheduled=[1],
                       routing=[(1, 1), (1, 1)])


def test_prefill_cost_counts_causal_keys():
    """A 4-token chunk after 2 cached tokens: its tokens see 3, 4, 5, 6 keys."""
    cost = step.step_cost(_tiny(), num_local=2, weights="bf16", computed=[2], scheduled=[4])
    assert cost["flops"]["attention"] == (4 * 2 * 16 * 18) + (2 * 16 * 18 + 4 * 2 * 16 * 18)
    assert cost["bytes"]["kv_cache"] == 2 * 6 * 2 * 16 * 2  # both layers read all 6 keys


def test_split_maps_ops_to_families_and_skips_containers():
    hlo = """HloModule jit_forward_step, entry_computation_layout={()->f32[]}

%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %m = f32[4]{0} multiply(%p, %p), metadata={op_name="jit(forward_step)/moe/mul"}
}

ENTRY %main () -> f32[4] {
  %fusion.1 = f32[4]{0} fusion(), kind=kLoop, calls=%fused
  %custom-call.2 = f32[4]{0} custom-call(), custom_call_target="mosaic_gpu", metadata={op_name="jit(forward_step)/attention_msa/jit(msa)/pallas_call"}
  %dot.3 = f32[4]{0} dot(), metadata={op_name="jit(forward_step)/dense_mlp/dot_general"}
  %while.4 = f32[4]{0} while(), condition=%c, body=%b, metadata={op_name="jit(forward_step)/norms/while"}
  ROOT %add.5 = f32[4]{0} add(), metadata={op_name="jit(forward_step)/add"}
}
"""
    name, ops = _common.hlo_ops(hlo)
    assert name == "jit_forward_step" and ops["fusion.1"]["op_name"] == "jit(forward_step)/moe/mul"
    assert ops["while.4"]["opcode"] == "while"
    modules = {name: ops, "jit_sampling_step": {"f.9": {"op_name": "x", "opcode": "fusion"}}}
    ev = lambda module, op, us: {"module": module, "op": op, "us": us, "device": True,  # noqa: E731
                                 "name": op}
    events = [ev(name, "fusion.1", 100.0), ev(name, "custom-call.2", 300.0),
              ev(name, "dot.3", 40.0), ev(name, "while.4", 1e6), ev(name, "add.5", 10.0),
              ev("jit_sampling_step", "f.9", 20.0), ev(None, None, 30.0)]
    events[-1]["name"] = "MemcpyH2D"
    split = step.split_by_family(events, modules, "jit_sampling_step", steps=2)
    assert split["family_ms"] == pytest.approx({
        "attention_dense": 0.0, "attention_msa": 0.15, "moe": 0.05, "projections": 0.02,
        "norms": 0.0, "other": 0.03})
    assert split["scope_ms"] == pytest.approx({"attention_msa": 0.15, "dense_mlp": 0.02,
                                               "moe": 0.05, "other": 0.02, "sampling": 0.01})
    assert split["device_ms"] == pytest.approx(0.25)
    assert [u["op"] for u in split["unattributed"]] == ["None:MemcpyH2D"]
    assert split["unattributed"][0]["ms"] == pytest.approx(0.015)
    assert step.scope_family("jit(f)/moe/jit(g)/projections/dot") == ("projections", "projections")
    assert step.scope_family("jit(f)/lm_head/dot") == ("lm_head", "projections")


def test_trace_reader_takes_device_streams_only(tmp_path):
    """A GPU-like trace: the stream's kernels and its memcpy count, the derived "XLA Ops" line
    and the host thread's annotations (which carry hlo_op too) do not."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7"}},
            {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]
    op = {"hlo_op": "fusion.1", "hlo_module": "jit_forward_step"}
    evs = [{"ph": "X", "pid": 1, "tid": 7, "dur": 5.0, "name": "k", "args": op},
           {"ph": "X", "pid": 1, "tid": 7, "dur": 2.0, "name": "MemcpyH2D", "args": {}},
           {"ph": "X", "pid": 1, "tid": 8, "dur": 5.0, "name": "fusion.1", "args": op},
           {"ph": "X", "pid": 2, "tid": 3, "dur": 9.0, "name": "thunk", "args": op}]
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + evs}, f)
    got = _common.trace_op_events(str(tmp_path))
    assert [(e["op"], e["us"], e["device"]) for e in got] == [("fusion.1", 5.0, True),
                                                              (None, 2.0, True)]


def test_plan_of_the_real_run():
    groups = step.plan(step.BATCHES, step.CONTEXTS, step.CHUNK, step.PREFILL_CONTEXTS,
                       step.TTFT_PROMPT)
    assert len(groups) == 13 and sum(len(g.points) for g in groups) == 15
    assert [(g.num_reqs, g.max_model_len) for g in groups[:3]] == [(16, 32768), (1, 32768),
                                                                   (1, 32768)]
    pre = groups[2]
    assert pre.num_tokens == 2048 and [p.name for p in pre.points] == [
        "prefill 2048 after 0", "prefill 2048 after 30720",
        "ttft 32768-token prompt, chunks of 2048"]
    sizes = [g.num_reqs * g.max_model_len for g in groups[3:]]
    assert sizes == sorted(sizes) and groups[-1].points[0].name == "decode B=256 L=131072"
    d = step.Point("decode", 16, 32768, 1).scheduled()
    assert d[0].tolist() == [32767] * 16 and d[1].tolist() == [1] * 16


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        step.parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip()


@pytest.mark.parametrize("argv,line", [
    (["--dry-run", "--batches", "4,0"], "argument --batches: every value must be >= 1, got 0"),
    (["--dry-run", "--contexts", "1"], "argument --contexts: every value must be >= 2, got 1"),
    (["--dry-run", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["--dry-run", "--tp", "3"], "argument --tp: 3 must divide num_heads=8"),
    (["--dry-run", "--ep", "3"], "argument --ep: 3 must divide num_experts=16"),
    (["--dry-run", "--weights", "fp4"],
     "argument --weights: invalid choice: 'fp4' (choose from 'bf16', 'fp8')"),
])
def test_bad_flags_name_the_flag_and_bound(argv, line, capsys):
    assert _refused(argv, capsys) == f"bench/step.py: error: {line}"


def test_help_and_no_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        step.parse_args(["--help"])
    assert e.value.code == 0 and "--dry-run" in capsys.readouterr().out
    if not _common.ON_GPU:
        assert "argument --dry-run: needed without a GPU backend" in _refused([], capsys)

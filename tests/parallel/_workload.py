"""The tensor/expert-parallel test workload: one greedy serving run, usable in-process (the
conftest's 4 host devices) and from a subprocess with more host devices.

``python tests/parallel/_workload.py [--single REC.json] TPxEP ...`` (XLA_FLAGS must give
enough host devices) serves the ``SHORT_LENS`` workload on every listed TP x EP mesh and
compares it with one device's serving of it: the recording in REC.json (``save_recording``:
the caller served it on one device already) or, without ``--single``, served here first.
Prints one JSON line ``{"TPxEP": {"same_outputs": bool, "max_logit_diff": float,
"compilations": int, "min_margin": float}}``.
"""
from __future__ import annotations

import json
import sys

import numpy as np

from jax_msa_runner.config import RESERVED_PAGES, ModelConfig, RunnerConfig
from jax_msa_runner.serving.compile_count import CompileCounter
from jax_msa_runner.serving.kv_cache import pages_needed
from jax_msa_runner.serving.runner import ModelRunner
from jax_msa_runner.serving.scheduler import Request, Scheduler, SchedulerConfig

# a dense-attention + dense-MLP layer and an MSA + MoE layer; 8 query / 4 KV / 4 index heads,
# 8 experts (top 2) with a shared expert: divisible by TP 1/2/4 and EP 1/2/4/8
MC = ModelConfig.tiny(num_layers=2, sparse_attention_freq=(0, 1), num_heads=8, num_kv_heads=4,
                      num_index_heads=4, head_dim=32, rotary_dim=16, index_dim=32,
                      hidden_size=64, intermediate_size=96, num_experts=8,
                      moe_intermediate_size=32, shared_intermediate_size=48, vocab_size=384)
MAX_LEN = 2304
BUDGET = 128
LENS = (2200, 300, 9)  # 2200 > 16 * 128: the MSA top-16 drops pages
SHORT_LENS = (300, 40, 9)  # for meshes with EP > 1: attention is replicated over "expert",
#                            so every expert rank repeats it (on shared host CPU cores)
SHORT_BUDGET = 32  # the short workload's step (its one bucket): the 300-token prompt still
#                    prefills in chunks over pages, each step 4x smaller on every expert rank
NEW_TOKENS = 4
LOGIT_TOL = 1e-4  # f32 logits of std ~1; the per-rank psums only reorder f32 sums
MIN_MARGIN = 50 * LOGIT_TOL  # every kept greedy sample's top-1/top-2 margin is above it
# the xdist group of the tests that use conftest's ``single_device`` recordings: one
# worker makes each recording once per test run
SINGLE_DEVICE_GROUP = "tp_ep_single_device"


def rconfig(tp: int = 1, ep: int = 1, dcp: int = 1, budget: int = BUDGET,
            max_len: int = MAX_LEN) -> RunnerConfig:
    return RunnerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=max_len,
                        bucket_sizes=(budget,), tp_size=tp, ep_size=ep, dcp_world_size=dcp)


def num_pages(lens, new, dcp: int = 1) -> int:
    return len(RESERVED_PAGES) + sum(pages_needed(n + new, dcp) for n in lens)


def runner(tp=1, ep=1, dcp=1, impl="reference", lens=LENS, new=NEW_TOKENS, **kw) -> ModelRunner:
    """A warmed-up runner for ``lens``: the short workload steps ``SHORT_BUDGET`` tokens."""
    kw = {"budget": SHORT_BUDGET if lens == SHORT_LENS else BUDGET, **kw}
    r = ModelRunner(MC, rconfig(tp, ep, dcp, **kw), num_pages=num_pages(lens, new, dcp), seed=1,
                    attention_impl=impl, debug=True)
    r.warm_up()
    return r


def serve_recording(r: ModelRunner, lens=LENS, new=NEW_TOKENS, seed=0) -> dict:
    """Greedy-serves the prompts of ``lens``: outputs {id: tokens}, per-step logits of the
    kept samples, the compilations while serving."""
    rc = r.rconfig
    sched = Scheduler(SchedulerConfig(max_num_seqs=rc.max_num_seqs,
                                      max_num_batched_tokens=rc.max_num_batched_tokens,
                                      max_model_len=rc.max_model_len,
                                      num_pages=num_pages(lens, new, rc.dcp_world_size),
                                      dcp_world_size=rc.dcp_world_size))
    rng = np.random.default_rng(seed)
    for i, n in enumerate(lens):
        sched.add_request(Request(i, tuple(int(t) for t in rng.integers(0, MC.vocab_size, n)),
                                  new))
    logits = []
    with CompileCounter() as cc:
        while sched.has_unfinished():
            batch = sched.schedule()
            tokens = r.execute(batch)
            logits.append(np.asarray(r.last_logits)[:batch.num_reqs][batch.sample])
            sched.update(batch, tokens)
    return dict(outputs={i: list(q.output) for i, q in sched.finished.items()}, logits=logits,
                compilations=cc.count)


def min_margin(rec: dict) -> float:
    """Smallest top-1 minus top-2 logit over the kept greedy samples."""
    top2 = np.sort(np.concatenate(rec["logits"]), axis=-1)[:, -2:]
    return float((top2[:, 1] - top2[:, 0]).min())


def compare(single: dict, dist: dict) -> dict:
    same_steps = len(single["logits"]) == len(dist["logits"])
    diff = max((float(np.abs(a - b).max()) for a, b in zip(single["logits"], dist["logits"])
                if a.size and a.shape == b.shape), default=0.0) if same_steps else float("inf")
    same_steps = same_steps and all(a.shape == b.shape for a, b in zip(single["logits"],
                                                                      dist["logits"]))
    return dict(same_outputs=dist["outputs"] == single["outputs"] and same_steps,
                max_logit_diff=diff, compilations=dist["compilations"],
                min_margin=min_margin(single))


def save_recording(rec: dict, path) -> None:
    """``serve_recording``'s result as JSON (f32 logits exactly: float32 -> JSON float64)."""
    with open(path, "w") as f:
        json.dump(dict(outputs={str(k): v for k, v in rec["outputs"].items()},
                       logits=[x.tolist() for x in rec["logits"]],
                       compilations=rec["compilations"]), f)


def load_recording(path) -> dict:
    with open(path) as f:
        rec = json.load(f)
    return dict(outputs={int(k): v for k, v in rec["outputs"].items()},
                logits=[np.asarray(x, np.float32).reshape(-1, MC.vocab_size)
                        for x in rec["logits"]],
                compilations=rec["compilations"])


def main(argv: list[str]) -> None:
    """Each mesh on ``SHORT_LENS`` against one device."""
    if argv[:1] == ["--single"]:
        single, argv = load_recording(argv[1]), argv[2:]
    else:
        single = serve_recording(runner(lens=SHORT_LENS), lens=SHORT_LENS)
    out = {}
    for arg in argv:
        tp, ep = (int(v) for v in arg.split("x"))
        out[arg] = compare(single, serve_recording(runner(tp, ep, lens=SHORT_LENS),
                                                   lens=SHORT_LENS))
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])

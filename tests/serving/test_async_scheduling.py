"""Asynchronous scheduling (``SchedulerConfig.async_scheduling``): the engine launches step
N+1 (fed step N's tokens on the device) before it reads step N's tokens.

One tiny runner (debug: every step validates its metadata and the pages' ref counts) serves
every workload twice, synchronously and asynchronously, through the engine; the outputs
must be identical: greedy and seeded token ids, text, finish reasons, logprobs, prompt
logprobs (echo), logit_bias, stop strings and stop tokens (found from a first run), n
seeded copies, max_tokens 1, chunked prefills; under page pressure (preemption); with
aborts mid-stream (pages all back, the others unchanged); with a grammar request mixed in
(the engine falls back to synchronous steps and still matches). Async serving compiles
nothing after warm-up, and the runner's event log shows step N+1 launched before step N's
tokens were read. The scheduler's placeholder bookkeeping is checked on its own too.
"""
import asyncio
import re

import numpy as np
import numpy.testing as npt
import pytest

from jax_msa_runner.config import ModelConfig, RunnerConfig, SchedulerConfig
from jax_msa_runner.serving.compile_count import CompileCounter
from jax_msa_runner.serving.engine import Engine, GenerationParams
from jax_msa_runner.serving.runner import ModelRunner
from jax_msa_runner.serving.sampling import SamplingParams
from jax_msa_runner.serving.scheduler import PLACEHOLDER, Request, Scheduler, Status
from jax_msa_runner.serving.tokenizer_io import ByteTokenizer
from jax_msa_runner.serving.tool_grammar import structured_output_grammar

from test_server import wait_idle

# the module-scoped fixtures (a warmed-up runner or server) are built once, on one xdist worker
pytestmark = pytest.mark.xdist_group("async_scheduling")

MC = ModelConfig.tiny(num_layers=2, sparse_attention_freq=(0, 1), num_heads=4, head_dim=32,
                      rotary_dim=16, index_dim=32)
RC = RunnerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=384,
                  bucket_sizes=(16, 64))
AMPLE = 2 + 40
TIGHT = 2 + 8  # 8 running requests share 8 pages -> preemption
TOK = ByteTokenizer(MC.vocab_size)
RNG = np.random.default_rng(52)
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, presence_penalty=0.5,
                         frequency_penalty=0.3, repetition_penalty=1.2)


def ids(n):
    return [int(t) for t in RNG.integers(0, MC.vocab_size, n)]


PROMPTS = [ids(n) for n in (3, 17, 40, 90, 150, 230, 8, 64)]
PRESSURE = [ids(n) for n in (110, 120, 125, 105, 118, 100, 122, 115)]  # all cross a page
STOP_SRC = [ids(n) for n in (12, 33, 70)]  # first run: their outputs pick the stops


def base_cases():
    cases = []
    for i, p in enumerate(PROMPTS):
        cases.append((p, GenerationParams(max_tokens=3 + 3 * i)))
        cases.append((p, GenerationParams(max_tokens=2 + 2 * i, seed=100 + i, sampling=SAMPLED)))
    copies = ids(50)
    cases += [(copies, GenerationParams(max_tokens=9, seed=7 + k,
                                        sampling=SamplingParams(temperature=1.0, top_p=0.95)))
              for k in range(3)]
    cases.append((ids(20), GenerationParams(max_tokens=1)))
    cases.append((ids(25), GenerationParams(max_tokens=7, logprobs=5)))
    cases.append((ids(30), GenerationParams(max_tokens=5, prompt_logprobs=3, logprobs=2)))
    bias = SamplingParams(logit_bias=((65, 100.0), (66, -100.0)))
    cases.append((ids(15), GenerationParams(max_tokens=6, sampling=bias)))
    return cases


def run_engine(runner, cases, *, async_on, pages, abort_after=None):
    """[result per case] of serving ``cases`` at once through a fresh engine; abort_after
    {case: n}: abort that request once n tokens came. Returns (results, engine, idle
    snapshot, compilations)."""
    engine = Engine(runner, SchedulerConfig.from_runner(RC, pages, async_scheduling=async_on),
                    TOK, max_queue=256).start()
    abort_after = abort_after or {}

    async def one(i, prompt, params):
        stream = engine.submit(prompt, params)
        r = dict(ids=[], text="", reason=None, lp=[], plp=None)
        async for o in stream:
            r["ids"] += o.token_ids
            r["text"] += o.text
            r["reason"] = o.finish_reason
            if o.logprobs is not None:
                r["lp"] += [(t.token_id, t.logprob, t.top) for t in o.logprobs]
            if o.prompt_logprobs is not None:
                r["plp"] = o.prompt_logprobs
            if i in abort_after and len(r["ids"]) >= abort_after[i]:
                engine.abort(stream.request_id)
                r["reason"] = "aborted"
                break
        return r

    async def main():
        return await asyncio.gather(*(one(i, p, g) for i, (p, g) in enumerate(cases)))

    try:
        with CompileCounter() as cc:
            results = asyncio.run(main())
            snap = wait_idle(engine)
    finally:
        engine.shutdown()
    assert engine.error is None
    assert snap.pages_in_use == 0
    return results, engine, snap, cc.count


def assert_same(a, b, skip=()):
    for i, (x, y) in enumerate(zip(a, b)):
        if i in skip:
            continue
        assert x["ids"] == y["ids"], i
        assert x["text"] == y["text"], i
        assert x["reason"] == y["reason"], i
        assert [t for t, _, _ in x["lp"]] == [t for t, _, _ in y["lp"]], i
        for (_, l1, t1), (_, l2, t2) in zip(x["lp"], y["lp"]):
            npt.assert_allclose(l1, l2, atol=1e-4)
            assert [t for t, _ in t1] == [t for t, _ in t2]
        assert (x["plp"] is None) == (y["plp"] is None), i
        if x["plp"] is not None:
            assert x["plp"][0] is None and y["plp"][0] is None
            npt.assert_allclose([e.logprob for e in x["plp"][1:]],
                                [e.logprob for e in y["plp"][1:]], atol=1e-4)


@pytest.fixture(scope="module")
def runner():
    r = ModelRunner(MC, RC, num_pages=AMPLE, seed=3, attention_impl="reference", debug=True,
                    async_scheduling=True)
    r.warm_up()
    return r


@pytest.fixture(scope="module")
def workload(runner):
    """The base cases plus stop string / stop token cases cut from a first greedy run."""
    first, *_ = run_engine(runner, [(p, GenerationParams(max_tokens=20)) for p in STOP_SRC],
                           async_on=False, pages=AMPLE)
    cases = base_cases()
    for p, r in zip(STOP_SRC, first):
        text = r["text"]
        stop = text[len(text) // 2:len(text) // 2 + 2]
        assert stop
        cases.append((p, GenerationParams(max_tokens=20, stop=(stop,))))
        cases.append((p, GenerationParams(max_tokens=20, stop_token_ids=(r["ids"][6],))))
    return cases


def test_mixed_workload_identical_with_async_on_and_off(runner, workload):
    sync, e_sync, _, _ = run_engine(runner, workload, async_on=False, pages=AMPLE)
    asy, e_async, _, compiles = run_engine(runner, workload, async_on=True, pages=AMPLE)
    assert_same(sync, asy)
    reasons = [r["reason"] for r in sync]
    assert reasons.count("stop") >= 6 and "length" in reasons  # stops hit mid-generation
    assert e_sync.async_steps == 0 and e_async.sync_steps == 0
    assert e_async.async_steps > 0 and e_async.overlapped_steps > 0
    assert compiles == 0
    assert runner.validated_steps > 0


def test_preemption_under_page_pressure_identical(runner, workload):
    cases = [(p, GenerationParams(max_tokens=24, seed=300 + i,
                                  sampling=SAMPLED if i % 2 else SamplingParams()))
             for i, p in enumerate(PRESSURE)] + [(p, g) for p, g in workload if len(p) >= 64]
    ref, *_ = run_engine(runner, cases, async_on=False, pages=AMPLE)
    sync, e_sync, _, _ = run_engine(runner, cases, async_on=False, pages=TIGHT)
    asy, e_async, _, compiles = run_engine(runner, cases, async_on=True, pages=TIGHT)
    assert e_sync.snapshot.preemptions > 0 and e_async.snapshot.preemptions > 0
    assert_same(ref, sync)
    assert_same(ref, asy)
    assert compiles == 0


def test_abort_mid_stream_frees_everything_and_keeps_the_rest(runner, workload):
    ref, *_ = run_engine(runner, workload, async_on=False, pages=AMPLE)
    aborts = {i: 2 for i, (_, g) in enumerate(workload) if g.max_tokens >= 8 and i % 3 == 0}
    assert len(aborts) >= 3
    asy, engine, snap, _ = run_engine(runner, workload, async_on=True, pages=TIGHT,
                                      abort_after=aborts)
    assert snap.pages_in_use == 0 and snap.live_requests == 0
    assert sorted(engine.scheduler._free_slots) == list(range(RC.max_num_seqs))
    assert not engine.scheduler.finished
    for i in aborts:
        assert asy[i]["ids"] == ref[i]["ids"][:len(asy[i]["ids"])]
    assert_same(ref, asy, skip=aborts)


def test_grammar_request_falls_back_to_sync_and_matches(runner, workload):
    grammar = structured_output_grammar({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{4}"}})
    cases = workload[:6] + [(ids(10), GenerationParams(max_tokens=12, grammar=grammar,
                                                       grammar_field="structured_outputs"))]
    sync, *_ = run_engine(runner, cases, async_on=False, pages=AMPLE)
    asy, engine, _, compiles = run_engine(runner, cases, async_on=True, pages=AMPLE)
    assert_same(sync, asy)
    assert re.fullmatch("[0-9]{3}-[a-z]{4}", asy[-1]["text"]), asy[-1]["text"]
    assert engine.sync_steps > 0
    assert compiles == 0


def test_step_n_plus_1_is_launched_before_step_n_is_read(runner):
    cases = [(p, GenerationParams(max_tokens=10)) for p in PROMPTS[:4]]
    runner.events.clear()
    _, engine, _, _ = run_engine(runner, cases, async_on=True, pages=AMPLE)
    ev = list(runner.events)
    where = {e: i for i, e in enumerate(ev)}
    steps = sorted(k for kind, k in ev if kind == "launch")
    assert len(steps) == engine.async_steps >= 10
    overlapped = sum(where[("launch", k + 1)] < where[("read", k)] for k in steps[:-1])
    assert overlapped == engine.overlapped_steps >= len(steps) // 2
    # the sync engine reads every step before launching the next
    runner.events.clear()
    run_engine(runner, cases, async_on=False, pages=AMPLE)
    ev = list(runner.events)
    assert ev == [(kind, k) for k in sorted({k for _, k in ev}) for kind in ("launch", "read")]


# ---- the scheduler's placeholders on their own -----------------------------------------------

def _sched(pages=20):
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256,
                                     max_model_len=2048, num_pages=pages))


def test_placeholders_resolve_finish_and_drop():
    s = _sched()
    a = Request(0, tuple(range(1, 10)), 3, stop_token_ids=frozenset({99}))
    b = Request(1, tuple(range(1, 20)), 2)
    s.add_request(a)
    s.add_request(b)
    b1 = s.schedule()
    assert s.update_pending(b1) == []
    assert a.output == [PLACEHOLDER] and a.num_pending == 1 and a.num_computed == 9
    b2 = s.schedule()  # planned on the placeholders
    assert list(b2.token_ids) == [PLACEHOLDER, PLACEHOLDER]
    assert list(b2.sample_index) == [1, 1]
    kept = s.resolve(b1, [5, 6])
    assert kept.tolist() == [True, True] and a.output == [5] and b.output == [6]
    done = s.update_pending(b2)  # b reaches max_new_tokens with its placeholder
    assert done == [b] and b.status is Status.FINISHED and b.finish_reason == "length"
    b3 = s.schedule()
    assert [r.request_id for r in b3.requests] == [0]
    s.resolve(b2, [99, 7])  # a's stop token: finished, b keeps "length"
    assert a.status is Status.FINISHED and a.finish_reason == "stop" and a.output == [5, 99]
    assert b.output == [6, 7]
    s.update_pending(b3)  # a's extra token of b3 is discarded
    assert a.output == [5, 99] and not s.resolve(b3, [1]).any()
    assert s.num_pages_in_use == 0


def test_preempted_or_aborted_request_discards_its_token_in_flight():
    s = _sched()
    a = Request(0, (1, 2, 3), 5)
    s.add_request(a)
    b1 = s.schedule()
    s.update_pending(b1)
    s._preempt(a)
    assert a.output == [] and a.num_pending == 0 and a.status is Status.WAITING
    assert not s.resolve(b1, [4]).any() and a.output == []
    b2 = s.schedule()  # resumed: samples output 0 again (same key)
    assert list(b2.sample_index) == [0] and list(b2.token_ids) == [1, 2, 3]
    s.update_pending(b2)
    s.abort(0)
    assert a.output == [] and not s.resolve(b2, [4]).any()
    assert s.num_pages_in_use == 0 and not s.has_unfinished()


def test_in_flight_page_keys_leave_the_placeholder_out():
    s = _sched()
    unit = s.unit
    a = Request(0, tuple(range(unit - 1)), 4)
    s.add_request(a)
    s.update_pending(s.schedule())
    assert a.num_tokens == unit and a.num_pending == 1
    assert s._keys_in_flight() == set() and a.page_keys == []


def test_dcp_runner_async_identical():
    """Under decode context parallelism (W = 2 of the conftest's host devices) the token
    patches run on the replicated step buffer too."""
    rc = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=384,
                      bucket_sizes=(16, 64), dcp_world_size=2)
    r = ModelRunner(MC, rc, num_pages=2 + 12, seed=3, attention_impl="reference", debug=True,
                    async_scheduling=True)
    r.warm_up()
    cases = [(p, GenerationParams(max_tokens=6, seed=40 + i,
                                  sampling=SAMPLED if i % 2 else SamplingParams()))
             for i, p in enumerate(PROMPTS[:5])]
    out = {}
    for on in (False, True):
        engine = Engine(r, SchedulerConfig.from_runner(rc, 2 + 12, async_scheduling=on), TOK,
                        max_queue=16).start()

        async def main():
            async def one(p, g):
                return [t for o in [o async for o in engine.submit(p, g)] for t in o.token_ids]
            return await asyncio.gather(*(one(p, g) for p, g in cases))

        try:
            with CompileCounter() as cc:
                out[on] = asyncio.run(main())
                wait_idle(engine)
        finally:
            engine.shutdown()
        assert engine.error is None and cc.count == 0
        assert (engine.overlapped_steps > 0) == on
    assert out[False] == out[True]
    assert all(len(t) == 6 for t in out[True])

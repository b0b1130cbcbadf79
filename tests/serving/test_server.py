"""The OpenAI-compatible server, live: uvicorn on a free port over one warmed-up tiny runner.

Every expected output comes from the offline path (the same runner driven by
``runner.serve`` with a scheduler of ample pages, before the engine thread takes the runner
over); the server's scheduler has few pages, so the load test preempts. Checked: greedy
completions through the official ``openai`` client (streamed and not, text and token-id
prompts, chat), seeded sampling with every sampling parameter set repeats exactly and
equals offline, stop strings, logprobs against the log-softmax of the runner's logits, 64
concurrent streams (token ids per chunk: nothing lost or duplicated) with 0 compilations,
16 mid-stream disconnects and 2 clients that stop waiting for a non-streamed answer (pages
and slots all back, the other streams intact), every bad
request's 400 followed by a served good request, 503 from a full queue, /metrics,
/v1/models and /health.
"""
import asyncio
import json
import time

import httpx
import numpy as np
import numpy.testing as npt
import openai
import pytest

from jax_msa_runner.config import ModelConfig, RunnerConfig, SchedulerConfig
from jax_msa_runner.serving.compile_count import CompileCounter
from jax_msa_runner.serving.engine import Engine, GenerationParams, make_request
from jax_msa_runner.serving.runner import ModelRunner, serve
from jax_msa_runner.serving.sampling import SamplingParams
from jax_msa_runner.serving.scheduler import Scheduler
from jax_msa_runner.serving.server import ServerThread, build_app
from jax_msa_runner.serving.tokenizer_io import ByteTokenizer

MC = ModelConfig.tiny(num_layers=2, sparse_attention_freq=(0, 1), num_heads=4, head_dim=32,
                      rotary_dim=16, index_dim=32)
RC = RunnerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=384,
                  bucket_sizes=(16, 64))
RUNNER_PAGES = 2 + 48  # the offline references: 16 requests of 3 pages at once
SERVER_PAGES = 2 + 10  # the server: 16 running requests share 10 pages -> preemption
MODEL = "tiny-test"
TOK = ByteTokenizer(MC.vocab_size)
RNG = np.random.default_rng(2024)

# ---- the workload (prompts as token ids, GenerationParams) -------------------------------------

SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, presence_penalty=0.5,
                         frequency_penalty=0.3, repetition_penalty=1.2)
TEXT_PROMPTS = ["Hello, world", "The quick brown fox jumps", "é€😀 unicode ✓", "a"]
IDS_PROMPT = [int(t) for t in RNG.integers(0, MC.vocab_size, 37)]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
CHAT_IDS = TOK.encode(TOK.apply_chat_template(CHAT))
STOP_PROMPT = TOK.encode("Stop strings cut here")
LOGPROBS_PROMPT = [int(t) for t in RNG.integers(0, MC.vocab_size, 21)]


def _load_workload():
    """64 requests: prompts of 1..300 tokens (a third over 200), 1..24 output tokens, half
    greedy, half seeded with the full set of sampling parameters."""
    reqs = []
    for i in range(64):
        n = int(RNG.choice([RNG.integers(1, 20), RNG.integers(20, 200), RNG.integers(200, 300)]))
        prompt = [int(t) for t in RNG.integers(0, MC.vocab_size, n)]
        m = int(RNG.integers(1, 25))
        params = (GenerationParams(max_tokens=m, seed=500 + i, sampling=SAMPLED) if i % 2 else
                  GenerationParams(max_tokens=m))
        reqs.append((prompt, params))
    return reqs


LOAD = _load_workload()
FAULT_KEEP = [([int(t) for t in RNG.integers(0, MC.vocab_size, n)], GenerationParams(max_tokens=20))
              for n in (5, 60, 150, 250, 9, 33, 120, 200)]
FAULT_DROP = [[int(t) for t in RNG.integers(0, MC.vocab_size, n)] for n in RNG.integers(5, 80, 16)]

REFERENCE_CASES = {
    **{("text", i): (TOK.encode(p), GenerationParams(max_tokens=12)) for i, p in enumerate(TEXT_PROMPTS)},
    ("ids",): (IDS_PROMPT, GenerationParams(max_tokens=10)),
    ("chat",): (CHAT_IDS, GenerationParams(max_tokens=10)),
    ("seeded",): (TOK.encode("Once upon a time"), GenerationParams(max_tokens=24, seed=1234, sampling=SAMPLED)),
    ("seeded-greedy",): (TOK.encode("Once upon a time"), GenerationParams(max_tokens=24)),
    ("stop",): (STOP_PROMPT, GenerationParams(max_tokens=40)),
    ("good",): (TOK.encode("ok"), GenerationParams(max_tokens=2)),
    **{("load", i): r for i, r in enumerate(LOAD)},
    **{("keep", i): r for i, r in enumerate(FAULT_KEEP)},
}


def offline_outputs(runner, cases):
    """Output token ids of every case, from the runner alone (serve + an ample scheduler)."""
    keys = list(cases)
    sched = Scheduler(SchedulerConfig.from_runner(RC, RUNNER_PAGES))
    for i, k in enumerate(keys):
        prompt, params = cases[k]
        sched.add_request(make_request(i, prompt, params, seed=params.seed or 0,
                                       eos_token_ids=TOK.eos_token_ids))
    stats = serve(runner, sched)
    assert stats.compilations == 0
    return {k: list(sched.finished[i].output) for i, k in enumerate(keys)}


def offline_logits(runner, prompt, max_tokens):
    """(output ids, logits f32 [max_tokens, V] of every sampled step) of one greedy request."""
    sched = Scheduler(SchedulerConfig.from_runner(RC, RUNNER_PAGES))
    sched.add_request(make_request(0, prompt, GenerationParams(max_tokens=max_tokens), seed=0,
                                   eos_token_ids=()))
    rows = []
    while sched.has_unfinished():
        batch = sched.schedule()
        tokens = runner.execute(batch)
        if batch.sample[0]:
            rows.append(np.asarray(runner.last_logits)[0])
        sched.update(batch, tokens)
    return sched.finished[0].output, np.stack(rows)


@pytest.fixture(scope="module")
def live():
    runner = ModelRunner(MC, RC, num_pages=RUNNER_PAGES, seed=3, attention_impl="reference")
    runner.warm_up()
    ref = offline_outputs(runner, REFERENCE_CASES)
    lp_ids, lp_logits = offline_logits(runner, LOGPROBS_PROMPT, 6)
    engine = Engine(runner, SchedulerConfig.from_runner(RC, SERVER_PAGES), TOK, max_queue=128)
    engine.start()
    server = ServerThread(build_app(engine, model_name=MODEL)).start()
    yield dict(engine=engine, url=server.url, ref=ref, lp=(lp_ids, lp_logits))
    errors = engine.metrics.requests.labels(outcome="error")._value.get()
    server.stop()
    engine.shutdown()
    assert errors == 0 and engine.error is None, "the server had internal errors"


def client(live):
    return openai.OpenAI(base_url=live["url"] + "/v1", api_key="none", max_retries=0, timeout=120)


def sampling_body(params: GenerationParams) -> dict:
    s = params.sampling
    body = dict(max_tokens=params.max_tokens, temperature=s.temperature)
    if s.temperature > 0:
        body.update(seed=params.seed, top_p=s.top_p, presence_penalty=s.presence_penalty,
                    frequency_penalty=s.frequency_penalty)
        body["extra_body"] = dict(top_k=s.top_k, min_p=s.min_p,
                                  repetition_penalty=s.repetition_penalty,
                                  return_token_ids=True)
    else:
        body["extra_body"] = dict(return_token_ids=True)
    return body


def wait_idle(engine, timeout=60.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        s = engine.snapshot
        if s.live_requests == 0 and s.running == 0 and s.waiting == 0 and not engine._inbox:
            return s
        time.sleep(0.02)
    raise AssertionError(f"engine not idle after {timeout}s: {engine.snapshot}")


async def drop_mid_stream(hc: httpx.AsyncClient, prompt, *, max_tokens: int, model=MODEL):
    """A greedy streamed completion left after its second SSE line (the connection closes)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    async with hc.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        n = 0
        async for line in r.aiter_lines():
            n += line.startswith("data: ")
            if n == 2:
                return


def served_alone(runner, sconfig, cases) -> list[list[int]]:
    """Token ids of each (prompt ids, GenerationParams) served by the runner alone under the
    scheduler config ``sconfig`` (no EOS: the lengths are the requests')."""
    sched = Scheduler(sconfig)
    for i, (prompt, params) in enumerate(cases):
        sched.add_request(make_request(i, prompt, params, seed=params.seed or 0,
                                       eos_token_ids=()))
    serve(runner, sched)
    return [list(sched.finished[i].output) for i in range(len(cases))]


def metric(live, name, labels=""):
    text = httpx.get(live["url"] + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    raise KeyError(name + labels)


# ---- correctness through the openai client ----------------------------------------------------

def test_greedy_completions_equal_offline_streamed_and_not(live):
    c, ref = client(live), live["ref"]
    for i, prompt in enumerate(TEXT_PROMPTS):
        want = ref[("text", i)]
        res = c.completions.create(model=MODEL, prompt=prompt, **sampling_body(GenerationParams(12)))
        choice = res.choices[0]
        assert choice.model_extra["token_ids"] == want
        assert choice.text == TOK.decode(want) and choice.finish_reason == "length"
        assert res.usage.prompt_tokens == len(TOK.encode(prompt)) and res.usage.completion_tokens == 12
        chunks = list(c.completions.create(model=MODEL, prompt=prompt, stream=True,
                                           **sampling_body(GenerationParams(12))))
        assert [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]] == want
        assert "".join(ch.choices[0].text for ch in chunks) == TOK.decode(want)
        assert chunks[-1].choices[0].finish_reason == "length"
    # a token-id prompt, plain client fields only
    res = c.completions.create(model=MODEL, prompt=IDS_PROMPT, max_tokens=10, temperature=0)
    assert res.choices[0].text == TOK.decode(ref[("ids",)])


def test_chat_uses_the_template_streamed_and_not(live):
    c, want = client(live), live["ref"][("chat",)]
    res = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    assert res.choices[0].message.content == TOK.decode(want)
    assert res.choices[0].message.role == "assistant" and res.usage.prompt_tokens == len(CHAT_IDS)
    chunks = list(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == TOK.decode(want)
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []


def test_seeded_sampling_repeats_exactly_and_equals_offline(live):
    c = client(live)
    prompt, params = REFERENCE_CASES[("seeded",)]
    want = live["ref"][("seeded",)]
    outs = [c.completions.create(model=MODEL, prompt=TOK.decode(prompt), **sampling_body(params))
            .choices[0].model_extra["token_ids"] for _ in range(2)]
    streamed = [t for ch in c.completions.create(model=MODEL, prompt=TOK.decode(prompt), stream=True,
                                                 **sampling_body(params))
                for t in ch.choices[0].model_extra["token_ids"]]
    assert outs[0] == outs[1] == streamed == want
    assert want != live["ref"][("seeded-greedy",)]  # it really sampled
    other = c.completions.create(model=MODEL, prompt=TOK.decode(prompt),
                                 **{**sampling_body(params), "seed": 99})
    assert other.choices[0].model_extra["token_ids"] != want


def test_stop_strings_cut_where_they_should(live):
    c = client(live)
    full_ids = live["ref"][("stop",)]
    full = TOK.decode(full_ids)
    at = len(full) // 2
    stop = full[at:at + 3]
    cut = full[:full.find(stop)]
    res = c.completions.create(model=MODEL, prompt=TOK.decode(STOP_PROMPT), max_tokens=40,
                               temperature=0, stop=[stop, "never-produced-§"])
    assert res.choices[0].text == cut and res.choices[0].finish_reason == "stop"
    assert res.usage.completion_tokens < 40
    chunks = list(c.completions.create(model=MODEL, prompt=TOK.decode(STOP_PROMPT), max_tokens=40,
                                       temperature=0, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    # a stop token id ends the generation too; its text is not part of the output
    k = 5
    res = c.completions.create(model=MODEL, prompt=TOK.decode(STOP_PROMPT), max_tokens=40,
                               temperature=0, extra_body={"stop_token_ids": [full_ids[k]],
                                                          "return_token_ids": True})
    first = full_ids.index(full_ids[k])
    assert res.choices[0].model_extra["token_ids"] == full_ids[:first + 1]
    assert res.choices[0].text == TOK.decode(full_ids[:first]) and res.choices[0].finish_reason == "stop"
    wait_idle(live["engine"])
    assert live["engine"].snapshot.pages_in_use == 0


def test_logprobs_equal_log_softmax_of_runner_logits(live):
    c = client(live)
    ids, logits = live["lp"]
    logits = logits.astype(np.float64)
    want = logits - logits.max(1, keepdims=True)
    want -= np.log(np.exp(want).sum(1, keepdims=True))
    res = c.completions.create(model=MODEL, prompt=LOGPROBS_PROMPT, max_tokens=6, temperature=0,
                               logprobs=5)
    lp = res.choices[0].logprobs
    assert lp.tokens == [TOK.token_str(t) for t in ids]
    npt.assert_allclose(lp.token_logprobs, want[np.arange(6), ids], atol=2e-5)
    piece_id = {TOK.token_str(i): i for i in range(MC.vocab_size)}
    for step, top in enumerate(lp.top_logprobs):
        assert len(top) == 5
        top_ids = [piece_id[s] for s in top]
        npt.assert_array_equal(top_ids, np.argsort(-want[step], kind="stable")[:5])
        npt.assert_allclose(list(top.values()), want[step, top_ids], atol=2e-5)
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                     max_tokens=3, temperature=0, logprobs=True, top_logprobs=20)
    for e in chat.choices[0].logprobs.content:
        assert len(e.top_logprobs) == 20 and e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert e.logprob <= e.top_logprobs[0].logprob + 1e-6


# ---- load and faults ------------------------------------------------------------------------------

async def _stream_ids(ac: openai.AsyncOpenAI, prompt, params):
    stream = await ac.completions.create(model=MODEL, prompt=prompt, stream=True,
                                         **sampling_body(params))
    ids, text, reasons = [], [], []
    async for ch in stream:
        ids.extend(ch.choices[0].model_extra["token_ids"])
        text.append(ch.choices[0].text)
        reasons.append(ch.choices[0].finish_reason)
    return ids, "".join(text), reasons


def test_64_concurrent_streams_with_preemption_lose_nothing_and_never_compile(live):
    engine, ref = live["engine"], live["ref"]
    preempted_before = engine.snapshot.preemptions

    async def main():
        async with openai.AsyncOpenAI(base_url=live["url"] + "/v1", api_key="none",
                                      max_retries=0, timeout=300) as ac:
            return await asyncio.gather(*(_stream_ids(ac, p, params) for p, params in LOAD))

    with CompileCounter() as cc:
        results = asyncio.run(main())
        wait_idle(engine)
    assert cc.count == 0, cc.names
    for i, (ids, text, reasons) in enumerate(results):
        want = ref[("load", i)]
        assert ids == want, f"request {i}: stream {ids} != offline {want}"
        assert text == TOK.decode(want)
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert engine.snapshot.preemptions > preempted_before
    assert engine.snapshot.pages_in_use == 0


def test_disconnects_free_every_page_and_leave_other_streams_intact(live):
    engine, ref = live["engine"], live["ref"]
    aborts_before = metric(live, "jax_msa_requests_total", '{outcome="abort"}')

    async def give_up(hc: httpx.AsyncClient, prompt):
        """A non-streamed request whose client stops waiting."""
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 300, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            await hc.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))

    async def main():
        async with openai.AsyncOpenAI(base_url=live["url"] + "/v1", api_key="none",
                                      max_retries=0, timeout=300) as ac, \
                httpx.AsyncClient(base_url=live["url"], timeout=300) as hc:
            keep = [_stream_ids(ac, p, params) for p, params in FAULT_KEEP]
            gone = [drop_mid_stream(hc, p, max_tokens=300) for p in FAULT_DROP]
            waited = [give_up(hc, p) for p in FAULT_DROP[:2]]
            return await asyncio.gather(*keep, *gone, *waited)

    results = asyncio.run(main())
    snap = wait_idle(engine)
    for i, (ids, _, _) in enumerate(results[:len(FAULT_KEEP)]):
        assert ids == ref[("keep", i)]
    assert metric(live, "jax_msa_requests_total", '{outcome="abort"}') - aborts_before == 16 + 2
    alloc = engine.scheduler.pool
    assert snap.pages_in_use == 0 and alloc.num_free == alloc.num_usable
    assert sorted(engine.scheduler._free_slots) == list(range(RC.max_num_seqs))
    assert metric(live, "jax_msa_kv_pages_in_use") == 0


# ---- bad requests, overload, the other routes -------------------------------------------------------

BAD = [  # (route, body, param named in the error)
    ("completions", {"prompt": [1] * 384, "max_tokens": 1}, "prompt"),
    ("completions", {"prompt": [1] * 300, "max_tokens": 100}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, "model"),
    ("completions", {"prompt": "hi", "model": None}, "model"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [1, 512]}, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("completions", {"prompt": "hi", "top_k": -2}, "top_k"),
    ("completions", {"prompt": "hi", "min_p": 2}, "min_p"),
    ("completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ("completions", {"prompt": "hi", "frequency_penalty": -2.5}, "frequency_penalty"),
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"prompt": "hi", "seed": "abc"}, "seed"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("completions", {"prompt": "hi", "stop_token_ids": [9999]}, "stop_token_ids"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "n": 17}, "n"),
    ("completions", {"prompt": "hi", "logit_bias": {"512": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"3": 101}}, "logit_bias"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 400}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
     "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                          "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]},
     "tools[0]"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
     "tool_choice"),
]


def test_every_bad_request_gets_400_naming_the_field_and_the_next_is_served(live):
    good = {"model": MODEL, "prompt": "ok", "max_tokens": 2, "temperature": 0,
            "return_token_ids": True}
    want = live["ref"][("good",)]
    with httpx.Client(base_url=live["url"], timeout=60) as hc:
        raw_cases = [(b"{not json", None), (b"[1, 2]", None), (b"", None)]
        for raw, param in raw_cases:
            r = hc.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        for route, body, param in BAD:
            full = {"model": MODEL, **body} if "model" not in body else body
            if full.get("model") is None:
                full.pop("model")
            r = hc.post(f"/v1/{route}", json=full)
            err = r.json().get("error")
            assert r.status_code == 400 and err is not None, (body, r.text)
            assert set(err) == {"message", "type", "param", "code"}
            assert err["param"] == param and err["type"] == "invalid_request_error", (body, err)
            assert err["message"].startswith(f"{param}: "), err
            ok = hc.post("/v1/completions", json=good)
            assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == want
    with pytest.raises(openai.BadRequestError) as e:  # through the official client too
        client(live).completions.create(model=MODEL, prompt="hi", top_p=0)
    assert e.value.body["param"] == "top_p"


def test_full_queue_answers_503_and_recovers(live):
    engine = live["engine"]
    prompt = [int(t) for t in RNG.integers(0, MC.vocab_size, 200)]

    async def main():
        async with httpx.AsyncClient(base_url=live["url"], timeout=300) as hc:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            return await asyncio.gather(*(hc.post("/v1/completions", json=body) for _ in range(40)))

    engine.max_queue = 2
    try:
        responses = asyncio.run(main())
    finally:
        engine.max_queue = 128
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503} and codes.count(503) >= 1 and codes.count(200) >= 2, codes
    busy = next(r for r in responses if r.status_code == 503).json()["error"]
    assert busy["code"] == "queue_full" and busy["type"] == "server_error"
    texts = {r.json()["choices"][0]["text"] for r in responses if r.status_code == 200}
    assert len(texts) == 1  # the same prompt, greedy: the same token whatever the batch
    wait_idle(engine)
    r = httpx.post(live["url"] + "/v1/completions",
                   json={"model": MODEL, "prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200
    assert metric(live, "jax_msa_requests_total", '{outcome="overloaded"}') == codes.count(503)


def test_models_health_and_metrics(live):
    models = client(live).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(live["url"] + "/health").json() == {"status": "ok"}
    text = httpx.get(live["url"] + "/metrics").text
    for name in ("jax_msa_requests_total", "jax_msa_prompt_tokens_total",
                 "jax_msa_generation_tokens_total", "jax_msa_queue_depth",
                 "jax_msa_step_latency_seconds_bucket", "jax_msa_step_host_gap_seconds_count",
                 "jax_msa_kv_pages_in_use", "jax_msa_kv_pages_total", "jax_msa_preemptions_total",
                 "jax_msa_time_to_first_token_seconds_count"):
        assert name in text, name
    assert metric(live, "jax_msa_step_latency_seconds_count") > 0
    assert metric(live, "jax_msa_kv_pages_total") == SERVER_PAGES - 2
    assert metric(live, "jax_msa_generation_tokens_total") > 0
    r = httpx.post(live["url"] + "/v1/completions", json={"model": MODEL, "prompt": "x",
                                                         "max_tokens": 1})
    assert json.loads(r.text)["object"] == "text_completion"

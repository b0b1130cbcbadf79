"""The OpenAI features beyond plain sampling, live through the ``openai`` client: ``n``
copies (streamed and not, seeded copies repeat and equal the offline runner with seed
``seed + i``), ``logit_bias`` applied on the device, ``echo`` with prompt logprobs (against
the log-softmax of every token's logits from a runner that returns them, on a prompt
prefilled in three chunks), ``/metrics``'s compilation counter (0 while serving), the tokenizer
routes, and lm-eval's ``local-completions`` model running a loglikelihood task against it. A
random tiny model: every guarantee checked here comes from the server, not from what the model
happens to prefer.
"""
import json
import os
import re
import subprocess

import chex
import httpx
import jax
import numpy as np
import openai
import pytest

from jax_msa_runner.config import ModelConfig, RunnerConfig, SchedulerConfig
from jax_msa_runner.serving.engine import Engine, GenerationParams, make_request
from jax_msa_runner.serving.runner import ModelRunner, serve
from jax_msa_runner.serving.sampling import SamplingParams
from jax_msa_runner.serving.scheduler import Scheduler
from jax_msa_runner.serving.server import ServerThread, build_app
from jax_msa_runner.serving.tokenizer_io import ByteTokenizer

from _hf_env import REF_PYTHON, check_lm_eval_env
from test_server import served_alone

MC = ModelConfig.tiny(num_layers=2, sparse_attention_freq=(0, 1), num_heads=4, head_dim=32,
                      rotary_dim=16, index_dim=32)
RC = RunnerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=1024,
                  bucket_sizes=(8, 32))
MODEL = "tiny-features"
TOK = ByteTokenizer(MC.vocab_size)
PROMPT = "Seeded copies"
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95)
ECHO_PROMPT = "An echoed prompt of seventy characters, prefilled in three chunks: ok."


@pytest.fixture(scope="module")
def live():
    runner = ModelRunner(MC, RC, num_pages=2 + 24, seed=3, attention_impl="reference")
    runner.warm_up()
    seeded = [(TOK.encode(PROMPT), GenerationParams(max_tokens=8, seed=77 + i, sampling=SAMPLED))
              for i in range(3)]
    greedy = [(TOK.encode("bias"), GenerationParams(max_tokens=6))]
    ref = served_alone(runner, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                                  max_model_len=256, num_pages=runner.num_pages),
                          seeded + greedy)
    ref_rc = RunnerConfig(max_num_seqs=1, max_num_batched_tokens=128, max_model_len=256,
                          bucket_sizes=(128,))
    every = ModelRunner(MC, ref_rc, num_pages=2 + 2, seed=3, attention_impl="reference",
                        all_token_logits=True)
    every.warm_up()
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=128,
                                      max_model_len=256, num_pages=4))
    sched.add_request(make_request(0, TOK.encode(ECHO_PROMPT), GenerationParams(max_tokens=1),
                                   seed=0, eos_token_ids=()))
    serve(every, sched)
    n = len(ECHO_PROMPT)
    prompt_lp = np.asarray(jax.nn.log_softmax(every.last_logits[:n - 1], axis=-1))
    engine = Engine(runner, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                            max_model_len=1024, num_pages=2 + 24), TOK,
                    max_queue=32).start()
    server = ServerThread(build_app(engine, model_name=MODEL)).start()
    yield {"url": server.url, "seeded": ref[:3], "greedy": ref[3], "engine": engine,
           "prompt_lp": prompt_lp}
    server.stop()
    engine.shutdown()


def client(live):
    return openai.OpenAI(base_url=live["url"] + "/v1", api_key="none", max_retries=0)


def test_n_copies_repeat_their_seeds_streamed_or_not(live):
    c = client(live)
    extra = {"return_token_ids": True}
    r = c.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=8, seed=77,
                             temperature=1.0, top_p=0.95, extra_body=extra)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.token_ids for ch in r.choices] == live["seeded"]
    assert r.usage.prompt_tokens == len(PROMPT) and r.usage.completion_tokens == 24
    got = {0: [], 1: [], 2: []}
    for chunk in c.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=8, seed=77,
                                      temperature=1.0, top_p=0.95, stream=True,
                                      extra_body=extra):
        for ch in chunk.choices:
            got[ch.index] += ch.token_ids
    assert [got[i] for i in range(3)] == live["seeded"]
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                     n=2, max_tokens=4, seed=5, temperature=1.0)
    assert [ch.index for ch in chat.choices] == [0, 1]
    assert all(ch.message.role == "assistant" for ch in chat.choices)


def test_logit_bias_forces_and_bans_tokens(live):
    c = client(live)
    forced = c.completions.create(model=MODEL, prompt="bias", max_tokens=6, temperature=0,
                                  logit_bias={"65": 100}, extra_body={"return_token_ids": True})
    assert forced.choices[0].token_ids == [65] * 6  # "A"
    assert live["greedy"] != [65] * 6  # not what the model prefers unbiased
    first = live["greedy"][0]
    banned = c.completions.create(model=MODEL, prompt="bias", max_tokens=6, temperature=0,
                                  logit_bias={str(first): -100},
                                  extra_body={"return_token_ids": True})
    assert banned.choices[0].token_ids[0] != first
    sampled = c.completions.create(model=MODEL, prompt="bias", max_tokens=6, temperature=1.0,
                                   seed=3, logit_bias={"66": 100},
                                   extra_body={"return_token_ids": True})
    assert sampled.choices[0].token_ids == [66] * 6


def test_bad_n_and_bias_get_400_and_serving_goes_on(live):
    c = client(live)
    for kw, param in ((dict(n=0), "n"), (dict(logit_bias={str(MC.vocab_size): 1}), "logit_bias"),
                      (dict(logit_bias={"1": -101}), "logit_bias")):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt="x", max_tokens=1, **kw)
        assert e.value.body["param"] == param
    ok = c.completions.create(model=MODEL, prompt="bias", max_tokens=6, temperature=0,
                              extra_body={"return_token_ids": True})
    assert ok.choices[0].token_ids == live["greedy"]


def test_no_compilation_after_warm_up_in_metrics(live):
    client(live).completions.create(model=MODEL, prompt="metrics", max_tokens=3, n=2,
                                    logit_bias={"70": 5})
    text = httpx.get(live["url"] + "/metrics").text
    m = re.search(r"^jax_msa_compilations_after_warmup_total (\S+)$", text, re.M)
    assert m is not None and float(m.group(1)) == 0.0, text[:2000]


def test_echo_returns_prompt_logprobs_computed_in_the_prefill(live):
    c = client(live)
    ids = TOK.encode(ECHO_PROMPT)
    ref = live["prompt_lp"]  # [n - 1, V]: row t predicts prompt token t + 1
    want = [float(ref[t, ids[t + 1]]) for t in range(len(ids) - 1)]
    only = c.completions.create(model=MODEL, prompt=ECHO_PROMPT, max_tokens=0, echo=True,
                                logprobs=2, temperature=0)
    ch = only.choices[0]
    assert ch.text == ECHO_PROMPT and only.usage.completion_tokens == 0
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(len(t) == 2 for t in lp.top_logprobs[1:])
    np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=2e-3)
    best = [float(ref[t].max()) for t in range(len(ids) - 1)]
    np.testing.assert_allclose([max(t.values()) for t in lp.top_logprobs[1:]], best, atol=2e-3)
    assert lp.text_offset[:3] == [0, 1, 2]
    one = c.completions.create(model=MODEL, prompt=ECHO_PROMPT, max_tokens=1, echo=True,
                               logprobs=1, temperature=0)
    lp1 = one.choices[0].logprobs
    assert len(lp1.token_logprobs) == len(ids) + 1 and one.usage.completion_tokens == 1
    np.testing.assert_allclose(lp1.token_logprobs[1:-1], want, atol=2e-3)
    assert one.choices[0].text.startswith(ECHO_PROMPT)
    streamed = "".join(chunk.choices[0].text for chunk in c.completions.create(
        model=MODEL, prompt=ECHO_PROMPT, max_tokens=3, echo=True, temperature=0, stream=True))
    plain = c.completions.create(model=MODEL, prompt=ECHO_PROMPT, max_tokens=3, temperature=0)
    assert streamed == ECHO_PROMPT + plain.choices[0].text


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                    "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}


def _valid(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) <= {"name", "age", "tags"}
            and isinstance(obj.get("name"), str) and len(obj["name"]) <= 12
            and isinstance(obj.get("age"), int) and not isinstance(obj["age"], bool)
            and all(t in ("a", "b") for t in obj.get("tags", [])))


def test_structured_outputs_hold_whatever_the_random_model_samples(live):
    """The random model would write bytes; the mask makes every sample parse."""
    import json
    c = client(live)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for seed in range(4):
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json"}],
                                      response_format=fmt, max_tokens=120, temperature=1.0,
                                      seed=seed)
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        assert _valid(json.loads(r.choices[0].message.content)), r.choices[0].message.content
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "any"}],
                                  response_format={"type": "json_object"}, max_tokens=120,
                                  temperature=1.0, seed=9)
    text = r.choices[0].message.content  # free keys: a random model may run out of tokens
    assert text.lstrip().startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    for so, check in (({"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
                      ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe"))):
        for seed in range(3):
            r = c.completions.create(model=MODEL, prompt="q", max_tokens=40, temperature=1.0,
                                     seed=seed, extra_body={"structured_outputs": so})
            assert check(r.choices[0].text), (so, r.choices[0].text)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt="q", max_tokens=40, temperature=1.0, seed=1, stream=True,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}))
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", streamed)


def test_malformed_schema_gets_400_and_serving_goes_on(live):
    c = client(live)
    bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                        "schema": {"type": 7}}}},
            "response_format"),
           ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
           ({"response_format": {"type": "xml"}}, "response_format")]
    for body, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body=body)
        assert e.value.body["param"].startswith(param), e.value.body
    ok = c.completions.create(model=MODEL, prompt="bias", max_tokens=6, temperature=0,
                              extra_body={"return_token_ids": True})
    assert ok.choices[0].token_ids == live["greedy"]


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                    "metric": {"type": "boolean"}},
                   "required": ["city", "metric"]}}},
         {"type": "function", "function": {
             "name": "get_time", "parameters": {"type": "object", "properties": {
                 "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
ASK = [{"role": "user", "content": "weather?"}]


def _check_call(call, names):
    import json
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "metric"} and isinstance(args["metric"], bool)
        assert isinstance(args["city"], str) and len(args["city"]) <= 6
    else:
        assert call.function.name == "get_time" and args == {"zone": args["zone"]}
        assert args["zone"] in ("UTC", "CET")
    assert call.function.name in names


def test_forced_tool_calls_always_match_the_schema(live):
    c = client(live)
    for seed in range(3):
        r = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                      tool_choice="required", max_tokens=300, temperature=1.0,
                                      seed=seed)
        ch = r.choices[0]
        # "required": one or more calls, so a random model may go on calling until
        # max_tokens; every call that completed matches its schema
        assert ch.finish_reason in ("tool_calls", "length") and ch.message.tool_calls, ch
        done = ch.message.tool_calls[:-1] if ch.finish_reason == "length" else \
            ch.message.tool_calls
        for call in done:
            _check_call(call, ("get_weather", "get_time"))
    named = {"type": "function", "function": {"name": "get_time"}}
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                  max_tokens=400, temperature=1.0, seed=4)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]  # one call, then the end
    (call,) = r.choices[0].message.tool_calls
    _check_call(call, ("get_time",))
    deltas = {}  # streamed: the deltas assemble into the same call
    for chunk in c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           tool_choice=named, max_tokens=400, temperature=1.0,
                                           seed=4, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            deltas.setdefault(d.index, []).append(d)
        last = chunk.choices[0].finish_reason or None
    assert last == "tool_calls" and list(deltas) == [0]
    assert deltas[0][0].function.name == "get_time"
    assert "".join(d.function.arguments or "" for d in deltas[0]) == call.function.arguments
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    r = c.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=3,
                                  temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_bad_tool_choice_gets_400(live):
    c = client(live)
    for kw, param in ((dict(tools=TOOLS, tool_choice={"type": "function",
                                                      "function": {"name": "nope"}}),
                       "tool_choice"),
                      (dict(tool_choice="required"), "tool_choice"),
                      (dict(tools=[{"type": "function"}]), "tools[0]")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, **kw)
        assert e.value.body["param"] == param, e.value.body


def test_reasoning_is_separated_streamed_or_not(live):
    """The grammar makes the random model write a think block, then an answer."""
    c = client(live)
    so = {"structured_outputs": {"regex": "<mm:think>[a-z]{4}</mm:think>[0-9]{3}"}}
    r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=1.0,
                                  seed=2, extra_body=so)
    msg = r.choices[0].message
    assert re.fullmatch("[a-z]{4}", msg.reasoning_content) and re.fullmatch("[0-9]{3}",
                                                                             msg.content)
    parts = {"reasoning": "", "content": ""}
    for chunk in c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60,
                                           temperature=1.0, seed=2, stream=True, extra_body=so):
        d = chunk.choices[0].delta
        parts["reasoning"] += getattr(d, "reasoning_content", None) or ""
        parts["content"] += d.content or ""
    assert parts == {"reasoning": msg.reasoning_content, "content": msg.content}
    thinking = c.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=5, temperature=0,
        extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"},
                    "structured_outputs": {"regex": "[a-z]{5}"}})
    assert re.fullmatch("[a-z]{5}", thinking.choices[0].message.reasoning_content)
    assert thinking.choices[0].message.content == ""


def test_tokenize_routes_round_trip_and_name_bad_fields(live):
    url = live["url"]
    ids = TOK.encode(ECHO_PROMPT)
    r = httpx.post(f"{url}/tokenize", json={"prompt": ECHO_PROMPT, "add_special_tokens": False})
    assert r.status_code == 200 and r.json() == {"count": len(ids), "max_model_len": 1024,
                                                  "tokens": ids}
    chat = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": ASK}).json()
    assert chat["tokens"] == TOK.encode(TOK.apply_chat_template(ASK))
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json() == {"prompt": ECHO_PROMPT}
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info == {"tokenizer_class": "ByteTokenizer", "vocab_size": MC.vocab_size,
                    "model_max_length": 1024, "eos_token": None, "bos_token": None,
                    "pad_token": None}
    for route, body, param in (("tokenize", {}, "prompt"),
                               ("tokenize", {"prompt": [1, 2]}, "prompt"),
                               ("tokenize", {"prompt": "a", "messages": ASK}, "prompt"),
                               ("tokenize", {"prompt": "a", "model": "other"}, "model"),
                               ("detokenize", {"tokens": [1, MC.vocab_size]}, "tokens"),
                               ("detokenize", {"tokens": "abc"}, "tokens")):
        r = httpx.post(f"{url}/{route}", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, r.text)
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


LM_EVAL_TASK = """task: jax_msa_echo
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


def test_lm_eval_local_completions_loglikelihood(live, tmp_path):
    """lm-eval's ``local-completions`` model (tokenizing through /tokenize) runs a
    loglikelihood task from a local jsonl against the server; every loglikelihood and
    is-greedy flag equals the log-softmax reference of the prompt's logits."""
    check_lm_eval_env()
    ids, ref = TOK.encode(ECHO_PROMPT), live["prompt_lp"]
    spans = [(2, 70), (9, 31), (38, 39), (55, 68)]  # (context end, continuation end)
    # and one greedy continuation: the model's argmax after a prefix, a printable byte
    g = next(k for k in range(1, len(ids))
             if 0x21 <= int(ref[k - 1].argmax()) < 0x7F and ECHO_PROMPT[k - 1] != " ")
    top = int(ref[g - 1].argmax())
    assert all(ECHO_PROMPT[k - 1] != " " for k, _ in spans)  # lm-eval moves trailing spaces
    docs = [{"context": ECHO_PROMPT[:k], "continuation": ECHO_PROMPT[k:j]} for k, j in spans]
    docs.append({"context": ECHO_PROMPT[:g], "continuation": chr(top)})
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "task.yaml").write_text(LM_EVAL_TASK.format(data=data))
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    args = [REF_PYTHON, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
            f"base_url={live['url']}/v1/completions,model={MODEL},tokenizer_backend=remote,"
            f"num_concurrent=1,max_retries=1", "--tasks", "jax_msa_echo", "--include_path",
            str(tmp_path), "--output_path", str(tmp_path / "out"), "--log_samples"]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (samples,) = tmp_path.glob("out/*/samples_jax_msa_echo_*.jsonl")
    got = sorted((json.loads(line) for line in samples.read_text().splitlines()),
                 key=lambda s: s["doc_id"])
    want_ll = [sum(float(ref[t - 1, ids[t]]) for t in range(k, j)) for k, j in spans]
    want_greedy = [all(int(ref[t - 1].argmax()) == ids[t] for t in range(k, j)) for k, j in spans]
    want_ll.append(float(ref[g - 1, top]))
    want_greedy.append(True)
    chex.assert_trees_all_close([float(s["resps"][0][0][0]) for s in got], want_ll, atol=1e-2)
    assert [s["resps"][0][0][1] for s in got] == [str(w) for w in want_greedy]  # logged as text
    (results,) = tmp_path.glob("out/*/results_*.json")
    metrics = json.loads(results.read_text())["results"]["jax_msa_echo"]
    chex.assert_trees_all_close(metrics["acc,none"], float(np.mean(want_greedy)), atol=1e-6)

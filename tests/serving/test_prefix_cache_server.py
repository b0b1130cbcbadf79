"""Prefix caching through the OpenAI server, live (uvicorn over one warmed-up tiny runner in
debug mode: every step validates its metadata and checks the pages' ref counts against the
block tables; a failed check would kill the engine and fail every later test).

Checked: a repeated 1500-token prompt reports 1408 cached tokens (11 full pages) in
``usage.prompt_tokens_details.cached_tokens``, streamed and not, with the greedy text of the
offline runner without caching, and ``/metrics`` counts the queried and hit tokens; ``n``
seeded copies share their prompt's pages (copies 1 and 2 hit) and equal the offline copies;
echo with prompt logprobs recomputes the whole prompt (0 cached tokens, the same logprobs as
before the prompt was cached); logit_bias and a regex grammar give the same tokens on a
cached prompt as on a cold one; a load of streams over shared prefixes with 12 disconnects
leaves no page held, every page free or cached, and the other streams equal to offline.
"""
import asyncio
import re

import httpx
import numpy as np
import openai
import pytest

from jax_msa_runner.config import ModelConfig, RunnerConfig, SchedulerConfig
from jax_msa_runner.serving.engine import Engine, GenerationParams
from jax_msa_runner.serving.runner import ModelRunner
from jax_msa_runner.serving.sampling import SamplingParams
from jax_msa_runner.serving.server import ServerThread, build_app
from jax_msa_runner.serving.tokenizer_io import ByteTokenizer

from test_server import drop_mid_stream, served_alone, wait_idle

# the module-scoped fixtures (a warmed-up runner or server) are built once, on one xdist worker
pytestmark = pytest.mark.xdist_group("prefix_cache_server")

MC = ModelConfig.tiny(num_layers=2, sparse_attention_freq=(0, 1), num_heads=4, head_dim=32,
                      rotary_dim=16, index_dim=32)
RC = RunnerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048,
                  bucket_sizes=(16, 256))
RUNNER_PAGES = 2 + 64
SERVER_PAGES = 2 + 24
MODEL = "tiny-prefix"
TOK = ByteTokenizer(MC.vocab_size)
RNG = np.random.default_rng(1500)


def ids(n):
    return [int(t) for t in RNG.integers(0, MC.vocab_size, n)]


LONG = ids(1500)
COPIES = ids(700)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95)
SHARED = [ids(n) for n in (300, 520, 700)]
KEEP = [SHARED[i % 3] + ids(5 + 7 * i) for i in range(8)]
DROP = [SHARED[i % 3] + ids(3 + i) for i in range(12)]


@pytest.fixture(scope="module")
def live():
    runner = ModelRunner(MC, RC, num_pages=RUNNER_PAGES, seed=5, attention_impl="reference",
                         debug=True)
    runner.warm_up()
    cases = ([(LONG, GenerationParams(max_tokens=8))]
             + [(COPIES, GenerationParams(max_tokens=6, seed=11 + i, sampling=SEEDED))
                for i in range(3)]
             + [(p, GenerationParams(max_tokens=12)) for p in KEEP])
    ref = served_alone(runner, SchedulerConfig.from_runner(RC, RUNNER_PAGES,
                                                              enable_prefix_caching=False), cases)
    engine = Engine(runner, SchedulerConfig.from_runner(RC, SERVER_PAGES), TOK, max_queue=64,
                    model_tag="test").start()
    server = ServerThread(build_app(engine, model_name=MODEL)).start()
    yield dict(engine=engine, url=server.url, long=ref[0], copies=ref[1:4], keep=ref[4:])
    server.stop()
    engine.shutdown()
    assert engine.error is None


def client(live):
    return openai.OpenAI(base_url=live["url"] + "/v1", api_key="none", max_retries=0,
                         timeout=300)


def metric(live, name):
    text = httpx.get(live["url"] + "/metrics").text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m is not None, name
    return float(m.group(1))


def complete(c, prompt, **kw):
    kw.setdefault("temperature", 0)
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    return c.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **kw)


def test_repeated_1500_token_prompt_reports_cached_tokens_and_the_same_text(live):
    c = client(live)
    q0 = metric(live, "jax_msa_prefix_cache_queries_total")
    h0 = metric(live, "jax_msa_prefix_cache_hits_total")
    first = complete(c, LONG, max_tokens=8)
    again = complete(c, LONG, max_tokens=8)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 1408  # 11 full pages >= 1280
    assert first.choices[0].token_ids == again.choices[0].token_ids == live["long"]
    assert again.choices[0].text == first.choices[0].text == TOK.decode(live["long"])
    chunks = list(c.completions.create(model=MODEL, prompt=LONG, max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == first.choices[0].text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 1408
    assert metric(live, "jax_msa_prefix_cache_queries_total") - q0 == 3 * 1500
    assert metric(live, "jax_msa_prefix_cache_hits_total") - h0 == 2 * 1408
    assert metric(live, "jax_msa_prefix_cache_pages") >= 11


def test_n_copies_share_their_prompt_pages(live):
    h0 = metric(live, "jax_msa_prefix_cache_hits_total")
    r = complete(client(live), COPIES, n=3, max_tokens=6, seed=11, temperature=1.0, top_p=0.95)
    assert [ch.token_ids for ch in r.choices] == live["copies"]
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # copy 0 computed the prompt
    assert metric(live, "jax_msa_prefix_cache_hits_total") - h0 == 2 * 640  # copies 1, 2


def test_prompt_logprobs_recompute_the_whole_prompt(live):
    c = client(live)
    prompt = ids(300)
    cold = complete(c, prompt, max_tokens=1, echo=True, logprobs=2)
    plain = complete(c, prompt, max_tokens=1)
    warm = complete(c, prompt, max_tokens=1, echo=True, logprobs=2)
    assert plain.usage.prompt_tokens_details.cached_tokens == 256
    assert warm.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].logprobs.token_logprobs == cold.choices[0].logprobs.token_logprobs
    assert warm.choices[0].logprobs.top_logprobs == cold.choices[0].logprobs.top_logprobs
    assert len(warm.choices[0].logprobs.token_logprobs) == 301
    assert warm.choices[0].text == cold.choices[0].text
    assert plain.choices[0].token_ids == cold.choices[0].token_ids[-1:]


def test_logit_bias_and_grammar_unchanged_on_a_cached_prompt(live):
    c = client(live)
    prompt = ids(400)
    biased = [complete(c, prompt, max_tokens=6, logit_bias={"66": 6, "200": -100})
              for _ in range(2)]
    assert biased[1].usage.prompt_tokens_details.cached_tokens == 384
    assert biased[0].choices[0].token_ids == biased[1].choices[0].token_ids
    regex = {"structured_outputs": {"regex": "[0-9]{3}"}}
    shaped = [complete(c, prompt, max_tokens=8, extra_body=regex) for _ in range(2)]
    assert shaped[1].usage.prompt_tokens_details.cached_tokens == 384
    assert re.fullmatch("[0-9]{3}", shaped[0].choices[0].text)
    assert shaped[0].choices[0].token_ids == shaped[1].choices[0].token_ids


def test_load_with_disconnects_leaks_no_page(live):
    engine = live["engine"]

    async def keep(ac, prompt):
        stream = await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                             temperature=0, stream=True,
                                             extra_body={"return_token_ids": True})
        out = []
        async for ch in stream:
            out.extend(ch.choices[0].model_extra["token_ids"])
        return out

    async def main():
        async with openai.AsyncOpenAI(base_url=live["url"] + "/v1", api_key="none",
                                      max_retries=0, timeout=300) as ac, \
                httpx.AsyncClient(base_url=live["url"], timeout=300) as hc:
            return await asyncio.gather(*[keep(ac, p) for p in KEEP],
                                        *[drop_mid_stream(hc, p, max_tokens=200, model=MODEL) for p in DROP])

    results = asyncio.run(main())
    snap = wait_idle(engine)
    assert results[:len(KEEP)] == live["keep"]
    pool = engine.scheduler.pool
    assert snap.pages_in_use == 0 and pool.num_held == 0
    assert pool.num_free == pool.num_usable and pool.num_cached > 0
    pool.check([])  # every page free or cached, the key index one to one
    assert sorted(engine.scheduler._free_slots) == list(range(RC.max_num_seqs))
    assert metric(live, "jax_msa_kv_pages_in_use") == 0
    assert engine.error is None

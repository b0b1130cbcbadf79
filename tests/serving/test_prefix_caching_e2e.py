"""Prefix caching end to end on the runner: outputs with the cache equal outputs without it.

One warmed-up runner (2 layers: 1 dense + 1 MSA, reference attention on CPU, debug: every
step's metadata is validated and the pages' ref counts are checked against the block
tables) serves schedulers with caching on and off. Greedy and seeded outputs must be
identical for short and long prompts, for a follow-up turn that resends the history, for
a 2200-token prompt whose decode tokens see 18 pages of which 17 came from the cache (the
MSA indexer scores the cached index-K pages and the top-16 selection can only pick cached
pages besides the token's own), for concurrent requests sharing a prefix, under eviction,
and when a request holding shared pages is preempted.
"""
import numpy as np
import pytest

from jax_msa_runner.config import ModelConfig, RunnerConfig, SchedulerConfig
from jax_msa_runner.serving.runner import ModelRunner, serve
from jax_msa_runner.serving.sampling import SamplingParams
from jax_msa_runner.serving.scheduler import Request, Scheduler

# the module-scoped fixtures (a warmed-up runner or server) are built once, on one xdist worker
pytestmark = pytest.mark.xdist_group("prefix_caching_e2e")

MC = ModelConfig.tiny(num_layers=2, sparse_attention_freq=(0, 1), num_heads=4, head_dim=32,
                      rotary_dim=16, index_dim=32)
RC = RunnerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2560,
                  bucket_sizes=(16, 256))
PAGES = 2 + 64
RNG = np.random.default_rng(51)


def tokens(n):
    return tuple(int(t) for t in RNG.integers(0, MC.vocab_size, n))


@pytest.fixture(scope="module")
def runner():
    r = ModelRunner(MC, RC, num_pages=PAGES, seed=4, attention_impl="reference", debug=True)
    r.warm_up()
    return r


def scheduler(caching, pages=PAGES, seqs=8):
    return Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=256,
                                     max_model_len=RC.max_model_len, num_pages=pages,
                                     enable_prefix_caching=caching))


def request(i, prompt, new=8, temperature=0.0):
    return Request(i, prompt, new, sampling=SamplingParams(temperature=temperature),
                   seed=100 + i)


def run(runner, s, reqs):
    """Serves reqs on s (validated every step); returns {id: output} of these requests."""
    for r in reqs:
        s.add_request(r)
    before = runner.validated_steps
    stats = serve(runner, s)
    assert stats.compilations == 0 and runner.validated_steps - before == stats.steps
    return {r.request_id: list(s.finished[r.request_id].output) for r in reqs}


def cold(runner, reqs):
    """The outputs without caching, each request alone."""
    out = {}
    for r in reqs:
        out.update(run(runner, scheduler(False), [Request(r.request_id, r.prompt,
                                                          r.max_new_tokens, sampling=r.sampling,
                                                          seed=r.seed)]))
    return out


def test_repeats_and_follow_up_turns_equal_no_cache_short_and_long(runner):
    s = scheduler(True)
    for n in (40, 200, 2200):
        prompt = tokens(n)
        first = run(runner, s, [request(0, prompt)])[0]
        s.pop_finished(0)
        again = run(runner, s, [request(0, prompt)])
        cached = s.finished[0].num_cached_tokens
        s.pop_finished(0)
        assert cached == (n - 1) // 128 * 128
        turn = prompt + tuple(first) + tokens(30)  # the next turn resends the history
        follow = run(runner, s, [request(1, turn, temperature=0.9)])
        assert s.pop_finished(1).num_cached_tokens == (n + 8 - 1) // 128 * 128
        want = cold(runner, [request(0, prompt), request(1, turn, temperature=0.9)])
        assert first == again[0] == want[0], n
        assert follow[1] == want[1], n
    assert s.pool.num_held == 0


def test_concurrent_requests_share_a_prefix(runner):
    prefix = tokens(600)
    reqs = [request(i, prefix + tokens(30), temperature=0.0 if i % 2 else 1.0)
            for i in range(4)]
    s = scheduler(True)
    shared = []

    def on_step(s, _):
        counts = [s.pool.ref_count(p) for r in s.running for p in r.pages]
        shared.append(max(counts, default=0))

    for r in reqs:
        s.add_request(r)
    serve(runner, s, on_step=on_step)
    got = {r.request_id: list(s.finished[r.request_id].output) for r in reqs}
    assert max(shared) == 4  # the 4 full prefix pages are held by every request at once
    assert [s.finished[i].num_cached_tokens for i in range(4)] == [0, 512, 512, 512]
    assert got == cold(runner, reqs)


def test_eviction_under_pressure_keeps_outputs(runner):
    prompts = [tokens(300) for _ in range(3)]
    reqs = [request(i, prompts[i % 3], new=6) for i in range(6)]  # each prompt twice
    s = scheduler(True, pages=2 + 6, seqs=2)
    got = {}
    for r in reqs:  # one after another: the third prompt evicts the first's pages
        got.update(run(runner, s, [r]))
    # 6 usable pages, 2 keyed per prompt: each request evicts the least recently released
    # page, the second page of the oldest prompt (a request releases its last page first),
    # so every repeat finds its first page only
    assert s.pool.num_evictions == 4
    assert [s.finished[i].num_cached_tokens for i in range(6)] == [0, 0, 0, 128, 128, 128]
    assert s.pool.num_held == 0
    assert got == cold(runner, reqs)


def test_preempting_a_request_that_holds_shared_pages(runner):
    prefix = tokens(400)  # 3 full pages shared by all three; each needs 2 more of its own
    reqs = [request(i, prefix + tokens(100 + 5 * i), new=30, temperature=0.8)
            for i in range(3)]
    s = scheduler(True, pages=2 + 7)
    for r in reqs:
        s.add_request(r)
    stats = serve(runner, s)
    assert stats.preemptions > 0
    assert max(s.finished[i].num_cached_tokens for i in range(3)) == 384
    got = {i: list(s.finished[i].output) for i in range(3)}
    assert got == cold(runner, reqs)
    assert s.pool.num_held == 0 and s.pool.num_free == s.pool.num_usable

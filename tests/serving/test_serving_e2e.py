"""End to end: warm-up, batch invariance, chunked == unchunked, preemption == ample pages,
zero compilations over a 500-step mixed workload with every step's metadata validated.

One warmed-up runner (small heads, 3 layers: 1 dense + 2 MSA, reference attention on CPU) is
shared by every test; schedulers with different budgets / page counts drive it (a scheduler
may use fewer pages than the cache holds, so tight-page runs need no second compile).
"""
import numpy as np
import pytest

from jax_msa_runner.config import ModelConfig, RunnerConfig
from jax_msa_runner.serving.runner import ModelRunner, serve
from jax_msa_runner.serving.sampling import SamplingParams
from jax_msa_runner.serving.scheduler import Request, Scheduler, SchedulerConfig

MC = ModelConfig.tiny(num_layers=3, sparse_attention_freq=(0, 1, 1), num_heads=4, head_dim=32,
                      rotary_dim=16, index_dim=32)
RC = RunnerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=384,
                  bucket_sizes=(16, 64))
CACHE_PAGES = 64


# every test here uses the module-scoped ``runner``: one xdist worker warms it up, once
pytestmark = pytest.mark.xdist_group("serving_e2e_runner")


@pytest.fixture(scope="module")
def runner():
    r = ModelRunner(MC, RC, num_pages=CACHE_PAGES, seed=1, attention_impl="reference", debug=True)
    r.report = r.warm_up()
    return r


def _serve(runner, reqs, *, budget=64, pages=CACHE_PAGES, seqs=16, max_steps=None):
    s = Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget,
                                  max_model_len=RC.max_model_len, num_pages=pages))
    for r in reqs:
        s.add_request(r)
    stats = serve(runner, s, max_steps=max_steps)
    return {i: list(r.output) for i, r in s.finished.items()}, stats, s


def _reqs(lens, new, temperature=0.0, seed=0):
    rng = np.random.default_rng(seed)
    return [Request(i, tuple(int(t) for t in rng.integers(0, MC.vocab_size, n)), m,
                    sampling=SamplingParams(temperature=temperature if i % 2 else 0.0),
                    seed=1000 + i)
            for i, (n, m) in enumerate(zip(lens, new))]


def test_warm_up_compiles_every_bucket_and_profiles(runner):
    rep = runner.report
    assert [b.num_tokens for b in rep.buckets] == [16, 64]
    assert rep.compilations >= len(rep.buckets)
    assert rep.profile_bucket == rep.buckets[-1]
    assert rep.step_temp_bytes and rep.step_temp_bytes > 0
    assert rep.cache_bytes > 0 and rep.param_bytes > 0


def test_batch_invariance_alone_vs_batch_of_16(runner):
    lens = [37, 5, 90, 14, 61, 3, 120, 8, 44, 27, 70, 9, 33, 100, 12, 55]
    batch, _, _ = _serve(runner, _reqs(lens, [12] * 16))
    for i in (0, 6, 13):
        alone, _, _ = _serve(runner, [_reqs(lens, [12] * 16)[i]])
        assert alone[i] == batch[i], f"request {i}: alone {alone[i]} vs in batch {batch[i]}"


def test_chunked_prefill_equals_unchunked(runner):
    lens, new = [60, 45, 63], [10, 10, 10]
    whole, _, _ = _serve(runner, _reqs(lens, new, seed=3), budget=64, seqs=1)  # one chunk each
    chunked, stats, _ = _serve(runner, _reqs(lens, new, seed=3), budget=7)  # chunks of <= 7
    assert stats.steps >= sum(lens) // 7
    assert chunked == whole


def test_preemption_outputs_equal_ample_pages(runner):
    lens = [120, 110, 126, 100, 90, 127, 115, 105]
    new = [30] * 8
    ample, _, _ = _serve(runner, _reqs(lens, new, temperature=0.8, seed=5))
    tight, stats, s = _serve(runner, _reqs(lens, new, temperature=0.8, seed=5), pages=2 + 5)
    assert stats.preemptions > 0
    assert sorted(tight) == list(range(8))
    assert tight == ample


def test_500_steps_zero_compilations_and_valid_metadata(runner):
    rng = np.random.default_rng(11)
    lens = [int(rng.choice([int(rng.integers(1, 20)), int(rng.integers(20, 250))])) for _ in range(70)]
    new = [int(rng.integers(5, 60)) for _ in range(70)]
    before = runner.validated_steps
    _, stats, s = _serve(runner, _reqs(lens, new, temperature=1.0, seed=11), budget=48, pages=2 + 5,
                         seqs=4, max_steps=500)
    assert stats.steps == 500
    assert stats.compilations == 0
    assert runner.validated_steps - before == 500  # debug mode: validate_metadata every step
    assert stats.preemptions > 0 and len(s.finished) > 10

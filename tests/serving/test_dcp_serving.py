"""Serving with decode context parallelism on the conftest's 4 host devices.

The same greedy workload is served by the single-device runner and by DCP runners over
W = 2 and 4 devices (one prompt > 2048 tokens, so the top-16 selection drops blocks and
every rank owns several of its blocks; one > W * 128 = 512). Per step the logits of every
kept sample agree within LOGIT_TOL (measured max |diff| ~2e-6 on f32 logits of std ~1: the
log-sum-exp merge reorders f32 sums), and every kept greedy sample has a top-1/top-2 margin
far above LOGIT_TOL, so identical outputs follow from the logits and are asserted too.
The long request's cache, gathered in global order through the interleave rule (global
block g on rank g % W at local page g // W), equals the single-device cache.
Each runner validates every step's metadata (debug mode) and compiles nothing after warm-up.
Measured on this workload: min greedy margin 0.043, max |logit diff| 1.8e-6 (W=2), 1.7e-6
(W=4), max |cache diff| 2.6e-6. Also: preemption with rank-local pages, one W=2 run through
the Pallas kernels (interpret mode), and the error for more ranks than devices.
"""
import dataclasses
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import numpy.testing as npt
import pytest
from jax.sharding import PartitionSpec as P

from jax_msa_runner.serving.compile_count import CompileCounter
from jax_msa_runner.config import RESERVED_PAGES, ModelConfig, RunnerConfig
from jax_msa_runner.attention.dcp import DCP_AXIS, DCPError
from jax_msa_runner.cli.demo import HOST_DEVICES_FLAG, main as demo_main, request_host_devices
from jax_msa_runner.serving.kv_cache import pages_needed
from jax_msa_runner.serving.runner import ModelRunner, serve
from jax_msa_runner.serving.scheduler import (Request, RequestRejectedError, Scheduler,
                                      SchedulerConfig)

MC = ModelConfig.tiny(num_layers=2, sparse_attention_freq=(0, 1), num_heads=4, head_dim=32,
                      rotary_dim=16, index_dim=32)
MAX_LEN = 2304
BUDGET = 128
LENS = (2200, 600, 40, 9)  # 2200 > 2048: sparse selection; 600 > 4 * 128
NEW_TOKENS = 5
LONG = 0  # request id of the 2200-token prompt
LOGIT_TOL = dict(atol=1e-4, rtol=0)
MIN_MARGIN = 50 * LOGIT_TOL["atol"]


def _rconfig(world_size, budget=BUDGET, max_len=MAX_LEN, seqs=4):
    return RunnerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                        bucket_sizes=(budget,), dcp_world_size=world_size)


def _requests(lens, new, seed=0):
    rng = np.random.default_rng(seed)
    return [Request(i, tuple(int(t) for t in rng.integers(0, MC.vocab_size, n)), new)
            for i, n in enumerate(lens)]


def _num_pages(lens, new, world_size):
    """Pages per rank holding every request at once."""
    return len(RESERVED_PAGES) + sum(pages_needed(n + new, world_size) for n in lens)


def _request_cache(caches, pages, length, world_size):
    """A request's cache rows in global token order, per layer (numpy).

    caches: KVCaches (leaves [N, ...], or [W, N_local, ...] under DCP); pages: the request's
    (rank-local) page ids; global block g is read from rank g % W, local page g // W.
    Returns (kv per layer [Hkv, length, 2D], index-K per MSA layer [length, Di]).
    """
    def gather(leaf, token_axis):
        shards = np.asarray(leaf) if world_size > 1 else np.asarray(leaf)[None]
        blocks = [shards[g % world_size, pages[g // world_size]]
                  for g in range(pages_needed(length))]
        return np.take(np.concatenate(blocks, axis=token_axis), np.arange(length),
                       axis=token_axis)

    kv = tuple(gather(leaf, 1) for leaf in caches.kv)
    index_k = tuple(gather(leaf, 0) for leaf in caches.index_k if leaf is not None)
    return kv, index_k


def _serve_recording(runner, reqs, world_size, *, budget=BUDGET, max_len=MAX_LEN, seqs=4,
                     num_pages=None):
    """Serves ``reqs`` to completion; returns a dict of what the tests compare.

    num_pages: the scheduler's pages per rank (default: every request at once).
    outputs {id: tokens}; logits: per step f32 [kept rows, V] (rows whose sample is kept);
    long_cache: ``_request_cache`` of request LONG just before it finishes (None if absent);
    compilations: XLA compiles while serving; steps; preemptions.
    """
    n_pages = num_pages or _num_pages([len(r.prompt) for r in reqs], reqs[0].max_new_tokens,
                                      world_size)
    sched = Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget,
                                      max_model_len=max_len, num_pages=n_pages,
                                      dcp_world_size=world_size))
    for r in reqs:
        sched.add_request(r)
    logits, long_cache = [], None
    with CompileCounter() as cc:
        while sched.has_unfinished():
            batch = sched.schedule()
            tokens = runner.execute(batch)
            logits.append(np.asarray(runner.last_logits)[:batch.num_reqs][batch.sample])
            for row, req in enumerate(batch.requests):
                if (req.request_id == LONG and batch.sample[row]
                        and len(req.output) + 1 == req.max_new_tokens):
                    length = int(batch.num_computed[row] + batch.num_scheduled[row])
                    long_cache = _request_cache(runner.caches, req.pages, length, world_size)
            sched.update(batch, tokens)
    return dict(outputs={i: list(r.output) for i, r in sched.finished.items()}, logits=logits,
                long_cache=long_cache, compilations=cc.count, steps=len(logits),
                preemptions=sched.num_preemptions)


def _runner(world_size, impl="reference", mc=MC, **kw):
    rc = _rconfig(world_size, **kw)
    n_pages = _num_pages(LENS, NEW_TOKENS, world_size)
    runner = ModelRunner(mc, rc, num_pages=n_pages, seed=1, attention_impl=impl, debug=True)
    runner.warm_up()
    return runner


# the tests of the module-scoped ``single_device`` and ``dcp_runners`` on one xdist worker:
# the single-device serving and the W = 2 / 4 warm-ups happen once per test run
SHARED_RUNNERS_GROUP = pytest.mark.xdist_group("dcp_serving_shared_runners")


@pytest.fixture(scope="module")
def single_device():
    return _serve_recording(_runner(1), _requests(LENS, NEW_TOKENS), 1)


@pytest.fixture(scope="module")
def dcp_runners():
    """Warmed-up DCP runners by world size, built on first use and shared."""
    cache = {}

    def get(world_size):
        if world_size not in cache:
            cache[world_size] = _runner(world_size)
        return cache[world_size]

    return get


def _assert_same_serving(single, dist):
    assert dist["steps"] == single["steps"]
    for step, (a, b) in enumerate(zip(single["logits"], dist["logits"])):
        chex.assert_equal_shape([a, b])
        npt.assert_allclose(b, a, **LOGIT_TOL, err_msg=f"step {step}")
    assert dist["outputs"] == single["outputs"]


@SHARED_RUNNERS_GROUP
@pytest.mark.parametrize("world_size", [2, 4])
def test_dcp_serving_equals_single_device(single_device, dcp_runners, world_size):
    # the workload is stable: every kept greedy sample wins by far more than LOGIT_TOL
    kept = np.concatenate(single_device["logits"])
    top2 = np.sort(kept, axis=-1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > MIN_MARGIN
    assert sorted(single_device["outputs"]) == list(range(len(LENS)))

    runner = dcp_runners(world_size)
    leaf = runner.caches.kv[0]
    assert leaf.shape[:2] == (world_size, _num_pages(LENS, NEW_TOKENS, world_size))
    assert leaf.sharding.spec == P(DCP_AXIS)
    before = runner.validated_steps
    dist = _serve_recording(runner, _requests(LENS, NEW_TOKENS), world_size)

    _assert_same_serving(single_device, dist)
    assert dist["compilations"] == 0
    assert runner.validated_steps - before == dist["steps"]  # debug: every step validated
    # the long request's K/V and index-K, read back through the interleave rule
    for one, many in zip(jax.tree.leaves(single_device["long_cache"]),
                         jax.tree.leaves(dist["long_cache"])):
        npt.assert_allclose(many, one, atol=1e-5, rtol=1e-5)


@SHARED_RUNNERS_GROUP
def test_dcp_preemption_with_rank_local_pages_equals_single_device(single_device, dcp_runners):
    """Too few rank-local pages for the workload at once: requests are preempted (their
    local pages freed on every rank) and recomputed; greedy outputs stay those of one device."""
    runner = dcp_runners(2)
    before = runner.validated_steps
    usable = pages_needed(LENS[0] + NEW_TOKENS, 2) + 1  # the long request plus one page
    dist = _serve_recording(runner, _requests(LENS, NEW_TOKENS), 2,
                            num_pages=len(RESERVED_PAGES) + usable)
    assert dist["preemptions"] > 0
    assert dist["outputs"] == single_device["outputs"]
    assert dist["compilations"] == 0
    assert runner.validated_steps - before == dist["steps"]


@SHARED_RUNNERS_GROUP
def test_dcp_prefix_cache_maps_rank_local_pages_and_equals_single_device(single_device,
                                                                         dcp_runners):
    """Prefix caching under DCP: a page of a request's list holds W * 128 tokens over the W
    ranks, so the workload served again on the same scheduler maps 8 pages (2048 tokens) of
    the 2200-token prompt and 2 (512) of the 600-token one; the outputs stay those of one
    device and every step's ref counts match the block tables (debug)."""
    runner = dcp_runners(2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=BUDGET,
                                      max_model_len=MAX_LEN, dcp_world_size=2,
                                      num_pages=_num_pages(LENS, NEW_TOKENS, 2)))
    for r in _requests(LENS, NEW_TOKENS):
        sched.add_request(r)
    first = serve(runner, sched)
    for r in _requests(LENS, NEW_TOKENS):
        sched.add_request(dataclasses.replace(r, request_id=10 + r.request_id))
    again = serve(runner, sched)
    assert [sched.finished[10 + i].num_cached_tokens for i in range(4)] == [2048, 512, 0, 0]
    assert {i: list(sched.finished[10 + i].output) for i in range(4)} == \
        single_device["outputs"] == {i: list(sched.finished[i].output) for i in range(4)}
    assert again.steps < first.steps and first.compilations == again.compilations == 0


@pytest.mark.slow
def test_dcp_pallas_kernels_interpret_equal_single_device_reference():
    """Runner steps through the Pallas kernels (interpret mode on CPU) with W = 2 ==
    the single-device reference runner (small buckets keep interpret mode cheap)."""
    kw = dict(budget=16, max_len=384, seqs=2)
    reqs = lambda: _requests((300, 7), 3, seed=4)  # noqa: E731  300 > 2 * 128
    single = _serve_recording(_runner(1, "reference", **kw), reqs(), 1, **kw)
    runner = _runner(2, "pallas", **kw)
    assert runner.interpret == (jax.default_backend() != "gpu")
    dist = _serve_recording(runner, reqs(), 2, **kw)
    _assert_same_serving(single, dist)
    assert dist["compilations"] == 0


@pytest.mark.slow
def test_dcp_with_fp8_index_cache_equals_single_device():
    """An fp8 index-K cache under DCP (W = 2): every rank's index pages stay fp8 and the
    logits and greedy outputs equal one device's serving with the same fp8 cache."""
    mc = dataclasses.replace(MC, index_cache_dtype="float8_e4m3fn")
    single = _serve_recording(_runner(1, mc=mc), _requests(LENS, NEW_TOKENS), 1)
    runner = _runner(2, mc=mc)
    index_pages = [leaf for leaf in runner.caches.index_k if leaf is not None]
    assert index_pages and all(leaf.dtype == jnp.float8_e4m3fn for leaf in index_pages)
    dist = _serve_recording(runner, _requests(LENS, NEW_TOKENS), 2)
    _assert_same_serving(single, dist)
    assert dist["compilations"] == 0
    chex.assert_tree_all_finite([leaf.astype(np.float32) for leaf in runner.caches.index_k
                                 if leaf is not None])


def test_more_ranks_than_devices_is_a_clear_error():
    n = len(jax.devices())
    with pytest.raises(DCPError, match=f"dcp_world_size: {n + 1} ranks need {n + 1} devices, "
                                       f"only {n} available"):
        ModelRunner(MC, _rconfig(n + 1), num_pages=8, attention_impl="reference")


def test_demo_dcp_flag_sets_host_devices_or_names_the_flag(monkeypatch, capsys):
    n = len(jax.devices())  # jax up before the test's XLA_FLAGS, whatever ran first here
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1")
    request_host_devices(1)  # no DCP: untouched
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_foo=1"
    request_host_devices(3)
    assert os.environ["XLA_FLAGS"] == f"--xla_cpu_foo=1 {HOST_DEVICES_FLAG}=3"
    request_host_devices(5)  # a flag already given is the user's choice: kept
    assert os.environ["XLA_FLAGS"] == f"--xla_cpu_foo=1 {HOST_DEVICES_FLAG}=3"
    # jax already runs on len(jax.devices()) devices here: one rank more is refused clearly,
    # in one line on stderr with exit status 2 (tests/test_cli.py: before any work starts)
    with pytest.raises(SystemExit) as exc:
        demo_main(["--dcp", str(n + 1), "--num-requests", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --dcp: {n + 1} ranks need {n + 1} devices" in err
    assert f"XLA_FLAGS={HOST_DEVICES_FLAG}={n + 1}" in err


def test_scheduler_allocates_rank_local_pages():
    W = 2
    usable = 3  # per rank: 3 * 2 * 128 = 768 tokens of context
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=300, max_model_len=2048,
                          num_pages=len(RESERVED_PAGES) + usable, dcp_world_size=W)
    sched = Scheduler(cfg)
    with pytest.raises(RequestRejectedError, match="needs 4 KV pages per rank"):
        sched.add_request(Request(9, tuple(range(770)), 1))  # 770 tokens: ceil(770/256) = 4
    sched.add_request(Request(0, tuple(range(700)), 2))
    counts = []
    while sched.has_unfinished():
        batch = sched.schedule()
        counts.append((int(batch.num_computed[0] + batch.num_scheduled[0]),
                       len(batch.block_table[0])))
        sched.update(batch, [1] * batch.num_reqs)
    # seq_len -> ceil(seq_len / 256) local pages: 300 -> 2, 600 -> 3, 700 -> 3, 701 -> 3
    assert counts == [(300, 2), (600, 3), (700, 3), (701, 3)]
    with pytest.raises(ValueError, match="dcp_world_size"):
        Scheduler(SchedulerConfig(1, 8, 64, 8, dcp_world_size=0))

"""Prefix caching on the host: the key chain, the ref-counted page pool (sharing, LRU
eviction of ref-0 pages only, the debug check), and the scheduler over it (the cached prefix
it maps, the last token always computed, readers that must skip the cache, ``n`` copies
sharing one prefill, preemption of a request holding shared pages, eviction and aborts
under pressure with every ref count checked each step and no page leaked).

The model is ``test_scheduler.fake_model``: its token depends on the whole sequence, so a
schedule that reused a wrong page or skipped a token would change the outputs.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_msa_runner.config import ModelConfig
from jax_msa_runner.serving.prefix_cache import (OutOfPagesError, PagePool, PageRefError,
                                                 cache_identity, chain_keys)
from jax_msa_runner.serving.sampling import SamplingParams
from jax_msa_runner.serving.scheduler import Request, Scheduler, SchedulerConfig, Status

from test_scheduler import check_invariants, fake_model

ROOT = cache_identity(ModelConfig.tiny(), ("float32", "float32"))


def sched(caching=True, **cfg):
    return Scheduler(SchedulerConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 64,
                                        "max_model_len": 2048, "num_pages": 40,
                                        "enable_prefix_caching": caching, **cfg}),
                     cache_identity=ROOT)


def run(s, max_steps=20_000, on_step=None):
    """Runs s to the end, checking invariants and ref counts every step; returns the number
    of tokens the steps computed."""
    computed = steps = 0
    while s.has_unfinished():
        b = s.schedule()
        check_invariants(s, b)
        computed += b.num_tokens
        s.update(b, fake_model(b))
        s.check_pages()
        if on_step is not None:
            on_step(s, b)
        steps += 1
        assert steps < max_steps
    return computed


def outputs(s):
    return {i: list(r.output) for i, r in s.finished.items()}


# ---- keys and the pool -------------------------------------------------------------------------

def test_keys_chain_the_whole_prefix_and_the_cache_identity():
    toks = list(range(300))
    keys = chain_keys(ROOT, toks, 128)
    assert len(keys) == 2  # the partial third page has no key
    assert chain_keys(ROOT, toks[:256], 128) == keys
    changed = chain_keys(ROOT, [999] + toks[1:], 128)
    assert changed[0] != keys[0] and changed[1] != keys[1]  # page 1 keys page 0's tokens too
    fp8 = cache_identity(ModelConfig.tiny(index_cache_dtype="float8_e4m3fn"),
                         ("float32", "float8_e4m3fn"))
    bf16 = cache_identity(ModelConfig.tiny(dtype="bfloat16"), ("bfloat16", "bfloat16"))
    assert len({ROOT, fp8, bf16, cache_identity(ModelConfig.tiny(), ("float32",) * 2,
                                                model_tag="other weights")}) == 4
    assert chain_keys(fp8, toks, 128)[0] != keys[0]
    dcp2 = chain_keys(ROOT, toks, 256)  # DCP over 2 ranks: a page of the list is 256 tokens
    assert len(dcp2) == 1 and dcp2[0] not in keys


def test_pool_shares_keyed_pages_and_evicts_only_ref0_least_recent_first():
    pool = PagePool(8)  # usable pages 2..7
    a = pool.allocate(3)
    assert a == [2, 3, 4] and pool.num_free == 3 and pool.num_held == 3
    for page, key in zip(a, (b"k0", b"k1", b"k2")):
        assert pool.insert(page, key)
    assert not pool.insert(a[0], b"k9")  # keyed already
    b = pool.allocate(1)
    assert not pool.insert(b[0], b"k0")  # the key names page 2: page 5 stays unkeyed
    assert pool.lookup([b"k0", b"k1", b"zz", b"k2"]) == [2, 3]
    pool.acquire([2, 3])  # a second request shares the prefix
    assert pool.ref_count(2) == 2 and pool.ref_count(4) == 1
    pool.check([a, [2, 3], b])
    pool.release(a)  # 4 goes cached; 2 and 3 stay held by the sharer
    assert pool.ref_count(2) == 1 and pool.num_held == 3 and pool.num_free == 3
    pool.release(b)  # unkeyed: free
    pool.release([2, 3])  # released last page first: 3 is older than 2 in the LRU order
    pool.check([])
    assert pool.num_free == 6 and pool.num_cached == 3
    c = pool.allocate(4)  # the 3 free pages, lowest id first, then evicts the LRU cached: 4
    assert c == [5, 6, 7, 4] and pool.num_evictions == 1
    assert pool.lookup([b"k0", b"k1", b"k2"]) == [2, 3]
    assert pool.allocate(1) == [3] and pool.lookup([b"k0", b"k1"]) == [2]
    pool.acquire([2])
    with pytest.raises(OutOfPagesError, match="requested 1 pages, 0 free of 6"):
        pool.allocate(1)  # page 2 is held: never evicted
    pool.check([c, [3], [2]])


def test_pool_errors_and_the_debug_check_name_the_page():
    pool = PagePool(6)
    with pytest.raises(ValueError, match="n: must be >= 0, got -1"):
        pool.allocate(-1)
    p = pool.allocate(2)
    with pytest.raises(ValueError, match="page 2: only a keyed page can be shared"):
        pool.acquire([2])
    with pytest.raises(ValueError, match="page 5: only a held page can be keyed"):
        pool.insert(5, b"x")
    with pytest.raises(PageRefError, match="page 3: ref count 1 but 0 running block tables"):
        pool.check([[2]])
    with pytest.raises(PageRefError, match="page 2: ref count 1 but 2 running block tables"):
        pool.check([[2], [2, 3]])
    with pytest.raises(PageRefError, match="holds a page twice"):
        pool.check([[2, 2, 3]])
    pool.release(p)
    with pytest.raises(ValueError, match="page 2 is not held"):
        pool.release([2])
    with pytest.raises(ValueError, match="page 0 is not held"):
        pool.release([0])
    with pytest.raises(Exception, match="enable_prefix_caching: must be a bool"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1, max_model_len=8,
                        num_pages=4, enable_prefix_caching="yes")


# ---- the scheduler -----------------------------------------------------------------------------

@pytest.mark.parametrize("n, cached", [(1500, 1408), (1408, 1280), (1409, 1408), (128, 0),
                                       (129, 128), (40, 0)])
def test_repeat_maps_full_pages_and_computes_from_the_first_uncached_token(n, cached):
    prompt = tuple(int(t) for t in np.random.default_rng(n).integers(0, 500, n))
    s = sched()
    s.add_request(Request(0, prompt, 5))
    first = run(s)
    s.add_request(Request(1, prompt, 5))
    b = s.schedule()
    assert b.num_computed[0] == cached and s.running[0].num_cached_tokens == cached
    assert b.num_scheduled[0] == min(n - cached, 64)  # from the first uncached token
    s.update(b, fake_model(b))
    again = b.num_tokens + run(s)
    assert outputs(s)[1] == outputs(s)[0]
    assert first - again == cached
    assert (s.prefix_queries, s.prefix_hits) == (2 * n, cached)
    assert s.pool.num_held == 0 and s.pool.num_free == s.pool.num_usable


def test_staged_metadata_counts_cached_pages_as_computed_context():
    """The batch of a request that hit 11 cached pages stages (and validates) as a chunk
    after 1408 computed tokens: positions, seq_lens, kv_lens, the indexer's valid pages and
    the slots of the new tokens follow from num_computed, on pages after the cached ones."""
    from jax_msa_runner.batch.staging import stage_batch
    from jax_msa_runner.batch.validate import validate_metadata
    from jax_msa_runner.config import RunnerConfig

    rc = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=2048,
                      bucket_sizes=(64,))
    prompt = tuple(range(1500))
    s = sched()
    s.add_request(Request(0, prompt, 2))
    run(s)
    s.add_request(Request(1, prompt, 2))
    b = s.schedule()
    md = stage_batch(b.num_scheduled, b.num_computed, b.block_table, rc)
    validate_metadata(md, rc)
    pos = np.asarray(md.positions)[:64]
    assert list(pos) == list(range(1408, 1472)) and int(md.seq_lens[0]) == 1472
    assert list(np.asarray(md.kv_lens)[:64]) == list(range(1409, 1473))
    assert set(np.asarray(md.num_valid_pages)[:64].tolist()) == {12}
    table = np.asarray(md.block_table)[0]
    assert list(np.asarray(md.slot_mapping)[:64]) == [int(table[11]) * 128 + i
                                                      for i in range(64)]
    assert int(table[11]) not in b.block_table[0][:11]  # written: a page of its own


def test_cached_pages_are_the_first_requests_pages():
    prompt = tuple(range(400))
    s = sched(max_num_batched_tokens=512)  # one chunk: the first step holds all 4 pages
    s.add_request(Request(0, prompt, 3))
    b = s.schedule()
    pages = b.block_table[0]
    s.update(b, fake_model(b))
    run(s)
    s.add_request(Request(1, prompt, 3))
    b = s.schedule()
    assert b.block_table[0][:3] == pages[:3] and b.num_computed[0] == 384


def test_prompt_logprobs_and_penalties_never_read_the_cache_but_fill_it():
    prompt = tuple(range(1, 301))
    s = sched()
    s.add_request(Request(0, prompt, 4, prompt_logprobs=True))
    s.add_request(Request(1, prompt, 4, sampling=SamplingParams(repetition_penalty=1.1)))
    s.add_request(Request(2, prompt, 4, sampling=SamplingParams(presence_penalty=0.5)))
    run(s)
    assert s.pool.num_cached == 2 and s.prefix_queries == 0
    for i in range(3):
        assert s.finished[i].num_cached_tokens == 0
    s.add_request(Request(3, prompt, 4, sampling=SamplingParams(temperature=0.7)))
    run(s)
    assert s.finished[3].num_cached_tokens == 256 and outputs(s)[3] == outputs(s)[0]


def test_caching_off_computes_everything():
    prompt = tuple(range(600))
    s = sched(caching=False)
    for i in range(2):
        s.add_request(Request(i, prompt, 3))
        run(s)
    assert [s.finished[i].num_cached_tokens for i in range(2)] == [0, 0]
    assert s.pool.num_cached == 0 and s.prefix_hits == 0


def test_n_copies_prefill_the_prefix_once_and_share_its_pages():
    """Three copies submitted together: copies 1 and 2 wait for copy 0's pages and map them;
    the shared pages have ref count 3 while all run."""
    prompt = tuple(range(3, 503))  # 3 full pages + 116 tokens
    s = sched(max_num_batched_tokens=64)
    for i in range(3):
        s.add_request(Request(i, prompt, 6, sampling=SamplingParams(temperature=1.0), seed=7 + i))
    refs = []
    computed = run(s, on_step=lambda s, b: refs.append(
        max((s.pool.ref_count(p) for r in s.running for p in r.pages), default=0)))
    assert max(refs) == 3
    assert [s.finished[i].num_cached_tokens for i in range(3)] == [0, 384, 384]
    assert computed == 500 + 2 * 116 + 3 * 5  # the prefix once, each copy's tail, decodes
    ref = sched(caching=False)
    for i in range(3):
        ref.add_request(Request(i, prompt, 6, sampling=SamplingParams(temperature=1.0),
                                seed=7 + i))
    run(ref)
    assert outputs(s) == outputs(ref)


def test_preempting_a_request_that_holds_shared_pages_keeps_them_for_the_sharer():
    prefix = tuple(range(1, 257))
    s = sched(num_pages=2 + 5, max_num_batched_tokens=32, max_num_seqs=2)
    s.add_request(Request(0, prefix + (7,) * 100, 200))
    s.add_request(Request(1, prefix + (9,) * 20, 200))
    seen = []

    def on_step(s, b):
        if b.preempted:
            victim = next(r for r in s.waiting if r.request_id in b.preempted)
            other = s.running[0]
            shared = other.pages[:2]
            seen.append((victim.request_id, victim.pages, [s.pool.ref_count(p) for p in shared]))

    run(s, on_step=on_step)
    assert seen and seen[0][0] == 1 and seen[0][1] == []
    assert seen[0][2] == [1, 1]  # the victim's references are gone, the sharer's remain
    assert s.finished[1].num_cached_tokens == 256
    ref = sched(caching=False, num_pages=40)
    ref.add_request(Request(0, prefix + (7,) * 100, 200))
    ref.add_request(Request(1, prefix + (9,) * 20, 200))
    run(ref)
    assert outputs(s) == outputs(ref)
    assert s.pool.num_held == 0 and s.pool.num_free == s.pool.num_usable


PREFIXES = [tuple(int(t) for t in np.random.default_rng(k).integers(0, 500, n))
            for k, n in enumerate((400, 300, 390, 260, 140, 380))]


@settings(max_examples=60, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 200), st.integers(1, 40)),
                     min_size=1, max_size=12),
       aborts=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 11)), max_size=4),
       budget=st.integers(8, 256), pages=st.integers(6, 12), seqs=st.integers(1, 5))
def test_property_shared_prefixes_under_pressure_equal_no_cache_and_leak_nothing(
        reqs, aborts, budget, pages, seqs):
    """Requests over six shared prefixes (cut at random lengths), few pages (preemption,
    eviction), aborts at random steps: every step's ref counts match the running block
    tables, outputs equal a run without caching, and at the end no page is held."""
    def build(caching, num_pages):
        s = sched(caching, num_pages=num_pages, max_num_batched_tokens=budget,
                  max_num_seqs=seqs, max_model_len=512)
        for i, (k, cut, new) in enumerate(reqs):
            prompt = PREFIXES[k][:max(1, len(PREFIXES[k]) - cut)]
            s.add_request(Request(i, prompt, new))
        return s

    s, plan, step = build(True, pages), dict(aborts), 0
    aborted = set()
    while s.has_unfinished():
        if step in plan and s.abort(plan[step]) is not None:
            aborted.add(plan[step])
            s.check_pages()
            if not s.has_unfinished():
                break
        b = s.schedule()
        check_invariants(s, b)
        s.update(b, fake_model(b))
        s.check_pages()
        step += 1
    ref = build(False, 40)
    run(ref)
    for i, out in outputs(s).items():
        assert out == outputs(ref)[i]
    assert set(outputs(s)) | aborted >= set(range(len(reqs)))
    assert s.pool.num_held == 0 and s.pool.num_free == s.pool.num_usable
    assert all(r.status is Status.FINISHED for r in s.finished.values())

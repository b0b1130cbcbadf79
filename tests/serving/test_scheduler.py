"""Scheduler: budget, chunked prefill, decode, preemption by recompute, rejection, no loss."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_msa_runner.config import RESERVED_PAGES
from jax_msa_runner.serving.kv_cache import pages_needed
from jax_msa_runner.serving.sampling import SamplingParams
from jax_msa_runner.serving.scheduler import (Request, RequestRejectedError, Scheduler, SchedulerConfig,
                                      Status)


def fake_model(batch):
    """Deterministic 'model': next token = f(whole sequence so far), whatever the chunking."""
    out, off = [], 0
    for r, n, c in zip(batch.requests, batch.num_scheduled, batch.num_computed):
        assert list(batch.token_ids[off:off + n]) == r.token_slice(c, c + n)
        seq = np.asarray(r.token_slice(0, c + n), np.int64)
        out.append(int((seq * np.arange(1, len(seq) + 1)).sum() % 97))
        off += n
    return out


def check_invariants(s: Scheduler, batch):
    ids = [r.request_id for r in batch.requests]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    assert batch.num_tokens <= s.config.max_num_batched_tokens
    assert batch.num_reqs <= s.config.max_num_seqs
    held = {p for r in s.running for p in r.pages}  # shared prefix pages appear once
    s.check_pages()  # ref counts == the running page lists holding each page
    assert not held & set(RESERVED_PAGES)
    assert len(held) + s.pool.num_free == s.pool.num_usable
    for r, n, c, row in zip(batch.requests, batch.num_scheduled, batch.num_computed, batch.block_table):
        assert n >= 1 and c + n <= r.num_tokens
        assert len(row) >= pages_needed(c + n)


def run_all(s: Scheduler, max_steps=10_000):
    steps = 0
    while s.has_unfinished():
        b = s.schedule()
        check_invariants(s, b)
        s.update(b, fake_model(b))
        steps += 1
        assert steps < max_steps
    return steps


def add_all(s: Scheduler, lens, new) -> tuple[list[int], list[int]]:
    """Adds request i (prompt of lens[i] tokens, new[i] output tokens) for each i; returns
    the ids accepted and the ids rejected (RequestRejectedError), in order."""
    accepted, rejected = [], []
    for i, l in enumerate(lens):
        try:
            s.add_request(Request(i, tuple(range(l)), new[i]))
            accepted.append(i)
        except RequestRejectedError:
            rejected.append(i)
    return accepted, rejected


def make(n, lens, new, **cfg):
    s = Scheduler(SchedulerConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 16,
                                     "max_model_len": 512, "num_pages": 12, **cfg}))
    for i, (l, m) in enumerate(zip(lens, new)):
        s.add_request(Request(i, tuple(range(1, l + 1)), m))
    return s


def test_chunked_prefill_then_decode():
    s = make(1, [40], [3])
    b = s.schedule()
    assert list(b.num_scheduled) == [16] and not b.sample[0]
    s.update(b, fake_model(b))
    b = s.schedule()
    assert list(b.num_computed) == [16] and list(b.num_scheduled) == [16]
    s.update(b, fake_model(b))
    b = s.schedule()
    assert list(b.num_scheduled) == [8] and b.sample[0] and b.sample_index[0] == 0
    s.update(b, fake_model(b))
    b = s.schedule()  # decode: one token, the sampled one
    assert list(b.num_scheduled) == [1] and b.token_ids[0] == s.running[0].output[0]
    run_all(s)
    assert len(s.finished[0].output) == 3 and s.pool.num_free == s.pool.num_usable


def test_budget_shared_and_decodes_first():
    s = make(3, [3, 3, 40], [5, 5, 2])
    b = s.schedule()
    assert list(b.num_scheduled) == [3, 3, 10]  # the third prompt gets what the budget leaves
    s.update(b, fake_model(b))
    b = s.schedule()
    assert list(b.num_scheduled) == [1, 1, 14]  # decodes first, then the prefill chunk


def test_outputs_independent_of_budget_and_pages():
    lens, new = [120, 5, 125, 100, 127, 9], [20, 9, 10, 30, 5, 8]
    ref = make(0, lens, new, max_num_batched_tokens=256, num_pages=40, max_num_seqs=8)
    run_all(ref)
    tight = make(0, lens, new, max_num_batched_tokens=8, num_pages=4, max_num_seqs=3)
    run_all(tight)
    assert tight.num_preemptions > 0
    assert {i: r.output for i, r in tight.finished.items()} == {i: r.output for i, r in ref.finished.items()}


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 300), min_size=1, max_size=10),
       new=st.lists(st.integers(1, 20), min_size=10, max_size=10),
       budget=st.integers(1, 64), pages=st.integers(5, 20), seqs=st.integers(1, 6))
def test_property_no_request_lost_or_duplicated(lens, new, budget, pages, seqs):
    s = Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget,
                                  max_model_len=400, num_pages=pages))
    accepted, rejected = add_all(s, lens, new)
    for i in rejected:
        assert (pages_needed(lens[i] + new[i] - 1) > pages - len(RESERVED_PAGES)
                or lens[i] + new[i] > 400)
    run_all(s)
    assert sorted(s.finished) == accepted
    for i in accepted:
        r = s.finished[i]
        assert r.status is Status.FINISHED and len(r.output) == new[i] and r.pages == []
    assert s.pool.num_free == s.pool.num_usable


def test_rejections_are_clear():
    s = make(0, [], [], max_model_len=300, num_pages=4)
    with pytest.raises(RequestRejectedError, match="exceeds max_model_len=300"):
        s.add_request(Request(0, tuple(range(290)), 20))
    with pytest.raises(RequestRejectedError, match="needs 3 KV pages .* only 2 usable pages"):
        s.add_request(Request(1, tuple(range(280)), 5))
    with pytest.raises(RequestRejectedError, match="empty prompt"):
        s.add_request(Request(2, (), 5))
    s.add_request(Request(3, (1, 2), 5))
    with pytest.raises(RequestRejectedError, match="duplicate"):
        s.add_request(Request(3, (1, 2), 5))


def test_eos_stops_and_preempted_request_keeps_outputs():
    s = make(0, [100, 100], [50, 50], num_pages=4, max_num_batched_tokens=32)  # 2 usable pages
    s.waiting[1].eos_token_id = -5  # never produced
    steps = 0
    while s.has_unfinished() and steps < 400:
        b = s.schedule()
        check_invariants(s, b)
        if b.preempted:
            victim = [r for r in s.waiting if r.request_id in b.preempted][0]
            assert victim.num_computed == 0 and victim.pages == [] and len(victim.output) > 0
            # on resume it recomputes prompt + outputs as one prefill
        s.update(b, fake_model(b))
        steps += 1
    assert not s.has_unfinished() and s.num_preemptions > 0
    assert all(len(r.output) == 50 for r in s.finished.values())


def _check_slots(s: Scheduler):
    held = [r.slot for r in s.running]
    assert len(held) == len(set(held)) and all(0 <= x < s.config.max_num_seqs for x in held)
    assert sorted(held + s._free_slots) == list(range(s.config.max_num_seqs))
    assert all(r.slot == -1 for r in s.waiting)


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 300), min_size=1, max_size=10),
       new=st.lists(st.integers(1, 20), min_size=10, max_size=10),
       aborts=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 9)), max_size=6),
       pages=st.integers(5, 20), seqs=st.integers(1, 6))
def test_property_abort_anywhere_frees_pages_and_slots(lens, new, aborts, pages, seqs):
    """Aborts at random steps (waiting, running, finished or unknown requests): the others
    finish with their full outputs, and every page and slot is back at the end."""
    s = Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=16,
                                  max_model_len=400, num_pages=pages))
    accepted, _ = add_all(s, lens, new)
    plan = dict(aborts)
    aborted = set()
    step = 0
    while s.has_unfinished():
        if step in plan:
            rid = plan[step]
            req = s.abort(rid)
            if req is not None and req.status is Status.ABORTED:
                aborted.add(rid)
                assert req.pages == [] and req.slot == -1
            assert rid not in s._ids
            if not s.has_unfinished():
                break
        b = s.schedule()
        check_invariants(s, b)
        _check_slots(s)
        assert list(b.sampling.slot) == [r.slot for r in b.requests]
        s.update(b, fake_model(b))
        step += 1
    done = {i for i in accepted if i not in aborted}
    assert set(s.finished) <= done
    for i in done - set(s.finished):  # finished and aborted afterwards: popped by abort
        assert i in plan.values()
    for r in s.finished.values():
        assert len(r.output) == r.max_new_tokens and r.finish_reason == "length"
    assert s.pool.num_free == s.pool.num_usable and s.num_pages_in_use == 0
    _check_slots(s)


def test_stop_tokens_finish_with_reason_and_ids_are_released():
    s = make(0, [5, 5], [50, 50])
    s.waiting[0].stop_token_ids = frozenset({7})
    s.waiting[1].eos_token_id = 8
    b = s.schedule()
    done = s.update(b, [7, 8])  # both stop at their first sample
    assert [(r.request_id, r.finish_reason, r.output) for r in done] == [(0, "stop", [7]),
                                                                        (1, "stop", [8])]
    assert s.pop_finished(0).request_id == 0
    s.add_request(Request(0, (1, 2), 3))  # a popped id may be reused
    with pytest.raises(RequestRejectedError, match="duplicate") as e:
        s.add_request(Request(1, (1, 2), 3))  # still in finished
    assert e.value.field == "request_id"
    assert s.abort(1).status is Status.FINISHED and s.abort(1) is None


def test_rejections_name_the_field():
    s = make(0, [], [], max_model_len=300, num_pages=4)
    cases = [(Request(0, tuple(range(300)), 1), "prompt", "leaves no room"),
             (Request(1, tuple(range(200)), 101), "max_new_tokens", "exceeds max_model_len"),
             (Request(2, tuple(range(280)), 5), "prompt", "needs 3 KV pages"),
             (Request(3, tuple(range(200)), 60), "max_new_tokens", "needs 3 KV pages"),
             (Request(4, (1,), 5, sampling=SamplingParams(top_p=0.0)), "top_p", r"\(0, 1\]"),
             (Request(5, (1,), 5, sampling=SamplingParams(temperature=3.0)), "temperature",
              r"\[0, 2\]")]
    for req, field, msg in cases:
        with pytest.raises(RequestRejectedError, match=msg) as e:
            s.add_request(req)
        assert e.value.field == field

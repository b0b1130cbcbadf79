"""The on-device sampler: parameter bounds, filters and penalties against numpy references,
seeded draws, the per-slot penalty state under chunking and slot reuse, the output layout."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import numpy.testing as npt
import pytest

from jax_msa_runner.batch.staging import stage_batch
from jax_msa_runner.config import RunnerConfig
from jax_msa_runner.serving.sampling import (NUM_TOP_LOGPROBS, PenaltyState, SamplingParamError,
                                             SamplingRows, apply_penalties, check_sampling,
                                             filter_logits, init_penalty_state, sample_rows,
                                             sample_step, step_output_width, track_tokens,
                                             unpack_step_output)


def rows_of(n, **cols):
    rows = SamplingRows.neutral(n)
    return rows._replace(**{k: np.asarray(v, getattr(rows, k).dtype) for k, v in cols.items()})


def as_jnp(rows):
    return SamplingRows(*(jnp.asarray(c) for c in rows))


_sample = jax.jit(sample_rows)
_filter = jax.jit(filter_logits)
_penalties = jax.jit(apply_penalties)


def test_check_sampling_names_field_and_bound():
    ok = dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0,
              frequency_penalty=0.0, repetition_penalty=1.0, seed=0)
    check_sampling(**ok, vocab_size=50)
    bad = [("temperature", -0.1, r"\[0, 2\]"), ("temperature", float("nan"), "finite"),
           ("top_k", -1, "0 \\(off\\)"), ("top_k", 51, "vocab_size=50"), ("top_k", 2.5, "integer"),
           ("top_p", 0.0, r"\(0, 1\]"), ("top_p", 1.01, r"\(0, 1\]"), ("min_p", 1.5, r"\[0, 1\]"),
           ("presence_penalty", 2.5, r"\[-2, 2\]"), ("frequency_penalty", -3, r"\[-2, 2\]"),
           ("repetition_penalty", 0.0, r"\(0, 2\]"), ("seed", 2**31, "2147483647"),
           ("seed", True, "integer"), ("top_p", "0.5", "number")]
    for field, value, bound in bad:
        with pytest.raises(SamplingParamError, match=f"^{field}: .*{bound}") as e:
            check_sampling(**{**ok, field: value}, vocab_size=50)
        assert e.value.field == field


def test_neutral_rows_greedy_and_seeded_draws():
    logits = jax.random.normal(jax.random.key(0), (4, 50))
    rows = rows_of(4, temperature=[0.0, 1.0, 1.0, 1.0], seed=[0, 7, 7, 8], sample_index=[0, 3, 3, 3])
    a = np.asarray(_sample(logits, as_jnp(rows)))
    assert a[0] == int(jnp.argmax(logits[0]))
    # same (seed, index, logits) -> same token, whatever the row or the batch
    one = rows_of(1, temperature=[1.0], seed=[7], sample_index=[3])
    assert a[1] == int(_sample(logits[1:2], as_jnp(one))[0])
    # a seeded draw follows the softmax: empirical frequencies over many indices
    draws = jax.jit(jax.vmap(lambda i: sample_rows(
        logits[1:2], as_jnp(one)._replace(sample_index=i[None]))[0]))(jnp.arange(4000, dtype=jnp.int32))
    freq = np.bincount(np.asarray(draws), minlength=50) / 4000
    npt.assert_allclose(freq, np.asarray(jax.nn.softmax(logits[1])), atol=0.03)


def _filter_reference(scaled, top_k, top_p, min_p):
    """numpy: the kept set of each row (top-k, then the smallest top-p prefix, then min-p)."""
    out = np.full_like(scaled, -np.inf)
    for r, row in enumerate(scaled):
        order = np.argsort(-row, kind="stable")
        k = top_k[r] if top_k[r] > 0 else row.size
        cand = order[:k]
        p = np.exp(row[cand] - row[cand].max())
        p /= p.sum()
        if top_p[r] < 1.0:
            n = int(np.searchsorted(np.cumsum(p), top_p[r]) + 1)  # first prefix reaching top_p
            cand = cand[:n]
        full = np.exp(row - row.max())
        full /= full.sum()
        cand = [c for c in cand if full[c] >= min_p[r] * full.max()]
        out[r, cand] = row[cand]
    return out


def test_filters_match_numpy_reference():
    rng = np.random.default_rng(3)
    R, V = 7, 37
    scaled = rng.normal(size=(R, V)).astype(np.float32) * 2
    top_k = np.array([0, 1, 5, 0, 36, 37, 3], np.int32)
    top_p = np.array([1.0, 1.0, 0.9, 0.3, 0.5, 1.0, 0.05], np.float32)
    min_p = np.array([0.0, 0.0, 0.0, 0.2, 0.0, 0.05, 0.0], np.float32)
    got = np.asarray(_filter(jnp.asarray(scaled), as_jnp(rows_of(R, top_k=top_k, top_p=top_p,
                                                                  min_p=min_p))))
    want = _filter_reference(scaled, top_k, top_p, min_p)
    npt.assert_array_equal(np.isfinite(got), np.isfinite(want))
    npt.assert_array_equal(got[np.isfinite(got)], want[np.isfinite(want)])
    assert np.isfinite(got).sum(1)[1] == 1 and np.isfinite(got).sum(1)[0] == V


def test_filtered_draws_follow_renormalised_distribution():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(1, 29)).astype(np.float32)
    rows = rows_of(1, temperature=[0.8], top_k=[6], top_p=[0.85], min_p=[0.05], seed=[99])
    draws = jax.jit(jax.vmap(lambda i: sample_rows(
        jnp.asarray(logits), as_jnp(rows)._replace(sample_index=i[None]))[0]))(
        jnp.arange(4000, dtype=jnp.int32))
    kept = _filter_reference(logits / 0.8, [6], [0.85], [0.05])[0]
    p = np.where(np.isfinite(kept), np.exp(kept - kept[np.isfinite(kept)].max()), 0.0)
    p /= p.sum()
    freq = np.bincount(np.asarray(draws), minlength=29) / 4000
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(p))
    npt.assert_allclose(freq, p, atol=0.03)


def test_penalties_match_reference_and_neutral_is_identity():
    rng = np.random.default_rng(7)
    R, V = 5, 41
    logits = rng.normal(size=(R, V)).astype(np.float32)
    counts = rng.integers(0, 4, (R, V)) * (rng.random((R, V)) < 0.3)
    prompt_seen = rng.random((R, V)) < 0.2
    rep = np.array([1.0, 1.5, 0.7, 2.0, 1.0], np.float32)
    pres = np.array([0.0, 0.5, -1.0, 2.0, 0.0], np.float32)
    freq = np.array([0.0, 0.3, 1.0, -2.0, 0.0], np.float32)
    rows = rows_of(R, repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)
    seen = prompt_seen | (counts > 0)
    got = np.asarray(_penalties(jnp.asarray(logits), jnp.asarray(counts, jnp.int32),
                                jnp.asarray(seen), as_jnp(rows)))
    want = logits.copy()
    for r in range(R):
        s = seen[r]
        want[r, s] = np.where(want[r, s] > 0, want[r, s] / rep[r], want[r, s] * rep[r])
        want[r] -= freq[r] * counts[r] + pres[r] * (counts[r] > 0)
    npt.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    npt.assert_array_equal(got[0], logits[0])  # neutral row: bit for bit
    npt.assert_array_equal(got[4], logits[4])


_track = jax.jit(track_tokens)


def test_penalty_state_counts_survive_chunking_and_reset_on_reuse():
    rc = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256,
                      bucket_sizes=(16,))
    V, S = 23, rc.max_num_seqs
    rng = np.random.default_rng(11)
    seq_a = rng.integers(0, V, 30)  # prompt 12 + 18 "outputs"
    seq_b = rng.integers(0, V, 9)  # prompt 9, no outputs yet
    plen = {"a": 12, "b": 9}
    state = init_penalty_state(S, V)
    # stale garbage in slot 2 (a previous request): reset when b starts at position 0
    state = PenaltyState(state.output_counts.at[2].set(5), state.prompt_seen.at[2].set(True))
    chunks = [(0, 7), (7, 16), (16, 25), (25, 30)]  # request a fed in uneven chunks
    for step, (lo, hi) in enumerate(chunks):
        if step == 0:  # b is prefilled whole alongside a's first chunk
            sched, comp, table = [hi - lo, 9], [lo, 0], [[2], [3]]
            toks = np.concatenate([seq_a[lo:hi], seq_b])
            rows = rows_of(2, slot=[0, 2], prompt_len=[plen["a"], plen["b"]])
        else:
            sched, comp, table = [hi - lo], [lo], [[2]]
            toks = seq_a[lo:hi]
            rows = rows_of(1, slot=[0], prompt_len=[plen["a"]])
        md = stage_batch(np.array(sched), np.array(comp), table, rc)
        T, R = md.num_tokens_padded, md.num_reqs_padded
        tok = np.zeros(T, np.int32)
        tok[:len(toks)] = toks
        padded = SamplingRows(*(np.concatenate([c, getattr(SamplingRows.neutral(R - len(c)), f)])
                                for f, c in zip(SamplingRows._fields, rows)))
        state, counts, seen = _track(state, as_jnp(padded), md, jnp.asarray(tok))
        # what the step sees for a: every token fed so far (up to hi)
        want_counts = np.bincount(seq_a[plen["a"]:hi], minlength=V) if hi > plen["a"] else np.zeros(V)
        want_seen = np.isin(np.arange(V), seq_a[:min(hi, plen["a"])]) | (want_counts > 0)
        npt.assert_array_equal(np.asarray(counts[0]), want_counts)
        npt.assert_array_equal(np.asarray(seen[0]), want_seen)
    npt.assert_array_equal(np.asarray(state.output_counts[2]), np.zeros(V))
    npt.assert_array_equal(np.asarray(state.prompt_seen[2]), np.isin(np.arange(V), seq_b))
    npt.assert_array_equal(np.asarray(state.output_counts[1]), np.zeros(V))  # untouched slot
    chex.assert_shape(state.output_counts, (S + 1, V))


def test_sample_step_output_layout_and_logprobs():
    rc = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256,
                      bucket_sizes=(16,))
    V = 57
    md = stage_batch(np.array([3, 1]), np.array([0, 5]), [[2], [3]], rc)
    R = md.num_reqs_padded
    logits = jax.random.normal(jax.random.key(2), (R, V)) * 3
    rows = rows_of(R, slot=[0, 1, -1, -1], prompt_len=[3, 4, 0, 0], temperature=[0.0, 0.9, 0, 0],
                   seed=[0, 4, 0, 0])
    out, _ = jax.jit(sample_step)(logits, as_jnp(rows), md, jnp.zeros(16, jnp.int32),
                                  init_penalty_state(4, V))
    assert out.shape == (R, step_output_width(V)) and out.dtype == jnp.int32
    res = unpack_step_output(np.asarray(out), R)
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    assert res.tokens[0] == np.argmax(lp[0]) and list(res.tokens[2:]) == [-1, -1]
    npt.assert_allclose(res.logprobs[:2], lp[[0, 1], res.tokens[:2]], rtol=1e-6)
    K = NUM_TOP_LOGPROBS
    for r in range(2):
        npt.assert_array_equal(res.top_ids[r], np.argsort(-lp[r], kind="stable")[:K])
        npt.assert_allclose(res.top_logprobs[r], np.sort(lp[r])[::-1][:K], rtol=1e-6)


def test_logit_bias_and_token_mask():
    """Biases add to the named tokens only; masked tokens are never picked (greedy or
    sampled); the neutral extras leave the logits unchanged bit for bit; bounds named."""
    from jax_msa_runner.serving.sampling import (MAX_LOGIT_BIAS, SamplingExtras,
                                                 apply_bias_and_mask, bias_arrays,
                                                 mask_words, neutral_extras)
    R, V = 3, 70  # 70: not a multiple of 32
    logits = jax.random.normal(jax.random.key(fresh := np.random.randint(1 << 30)), (R, V))
    neutral = SamplingExtras(*map(jnp.asarray, neutral_extras(R, V)))
    chex.assert_trees_all_equal(jax.jit(apply_bias_and_mask)(logits, neutral), logits)
    ids, vals = bias_arrays([((5, 100.0), (69, -3.5)), (), ((0, -100.0),)], R)
    chex.assert_shape((ids, vals), ((R, MAX_LOGIT_BIAS),) * 2)
    biased = apply_bias_and_mask(logits, neutral._replace(bias_ids=jnp.asarray(ids),
                                                          bias_values=jnp.asarray(vals)))
    want = np.asarray(logits).copy()
    want[0, 5] += 100.0
    want[0, 69] -= 3.5
    want[2, 0] -= 100.0
    chex.assert_trees_all_close(biased, want, atol=1e-6)
    mask = np.zeros((R, mask_words(V)), np.int32)  # row 0: only 3 and 66; rows 1-2: all
    mask[0, 0] = 1 << 3
    mask[0, 2] = 1 << 2
    mask[1:] = -1
    masked = apply_bias_and_mask(logits, neutral._replace(token_mask=jnp.asarray(mask)))
    allowed = np.isfinite(np.asarray(masked[0]))
    npt.assert_array_equal(np.flatnonzero(allowed), [3, 66], err_msg=f"seed {fresh}")
    chex.assert_trees_all_equal(masked[1:], logits[1:])
    rows = as_jnp(rows_of(R, temperature=[1.0, 0.0, 0.0], seed=[1, 2, 3]))
    for i in range(5):
        pick = _sample(masked, rows._replace(sample_index=jnp.full((R,), i, jnp.int32)))
        assert int(pick[0]) in (3, 66)
    ok = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0,
              frequency_penalty=0.0, repetition_penalty=1.0, seed=0)
    for bias, match in ((((V, 1.0),), "outside the vocabulary"), (((1, 101.0),), r"\[-100, 100\]"),
                        (tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS + 1)), "at most")):
        with pytest.raises(SamplingParamError, match=match) as e:
            check_sampling(**ok, logit_bias=bias, vocab_size=V)
        assert e.value.field == "logit_bias"

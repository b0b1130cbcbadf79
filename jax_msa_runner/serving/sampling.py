"""Per-row sampling inside the compiled step: parameters, penalty state, sampler, logprobs.

Every sampling parameter is a per-row value of the step's int32 host buffer (floats
bitcast), so no value ever selects a different executable. Rows of one step
(``SamplingRows``, R rows, field-major in the buffer, padded rows neutral):

    int32: seed, sample_index, top_k (0 = off), slot (penalty-state row, -1 = none),
           prompt_len, prompt_logprobs (1: the row wants its prompt tokens' logprobs),
           next_token (the prompt token after the row's last scheduled one, -1 = none)
    f32:   temperature (0 = greedy), top_p (1 = off), min_p (0 = off), presence_penalty,
           frequency_penalty, repetition_penalty (1 = off)

Penalty state (``PenaltyState``, device-resident, donated through the step): per slot
``output_counts`` int32 [S + 1, V] (how often each token occurs among the request's
generated tokens) and ``prompt_seen`` bool [S + 1, V] (the token occurs in its prompt).
S = max_num_seqs; row S is scratch for padded and dummy rows. A slot is reset when its
row is scheduled from position 0 (a new request, or one resumed after preemption by
recompute), then every token the step feeds the model is counted at its position:
positions < prompt_len into ``prompt_seen``, later ones into ``output_counts``. When a row
samples output k, the tokens fed so far are exactly its prompt and outputs 0..k-1, so the
counts never depend on chunking, batching or preemption.

Order on the [R, V] f32 logits: repetition penalty on every token seen in prompt or
output (positive logits divided, negative multiplied), frequency and presence penalties
on generated tokens (``l - f * count - p * (count > 0)``); greedy rows take the argmax;
sampled rows divide by the temperature, then top-k, top-p (over the top-k set) and min-p
(relative to the most likely token) mask tokens to -inf, skipped through ``lax.cond``
when no row sets one (ties at a threshold are kept); the draw is
``categorical(fold_in(key(seed), sample_index))``, independent of the batch.
Then, before greedy or sampled picking, each row's ``logit_bias`` (up to
``MAX_LOGIT_BIAS`` (token id, bias) pairs, ``SamplingExtras.bias_ids`` / ``bias_values``
[R, B], id -1 = unused) is added, and the row's token mask (``SamplingExtras.token_mask``
int32 [R, ceil(V / 32)], bit ``v % 32`` of word ``v // 32`` set = token ``v`` allowed:
llguidance's bitmask layout; all ones = unconstrained) sets disallowed tokens to -inf.
These extras are separate step inputs: a step without biases or masks passes device-resident
neutral ones and copies nothing.
Logprobs are the model's: ``log_softmax`` of the raw logits (before penalties, biases, masks
and temperature), for the chosen token and the top ``NUM_TOP_LOGPROBS``.

Step output (one int32 array, one device-to-host copy): ``[R, 2 + 2K]`` with columns
``token | bits(logprob) | top ids (K) | bits(top logprobs) (K)``; token -1 on padded rows.
"""
from __future__ import annotations

import dataclasses

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_msa_runner.batch.metadata import BatchMetadata

NUM_TOP_LOGPROBS = 20  # K: top logprobs every step returns per row
MAX_LOGIT_BIAS = 300  # B: (token id, bias) pairs per request (the OpenAI API's limit)
LOGIT_BIAS_BOUND = 100.0  # |bias| <= this
INT_FIELDS = ("seed", "sample_index", "top_k", "slot", "prompt_len", "prompt_logprobs",
              "next_token")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty")
PAD_VALUES = {"slot": -1, "next_token": -1, "top_p": 1.0,
              "repetition_penalty": 1.0}  # other fields pad with 0
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


class SamplingParamError(ValueError):
    """An out-of-range sampling parameter; ``field`` names it, the message gives the bound."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _finite(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise SamplingParamError(name, f"must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise SamplingParamError(name, f"must be finite, got {value}")
    return value


def _integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise SamplingParamError(name, f"must be an integer, got {value!r}")
    return int(value)


def check_sampling(*, temperature, top_k, top_p, min_p, presence_penalty, frequency_penalty,
                   repetition_penalty, seed, logit_bias=(), vocab_size: int | None = None
                   ) -> None:
    """Raises SamplingParamError naming the first parameter outside its bound.

    temperature [0, 2]; top_k 0 (off) or [1, vocab_size]; top_p (0, 1]; min_p [0, 1];
    presence/frequency penalty [-2, 2]; repetition_penalty (0, 2]; seed an int32;
    logit_bias at most MAX_LOGIT_BIAS (token id in [0, vocab_size), bias in [-100, 100]) pairs.
    """
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise SamplingParamError("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got "
                                               f"{len(logit_bias)}")
    for tok, bias in logit_bias:
        tok = _integer("logit_bias", tok)
        if tok < 0 or (vocab_size is not None and tok >= vocab_size):
            raise SamplingParamError("logit_bias", f"token id {tok} is outside the vocabulary "
                                                   f"[0, {vocab_size})")
        b = _finite("logit_bias", bias)
        if not -LOGIT_BIAS_BOUND <= b <= LOGIT_BIAS_BOUND:
            raise SamplingParamError("logit_bias", f"bias of token {tok} must be in "
                                                   f"[-100, 100], got {b}")
    t = _finite("temperature", temperature)
    if not 0.0 <= t <= 2.0:
        raise SamplingParamError("temperature", f"must be in [0, 2], got {t}")
    k = _integer("top_k", top_k)
    hi = "" if vocab_size is None else f", vocab_size={vocab_size}"
    if k < 0 or (vocab_size is not None and k > vocab_size):
        raise SamplingParamError("top_k", f"must be 0 (off) or in [1, vocab_size{hi}], got {k}")
    p = _finite("top_p", top_p)
    if not 0.0 < p <= 1.0:
        raise SamplingParamError("top_p", f"must be in (0, 1], got {p}")
    m = _finite("min_p", min_p)
    if not 0.0 <= m <= 1.0:
        raise SamplingParamError("min_p", f"must be in [0, 1], got {m}")
    for name, v in (("presence_penalty", presence_penalty),
                    ("frequency_penalty", frequency_penalty)):
        v = _finite(name, v)
        if not -2.0 <= v <= 2.0:
            raise SamplingParamError(name, f"must be in [-2, 2], got {v}")
    r = _finite("repetition_penalty", repetition_penalty)
    if not 0.0 < r <= 2.0:
        raise SamplingParamError("repetition_penalty", f"must be in (0, 2], got {r}")
    s = _integer("seed", seed)
    if not INT32_MIN <= s <= INT32_MAX:
        raise SamplingParamError("seed", f"must be in [{INT32_MIN}, {INT32_MAX}], got {s}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens, in the OpenAI API's names: temperature (0: greedy),
    top_k (0: off), top_p, min_p, and the presence, frequency and repetition penalties
    (neutral: 0, 0 and 1), and ``logit_bias`` ((token id, bias) pairs added to the logits).
    The one definition of these knobs: the scheduler's ``Request`` and the engine's
    ``GenerationParams`` both hold one."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def check(self, *, seed, vocab_size: int | None = None) -> None:
        """:func:`check_sampling` of these knobs and ``seed``."""
        check_sampling(**dataclasses.asdict(self), seed=seed, vocab_size=vocab_size)


# ---- per-row parameters (host packing, device unpacking) --------------------------------------

class SamplingRows(NamedTuple):
    """Per-row sampling inputs of one step: numpy [n] on the host, jnp [R] in the step."""

    seed: np.ndarray
    sample_index: np.ndarray
    top_k: np.ndarray
    slot: np.ndarray
    prompt_len: np.ndarray
    prompt_logprobs: np.ndarray
    next_token: np.ndarray
    temperature: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    repetition_penalty: np.ndarray

    @classmethod
    def neutral(cls, n: int) -> "SamplingRows":
        """n greedy rows without penalties or a slot (padding values)."""
        return cls(**{f: np.full((n,), PAD_VALUES.get(f, 0),
                                 np.int32 if f in INT_FIELDS else np.float32)
                      for f in cls._fields})


def rows_buffer_size(num_reqs: int) -> int:
    """int32 entries of R rows' parameters in the host buffer."""
    return (len(INT_FIELDS) + len(FLOAT_FIELDS)) * num_reqs


def pack_rows(rows: SamplingRows, num_reqs: int) -> np.ndarray:
    """Field-major int32 [rows_buffer_size(R)]: ints, then f32 bits; rows n..R-1 padded."""
    parts = []
    for f in INT_FIELDS + FLOAT_FIELDS:
        is_int = f in INT_FIELDS
        vals = np.asarray(getattr(rows, f), np.int64 if is_int else np.float32)
        if vals.ndim != 1 or vals.size > num_reqs:
            raise ValueError(f"rows.{f}: expected at most {num_reqs} values, got shape {vals.shape}")
        col = np.full((num_reqs,), PAD_VALUES.get(f, 0), np.int32 if is_int else np.float32)
        col[:vals.size] = vals
        parts.append(col if is_int else col.view(np.int32))
    return np.concatenate(parts)


def unpack_rows(buf: jax.Array, num_reqs: int) -> SamplingRows:
    """Inverse of ``pack_rows`` inside the step: buf int32 [rows_buffer_size(R)]."""
    R = num_reqs
    cols = {}
    for i, f in enumerate(INT_FIELDS + FLOAT_FIELDS):
        col = buf[i * R:(i + 1) * R]
        cols[f] = col if f in INT_FIELDS else jax.lax.bitcast_convert_type(col, jnp.float32)
    return SamplingRows(**cols)


class SamplingExtras(NamedTuple):
    """The step's sparse per-row inputs: bias_ids int32 [R, B] (-1 = unused),
    bias_values f32 [R, B], token_mask int32 [R, ceil(V / 32)] (all ones = unconstrained)."""

    bias_ids: jax.Array | np.ndarray
    bias_values: jax.Array | np.ndarray
    token_mask: jax.Array | np.ndarray


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's token bitmask."""
    return -(-vocab_size // 32)


def neutral_extras(num_reqs: int, vocab_size: int) -> SamplingExtras:
    """Host extras of R rows without biases or masks."""
    return SamplingExtras(np.full((num_reqs, MAX_LOGIT_BIAS), -1, np.int32),
                          np.zeros((num_reqs, MAX_LOGIT_BIAS), np.float32),
                          np.full((num_reqs, mask_words(vocab_size)), -1, np.int32))


def bias_arrays(biases, num_reqs: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [R, B], values f32 [R, B]) of the rows' ``logit_bias`` pair tuples."""
    ids = np.full((num_reqs, MAX_LOGIT_BIAS), -1, np.int32)
    vals = np.zeros((num_reqs, MAX_LOGIT_BIAS), np.float32)
    for r, pairs in enumerate(biases):
        for j, (tok, b) in enumerate(pairs):
            ids[r, j], vals[r, j] = tok, b
    return ids, vals


def apply_bias_and_mask(logits: jax.Array, extras: SamplingExtras) -> jax.Array:
    """Biases added, then masked tokens at -inf; logits f32 [R, V]."""
    R, V = logits.shape
    rows = jnp.arange(R, dtype=jnp.int32)[:, None]
    ids = jnp.where(extras.bias_ids >= 0, extras.bias_ids, V)  # unused: out of bounds, dropped
    logits = logits.at[rows, ids].add(extras.bias_values, mode="drop")
    W = extras.token_mask.shape[1]
    padded = jnp.pad(logits, ((0, 0), (0, W * 32 - V))).reshape(R, W, 32)
    bit = jnp.arange(32, dtype=jnp.int32)
    allowed = (jnp.right_shift(extras.token_mask[:, :, None].view(jnp.uint32),
                               bit[None, None, :].astype(jnp.uint32)) & 1) == 1
    return jnp.where(allowed, padded, -jnp.inf).reshape(R, W * 32)[:, :V]


# ---- penalty state ------------------------------------------------------------------------------

class PenaltyState(NamedTuple):
    """Device arrays: output_counts int32 [S + 1, V], prompt_seen bool [S + 1, V]."""

    output_counts: jax.Array
    prompt_seen: jax.Array


def init_penalty_state(num_slots: int, vocab_size: int) -> PenaltyState:
    """Zero state for ``num_slots`` request slots plus the scratch row."""
    return PenaltyState(jnp.zeros((num_slots + 1, vocab_size), jnp.int32),
                        jnp.zeros((num_slots + 1, vocab_size), jnp.bool_))


def track_tokens(state: PenaltyState, rows: SamplingRows, md: BatchMetadata,
                 tokens: jax.Array) -> tuple[PenaltyState, jax.Array, jax.Array]:
    """Counts this step's tokens [T] into each row's slot (reset at position 0).

    Returns (new state, counts int32 [R, V], seen bool [R, V]) where ``seen`` marks tokens in
    the prompt or among the generated ones.
    """
    scratch = state.output_counts.shape[0] - 1
    slot = jnp.where(md.req_mask & (rows.slot >= 0), rows.slot, scratch)
    reset = (md.req_mask & (md.num_computed_tokens == 0))[:, None]
    counts = jnp.where(reset, 0, state.output_counts[slot])
    prompt = jnp.where(reset, False, state.prompt_seen[slot])
    r = md.req_indices
    is_output = md.token_mask & (md.positions >= rows.prompt_len[r])
    counts = counts.at[r, tokens].add(is_output.astype(jnp.int32))
    prompt = prompt.at[r, tokens].max(md.token_mask & ~is_output)
    new = PenaltyState(state.output_counts.at[slot].set(counts),
                       state.prompt_seen.at[slot].set(prompt))
    return new, counts, prompt | (counts > 0)


def apply_penalties(logits: jax.Array, counts: jax.Array, seen: jax.Array,
                    rows: SamplingRows) -> jax.Array:
    """Repetition, then frequency and presence penalties. logits f32 [R, V]; neutral
    parameters (1, 0, 0) return the logits unchanged bit for bit."""
    rep = rows.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return (logits - rows.frequency_penalty[:, None] * counts
            - rows.presence_penalty[:, None] * (counts > 0))


def filter_logits(scaled: jax.Array, rows: SamplingRows) -> jax.Array:
    """Top-k, top-p and min-p masks (-inf) on temperature-scaled logits f32 [R, V]."""
    V = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(rows.top_k > 0, jnp.minimum(rows.top_k, V), V)
    in_k = jnp.arange(V)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    top_p = rows.top_p[:, None]
    keep = in_k & ((before < top_p) | (top_p >= 1.0))
    threshold = jnp.take_along_axis(desc, (keep.sum(-1) - 1)[:, None], axis=-1)
    p = jax.nn.softmax(scaled, axis=-1)
    below_min = p < rows.min_p[:, None] * p.max(-1, keepdims=True)
    return jnp.where((scaled < threshold) | below_min, -jnp.inf, scaled)


def sample_rows(logits: jax.Array, rows: SamplingRows) -> jax.Array:
    """Penalised logits f32 [R, V] -> int32 [R]: argmax where temperature == 0, else a
    categorical draw with key fold_in(key(seed), sample_index) after the filters."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    t = rows.temperature
    scaled = logits / jnp.where(t > 0, t, 1.0)[:, None]
    needs = (t > 0) & ((rows.top_k > 0) | (rows.top_p < 1.0) | (rows.min_p > 0.0))
    scaled = jax.lax.cond(jnp.any(needs), filter_logits, lambda s, _: s, scaled, rows)

    def draw(lg, s, i):
        key = jax.random.fold_in(jax.random.key(s.astype(jnp.uint32)), i)
        return jax.random.categorical(key, lg).astype(jnp.int32)

    drawn = jax.vmap(draw)(scaled, rows.seed, rows.sample_index)
    return jnp.where(t > 0, drawn, greedy)


def step_output_width(vocab_size: int) -> int:
    """Columns of the step output: 2 + 2K, K = min(NUM_TOP_LOGPROBS, vocab_size)."""
    return 2 + 2 * min(NUM_TOP_LOGPROBS, vocab_size)


def sample_step(logits: jax.Array, rows: SamplingRows, md: BatchMetadata, tokens: jax.Array,
                state: PenaltyState, extras: SamplingExtras | None = None
                ) -> tuple[jax.Array, PenaltyState]:
    """The sampling stage of one step.

    logits f32 [R, V] (each row's last token), rows: jnp [R], tokens int32 [T] (the step's
    inputs), extras: the rows' biases and token masks (None: none). Returns (int32 [R,
    step_output_width(V)], the updated penalty state).
    """
    K = min(NUM_TOP_LOGPROBS, logits.shape[-1])
    state, counts, seen = track_tokens(state, rows, md, tokens)
    if extras is None:
        extras = SamplingExtras(*map(jnp.asarray, neutral_extras(*logits.shape)))
    picked = apply_bias_and_mask(apply_penalties(logits, counts, seen, rows), extras)
    chosen = sample_rows(picked, rows)
    chosen = jnp.where(md.req_mask, chosen, -1)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = jax.lax.top_k(logprobs, K)
    chosen_lp = jnp.take_along_axis(logprobs, jnp.maximum(chosen, 0)[:, None], axis=-1)
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)  # noqa: E731
    out = jnp.concatenate([chosen[:, None], bits(chosen_lp), top_ids.astype(jnp.int32),
                           bits(top_lp)], axis=1)
    return out, state


PROMPT_CHUNK = 64  # tokens per LM-head chunk of the prompt logprobs (bounds the [C, V] logits)


def next_prompt_tokens(tokens: jax.Array, md: BatchMetadata, rows: SamplingRows) -> jax.Array:
    """int32 [T]: the prompt token that follows each of the step's tokens (-1 where none):
    the next token of the same row, or the row's ``next_token`` after its last one."""
    T = tokens.shape[0]
    r = md.req_indices
    t = jnp.arange(T, dtype=jnp.int32)
    ahead = jnp.concatenate([tokens[1:], jnp.full((1,), -1, jnp.int32)])
    same = jnp.concatenate([(r[1:] == r[:-1]) & md.token_mask[1:], jnp.zeros((1,), bool)])
    last = t == md.query_start_loc[1:][r] - 1
    nxt = jnp.where(same, ahead, jnp.where(last, rows.next_token[r], -1))
    in_prompt = md.positions + 1 < rows.prompt_len[r]
    return jnp.where(md.token_mask & in_prompt, nxt, -1)


def prompt_logprobs(lm_head, hidden: jax.Array, next_ids: jax.Array, K: int) -> jax.Array:
    """The logprob of each token's next prompt token and the top K: int32 [T, 2 + 2K] in the
    step output's layout (``next id | bits(logprob) | top ids | bits(top logprobs)``).
    ``lm_head(hidden [C, H]) -> f32 [C, V]`` runs on chunks of :data:`PROMPT_CHUNK` tokens."""
    T = hidden.shape[0]
    C = min(PROMPT_CHUNK, T)
    pad = -T % C
    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, C, hidden.shape[1])
    ids = jnp.pad(next_ids, (0, pad), constant_values=-1).reshape(-1, C)
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)  # noqa: E731

    def chunk(args):
        hc, ic = args
        lp = jax.nn.log_softmax(lm_head(hc), axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, K)
        chosen = jnp.take_along_axis(lp, jnp.maximum(ic, 0)[:, None], axis=-1)
        return jnp.concatenate([ic[:, None], bits(chosen), top_ids.astype(jnp.int32),
                                bits(top_lp)], axis=1)

    return jax.lax.map(chunk, (h, ids)).reshape(-1, 2 + 2 * K)[:T]


class StepOutput(NamedTuple):
    """One step's results on the host for its n rows.

    tokens int32 [n]; logprobs f32 [n] (of the chosen token); top_ids int32 [n, K];
    top_logprobs f32 [n, K] (descending); prompt: None, or where a row asked for its prompt
    logprobs the step's tokens' next-prompt-token entries (``unpack_step_output`` of the
    [S, 2 + 2K] prompt output: ``tokens`` holds the next prompt token, -1 where none).
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    prompt: "StepOutput | None" = None


def unpack_step_output(out: np.ndarray, num_rows: int) -> StepOutput:
    """The step's int32 [R, 2 + 2K] output -> StepOutput of its first ``num_rows`` rows."""
    out = np.asarray(out, np.int32)[:num_rows]
    K = (out.shape[1] - 2) // 2
    return StepOutput(tokens=np.ascontiguousarray(out[:, 0]),
                      logprobs=np.ascontiguousarray(out[:, 1]).view(np.float32),
                      top_ids=np.ascontiguousarray(out[:, 2:2 + K]),
                      top_logprobs=np.ascontiguousarray(out[:, 2 + K:]).view(np.float32))

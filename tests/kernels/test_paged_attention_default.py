"""The dense paged-attention contract: the jnp reference against an independent numpy
softmax, the prefill tiling, the default's kernel rule, and the default on either kernel
(interpreted on a CPU backend, compiled on a GPU) against the reference on mixed batches."""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _dense_batch import as_inputs, build_dense_batch
from _helpers import INTERPRET, fresh_seed
from pallas_kernels import PAGE_SIZE
from pallas_kernels.paged_attention import (max_tiles, paged_attention_reference,
                                            prefill_tiles, validate_inputs)
from pallas_kernels.paged_attention_default import (DECODE_MAX_RUN, DECODE_MAX_TOKENS,
                                                    attention_backend, kernels_support,
                                                    longest_run, paged_attention_default)


def numpy_attention(q, kv, bt, req, lens, scale):
    """Float64 softmax over each token's gathered context (no paging tricks)."""
    t, hq, d = q.shape
    g = hq // kv.shape[1]
    out = np.zeros((t, hq, d))
    lse = np.full((t, hq), -np.inf)
    for i in range(t):
        n = int(lens[i])
        if n == 0:
            continue
        pages = bt[req[i], :-(-n // PAGE_SIZE)]
        ctx = kv[pages].astype(np.float64)  # [n_pages, Hkv, 128, 2D]
        ctx = ctx.transpose(1, 0, 2, 3).reshape(kv.shape[1], -1, 2 * d)[:, :n]
        for h in range(hq):
            k, v = ctx[h // g, :, :d], ctx[h // g, :, d:]
            s = k @ q[i, h].astype(np.float64) * scale
            top = s.max()
            w = np.exp(s - top)
            out[i, h] = w @ v / w.sum()
            lse[i, h] = top + np.log(w.sum())
    return out, lse


def test_reference_matches_numpy_and_ignores_nan_pages():
    batch = build_dense_batch(fresh_seed(), hq=4, hkv=2, d=16, runs=(1, 5, 2), max_len=400)
    q, kv, bt, req, lens = batch
    out, lse = paged_attention_reference(*as_inputs(batch, jnp.float32), scale=0.25)
    want_out, want_lse = numpy_attention(q, kv, bt, req, lens, 0.25)
    chex.assert_trees_all_close(np.asarray(out, np.float64), want_out, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(np.asarray(lse, np.float64), want_lse, atol=1e-5, rtol=1e-5)


def test_prefill_tiles_cover_every_token_once():
    rng = np.random.default_rng(fresh_seed())
    runs = rng.integers(1, 40, 7)
    req = np.repeat(np.arange(7), runs).astype(np.int32)
    lens = rng.integers(0, 500, req.size).astype(np.int32)
    bq = 16
    nt = max_tiles(req.size, bq, 7)
    tiles = prefill_tiles(jnp.asarray(req), jnp.asarray(lens), block_q=bq, num_tiles=nt)
    chex.assert_shape((tiles.token, tiles.req, tiles.kv_lens), ((nt, bq), (nt,), (nt, bq)))
    tok = np.asarray(tiles.token)
    np.testing.assert_array_equal(np.sort(tok[tok >= 0]), np.arange(req.size))
    for n in range(nt):
        row = tok[n][tok[n] >= 0]
        if row.size:
            assert (np.diff(row) == 1).all() and (req[row] == int(tiles.req[n])).all()
            np.testing.assert_array_equal(np.asarray(tiles.kv_lens[n, :row.size]), lens[row])
        assert (np.asarray(tiles.kv_lens[n, row.size:]) == 0).all()


def test_backend_rule():
    assert attention_backend(1, interpreting=True, explicit_interpret=False) == "reference"
    assert attention_backend(1, interpreting=True, explicit_interpret=True) == "auto"
    assert attention_backend(DECODE_MAX_TOKENS, interpreting=False,
                             explicit_interpret=False) == "auto"
    assert attention_backend(DECODE_MAX_TOKENS + 1, interpreting=False,
                             explicit_interpret=False) == "prefill"
    req = jnp.asarray([0, 0, 1, 1, 1, 2, 0], jnp.int32)
    assert int(longest_run(req)) == 3


@pytest.mark.parametrize("q_dtype,kv_dtype,d,group,want", [
    (jnp.bfloat16, jnp.bfloat16, 128, 16, True), (jnp.float16, jnp.float16, 64, 64, True),
    (jnp.float32, jnp.float32, 128, 16, False), (jnp.bfloat16, jnp.float16, 128, 16, False),
    (jnp.bfloat16, jnp.bfloat16, 96, 16, False), (jnp.bfloat16, jnp.bfloat16, 128, 65, False)])
def test_kernels_support(q_dtype, kv_dtype, d, group, want):
    assert kernels_support(q_dtype, kv_dtype, d, group) == want


def test_unsupported_calls_run_the_reference_even_with_kernels_asked_for():
    """f32 (a tiny model's dtype) with ``interpret=True``, which would pick the kernels: the
    reference runs, as it does compiled on a GPU."""
    s = jax.ShapeDtypeStruct
    args = (s((4, 8, 64), jnp.float32), s((6, 1, 128, 128), jnp.float32), s((2, 3), jnp.int32),
            s((4,), jnp.int32), s((4,), jnp.int32))
    text = jax.jit(functools.partial(paged_attention_default, scale=0.125, interpret=True)
                   ).lower(*args).as_text()
    assert "mosaic" not in text.lower() and "custom_call" not in text


# (tokens per request, backend): decode rows only (the auto rule takes the decode kernel),
# decode rows and a chunk of more than DECODE_MAX_RUN tokens at a context offset (auto takes
# the prefill kernel), and each kernel named on the mixed batch.
CASES = [((1, 1, 2), None), ((1, DECODE_MAX_RUN + 5, 1), None),
         ((2, 20, 1), "decode"), ((1, 70), "prefill")]


@pytest.mark.parametrize("runs,backend", CASES)
def test_default_matches_reference(runs, backend):
    seed = fresh_seed()
    args = as_inputs(build_dense_batch(seed, hq=8, hkv=2, d=64, runs=runs, max_len=300))
    out, lse = paged_attention_default(*args, scale=0.125, backend=backend,
                                       interpret=True if INTERPRET else None)
    ref_out, ref_lse = paged_attention_reference(*args, scale=0.125)
    assert np.isfinite(np.asarray(out, np.float32)).all(), f"seed {seed}: NaN read"
    chex.assert_trees_all_close(out.astype(jnp.float32), ref_out.astype(jnp.float32),
                                atol=2e-2, rtol=2e-2, custom_message=f"seed {seed}")
    chex.assert_trees_all_close(lse, ref_lse, atol=1e-3, rtol=1e-3,
                                custom_message=f"seed {seed}")


def test_bad_inputs_are_named():
    args = list(as_inputs(build_dense_batch(0, hq=4, hkv=1, d=16, runs=(1,))))
    with pytest.raises(ValueError, match="kv_lens must be"):
        validate_inputs(*args[:4], args[4][:-1], name="x")
    with pytest.raises(TypeError, match="block_table dtype must be int32"):
        paged_attention_default(args[0], args[1], args[2].astype(jnp.int16), *args[3:],
                                scale=0.1)
    with pytest.raises(ValueError, match="backend must be one of"):
        paged_attention_default(*args, scale=0.1, backend="triton")

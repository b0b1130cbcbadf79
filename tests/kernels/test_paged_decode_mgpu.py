"""Mosaic GPU dense paged decode against ``paged_attention_reference``, and its CUDA lowering.

On a CPU backend the kernel runs in Mosaic GPU interpret mode without being asked
(``interpret=None``); on the H200 the same tests run it compiled. Each batch draws a fresh
seed (printed on failure) from ``tests/_dense_batch.py``: lengths not multiples of 128,
several tokens per request, padded tokens, NaN in every unconsumed page and past each
request's length, -1 / out-of-range block-table entries past a request's pages.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _dense_batch import as_inputs, build_dense_batch, dense_specs
from _helpers import fresh_seed
from pallas_kernels._lowering import custom_call_counts, lower_for_cuda
from pallas_kernels._shapes import NUM_SMS_H200
from pallas_kernels.paged_attention import paged_attention_reference
from pallas_kernels.paged_decode_mgpu import MAX_SPLITS, default_splits, paged_decode_mgpu

TOL = dict(atol=2e-2, rtol=2e-2)  # bf16 output, P rounded to bf16 before P V


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    """A kernel that raised inside the Mosaic GPU interpreter leaves its state behind."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    interpret_pallas_call.reset_gpu_interpret_mode_state()
    yield


def check_against_reference(args, *, scale, **kw):
    out, lse = paged_decode_mgpu(*args, scale=scale, **kw)
    ref_out, ref_lse = paged_attention_reference(*args, scale=scale)
    chex.assert_shape(out, args[0].shape)
    chex.assert_shape(lse, args[0].shape[:2])
    assert np.isfinite(np.asarray(out, np.float32)).all(), "NaN from an unconsumed page or row"
    chex.assert_trees_all_close(out.astype(jnp.float32), ref_out.astype(jnp.float32), **TOL)
    chex.assert_trees_all_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


# (hq, hkv, d, tokens per request, num_splits, num_stages)
CASES = [
    (16, 1, 128, (1, 1, 3), None, None),   # M3 TP4 16/1; a 3-token run (speculative rows)
    (64, 4, 128, (1, 2), 3, 2),            # 64/4, runs of 3 pages
    (5, 1, 64, (1, 1), 1, 1),              # a group padded to 8, one run, one stage
    (8, 2, 64, (2, 1), 4, 3),              # more runs than some requests have pages
]


@pytest.mark.parametrize("hq,hkv,d,runs,num_splits,num_stages", CASES)
def test_matches_reference(hq, hkv, d, runs, num_splits, num_stages):
    seed = fresh_seed()
    args = as_inputs(build_dense_batch(seed, hq=hq, hkv=hkv, d=d, runs=runs))
    check_against_reference(args, scale=d ** -0.5, num_splits=num_splits,
                            num_stages=num_stages)


def test_padded_rows_give_zeros_and_minus_inf():
    args = as_inputs(build_dense_batch(fresh_seed(), hq=8, hkv=1, d=64, runs=(1,),
                                       pad_tokens=2))
    out, lse = paged_decode_mgpu(*args, scale=0.125, num_splits=2)
    chex.assert_trees_all_equal(out[-2:], jnp.zeros_like(out[-2:]))
    chex.assert_trees_all_equal(lse[-2:], jnp.full_like(lse[-2:], -jnp.inf))


def test_nan_in_a_consumed_value_reaches_only_its_rows():
    q, kv, bt, req, lens = build_dense_batch(fresh_seed(), hq=8, hkv=1, d=64, runs=(1, 1),
                                             pad_tokens=0)
    kv[bt[0, 0], 0, 0, 64:] = np.nan  # request 0's first key's value
    out, _ = paged_decode_mgpu(*as_inputs((q, kv, bt, req, lens)), scale=0.125, num_splits=2)
    out = np.asarray(out, np.float32)
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()


def test_default_splits_fill_the_gpu():
    for rows in (1, 16, 64, 256, 1024):
        s = default_splits(rows, 1024)
        assert rows * s >= 2 * NUM_SMS_H200 or s == MAX_SPLITS or rows >= 2 * NUM_SMS_H200
        assert s == 1 or rows * (s - 1) < 2 * NUM_SMS_H200  # the smallest such split
    assert default_splits(1, 3) == 3  # never more runs than pages


@pytest.mark.parametrize("t,hq,hkv", [(1, 16, 1), (16, 16, 1), (64, 64, 4), (256, 16, 1)])
def test_lowers_to_one_mosaic_kernel_at_128k(t, hq, hkv):
    text = lower_for_cuda(paged_decode_mgpu, *dense_specs(t, hq, hkv, context=131072),
                          scale=128 ** -0.5, interpret=False)
    assert custom_call_counts(text) == {"mosaic": 1, "triton": 0, "other": 0}


@pytest.mark.parametrize("change,exc,match", [
    (dict(dtype=jnp.float32), TypeError, "q dtype must be bf16 or f16"),
    (dict(d=96), ValueError, "head dim D"),
    (dict(num_splits=0), ValueError, "num_splits must be in"),
    (dict(num_stages=7), ValueError, "num_stages must be one of"),
])
def test_bad_arguments_are_named(change, exc, match):
    d = change.get("d", 64)
    dtype = change.get("dtype", jnp.bfloat16)
    specs = dense_specs(2, 8, 1, d, context=256, dtype=dtype)
    args = [jnp.zeros(s.shape, s.dtype) for s in specs]
    kw = {k: v for k, v in change.items() if k in ("num_splits", "num_stages")}
    with pytest.raises(exc, match=match):
        paged_decode_mgpu(*args, scale=0.1, **kw)


def test_empty_batch():
    args = [jnp.zeros(s.shape, s.dtype) for s in dense_specs(0, 8, 1, 64, context=256,
                                                              rows=1)]
    out, lse = paged_decode_mgpu(*args, scale=0.1)
    chex.assert_shape((out, lse), ((0, 8, 64), (0, 8)))

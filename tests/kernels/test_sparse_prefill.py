"""Sparse prefill: kernel vs reference, numpy oracle, dense causal attention, decode.

Prefill rows have ``kv_len = position + 1``: a chunk of 34 tokens after a 2030-token prefix
(crossing 2048, so the later rows select 16 of 17 blocks), a fresh 9-token prompt (its tile
shares a program with the previous request's last tokens), a chunk with -1 inside the
consumed range, a chunk with a duplicated id, a chunk with valid ids in slots ``>= n_use``
(never consumed), padded tokens. The batch helpers and the
poison layout are those of ``test_sparse_decode``.
"""
from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from _helpers import INTERPRET
from pallas_kernels import TOPK
from pallas_kernels.sparse_decode import sparse_decode
from pallas_kernels.sparse_prefill import sparse_prefill, sparse_prefill_reference, tile_page_union
from test_sparse_decode import (Req, _small_args, assert_matches_reference_and_oracle,
                                build_batch, dense_causal_attention, tolerances)

PREFILL_REQS = (Req(2064, q_len=34), Req(9, q_len=9), Req(305, q_len=5, edit="minus1"),
                Req(600, q_len=2, edit="dup"), Req(300, q_len=2, edit="beyond"))


@pytest.mark.parametrize("dtype,hkv,d,tokens_per_tile,num_splits", [
    (jnp.float32, 1, 128, 4, None),   # default split over the page union
    (jnp.bfloat16, 4, 64, 8, 1),      # 8 tokens x 16 heads = 128 rows, single split
])
def test_prefill_matches_reference_oracle_dense_and_decode(dtype, hkv, d, tokens_per_tile,
                                                           num_splits):
    batch = build_batch(2, PREFILL_REQS, hq=16 * hkv, hkv=hkv, d=d, dtype=dtype, pad_tokens=3)
    scale = d ** -0.5
    args = batch.args()
    out, lse = sparse_prefill(*args, scale=scale, interpret=INTERPRET,
                              tokens_per_tile=tokens_per_tile, num_splits=num_splits)
    assert_matches_reference_and_oracle(batch, out, lse, sparse_prefill_reference, scale, dtype)
    atol, lse_atol = tolerances(dtype)

    np.testing.assert_array_equal(np.asarray(out[-3:], np.float32), 0.0)  # padded tokens
    np.testing.assert_array_equal(np.asarray(lse[-3:]), -np.inf)

    # exactness: rows with kv_len <= 2048 of the unedited requests equal dense causal attention
    rows = np.array([i for i in range(43) if batch.kv_lens[i] <= 2048])
    assert len(rows) == 18 + 9
    d_out, d_lse = dense_causal_attention(args[0][rows], args[1], args[3], args[4][rows],
                                          args[5][rows], scale=scale)
    chex.assert_trees_all_close(out[rows].astype(jnp.float32), d_out, atol=atol, rtol=atol)
    chex.assert_trees_all_close(lse[rows], d_lse, atol=lse_atol, rtol=lse_atol)

    if dtype == jnp.float32:  # same semantics as the decode kernel
        dec_out, dec_lse = sparse_decode(*args, scale=scale, interpret=INTERPRET)
        chex.assert_trees_all_close(out, dec_out, atol=atol, rtol=atol)
        chex.assert_trees_all_close(lse, dec_lse, atol=lse_atol, rtol=lse_atol)


def test_tile_page_union_dedups_consumed_pairs():
    sel = np.full((4, 1, TOPK), -1, np.int32)
    sel[0, 0, :3] = [0, 1, 2]
    sel[1, 0, :3] = [0, 2, -1]          # -1 inside the consumed range: dropped
    sel[2, 0, :2] = [0, 7]              # other request; 7 >= ceil(kv_len/128): dropped
    sel[3, 0, :2] = [1, 1]              # duplicate: one union entry
    kv_lens = np.array([300, 300, 100, 200], np.int32)
    rows = np.array([0, 0, 1, 0], np.int32)
    keys, count = tile_page_union(jnp.asarray(sel), jnp.asarray(kv_lens), jnp.asarray(rows),
                                  10, 2)
    chex.assert_shape(keys, (2, 1, 2 * TOPK))
    np.testing.assert_array_equal(np.asarray(count), [[3], [2]])
    np.testing.assert_array_equal(np.asarray(keys[0, 0, :3]), [0, 1, 2])
    np.testing.assert_array_equal(np.asarray(keys[1, 0, :2]), [1, 10])
    np.testing.assert_array_equal(np.asarray(keys[:, :, 3:]), 0)


@pytest.mark.parametrize("tokens_per_tile", [3, 0, 32])
def test_bad_tokens_per_tile_raises(tokens_per_tile):
    with pytest.raises(ValueError, match="tokens_per_tile"):
        sparse_prefill(**_small_args(), scale=1.0, interpret=True,
                       tokens_per_tile=tokens_per_tile)


@pytest.mark.parametrize("fn", [sparse_prefill, sparse_prefill_reference])
def test_bad_inputs_raise_naming_argument(fn):
    with pytest.raises(ValueError, match="selected must be"):
        fn(**_small_args(selected=jnp.zeros((2, 1, 8), jnp.int32)), scale=1.0)
    with pytest.raises(TypeError, match="kv_lens dtype"):
        fn(**_small_args(kv_lens=jnp.zeros((2,), jnp.float32)), scale=1.0)
    with pytest.raises(ValueError, match="power of two"):
        fn(**_small_args(q=jnp.zeros((2, 16, 24), jnp.float32)), scale=1.0)


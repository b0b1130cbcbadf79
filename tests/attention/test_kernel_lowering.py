"""Which kernels the runner's attention compiles to on an H200: Mosaic GPU at every shape the
runner can compile (decode buckets up to 256 tokens and 2048-token prefill chunks, MiniMax-M3's
per-rank GQA 16/1 and 64/4, 128K and 1M contexts), never the deprecated Pallas Triton backend.

Lowered for an abstract H200 on the CPU (``pallas_kernels._lowering.lower_for_cuda``).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest

from _dense_batch import dense_specs
from jax_msa_runner.attention.dense import paged_causal_attention
from jax_msa_runner.attention.msa import msa_attention
from pallas_kernels._lowering import custom_call_counts, lower_for_cuda
from pallas_kernels.index_select_default import sparse_topk_select_default

CONTEXT = 131072
LONG = 2 ** 20  # past the one-pass select's 1024 pages: the chunked select
INDEX_DIM = 128


class _Md(NamedTuple):
    """The BatchMetadata fields msa_attention reads."""
    block_table: jax.Array
    req_indices: jax.Array
    positions: jax.Array
    num_valid_pages: jax.Array
    kv_lens: jax.Array


def _msa(q, index_q, kv, index_k, bt, req, pos, nvp, lens):
    return msa_attention(q, index_q, kv, index_k, _Md(bt, req, pos, nvp, lens),
                         scale=128 ** -0.5)[0]


@pytest.mark.parametrize("t,hq,hkv,context", [
    (1, 16, 1, CONTEXT), (256, 16, 1, CONTEXT), (2048, 16, 1, CONTEXT), (256, 64, 4, CONTEXT),
    (2048, 64, 4, CONTEXT), (1, 16, 1, LONG), (2048, 16, 1, LONG)])
def test_msa_layer_lowers_to_mosaic_only(t, hq, hkv, context):
    """Scores, select and sparse attention; past 1024 pages the select is two launches."""
    q, kv, bt, req, lens = dense_specs(t, hq, hkv, context=context, rows=64, pages=8192)
    s = jax.ShapeDtypeStruct
    index_q = s((t, hkv, INDEX_DIM), jnp.bfloat16)
    index_k = s((8192, 128, INDEX_DIM), jnp.bfloat16)
    text = lower_for_cuda(_msa, q, index_q, kv, index_k, bt, req, lens, lens, lens)
    counts = custom_call_counts(text)
    want = 3 if context // 128 <= 1024 else 4
    assert counts["triton"] == 0 and counts["mosaic"] == want, counts


@pytest.mark.parametrize("t,hq,hkv,kernels,context", [
    (1, 16, 1, 2, CONTEXT), (64, 64, 4, 2, CONTEXT), (256, 16, 1, 2, CONTEXT),
    (2048, 16, 1, 1, CONTEXT), (2048, 64, 4, 1, CONTEXT), (1, 16, 1, 2, LONG),
    (2048, 16, 1, 1, LONG)])
def test_dense_layer_lowers_to_mosaic_only(t, hq, hkv, kernels, context):
    """Decode buckets compile both kernels (picked at run time by the longest run of one
    request); larger batches the prefill kernel alone."""
    args = dense_specs(t, hq, hkv, context=context, rows=64, pages=8192)
    text = lower_for_cuda(paged_causal_attention, *args, scale=128 ** -0.5)
    assert custom_call_counts(text) == {"mosaic": kernels, "triton": 0, "other": 0}


@pytest.mark.parametrize("context,launches", [(CONTEXT, 1), (LONG, 2)])
def test_dcp_select_at_256_tokens_lowers_to_mosaic(context, launches):
    scores = jax.ShapeDtypeStruct((256, 1, context // 128), jnp.float32)
    nvp = jax.ShapeDtypeStruct((256,), jnp.int32)
    text = lower_for_cuda(sparse_topk_select_default, scores, nvp, local_blocks=0)
    assert custom_call_counts(text) == {"mosaic": launches, "triton": 0, "other": 0}

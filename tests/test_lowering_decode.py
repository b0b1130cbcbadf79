"""Sparse decode and prefill lower to Triton for CUDA on the CPU (abstract H200), bf16,
at the benchmark shapes (Hq/Hkv 16/1 and 64/4, D 128, 16 selected pages)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels._lowering import lower_for_cuda, triton_calls
from pallas_kernels.sparse_decode import (PAGE, TOPK, default_num_splits, default_num_stages,
                                          sparse_decode)
from pallas_kernels.sparse_prefill import sparse_prefill

D = 128


def _specs(t, hq, hkv, *, pages=4096, rows=128, cols=512):
    s = jax.ShapeDtypeStruct
    return (s((t, hq, D), jnp.bfloat16), s((pages, hkv, PAGE, 2 * D), jnp.bfloat16),
            s((t, hkv, TOPK), jnp.int32), s((rows, cols), jnp.int32), s((t,), jnp.int32),
            s((t,), jnp.int32))


@pytest.mark.parametrize("hq,hkv", [(16, 1), (64, 4)])
@pytest.mark.parametrize("batch", [1, 128])
def test_sparse_decode_lowers_for_h200(hq, hkv, batch):
    text = lower_for_cuda(sparse_decode, *_specs(batch, hq, hkv), scale=D ** -0.5)
    calls = triton_calls(text)
    assert [c["name"] for c in calls] == ["msa_sparse_decode"]
    splits = default_num_splits(batch * hkv)
    assert (calls[0]["grid_x"], calls[0]["grid_y"], calls[0]["grid_z"]) == (batch, hkv, splits)
    assert batch * hkv * splits >= min(132, batch * hkv * TOPK)
    assert (calls[0]["num_warps"], calls[0]["num_stages"]) == (4, 2)  # 2 x 64 KiB K+V buffers


def test_default_stages_fit_shared_memory():
    assert default_num_stages(jnp.bfloat16, 128) == 2
    assert default_num_stages(jnp.float32, 128) == 1
    assert default_num_stages(jnp.bfloat16, 64) == 3


def test_sparse_decode_tunables_reach_triton():
    # a 17 GB cache (64K pages, B=128 at 64K context) takes the 64-bit address path
    text = lower_for_cuda(sparse_decode, *_specs(16, 64, 4, pages=65536, cols=65536 // PAGE),
                          scale=D ** -0.5, num_splits=16, num_warps=8, num_stages=3)
    [call] = triton_calls(text)
    assert (call["grid_z"], call["num_warps"], call["num_stages"]) == (16, 8, 3)


@pytest.mark.parametrize("hq,hkv,tokens_per_tile,num_warps", [(16, 1, 4, 4), (64, 4, 8, 8)])
def test_sparse_prefill_lowers_for_h200(hq, hkv, tokens_per_tile, num_warps):
    text = lower_for_cuda(sparse_prefill, *_specs(256, hq, hkv), scale=D ** -0.5,
                          tokens_per_tile=tokens_per_tile, num_warps=num_warps)
    calls = triton_calls(text)
    assert [c["name"] for c in calls] == ["msa_sparse_prefill"]
    assert (calls[0]["grid_x"], calls[0]["grid_y"]) == (256 // tokens_per_tile, hkv)
    assert calls[0]["num_warps"] == num_warps

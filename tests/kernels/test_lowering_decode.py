"""Sparse decode and prefill lower to Triton for CUDA on the CPU (abstract H200), bf16,
at the benchmark shapes (Hq/Hkv 16/1 and 64/4, D 128, 16 selected pages)."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from _decode_batch import decode_specs as _specs
from pallas_kernels._lowering import lower_for_cuda, triton_calls
from pallas_kernels import PAGE_SIZE
from pallas_kernels.sparse_decode import (SMEM_BYTES, default_decode_config,
                                          max_stages, pipeline_smem_bytes, sparse_decode,
                                          step_bytes)
from pallas_kernels.sparse_prefill import default_num_stages, sparse_prefill

D = 128


def lower(fn, *args, **kwargs):
    """`lower_for_cuda` of the compiled kernel: ``interpret=False`` (the default, None,
    would interpret on this CPU backend)."""
    return lower_for_cuda(fn, *args, interpret=False, **kwargs)


@pytest.mark.parametrize("hq,hkv,batch,want", [
    (16, 1, 1, (16, 4, 3)), (64, 4, 1, (16, 4, 3)),     # one page per program
    (16, 1, 16, (8, 4, 3)),                             # 128 programs: one wave, 3 stages
    (16, 1, 64, (2, 4, 3)),
    (16, 1, 128, (1, 4, 3)),                            # 128 rows: one split
    (64, 4, 128, (1, 4, 2)),                            # 512 programs: 2 stages
])
def test_sparse_decode_lowers_for_h200_with_defaults(hq, hkv, batch, want):
    text = lower(sparse_decode, *_specs(batch, hq, hkv), scale=D ** -0.5)
    calls = triton_calls(text)
    assert [c["name"] for c in calls] == ["msa_sparse_decode"]
    cfg = default_decode_config(batch * hkv, jnp.bfloat16, D)
    assert (cfg["num_splits"], cfg["num_warps"], cfg["num_stages"]) == want
    assert cfg["keys_per_step"] == PAGE_SIZE
    assert (calls[0]["grid_x"], calls[0]["grid_y"], calls[0]["grid_z"]) == (batch, hkv, want[0])
    assert (calls[0]["num_warps"], calls[0]["num_stages"]) == want[1:]
    # several splits merge in the kernel: a ticket counter (atomic add) aliased in and out
    assert ("atomic_rmw" in text) == ("output_operand_alias" in text) == (want[0] > 1)


@pytest.mark.parametrize("hq,hkv,batch,kw", [
    (16, 1, 128, dict(keys_per_step=64, num_splits=1, num_stages=6)),
    (16, 1, 128, dict(keys_per_step=64, num_splits=2, num_stages=3, num_warps=8)),
    (64, 4, 128, dict(keys_per_step=64, num_splits=1, num_stages=4)),
    (16, 1, 1, dict(keys_per_step=64, num_splits=16, num_stages=2)),
    (64, 4, 64, dict(keys_per_step=128, num_splits=2, num_stages=3, num_warps=8)),
    (16, 1, 128, dict(keys_per_step=128, num_splits=1, num_stages=3, v_mask="load")),
    (64, 4, 128, dict(keys_per_step=64, num_splits=2, num_stages=4, v_mask="load")),
])
def test_sparse_decode_tunables_lower_at_benchmark_shapes(hq, hkv, batch, kw):
    text = lower(sparse_decode, *_specs(batch, hq, hkv), scale=D ** -0.5, **kw)
    [call] = triton_calls(text)
    assert (call["grid_x"], call["grid_y"], call["grid_z"]) == (batch, hkv, kw["num_splits"])
    assert (call["num_warps"], call["num_stages"]) == (kw.get("num_warps", 4), kw["num_stages"])


def test_default_stages_fit_shared_memory():
    assert default_num_stages(jnp.bfloat16, 128, 32, 4) == 2   # prefill, 2-token tiles
    assert default_num_stages(jnp.float32, 128, 32, 4) == 1
    assert default_num_stages(jnp.bfloat16, 64, 32, 4) == 3
    for rows in (1, 16, 64, 128, 512):
        for dtype in (jnp.bfloat16, jnp.float32):
            cfg = default_decode_config(rows, dtype, D)
            stage = step_bytes(dtype, D, cfg["keys_per_step"])
            assert pipeline_smem_bytes(cfg["num_stages"], stage) <= SMEM_BYTES
    assert default_decode_config(128, jnp.float32, D)["num_stages"] == 2  # 1 x 128 KiB buffer
    # the default depth is re-capped for an explicit step size; too deep a pipeline raises
    [call] = triton_calls(lower(sparse_decode, *_specs(8, 16, 1), scale=1.0,
                                keys_per_step=64))
    assert call["num_stages"] == 3  # 8 rows x 16 splits: one wave
    with pytest.raises(ValueError, match="shared memory"):
        lower(sparse_decode, *_specs(128, 16, 1), scale=1.0, num_stages=5)
    assert max_stages(step_bytes(jnp.bfloat16, D, PAGE_SIZE)) == 4  # 3 x 64 KiB buffers
    assert max_stages(step_bytes(jnp.bfloat16, D, 64)) == 7


@pytest.mark.parametrize("keys_per_step", [128, 64])
def test_sparse_decode_tunables_reach_triton(keys_per_step):
    # a 17 GB cache (64K pages, B=128 at 64K context) takes the 64-bit address path
    text = lower(sparse_decode, *_specs(16, 64, 4, pages=65536, cols=65536 // PAGE_SIZE),
                          scale=D ** -0.5, num_splits=16, num_warps=8, num_stages=3,
                          keys_per_step=keys_per_step)
    [call] = triton_calls(text)
    assert (call["grid_z"], call["num_warps"], call["num_stages"]) == (16, 8, 3)


@pytest.mark.parametrize("hq,hkv,tokens_per_tile,num_warps", [(16, 1, 4, 4), (64, 4, 8, 8)])
def test_sparse_prefill_lowers_for_h200(hq, hkv, tokens_per_tile, num_warps):
    text = lower(sparse_prefill, *_specs(256, hq, hkv), scale=D ** -0.5,
                          tokens_per_tile=tokens_per_tile, num_warps=num_warps)
    calls = triton_calls(text)
    assert [c["name"] for c in calls] == ["msa_sparse_prefill"]
    assert (calls[0]["grid_x"], calls[0]["grid_y"]) == (256 // tokens_per_tile, hkv)
    assert calls[0]["num_warps"] == num_warps
    assert calls[0]["num_stages"] == (1 if tokens_per_tile * 16 == 64 and num_warps == 4 else 2)


def test_sparse_prefill_stages_bounded_by_shared_memory():
    """bf16 D=128 pages are 64 KiB: 4 stages (3 buffers) fit 227 KiB, 5 do not."""
    assert default_num_stages(jnp.bfloat16, D, 64, 4) == 1  # default tile: unpipelined
    assert default_num_stages(jnp.bfloat16, D, 128, 8) == 2
    assert default_num_stages(jnp.float32, D, 32, 4) == 1  # one 128 KiB page buffer
    [call] = triton_calls(lower(sparse_prefill, *_specs(256, 16, 1), scale=1.0,
                                         num_stages=4))
    assert call["num_stages"] == 4
    with pytest.raises(ValueError, match="sparse_prefill: num_stages 5 .*shared memory"):
        lower(sparse_prefill, *_specs(256, 16, 1), scale=1.0, num_stages=5)

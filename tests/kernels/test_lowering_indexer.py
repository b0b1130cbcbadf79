"""The indexer, select and fused index-select kernels lower to Triton for an (abstract) H200
at the benchmark shapes (bf16, and a float8_e4m3fn index-K cache): catches GPU-only lowering
errors on the CPU."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels._lowering import lower_for_cuda, triton_calls
from pallas_kernels.index_scores import default_pages_per_program, msa_index_scores
from pallas_kernels.index_select import msa_index_select
from pallas_kernels.topk_select import sparse_topk_select

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
S = jax.ShapeDtypeStruct
INDEX_DIM = 128


def lower(fn, *args, **kwargs):
    """`lower_for_cuda` of the compiled kernel: ``interpret=False`` (the default, None,
    would interpret on this CPU backend)."""
    return lower_for_cuda(fn, *args, interpret=False, **kwargs)


def indexer_args(batch, num_heads, max_pages, dtype=jnp.bfloat16, k_dtype=None):
    num_pages = batch * max_pages + 1
    return (S((batch, num_heads, INDEX_DIM), dtype),
            S((num_pages, 128, INDEX_DIM), k_dtype or dtype),
            S((batch, max_pages), jnp.int32), S((batch,), jnp.int32), S((batch,), jnp.int32))


@pytest.mark.parametrize("num_heads", [1, 4])
@pytest.mark.parametrize("batch", [1, 16, 64, 128])
@pytest.mark.parametrize("context", [8192, 65536])
def test_index_select_lowers_for_h200_to_one_kernel(num_heads, batch, context):
    max_pages = context // 128
    text = lower(msa_index_select, *indexer_args(batch, num_heads, max_pages))
    [call] = triton_calls(text)  # scores and select in one launch
    assert call["name"] == "msa_index_select"
    ppp = default_pages_per_program(batch, max_pages)
    assert (call["grid_x"], call["grid_y"]) == (batch, max_pages // ppp)
    # several chunks per token meet through a ticket counter (an atomic add, zeroed by XLA)
    assert ("atomic_rmw" in text) == (max_pages // ppp > 1)


def test_index_select_single_chunk_has_no_ticket():
    """One program per token: the scores stay in registers, no counter, no scratch row."""
    text = lower(msa_index_select, *indexer_args(4, 1, 64), pages_per_program=64)
    [call] = triton_calls(text)
    assert (call["grid_x"], call["grid_y"]) == (4, 1)
    assert "atomic_rmw" not in text and "output_operand_alias" not in text


@pytest.mark.parametrize("pages_per_program,num_warps,num_stages,preload", [
    (1, 4, 2, True), (16, 8, 4, False), (64, 4, 3, True), (8, 2, 5, False)])
def test_index_scores_tunables_lower(pages_per_program, num_warps, num_stages, preload):
    [call] = triton_calls(lower(msa_index_scores, *indexer_args(16, 4, 512),
                                         pages_per_program=pages_per_program,
                                         num_warps=num_warps, num_stages=num_stages,
                                         preload_block_table=preload))
    assert (call["grid_x"], call["grid_y"]) == (16, 512 // pages_per_program)
    assert (call["num_warps"], call["num_stages"]) == (num_warps, num_stages)


def test_f32_and_odd_shapes_lower():
    """f32 operands (IEEE dot), H=3 (padded to 4), P=40 (not a power of two), Di=32."""
    args = (S((5, 3, 32), jnp.float32), S((50, 128, 32), jnp.float32), S((2, 40), jnp.int32),
            S((5,), jnp.int32), S((5,), jnp.int32))
    calls = triton_calls(lower(msa_index_select, *args, pages_per_program=16))
    assert [c["name"] for c in calls] == ["msa_index_select"]
    calls = triton_calls(lower(sparse_topk_select, S((5, 3, 40), jnp.float32),
                                        S((5,), jnp.int32), init_blocks=1, num_warps=8))
    assert calls[0]["num_warps"] == 8


@pytest.mark.parametrize("q_dtype,num_heads,pages_per_program", [
    (jnp.bfloat16, 4, None), (jnp.float16, 1, 16), (jnp.float32, 3, 8)])
def test_fp8_index_k_cache_lowers(q_dtype, num_heads, pages_per_program):
    """A float8_e4m3fn index-K cache reaches the kernel as fp8 (no XLA convert of the whole
    cache before it) and the in-kernel fp8 -> index_q dtype convert lowers to Triton."""
    args = indexer_args(16, num_heads, 64, q_dtype, k_dtype=jnp.float8_e4m3fn)
    text = lower(msa_index_select, *args, pages_per_program=pages_per_program)
    assert not [ln for ln in text.splitlines() if "stablehlo.convert" in ln and "f8E4M3FN" in ln]
    cache_type = f"tensor<{16 * 64 + 1}x128x{INDEX_DIM}xf8E4M3FN>"
    assert cache_type in text
    assert [c["name"] for c in triton_calls(text)] == ["msa_index_select"]


@pytest.mark.parametrize("batch,context", [(1, 65536), (128, 65536)])
def test_fp8_queries_and_cache_lower(batch, context):
    """e4m3 queries over an e4m3 cache reach the kernel as fp8 (no convert of either before
    it): the score dot is fp8 x fp8."""
    args = indexer_args(batch, 1, context // 128, jnp.float8_e4m3fn, k_dtype=jnp.float8_e4m3fn)
    text = lower(msa_index_select, *args)
    assert not [ln for ln in text.splitlines() if "stablehlo.convert" in ln]
    assert f"tensor<{batch}x1x{INDEX_DIM}xf8E4M3FN>" in text
    assert [c["name"] for c in triton_calls(text)] == ["msa_index_select"]

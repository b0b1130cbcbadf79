"""sparse_topk_select_chunked (two Mosaic GPU select launches) vs the one-pass reference
(lax.top_k) on rows longer than a chunk: ties, NaN, -0, -inf runs, forced local / init blocks,
page counts past the row and below 16, lengths that are not multiples of the chunk; its bounds;
and the lowering for an abstract H200 (Mosaic GPU only) at the context lengths past 128K."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _helpers import fresh_seed
from pallas_kernels import PAGE_SIZE, TOPK
from pallas_kernels._lowering import custom_call_counts, lower_for_cuda
from pallas_kernels.index_select_mgpu import MAX_PAGES
from pallas_kernels.topk_select import sparse_topk_select_reference
from pallas_kernels.topk_select_chunked import max_chunked_pages, sparse_topk_select_chunked


def random_rows(seed: int, t: int, h: int, p: int) -> tuple[np.ndarray, np.ndarray]:
    """Scores [T, H, P] (row 0 rounded: many ties; NaN, -0, -inf runs, an all -inf row) and
    page counts [T] (0, negative, <= 16, 17, past P, random)."""
    rng = np.random.default_rng(seed)
    s = rng.standard_normal((t, h, p)).astype(np.float32)
    s[0] = np.round(s[0])
    s[1 % t, :, ::3] = -np.inf
    s[2 % t, 0, rng.integers(0, p, 7)] = np.nan
    s[3 % t, -1, : p // 2] = -0.0
    s[4 % t, 0, :] = -np.inf
    fixed = [p, p + 9, 0, -3, 16, 17, 1]
    nvp = np.array([fixed[i] if i < len(fixed) else rng.integers(17, p + 1) for i in range(t)],
                   np.int32)
    return s, nvp


@pytest.mark.parametrize("p,chunk,local_blocks,init_blocks", [
    (300, 128, 1, 0), (700, 128, 2, 1), (129, 128, 0, 0), (1000, 256, 1, 2)])
def test_matches_the_one_pass_reference(p, chunk, local_blocks, init_blocks):
    seed = fresh_seed()
    s, nvp = random_rows(seed, 9, 2, p)
    got = sparse_topk_select_chunked(jnp.asarray(s), jnp.asarray(nvp), local_blocks=local_blocks,
                                     init_blocks=init_blocks, chunk_pages=chunk)
    want = sparse_topk_select_reference(jnp.asarray(s), jnp.asarray(nvp),
                                        local_blocks=local_blocks, init_blocks=init_blocks)
    chex.assert_shape(got, (9, 2, TOPK))
    chex.assert_type(got, jnp.int32)
    chex.assert_trees_all_equal(got, want, custom_message=f"seed {seed}, P {p}, chunk {chunk}")


def test_matches_at_the_real_chunk_size():
    """MAX_PAGES columns a chunk, the row one column past two chunks (P = 2049)."""
    seed = fresh_seed()
    s, nvp = random_rows(seed, 3, 1, 2 * MAX_PAGES + 1)
    got = sparse_topk_select_chunked(jnp.asarray(s), jnp.asarray(nvp))
    chex.assert_trees_all_equal(got, sparse_topk_select_reference(jnp.asarray(s),
                                                                  jnp.asarray(nvp)),
                                custom_message=f"seed {seed}")


def test_one_chunk_is_the_one_pass_select():
    seed = fresh_seed()
    s, nvp = random_rows(seed, 5, 4, 100)
    got = sparse_topk_select_chunked(jnp.asarray(s), jnp.asarray(nvp), local_blocks=3,
                                     chunk_pages=128)
    chex.assert_trees_all_equal(got, sparse_topk_select_reference(
        jnp.asarray(s), jnp.asarray(nvp), local_blocks=3), custom_message=f"seed {seed}")


@pytest.mark.parametrize("kw,p,match", [
    (dict(topk=8), 300, "topk must be 16"),
    (dict(chunk_pages=200), 300, "chunk_pages must be a multiple of 128 in \\[128, 1024\\]"),
    (dict(chunk_pages=2048), 300, "chunk_pages must be a multiple of 128"),
    (dict(chunk_pages=128), 128 * 64 + 1, "8193 pages per row; at most 8192"),
])
def test_rejects_unsupported_arguments(kw, p, match):
    with pytest.raises(ValueError, match=match):
        sparse_topk_select_chunked(jnp.zeros((1, 1, p)), jnp.ones((1,), jnp.int32), **kw)


def test_bound_is_the_second_stage_row():
    assert max_chunked_pages() == MAX_PAGES * MAX_PAGES // TOPK == 65536
    assert max_chunked_pages(128) == 8192


@pytest.mark.parametrize("t,context", [(1, 1025 * PAGE_SIZE), (16, 2 ** 20), (2048, 2 ** 20),
                                       (1, 2 ** 23)])
def test_lowers_for_h200_to_two_mosaic_selects(t, context):
    """Past 128K keys (1025 pages) up to 8M: two Mosaic GPU custom calls, no Triton."""
    scores = jax.ShapeDtypeStruct((t, 1, context // PAGE_SIZE), jnp.float32)
    counts = jax.ShapeDtypeStruct((t,), jnp.int32)
    text = lower_for_cuda(sparse_topk_select_chunked, scores, counts)
    assert custom_call_counts(text) == dict(mosaic=2, triton=0, other=0)

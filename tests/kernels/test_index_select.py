"""msa_index_select (scores and select in one launch, chunks meeting through a ticket
counter) against the two jnp references in sequence, on random data with a fresh seed."""
import chex
import jax.numpy as jnp
import numpy as np
import pytest

from _helpers import INTERPRET, fresh_seed
from pallas_kernels import TOPK
from pallas_kernels.index_select import (msa_index_select, msa_index_select_reference,
                                         num_valid_pages_of)
from test_index_scores import MAX_PAGES, make_batch
from test_topk_select import check_structure

FP8 = jnp.float8_e4m3fn


@pytest.mark.parametrize("pages_per_program", [1, 4, 16, 64])  # 32, 8, 2 and 1 chunk(s)
@pytest.mark.parametrize("dtype,num_heads,index_dim,k_dtype", [
    (jnp.bfloat16, 4, 128, None), (jnp.float32, 3, 32, None), (jnp.bfloat16, 1, 64, FP8)])
def test_fused_matches_reference(pages_per_program, dtype, num_heads, index_dim, k_dtype):
    """Every chunking (one chunk: scores in registers; several: the ticket's last program
    selects from the scratch row), H not a power of two, an fp8 cache, padded tokens and the
    poison page of make_batch (-1 and N + 7 block-table entries past each request)."""
    q, k, bt, req, pos = make_batch(fresh_seed(), dtype, num_heads, index_dim, k_dtype=k_dtype)
    got = msa_index_select(q, k, bt, req, pos, interpret=INTERPRET,
                           pages_per_program=pages_per_program)
    chex.assert_shape(got, (pos.shape[0], num_heads, TOPK))
    chex.assert_trees_all_equal(got, msa_index_select_reference(q, k, bt, req, pos))
    check_structure(np.asarray(got), np.asarray(num_valid_pages_of(pos)), MAX_PAGES)


@pytest.mark.parametrize("pages_per_program", [2, 64])
@pytest.mark.parametrize("local_blocks,init_blocks", [(1, 0), (2, 1), (0, 0)])
def test_given_page_counts_and_forced_blocks(pages_per_program, local_blocks, init_blocks):
    """num_valid_pages given (some below, some above positions // 128 + 1, one negative, one
    past P): the selection follows them, as the reference's does."""
    q, k, bt, req, pos = make_batch(fresh_seed(), jnp.bfloat16, 2, 64)
    rng = np.random.default_rng(fresh_seed())
    nvp = np.asarray(num_valid_pages_of(pos)) + rng.integers(-3, 4, pos.shape[0])
    nvp[0], nvp[-1] = -1, MAX_PAGES + 5
    nvp = jnp.asarray(nvp, jnp.int32)
    kw = dict(local_blocks=local_blocks, init_blocks=init_blocks)
    got = msa_index_select(q, k, bt, req, pos, nvp, interpret=INTERPRET,
                           pages_per_program=pages_per_program, **kw)
    chex.assert_trees_all_equal(got, msa_index_select_reference(q, k, bt, req, pos, nvp, **kw))
    check_structure(np.asarray(got), np.asarray(nvp), MAX_PAGES)


@pytest.mark.parametrize("bad,match", [
    (dict(num_valid_pages=jnp.zeros((3,), jnp.int32)), "num_valid_pages"),
    (dict(num_valid_pages=jnp.zeros((12,), jnp.float32)), "num_valid_pages"),
    (dict(local_blocks=17), "local_blocks"),
    (dict(init_blocks=16), "init_blocks"),
    (dict(pages_per_program=3), "pages_per_program"),
])
def test_bad_arguments_name_the_field(bad, match):
    q, k, bt, req, pos = make_batch(1, jnp.bfloat16, 1, 32)
    with pytest.raises(ValueError, match=match):
        msa_index_select(q, k, bt, req, pos, interpret=INTERPRET, **bad)


def test_ticket_merge_repeatable_under_many_programs():
    """Many tokens of many chunks (compiled: programs finish in varying order) select the
    reference's blocks on every one of repeated runs: a score row read before all of its
    chunks were stored would show as a different selection."""
    rng = np.random.default_rng(fresh_seed())
    t, pages = (3, 16) if INTERPRET else (96, 64)
    num_pages = t * pages + 1
    bt = (rng.permutation(num_pages - 1) + 1).reshape(t, pages).astype(np.int32)
    pos = rng.integers(0, pages * 128, t).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((t, 2, 64)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((num_pages, 128, 64)), jnp.bfloat16)
    args = (q, k, jnp.asarray(bt), jnp.arange(t, dtype=jnp.int32), jnp.asarray(pos))
    want = msa_index_select_reference(*args)
    for _ in range(1 if INTERPRET else 30):
        chex.assert_trees_all_equal(
            msa_index_select(*args, interpret=INTERPRET, pages_per_program=1), want)

"""DCP helpers: ownership, local lengths, interleaved slot mapping."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from jax_msa_runner.config import RunnerConfig
from jax_msa_runner.batch.dcp import (dcp_local_pages, dcp_local_positions, dcp_local_seq_lens,
                                dcp_owner, dcp_slot_mapping, rank_slot_mapping)
from jax_msa_runner.batch.staging import stage_batch, stage_dummy_batch
from jax_msa_runner.batch.validate import validate_metadata

I = 128


@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
def test_local_seq_lens_match_ownership_counts(W):
    """Exhaustive over every length up to 3 full cycles + 1: counts of owned positions."""
    L = np.arange(0, 3 * W * I + 2)
    owner = np.asarray(dcp_owner(jnp.arange(L[-1]), W, I))
    for rank in range(W):
        counts = np.concatenate([[0], np.cumsum(owner == rank)])[L]
        np.testing.assert_array_equal(dcp_local_seq_lens(L, W, rank, I), counts,
                                      err_msg=f"rank {rank}")
    total = sum(np.asarray(dcp_local_seq_lens(L, W, r, I)) for r in range(W))
    np.testing.assert_array_equal(total, L)
    # rank 0 is the fullest rank; its page count is what the block table must cover.
    np.testing.assert_array_equal(dcp_local_pages(L, W),
                                  -(-np.asarray(dcp_local_seq_lens(L, W, 0, I)) // I))


@pytest.mark.parametrize("W", [1, 2, 4])
def test_local_positions_are_dense_per_rank(W):
    p = jnp.arange(5 * W * I + 17)
    owner, local = np.asarray(dcp_owner(p, W)), np.asarray(dcp_local_positions(p, W))
    for rank in range(W):
        mine = local[owner == rank]
        np.testing.assert_array_equal(mine, np.arange(mine.size))
    # global page g is local page g // W of rank g % W
    g = np.asarray(p) // I
    np.testing.assert_array_equal(owner, g % W)
    np.testing.assert_array_equal(local // I, g // W)


def test_rank_is_traceable():
    seq = jnp.array([0, 1, 300, 1000], jnp.int32)
    f = jax.jit(lambda r: dcp_local_seq_lens(seq, 4, r))
    for r in range(4):
        chex.assert_trees_all_equal(f(jnp.int32(r)), dcp_local_seq_lens(seq, 4, r))
    out = jax.vmap(lambda r: dcp_local_seq_lens(seq, 4, r))(jnp.arange(4))
    np.testing.assert_array_equal(out.sum(0), seq)


CFG_DCP = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=16, bucket_sizes=(2, 5, 16),
                       max_model_len=3000, dcp_world_size=4)


@jax.jit
def _all_rank_slots(md):
    """[W, T] slot mappings of every rank (traced rank): from staged metadata, and recomputed."""
    ranks = jnp.arange(4)
    staged = jax.vmap(lambda r: rank_slot_mapping(md, 4, r))(ranks)
    recomputed = jax.vmap(lambda r: dcp_slot_mapping(md.positions, md.req_indices, md.token_mask,
                                                     md.block_table, 4, r))(ranks)
    return staged, recomputed


@given(data=st.data())
def test_slot_mapping_single_owner_property(data):
    n = data.draw(st.integers(1, 4))
    sched = data.draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    comp = [data.draw(st.integers(0, 3000 - q)) for q in sched]
    need = [-(-(c + q) // (4 * I)) for q, c in zip(sched, comp)]
    ids = data.draw(st.lists(st.integers(1, 999), min_size=sum(need), max_size=sum(need),
                             unique=True))
    rows = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(n)]
    md = stage_batch(sched, comp, rows, CFG_DCP)
    validate_metadata(md, CFG_DCP)
    per_rank, recomputed = (np.asarray(a) for a in _all_rank_slots(md))
    np.testing.assert_array_equal(per_rank, recomputed)
    real = np.asarray(md.token_mask)
    np.testing.assert_array_equal((per_rank >= 0).sum(0), real.astype(int))
    owner = np.asarray(dcp_owner(md.positions, 4))
    np.testing.assert_array_equal(per_rank[owner[real], np.flatnonzero(real)],
                                  np.asarray(md.slot_mapping)[real])
    # With distinct pages per request, no two tokens of a rank write the same slot.
    for r in range(4):
        slots = per_rank[r][per_rank[r] >= 0]
        assert np.unique(slots).size == slots.size


def test_dcp_dummy_context_on_every_kind():
    for kind in ("default", "uniform_decode", "mixed"):
        md = stage_dummy_batch(5, CFG_DCP, kind=kind)
        validate_metadata(md, CFG_DCP)
        n = int(md.req_mask.sum())
        ctx = 4 * I
        np.testing.assert_array_equal(md.num_computed_tokens[:n], ctx)
        np.testing.assert_array_equal(dcp_local_seq_lens(md.seq_lens[:n], 4, 0),
                                      I + np.asarray(md.num_scheduled_tokens[:n]))
        np.testing.assert_array_equal(dcp_local_seq_lens(md.seq_lens[:n], 4, 1), I)
        # the fake context's rank-local page 0 and the query's page 1 are valid, non-null ids
        assert (np.asarray(md.block_table[:n, :2]) >= 1).all()
        # every query token sits at global page 4 -> rank 0, local page 1
        np.testing.assert_array_equal(rank_slot_mapping(md, 4, 1), -1)
        total = int(md.query_start_loc[n])
        rank0 = np.asarray(rank_slot_mapping(md, 4, 0))
        assert (rank0[:total] >= 0).all() and (rank0[total:] == -1).all()


def test_explicit_zero_context_disables_dummy_context():
    md = stage_dummy_batch(5, CFG_DCP, kind="mixed", dcp_context_len=0)
    np.testing.assert_array_equal(md.num_computed_tokens, 0)
    validate_metadata(md, CFG_DCP)

"""Real-batch staging: numpy reference agreement, invariants, padding, bad input."""
import chex
import jax
import numpy as np
import pytest
from hypothesis import given, strategies as st

from jax_msa_runner.batch.buckets import BucketError, make_buckets, select_bucket
from jax_msa_runner.config import RunnerConfig
from jax_msa_runner.batch.metadata import BatchMetadata
from jax_msa_runner.batch.staging import (StagingError, pack_host_batch, packed_size, stage_batch,
                                    stage_packed)
from jax_msa_runner.batch.validate import validate_metadata

CFG = RunnerConfig()  # S=8, 64 tokens, max_model_len 8192, buckets 1..64
CFG_DCP = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=16, bucket_sizes=(2, 5, 16),
                       max_model_len=3000, dcp_world_size=4)
CFG_SMALL = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=16, bucket_sizes=(4, 16),
                         max_model_len=512)


def reference_metadata(sched, comp, rows, bucket, config):
    """Plain-loop numpy reference of the staged metadata (docs/DESIGN.md, "Batch metadata" and "Decode context parallelism")."""
    T, R, P = bucket
    W, page = config.dcp_world_size, config.page_size
    ref = {k: np.zeros((R,), np.int32) for k in ("seq_lens", "num_computed_tokens",
                                                 "num_scheduled_tokens")}
    ref.update({k: np.zeros((T,), np.int32) for k in ("req_indices", "query_pos", "positions",
                                                      "num_valid_pages", "kv_lens")})
    ref["slot_mapping"] = np.full((T,), -1, np.int32)
    ref["block_table"] = np.zeros((R, P), np.int32)
    ref["token_mask"] = np.zeros((T,), bool)
    ref["req_mask"] = np.zeros((R,), bool)
    t = 0
    for i, (q, c, row) in enumerate(zip(sched, comp, rows)):
        ref["seq_lens"][i], ref["num_computed_tokens"][i], ref["num_scheduled_tokens"][i] = c + q, c, q
        ref["block_table"][i, :len(row)] = row
        ref["req_mask"][i] = True
        for k in range(q):
            p = c + k
            local = (p // (page * W)) * page + p % page
            ref["req_indices"][t], ref["query_pos"][t], ref["positions"][t] = i, k, p
            ref["num_valid_pages"][t], ref["kv_lens"][t] = p // page + 1, p + 1
            ref["slot_mapping"][t] = ref["block_table"][i, local // page] * page + local % page
            ref["token_mask"][t] = True
            t += 1
    ref["query_start_loc"] = np.concatenate([[0], np.cumsum(ref["num_scheduled_tokens"])]).astype(np.int32)
    return BatchMetadata(**ref)


def to_host(md):
    return jax.tree.map(np.asarray, jax.device_get(md))


def test_reference_real_batch():
    sched, comp = [3, 1, 5], [0, 300, 126]
    rows = [[7], [9, 4, 11], np.array([5, 6])]
    md = stage_batch(sched, comp, rows, CFG)
    bucket = select_bucket(9, 3, CFG)
    assert bucket == (16, 8, 64)
    chex.assert_shape(md.block_table, (8, 64))
    chex.assert_shape([md.positions, md.slot_mapping, md.token_mask], (16,))
    chex.assert_shape(md.query_start_loc, (9,))
    chex.assert_trees_all_equal(to_host(md), reference_metadata(sched, comp, rows, bucket, CFG))
    np.testing.assert_array_equal(md.positions[:9], [0, 1, 2, 300, 126, 127, 128, 129, 130])
    np.testing.assert_array_equal(md.slot_mapping[:9],
                                  [896, 897, 898, 11 * 128 + 44, 5 * 128 + 126, 5 * 128 + 127,
                                   6 * 128, 6 * 128 + 1, 6 * 128 + 2])
    np.testing.assert_array_equal(md.query_start_loc, [0, 3, 4, 9, 9, 9, 9, 9, 9])
    np.testing.assert_array_equal(md.kv_lens[:9], np.asarray(md.positions[:9]) + 1)
    validate_metadata(md, CFG)


def test_padding_is_cleared():
    md = to_host(stage_batch([2], [5], [[3]], CFG, bucket=make_buckets(CFG)[-1]))
    chex.assert_trees_all_equal(
        (md.seq_lens[1:], md.num_computed_tokens[1:], md.num_scheduled_tokens[1:],
         md.block_table[1:], md.req_mask[1:]),
        (np.zeros(7, np.int32), np.zeros(7, np.int32), np.zeros(7, np.int32),
         np.zeros((7, 64), np.int32), np.zeros(7, bool)))
    for name in ("req_indices", "query_pos", "positions", "num_valid_pages", "kv_lens"):
        np.testing.assert_array_equal(getattr(md, name)[2:], 0, err_msg=name)
    np.testing.assert_array_equal(md.slot_mapping[2:], -1)
    np.testing.assert_array_equal(md.token_mask, np.arange(64) < 2)


def test_stage_packed_inside_outer_jit():
    bucket = select_bucket(4, 2, CFG)
    packed = pack_host_batch([1, 3], [4, 0], [[2], [3]], bucket, CFG)
    chex.assert_shape(packed, (packed_size(bucket),))
    assert packed.dtype == np.int32

    @jax.jit
    def step(p):
        md = stage_packed(p, bucket, CFG)
        return md.positions.sum() + md.slot_mapping.sum()

    md = stage_packed(packed, bucket, CFG)
    assert int(step(packed)) == int(md.positions.sum() + md.slot_mapping.sum())
    validate_metadata(md, CFG)


@st.composite
def real_batches(draw, config):
    largest = make_buckets(config)[-1]
    n = draw(st.integers(0, largest.num_reqs))
    total = draw(st.integers(n, largest.num_tokens)) if n else 0
    cuts = sorted(draw(st.lists(st.integers(1, max(total - 1, 1)), min_size=n - 1,
                                max_size=n - 1, unique=True))) if n > 1 else []
    sched = np.diff([0, *cuts, total]).tolist() if n else []
    unit = config.page_size * config.dcp_world_size
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))  # page ids: cheap to draw
    comp, rows = [], []
    for q in sched:
        c = draw(st.integers(0, config.max_model_len - q))
        need = -(-(c + q) // unit)
        extra = draw(st.integers(0, config.max_pages - need))
        rows.append(rng.integers(1, 5000, size=need + extra))
        comp.append(c)
    return sched, comp, rows


@pytest.mark.parametrize("config", [CFG, CFG_DCP], ids=["single", "dcp4"])
def test_random_real_batches_property(config):
    @given(real_batches(config))
    def check(batch):
        sched, comp, rows = batch
        bucket = select_bucket(sum(sched), len(sched), config)
        md = stage_batch(sched, comp, rows, config)
        validate_metadata(md, config)
        chex.assert_trees_all_equal(to_host(md), reference_metadata(sched, comp, rows, bucket,
                                                                    config))
    check()


@pytest.mark.parametrize("args, match", [
    (([4, 1], [0, -2], [[1], [1]]), r"num_computed_tokens\[1\] = -2: must be >= 0"),
    (([-1], [0], [[1]]), r"num_scheduled_tokens\[0\] = -1: must be >= 1"),
    (([0], [3], [[1]]), r"num_scheduled_tokens\[0\] = 0"),
    (([4], [509], [[1, 2, 3, 4, 5]]), r"seq_len\[0\] = .* = 513 exceeds max_model_len=512"),
    (([2, 2], [200, 0], [[1], [1]]), r"block_table\[0\]: 1 entries but seq_len=202 needs 2 pages"),
    (([2], [0], [[0]]), r"block_table\[0\]\[0\] = 0 is the null page"),
    (([2], [0], [[-4]]), r"block_table\[0\]\[0\] = -4: page ids must be in"),
    (([2], [0], [[1, 2, 3, 4, 5]]), r"block_table\[0\]: 5 entries exceed bucket.max_pages=4"),
    (([2], [0], [[1], [2]]), r"block_table: has 2 rows but there are 1 requests"),
    (([2], [0, 1], [[1]]), r"num_computed_tokens: has 2 rows"),
    (([2.5], [0], [[1]]), r"num_scheduled_tokens: must hold integers"),
])
def test_bad_input_raises(args, match):
    with pytest.raises(StagingError, match=match):
        stage_batch(*args, CFG_SMALL)


def test_batch_too_large_for_buckets():
    with pytest.raises(BucketError, match=r"num_tokens=17.*largest bucket holds 16 tokens"):
        stage_batch([17], [0], [[1]], CFG_SMALL)
    with pytest.raises(BucketError, match=r"num_reqs=5.*max_num_seqs=4"):
        stage_batch([1] * 5, [0] * 5, [[1]] * 5, CFG_SMALL)
    bucket = make_buckets(CFG_SMALL)[0]  # 4 tokens, 4 rows
    with pytest.raises(StagingError, match=r"num_tokens: 5 scheduled tokens exceed bucket.num_tokens=4"):
        pack_host_batch([5], [0], [[1]], bucket, CFG_SMALL)
    with pytest.raises(StagingError, match=r"num_reqs: 5 requests exceed bucket.num_reqs=4"):
        pack_host_batch([1] * 5, [0] * 5, [[1]] * 5, bucket._replace(num_tokens=8), CFG_SMALL)


def test_block_table_as_2d_array():
    table = np.array([[4, 0, 0, 0], [6, 7, 0, 0]])
    md = stage_batch([1, 2], [0, 127], table, CFG_SMALL)
    np.testing.assert_array_equal(md.slot_mapping[:3], [512, 6 * 128 + 127, 7 * 128])
    validate_metadata(md, CFG_SMALL)


def test_empty_batch_is_all_padding():
    md = stage_batch([], [], [], CFG_SMALL)
    assert (md.num_tokens_padded, md.num_reqs_padded) == (4, 4)
    np.testing.assert_array_equal(md.query_start_loc, 0)
    np.testing.assert_array_equal(md.token_mask, False)
    np.testing.assert_array_equal(md.slot_mapping, -1)
    validate_metadata(md, CFG_SMALL)

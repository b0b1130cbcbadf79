"""Dummy batches (docs/DESIGN.md, "Dummy batches"): reference cases, negative controls, every kind x bucket."""
import chex
import jax
import numpy as np
import pytest
from hypothesis import given, strategies as st

from jax_msa_runner.batch.buckets import make_buckets, select_bucket
from jax_msa_runner.config import NULL_PAGE_ID, RunnerConfig
from jax_msa_runner.batch.dcp import dcp_owner, rank_slot_mapping
from jax_msa_runner.batch.staging import (DUMMY_KINDS, DUMMY_PAGE_ID, StagingError, dummy_host_batch,
                                    _pack_arrays, dummy_query_lens, pack_host_batch,
                                    stage_dummy_batch, stage_packed_jit)
from jax_msa_runner.batch.validate import MetadataInvariantError, checked_validate, validate_jit, validate_metadata

# One request of four scheduled tokens: max_num_seqs = 1.
CFG_ONE = RunnerConfig(max_num_seqs=1, max_num_batched_tokens=16, bucket_sizes=(8, 16),
                       max_model_len=8192)
CFG_DCP_MIXED = RunnerConfig(max_num_seqs=2, max_num_batched_tokens=16, bucket_sizes=(8, 16),
                             max_model_len=4096, dcp_world_size=2)
CFG_SPEC = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=32, bucket_sizes=(1, 3, 8, 17, 32),
                        max_model_len=1000, num_spec_tokens=3)
CONFIGS = [
    RunnerConfig(),  # S=8, buckets 1..64, max_model_len 8192
    CFG_SPEC,
    RunnerConfig(max_num_seqs=4, max_num_batched_tokens=16, bucket_sizes=(2, 5, 16),
                 max_model_len=3000, dcp_world_size=4, num_spec_tokens=1),
]


def host(md):
    return jax.tree.map(np.asarray, jax.device_get(md))


def assert_host_device_agree(md, h):
    n = h.num_scheduled.size
    chex.assert_trees_all_equal(
        (md.num_scheduled_tokens[:n], md.num_computed_tokens[:n], md.seq_lens[:n],
         md.block_table[:n]),
        (h.num_scheduled.astype(np.int32), h.num_computed.astype(np.int32),
         h.seq_lens.astype(np.int32), h.block_table.astype(np.int32)))


def assert_padding_zeroed(md, n):
    total = int(md.query_start_loc[n])
    for name in ("num_scheduled_tokens", "num_computed_tokens", "seq_lens"):
        np.testing.assert_array_equal(getattr(md, name)[n:], 0, err_msg=name)
    np.testing.assert_array_equal(md.block_table[n:], 0)
    np.testing.assert_array_equal(md.query_start_loc[n:], total)
    for name in ("req_indices", "query_pos", "positions", "num_valid_pages", "kv_lens"):
        np.testing.assert_array_equal(getattr(md, name)[total:], 0, err_msg=name)
    np.testing.assert_array_equal(md.slot_mapping[total:], -1)
    np.testing.assert_array_equal(md.token_mask, np.arange(md.num_tokens_padded) < total)
    np.testing.assert_array_equal(md.req_mask, np.arange(md.num_reqs_padded) < n)


@pytest.mark.parametrize("L, seq_len, computed, positions", [
    (1, 4, 0, [0, 1, 2, 3]),
    (4, 4, 0, [0, 1, 2, 3]),
    (4096, 4096, 4092, [4092, 4093, 4094, 4095]),
])
def test_reference_profiling_overrides(L, seq_len, computed, positions):
    h = dummy_host_batch(4, CFG_ONE, profile_seq_len=L)
    chex.assert_trees_all_equal((h.num_scheduled, h.num_computed, h.seq_lens),
                                (np.array([4]), np.array([computed]), np.array([seq_len])))
    md = host(stage_dummy_batch(4, CFG_ONE, profile_seq_len=L))
    chex.assert_shape(md.positions, (8,))
    assert_host_device_agree(md, h)
    np.testing.assert_array_equal(md.positions[:4], positions)
    np.testing.assert_array_equal(md.kv_lens[:4], np.array(positions) + 1)
    np.testing.assert_array_equal(md.num_valid_pages[:4], np.array(positions) // 128 + 1)
    np.testing.assert_array_equal(md.seq_lens, md.num_computed_tokens + md.num_scheduled_tokens)
    np.testing.assert_array_equal(
        md.positions[:4], md.num_computed_tokens[md.req_indices[:4]] + md.query_pos[:4])
    assert_padding_zeroed(md, 1)
    validate_metadata(md, CFG_ONE)
    assert validate_jit(md, CFG_ONE).get() is None


def test_mixed_dcp_batch_keeps_context_as_computed_length():
    cfg = CFG_DCP_MIXED
    ctx = cfg.dcp_dummy_context_len
    assert ctx == 2 * 128
    np.testing.assert_array_equal(dummy_query_lens(7, cfg, "mixed"), [1, 6])
    h = dummy_host_batch(7, cfg, kind="mixed")
    md = host(stage_dummy_batch(7, cfg, kind="mixed"))
    assert_host_device_agree(md, h)
    np.testing.assert_array_equal(md.num_computed_tokens[:2], [ctx, ctx])
    np.testing.assert_array_equal(md.seq_lens[:2], [ctx + 1, ctx + 6])
    # The fake context has valid, non-null block ids on every rank-local page it covers.
    np.testing.assert_array_equal(md.block_table[:2, :2], DUMMY_PAGE_ID)
    np.testing.assert_array_equal(md.block_table[:2, 2:], 0)
    validate_metadata(md, cfg)
    # Slot mapping over the exact active query-start slice: tokens [qsl[0], qsl[n]).
    qsl = md.query_start_loc[:3]
    np.testing.assert_array_equal(qsl, [0, 1, 7])
    active = slice(int(qsl[0]), int(qsl[-1]))
    pos = np.concatenate([np.arange(ctx, ctx + 1), np.arange(ctx, ctx + 6)])
    np.testing.assert_array_equal(md.positions[active], pos)
    owners = np.asarray(dcp_owner(md.positions, 2))[active]
    np.testing.assert_array_equal(owners, (pos // 128) % 2)
    per_rank = np.stack([np.asarray(rank_slot_mapping(md, 2, r)) for r in range(2)])
    local = (pos // 256) * 128 + pos % 128
    expected = DUMMY_PAGE_ID * 128 + local % 128
    for r in range(2):
        np.testing.assert_array_equal(per_rank[r, active], np.where(owners == r, expected, -1))
        np.testing.assert_array_equal(per_rank[r, int(qsl[-1]):], -1)
    np.testing.assert_array_equal((per_rank[:, active] >= 0).sum(axis=0), 1)


@pytest.mark.parametrize("L", [None, 300])
def test_ragged_uniform_decode_tail(L):
    cfg = RunnerConfig(max_num_seqs=2, max_num_batched_tokens=16, bucket_sizes=(8, 16),
                       max_model_len=1000, num_spec_tokens=3)
    np.testing.assert_array_equal(dummy_query_lens(7, cfg, "uniform_decode"), [4, 3])
    h = dummy_host_batch(7, cfg, kind="uniform_decode", profile_seq_len=L)
    md = host(stage_dummy_batch(7, cfg, kind="uniform_decode", profile_seq_len=L))
    assert_host_device_agree(md, h)
    seq = np.array([4, 3]) if L is None else np.array([L, L])
    np.testing.assert_array_equal(md.seq_lens[:2], seq)
    qsl = md.query_start_loc[:3]
    np.testing.assert_array_equal(qsl, [0, 4, 7])
    for r in range(2):
        rows = slice(int(qsl[r]), int(qsl[r + 1]))
        np.testing.assert_array_equal(md.positions[rows],
                                      np.arange(seq[r] - (rows.stop - rows.start), seq[r]))
        np.testing.assert_array_equal(md.slot_mapping[rows],
                                      DUMMY_PAGE_ID * 128 + md.positions[rows] % 128)
    assert md.positions[int(qsl[2]) - 1] == md.seq_lens[1] - 1
    np.testing.assert_array_equal(md.slot_mapping[int(qsl[2]):], -1)
    assert_padding_zeroed(md, 2)
    validate_metadata(md, cfg)


def test_negative_control_lower_bound_removed():
    """Without max(target, num_scheduled), L=1 under 4 scheduled tokens gives computed -3: the
    host packer refuses it, and staged anyway (no host checks) its metadata puts 3 tokens at
    negative positions whose slots fall in the null page; the validator rejects it. The
    fixed normalisation stages seq_len 4, computed 0."""
    L = 1
    q = dummy_query_lens(4, CFG_ONE, "default")
    np.testing.assert_array_equal(q, [4])  # max_num_seqs = 1: one row of all 4 tokens
    comp = np.minimum(L, CFG_ONE.max_model_len) - q  # the pre-fix normalisation: no max(., q)
    bucket = select_bucket(4, 1, CFG_ONE)
    table = np.zeros((1, bucket.max_pages), np.int64)
    table[0, 0] = DUMMY_PAGE_ID
    with pytest.raises(StagingError, match=r"num_computed_tokens\[0\] = -3"):
        pack_host_batch(q, comp, table, bucket, CFG_ONE)
    md = host(stage_packed_jit(_pack_arrays(q, comp, table, bucket), bucket=bucket, config=CFG_ONE))
    # the staged metadata against the expectations of a sequence of length L = 1 whose 4
    # query tokens end at position L - 1 = 0: positions -3..0, slots DUMMY_PAGE_ID * 128 + p,
    # i.e. the first three in page DUMMY_PAGE_ID - 1 = the null page
    np.testing.assert_array_equal(md.seq_lens[:1], [1])
    np.testing.assert_array_equal(md.num_computed_tokens[:1], [-3])
    np.testing.assert_array_equal(md.positions[:4], [-3, -2, -1, 0])
    np.testing.assert_array_equal(md.slot_mapping[:4], [125, 126, 127, 128])
    assert (md.slot_mapping[:3] // 128 == NULL_PAGE_ID).all()
    with pytest.raises(MetadataInvariantError, match=r"num_computed_tokens\[0\] = -3: must be >= 0"):
        validate_metadata(md, CFG_ONE)
    err = validate_jit(md, CFG_ONE)
    assert "num_computed_tokens[0] = -3" in err.get()
    # The fixed normalisation: seq_len = max(L, 4) = 4, computed 0, positions 0..3 in the
    # dummy page, valid.
    fixed = host(stage_dummy_batch(4, CFG_ONE, profile_seq_len=L))
    np.testing.assert_array_equal(fixed.seq_lens[:1], [4])
    np.testing.assert_array_equal(fixed.num_computed_tokens[:1], [0])
    np.testing.assert_array_equal(fixed.positions[:4], [0, 1, 2, 3])
    np.testing.assert_array_equal(fixed.slot_mapping[:4], [128, 129, 130, 131])
    validate_metadata(fixed, CFG_ONE)


def test_negative_control_stale_positions():
    """Pre-fix: seq_lens restaged to L=4096 but positions left at the short batch's values."""
    fixed = stage_dummy_batch(4, CFG_ONE, profile_seq_len=4096)
    short = stage_dummy_batch(4, CFG_ONE)  # positions 0..3: what a stale buffer holds
    stale = fixed.replace(positions=short.positions, num_valid_pages=short.num_valid_pages,
                          slot_mapping=short.slot_mapping)
    np.testing.assert_array_equal(stale.positions[:4], [0, 1, 2, 3])
    np.testing.assert_array_equal(stale.seq_lens[:1], [4096])
    with pytest.raises(MetadataInvariantError,
                       match=r"selector/consumer page count mismatch at token 0.*= 1 .*= 32"):
        validate_metadata(stale, CFG_ONE)
    err = validate_jit(stale, CFG_ONE)
    assert "selector/consumer page count mismatch" in err.get()
    with pytest.raises(Exception, match="selector/consumer page count mismatch"):
        err.throw()


def test_checked_validate_inside_user_jit():
    from jax.experimental import checkify
    from jax_msa_runner.batch.staging import pack_host_batch as pack, stage_packed

    bucket = select_bucket(4, 1, CFG_ONE)
    h = dummy_host_batch(4, CFG_ONE, profile_seq_len=4096)

    @jax.jit
    def debug_step(packed):
        md = stage_packed(packed, bucket, CFG_ONE)
        checked_validate(md, CFG_ONE)
        return md.positions

    good = pack(h.num_scheduled, h.num_computed, h.block_table, bucket, CFG_ONE)
    err, positions = checkify.checkify(debug_step)(good)
    assert err.get() is None
    np.testing.assert_array_equal(positions[:4], [4092, 4093, 4094, 4095])
    bad = _pack_arrays(np.array([4]), np.array([-3]), h.block_table, bucket)
    err, _ = checkify.checkify(debug_step)(bad)
    assert "num_computed_tokens[0] = -3" in err.get()


def test_build_attention_false_stages_nothing():
    assert stage_dummy_batch(4, CFG_ONE, profile_seq_len=4096, build_attention=False) is None
    with pytest.raises(StagingError, match="kind"):
        stage_dummy_batch(4, CFG_ONE, kind="prefill", build_attention=False)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_tokens=0), r"num_tokens: must be in \[1, 16\]"),
    (dict(num_tokens=17), r"num_tokens: must be in \[1, 16\]"),
    (dict(num_tokens=4, kind="decode"), r"kind: must be one of"),
    (dict(num_tokens=4, profile_seq_len=0), r"profile_seq_len: must be >= 1"),
    (dict(num_tokens=4, dcp_context_len=-1), r"dcp_context_len: must be >= 0"),
])
def test_dummy_bad_arguments(kwargs, match):
    with pytest.raises(StagingError, match=match):
        stage_dummy_batch(config=CFG_ONE, **kwargs)


def test_dummy_row_longer_than_max_model_len():
    cfg = RunnerConfig(max_num_seqs=2, max_num_batched_tokens=64, bucket_sizes=(64,),
                       max_model_len=40)
    with pytest.raises(StagingError, match=r"dummy row 1 of kind 'mixed' schedules 63 tokens"):
        stage_dummy_batch(64, cfg, kind="mixed")


def test_dummy_query_lens_shapes():
    cfg = RunnerConfig(max_num_seqs=3, max_num_batched_tokens=32, bucket_sizes=(32,),
                       num_spec_tokens=2)
    np.testing.assert_array_equal(dummy_query_lens(10, cfg, "default"), [3, 3, 4])
    np.testing.assert_array_equal(dummy_query_lens(2, cfg, "default"), [1, 1])
    np.testing.assert_array_equal(dummy_query_lens(8, cfg, "uniform_decode"), [3, 3, 2])
    np.testing.assert_array_equal(dummy_query_lens(2, cfg, "uniform_decode"), [2])
    np.testing.assert_array_equal(dummy_query_lens(20, cfg, "uniform_decode"), [3, 3, 3])
    np.testing.assert_array_equal(dummy_query_lens(10, cfg, "mixed"), [1, 1, 8])
    np.testing.assert_array_equal(dummy_query_lens(1, cfg, "mixed"), [1])


@given(cfg_i=st.integers(0, len(CONFIGS) - 1), data=st.data(),
       kind=st.sampled_from(DUMMY_KINDS),
       L=st.one_of(st.none(), st.integers(1, 9000)),
       ctx=st.one_of(st.none(), st.integers(0, 700)))
def test_every_dummy_kind_over_every_bucket_property(cfg_i, data, kind, L, ctx):
    cfg = CONFIGS[cfg_i]
    bucket = data.draw(st.sampled_from(make_buckets(cfg)))
    N = bucket.num_tokens
    h = dummy_host_batch(N, cfg, kind=kind, profile_seq_len=L, dcp_context_len=ctx)
    md = host(stage_dummy_batch(N, cfg, kind=kind, profile_seq_len=L, dcp_context_len=ctx))
    assert (md.num_tokens_padded, md.num_reqs_padded, md.max_pages) == tuple(bucket)
    validate_metadata(md, cfg)
    assert_host_device_agree(md, h)
    n = h.num_scheduled.size
    assert_padding_zeroed(md, n)
    q = h.num_scheduled
    ctx_len = cfg.dcp_dummy_context_len if ctx is None else ctx
    target = q + ctx_len if L is None else np.full_like(q, L)
    np.testing.assert_array_equal(h.seq_lens, np.minimum(np.maximum(target, q), cfg.max_model_len))
    assert (h.num_computed >= 0).all()
    # Every row's positions end at its causal tail, seq_len - 1.
    ends = md.query_start_loc[1:n + 1] - 1
    np.testing.assert_array_equal(md.positions[ends], md.seq_lens[:n] - 1)
    if L is None and (ctx_len + q <= cfg.max_model_len).all():
        np.testing.assert_array_equal(md.num_computed_tokens[:n], ctx_len)

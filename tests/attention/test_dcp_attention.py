"""DCP attention on a CPU device mesh (W = 2 and 4 host devices, conftest) == single device.

Every comparison runs the same batch twice: staged with dcp_world_size = 1 over global
caches and with dcp_world_size = W over the per-rank caches of the interleave rule
(``shard_paged_caches`` / ``unshard_paged_caches``). Selections (global block ids) must be
identical; outputs agree to f32 rounding (atol = rtol = 1e-5) in f32 and to BF16_TOL in
bf16 (the per-rank partial outputs are rounded to bf16 before the log-sum-exp merge: two
bf16 roundings instead of one).
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_msa_runner.config import ConfigError, RunnerConfig
from jax_msa_runner.batch.dcp import dcp_owner
from jax_msa_runner.attention.dense import paged_causal_attention
from jax_msa_runner.attention.paged_cache import write_kv
from jax_msa_runner.attention.dcp import (
    DCPError, check_config_mesh, dcp_dense_attention, dcp_index_select, dcp_msa_attention,
    dcp_write_caches, lse_merge_across,
    mesh_for_config, make_dcp_mesh, merge_candidates, shard_paged_caches, shard_to_mesh,
    unshard_paged_caches)
from jax_msa_runner.batch.staging import stage_batch, stage_dummy_batch
from jax_msa_runner.batch.validate import validate_metadata
from jax_msa_runner.attention.msa import msa_attention, msa_attention_reference
from pallas_kernels import msa_index_scores_reference, sparse_topk_select_reference
from _helpers import INTERPRET
from pallas_kernels import PAGE_SIZE

HQ, HKV, D, DI = 8, 2, 16, 16
SCALE = D ** -0.5
MAX_LEN = 4096  # 32 global pages: rows past 16 pages exercise the real top-16
MAX_PAGES = MAX_LEN // PAGE_SIZE
N_GLOBAL = 1 + 4 * MAX_PAGES  # fixed cache shapes: one compile per (W, dtype)
N_LOCAL = 1 + 4 * MAX_PAGES // 2  # enough for 4 rows of ceil(32 / W) local pages, W >= 2
F32_TOL = dict(atol=1e-5, rtol=1e-5)
BF16_TOL = dict(atol=4e-3, rtol=8e-3)  # measured max |diff| 1e-3 (one bf16 ulp at 0.25)
LSE_TOL = dict(atol=1e-5, rtol=1e-5)


def _config(world_size, **kw):
    kw = dict(dict(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=MAX_LEN,
                   bucket_sizes=(8,)), **kw)
    return RunnerConfig(dcp_world_size=world_size, **kw)


def _random_rows(rng):
    """1-3 requests of 1-2 tokens; the first one long (> 16 pages), the others anywhere."""
    n = int(rng.integers(1, 4))
    sched = rng.integers(1, 3, n)
    comp = rng.integers(0, MAX_LEN - sched + 1)
    comp[0] = rng.integers(2100, MAX_LEN - sched[0] + 1)
    return sched, comp


def _global_table(rng, seq):
    """Random distinct pages 1.. per row, width MAX_PAGES: int64 [n, MAX_PAGES]."""
    need = -(-seq // PAGE_SIZE)
    perm = rng.permutation(np.arange(1, N_GLOBAL))
    table = np.zeros((seq.size, MAX_PAGES), np.int64)
    o = 0
    for r, k in enumerate(need):
        table[r, :k] = perm[o:o + k]
        o += k
    return table


def _inputs(rng, n_pages, t, dtype, ties=False):
    """Caches kv [n_pages, Hkv, 128, 2D], index-K [n_pages, 128, Di] and queries (numpy)."""
    kv = rng.standard_normal((n_pages, HKV, PAGE_SIZE, 2 * D)).astype(np.float32)
    ik = (np.ones((n_pages, PAGE_SIZE, DI), np.float32) if ties
          else rng.standard_normal((n_pages, PAGE_SIZE, DI)).astype(np.float32))
    q = rng.standard_normal((t, HQ, D)).astype(np.float32)
    iq = rng.standard_normal((t, HKV, DI)).astype(np.float32)
    return tuple(np.asarray(jnp.asarray(a, dtype)) for a in (kv, ik, q, iq))


def _assert_same(single, dist, md, dtype):
    """Exact selections everywhere; out/lse on real tokens within the dtype's tolerance."""
    (o1, l1, s1), (o2, l2, s2) = single, dist
    mask = np.asarray(md.token_mask)
    chex.assert_shape(o2, o1.shape)
    chex.assert_trees_all_equal(np.asarray(s2), np.asarray(s1))
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    chex.assert_tree_all_finite(np.asarray(o2, np.float32)[mask])
    chex.assert_trees_all_close(np.asarray(o2, np.float32)[mask],
                                np.asarray(o1, np.float32)[mask], **tol)
    chex.assert_trees_all_close(np.asarray(l2)[mask], np.asarray(l1)[mask], **LSE_TOL)
    # padded tokens: no key anywhere -> exact zeros (finite: NaN is not zero) and -inf, as on
    # one device
    assert (~mask).any(), "the batch must have padded tokens for this check to mean anything"
    for o in (o1, o2):
        pad = np.asarray(o, np.float32)[~mask]
        chex.assert_tree_all_finite(pad)
        chex.assert_trees_all_equal(pad, np.zeros_like(pad))
    assert np.all(np.isneginf(np.asarray(l1)[~mask]))
    assert np.all(np.isneginf(np.asarray(l2)[~mask]))


def _stage_both_ways(rng, sched, comp, world_size, dtype, ties=False):
    """One batch staged for one device (global pages) and for W ranks (rank-local pages), both
    validated, with random caches and queries. Returns ``(md1, mdw, mesh, (kv, ik, q, iq),
    (kvs, iks))``: the global caches as numpy, the rank caches sharded over the mesh."""
    seq = sched + comp
    cfg1, cfgw = _config(1), _config(world_size)
    gbt = _global_table(rng, seq)
    md1 = stage_batch(sched, comp, gbt, cfg1)
    kv, ik, q, iq = _inputs(rng, N_GLOBAL, md1.num_tokens_padded, dtype, ties)
    (kvs, iks), lbt = shard_paged_caches([kv, ik], gbt, seq, world_size,
                                         num_local_pages=N_LOCAL)
    mdw = stage_batch(sched, comp, lbt, cfgw)
    validate_metadata(md1, cfg1)
    validate_metadata(mdw, cfgw)
    mesh = make_dcp_mesh(world_size)
    ranked = tuple(shard_to_mesh(jnp.asarray(x), mesh) for x in (kvs, iks))
    return md1, mdw, mesh, (kv, ik, q, iq), ranked


def _both_paths(rng, world_size, dtype, *, use_kernels, ties=False):
    """Stages one random batch both ways and runs the single-device and DCP pipelines."""
    sched, comp = _random_rows(rng)
    md1, mdw, mesh, (kv, ik, q, iq), (kvs, iks) = _stage_both_ways(rng, sched, comp,
                                                                   world_size, dtype, ties)
    if use_kernels:
        single = msa_attention(q, iq, kv, ik, md1, scale=SCALE, interpret=INTERPRET)
    else:
        single = msa_attention_reference(q, iq, kv, ik, md1, scale=SCALE)
    dist = dcp_msa_attention(q, iq, kvs, iks, mdw, mesh, scale=SCALE, interpret=INTERPRET,
                             use_kernels=use_kernels)
    return single, dist, md1, mdw, (iq, iks, mesh)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_random_batches_match_single_device_references(world_size, dtype):
    """jnp references inside shard_map: random batches and an all-ties index cache."""
    rng = np.random.default_rng(100 * world_size + (dtype == jnp.bfloat16))
    for ties in (False, False, False, True):
        single, dist, md1, mdw, (iq, iks, mesh) = _both_paths(rng, world_size, dtype,
                                                              use_kernels=False, ties=ties)
        _assert_same(single, dist, md1, dtype)
    # The last batch (all scores tied): the global tie-break is by id across ranks, so the
    # first 15 ids plus the forced local block win; each rank keeps exactly its own ids.
    glob, local = dcp_index_select(iq, iks, mdw, mesh, use_kernels=False)
    chex.assert_trees_all_equal(glob, dist[2])
    chex.assert_shape(local, (world_size,) + glob.shape)
    for d in range(world_size):
        chex.assert_trees_all_equal(local[d], _rank_share(np.asarray(glob), world_size, d))
    nvp = np.asarray(mdw.num_valid_pages)
    long_tokens = np.flatnonzero(np.asarray(mdw.token_mask) & (nvp > 16))
    assert long_tokens.size > 0
    for t in long_tokens:
        expected = np.append(np.arange(15), nvp[t] - 1)  # ids 0..14 and the forced block
        chex.assert_trees_all_equal(np.asarray(glob)[t], np.tile(expected, (HKV, 1)))


def test_init_blocks_forced_on_their_owners():
    """init_blocks = 3: global blocks 0, 1, 2 forced (on ranks 0, 1, 0 of W = 2) like the
    single-device selector's init blocks."""
    world_size = 2
    rng = np.random.default_rng(21)
    sched, comp = np.array([1, 2]), np.array([3500, 2600])
    md1, mdw, mesh, (_, ik, _, iq), (_, iks) = _stage_both_ways(rng, sched, comp, world_size,
                                                                jnp.float32)
    glob, _ = dcp_index_select(iq, iks, mdw, mesh, use_kernels=False, init_blocks=3)
    scores = msa_index_scores_reference(jnp.asarray(iq), jnp.asarray(ik), md1.block_table,
                                        md1.req_indices, md1.positions)
    expected = sparse_topk_select_reference(scores, md1.num_valid_pages, init_blocks=3)
    chex.assert_trees_all_equal(glob, expected)
    real = np.asarray(md1.token_mask)
    assert (np.asarray(glob)[real][..., :3] == np.arange(3)).all()


def _rank_share(glob, world_size, rank):
    """Rank's winners of a global selection as local ids, ascending, -1 padded (numpy)."""
    big = np.iinfo(np.int32).max
    own = np.sort(np.where((glob >= 0) & (glob % world_size == rank), glob // world_size, big),
                  axis=-1)
    return np.where(own == big, -1, own).astype(np.int32)


@pytest.mark.parametrize("world_size,dtype", [(2, jnp.float32), (4, jnp.bfloat16)],
                         ids=["w2-f32", "w4-bf16"])
def test_pallas_kernels_match_single_device_msa_attention(world_size, dtype):
    """Pallas kernels (interpret mode on CPU) inside shard_map == jax_msa_runner.attention.msa."""
    rng = np.random.default_rng(7 + world_size)
    single, dist, md1, _, _ = _both_paths(rng, world_size, dtype, use_kernels=True)
    _assert_same(single, dist, md1, dtype)


@pytest.mark.parametrize("kind,world_size,ctx,lens", [
    ("mixed", 2, None, [1, 6]), ("mixed", 4, 2600, [1, 6]),
    ("uniform_decode", 4, None, [4, 3]), ("uniform_decode", 2, 2600, [4, 3])])
def test_dcp_dummy_batches_stage_and_run(kind, world_size, ctx, lens):
    """A mixed DCP dummy batch [1, 6] and a ragged uniform-decode batch [4, 3] (the DCP dummy
    context W*I, or a long one past 16 pages) satisfy every invariant and attend like the
    single-device batch over the same (dummy-page) context."""
    extra = dict(max_num_seqs=2) if kind == "mixed" else dict(num_spec_tokens=3)
    cfgw, cfg1 = _config(world_size, **extra), _config(1, **extra)
    md = stage_dummy_batch(7, cfgw, kind=kind, dcp_context_len=ctx)
    validate_metadata(md, cfgw)
    n = int(np.asarray(md.req_mask).sum())
    sched = np.asarray(md.num_scheduled_tokens)[:n]
    comp = np.asarray(md.num_computed_tokens)[:n]
    chex.assert_trees_all_equal(sched, np.asarray(lens, np.int32))
    np.testing.assert_array_equal(comp, world_size * PAGE_SIZE if ctx is None else ctx)
    # every row's last token sits at its causal tail (the ragged row included)
    last = np.asarray(md.query_start_loc)[1:n + 1] - 1
    np.testing.assert_array_equal(np.asarray(md.positions)[last],
                                  np.asarray(md.seq_lens)[:n] - 1)

    rng = np.random.default_rng(len(kind) + world_size)
    _, _, q, iq = _inputs(rng, 1, md.num_tokens_padded, jnp.float32)
    kvs = rng.standard_normal((world_size, N_LOCAL, HKV, PAGE_SIZE, 2 * D)).astype(np.float32)
    iks = rng.standard_normal((world_size, N_LOCAL, PAGE_SIZE, DI)).astype(np.float32)
    lbt = np.asarray(md.block_table)[:n]
    (kv, ik), gbt = unshard_paged_caches([kvs, iks], lbt, sched + comp, world_size, MAX_PAGES)
    md1 = stage_batch(sched, comp, gbt, cfg1)
    validate_metadata(md1, cfg1)
    mesh = make_dcp_mesh(world_size)
    dist = dcp_msa_attention(q, iq, shard_to_mesh(jnp.asarray(kvs), mesh),
                             shard_to_mesh(jnp.asarray(iks), mesh), md, mesh, scale=SCALE,
                             use_kernels=False)
    single = msa_attention_reference(q, iq, kv, ik, md1, scale=SCALE)
    _assert_same(single, dist, md1, jnp.float32)


@pytest.mark.parametrize("world_size", [2, 4])
def test_dense_layers_match_single_device(world_size):
    """Dense causal attention (the dense layers) split over the ranks == one device."""
    rng = np.random.default_rng(50 + world_size)
    sched, comp = _random_rows(rng)
    md1, mdw, mesh, (kv, _, q, _), (kvs, _) = _stage_both_ways(rng, sched, comp, world_size,
                                                               jnp.float32)
    out, lse = dcp_dense_attention(q, kvs, mdw, mesh, scale=SCALE)
    ref_out, ref_lse = paged_causal_attention(jnp.asarray(q), jnp.asarray(kv), md1.block_table,
                                              md1.req_indices, md1.kv_lens, scale=SCALE)
    mask = np.asarray(md1.token_mask)
    chex.assert_trees_all_close(np.asarray(out)[mask], np.asarray(ref_out)[mask], **F32_TOL)
    chex.assert_trees_all_close(np.asarray(lse)[mask], np.asarray(ref_lse)[mask], **LSE_TOL)


def test_cache_writes_land_only_on_the_owning_rank():
    """dcp_write_caches: token at position p is written on rank (p // 128) % W only, at the
    slot that the interleave rule maps back to global position p."""
    world_size = 4
    rng = np.random.default_rng(3)
    sched, comp = np.array([2, 1, 3]), np.array([0, 600, 1000])
    seq = sched + comp
    cfgw = _config(world_size)
    lbt = 1 + rng.permutation(N_LOCAL - 1)[:3 * 4].reshape(3, 4)  # distinct local pages
    md = stage_batch(sched, comp, lbt, cfgw)
    validate_metadata(md, cfgw)
    t = md.num_tokens_padded
    k, v = (rng.standard_normal((t, HKV, D)).astype(np.float32) for _ in range(2))
    index_k = rng.standard_normal((t, DI)).astype(np.float32)
    mesh = make_dcp_mesh(world_size)
    kvs = shard_to_mesh(jnp.zeros((world_size, N_LOCAL, HKV, PAGE_SIZE, 2 * D)), mesh)
    iks = shard_to_mesh(jnp.zeros((world_size, N_LOCAL, PAGE_SIZE, DI)), mesh)
    kvs, iks = dcp_write_caches(kvs, iks, k, v, index_k, md, mesh)
    kvs, iks = np.asarray(kvs), np.asarray(iks)

    real = np.asarray(md.token_mask)
    pos, slot = np.asarray(md.positions), np.asarray(md.slot_mapping)
    owner = np.asarray(dcp_owner(md.positions, world_size))
    exp_kv, exp_ik = np.zeros_like(kvs), np.zeros_like(iks)
    for i in np.flatnonzero(real):
        exp_kv[owner[i], slot[i] // PAGE_SIZE, :, slot[i] % PAGE_SIZE] = np.concatenate([k[i], v[i]], -1)
        exp_ik[owner[i], slot[i] // PAGE_SIZE, slot[i] % PAGE_SIZE] = index_k[i]
    chex.assert_trees_all_equal((kvs, iks), (exp_kv, exp_ik))
    # read back through the global view: global position p holds token p's keys
    (kv, ik), gbt = unshard_paged_caches([kvs, iks], lbt, seq, world_size, MAX_PAGES)
    req = np.asarray(md.req_indices)
    for i in np.flatnonzero(real):
        page = gbt[req[i], pos[i] // PAGE_SIZE]
        chex.assert_trees_all_equal(kv[page, :, pos[i] % PAGE_SIZE, :D], k[i])
        chex.assert_trees_all_equal(ik[page, pos[i] % PAGE_SIZE], index_k[i])


def test_write_then_attend_on_the_mesh():
    """The config's mesh: place per-rank caches, write a step's K/V (owner only), attend
    (dense layer path) == one device writing the same K/V into the global view."""
    world_size = 2
    cfgw, cfg1 = _config(world_size), _config(1)
    mesh = mesh_for_config(cfgw)
    rng = np.random.default_rng(9)
    sched, comp = np.array([1, 2, 3]), np.array([300, 0, 1500])
    seq = sched + comp
    lbt = 1 + rng.permutation(N_LOCAL - 1)[:3 * 6].reshape(3, 6)
    mdw = stage_batch(sched, comp, lbt, cfgw)
    validate_metadata(mdw, cfgw)
    kvs = rng.standard_normal((world_size, N_LOCAL, HKV, PAGE_SIZE, 2 * D)).astype(np.float32)
    (kv,), gbt = unshard_paged_caches([kvs], lbt, seq, world_size, MAX_PAGES)
    md1 = stage_batch(sched, comp, gbt, cfg1)
    t = mdw.num_tokens_padded
    k, v, q = (jnp.asarray(rng.standard_normal(shape).astype(np.float32))
               for shape in ((t, HKV, D), (t, HKV, D), (t, HQ, D)))
    new_kvs, _ = dcp_write_caches(shard_to_mesh(jnp.asarray(kvs), mesh),
                                  shard_to_mesh(jnp.zeros((world_size, N_LOCAL, PAGE_SIZE, DI)), mesh),
                                  k, v, jnp.zeros((t, DI)), mdw, mesh)
    out, lse = dcp_dense_attention(q, new_kvs, mdw, mesh, scale=SCALE)
    new_kv = write_kv(jnp.asarray(kv), k, v, md1.slot_mapping)
    ref_out, ref_lse = paged_causal_attention(q, new_kv, md1.block_table, md1.req_indices,
                                              md1.kv_lens, scale=SCALE)
    mask = np.asarray(md1.token_mask)
    chex.assert_trees_all_close(np.asarray(out)[mask], np.asarray(ref_out)[mask], **F32_TOL)
    chex.assert_trees_all_close(np.asarray(lse)[mask], np.asarray(ref_lse)[mask], **LSE_TOL)
    # the written caches are the sharding of the single device's written cache
    (round_trip,), _ = unshard_paged_caches([np.asarray(new_kvs)], lbt, seq, world_size,
                                            MAX_PAGES)
    for r, n in enumerate(-(-seq // PAGE_SIZE)):
        chex.assert_trees_all_equal(round_trip[gbt[r, :n]], np.asarray(new_kv)[gbt[r, :n]])


def test_shard_unshard_round_trip():
    rng = np.random.default_rng(5)
    seq = np.array([4000, 129, 1])
    gbt = _global_table(rng, seq)
    kv, ik, _, _ = _inputs(rng, N_GLOBAL, 1, jnp.float32)
    for w in (1, 2, 4):
        (kvs, iks), lbt = shard_paged_caches([kv, ik], gbt, seq, w)
        chex.assert_shape(lbt, (3, -(-32 // w)))
        assert (lbt[0] > 0).all() and (lbt[2, 1:] == 0).all()
        (kv2, ik2), gbt2 = unshard_paged_caches([kvs, iks], lbt, seq, w, MAX_PAGES)
        for r, n in enumerate(-(-seq // PAGE_SIZE)):
            chex.assert_trees_all_equal((kv2[gbt2[r, :n]], ik2[gbt2[r, :n]]),
                                        (kv[gbt[r, :n]], ik[gbt[r, :n]]))


def test_merge_candidates_ties_and_rank_shares():
    """Global top-16 by (score desc, id asc) over all ranks' candidates; -inf never wins."""
    w = 2
    gids = np.stack([np.arange(0, 40, 2)[:16], np.arange(1, 41, 2)[:16]]).reshape(1, 1, 32)
    vals = np.ones((1, 1, 32), np.float32)
    vals[0, 0, 5] = np.inf  # forced: id 10
    vals[0, 0, 16:20] = 2.0  # ids 1, 3, 5, 7 (rank 1) beat the ties
    vals[0, 0, 31] = -np.inf  # id 31: never selected
    glob, local = merge_candidates(jnp.asarray(vals), jnp.asarray(gids, jnp.int32), w, 1)
    winners = [10, 1, 3, 5, 7]
    expected = np.sort(np.concatenate([winners, np.setdiff1d(np.arange(40), winners)[:11]]))
    chex.assert_trees_all_equal(np.asarray(glob)[0, 0], expected.astype(np.int32))
    chex.assert_trees_all_equal(np.asarray(local)[0, 0], _rank_share(expected, w, 1))
    # fewer than 16 finite candidates: -1 padded at the tail
    vals[0, 0, 3:] = -np.inf
    glob, local = merge_candidates(jnp.asarray(vals), jnp.asarray(gids, jnp.int32), w, 0)
    tail = [-1] * 13
    chex.assert_trees_all_equal(np.asarray(glob)[0, 0], np.array([0, 2, 4] + tail, np.int32))
    chex.assert_trees_all_equal(np.asarray(local)[0, 0], np.array([0, 1, 2] + tail, np.int32))


def _merge_on_mesh(out, lse, world_size):
    mesh = make_dcp_mesh(world_size)
    spec = jax.sharding.PartitionSpec("dcp")
    merged = jax.shard_map(lambda o, l: lse_merge_across(o[0], l[0]), mesh=mesh,
                           in_specs=(spec, spec), out_specs=(jax.sharding.PartitionSpec(),) * 2,
                           check_vma=False)
    return jax.jit(merged)(jnp.asarray(out), jnp.asarray(lse))


def test_lse_merge_across_keeps_nan_and_matches_a_float64_merge():
    """Finite rows equal the float64 merge; an empty row gives (0, -inf); a rank's NaN lse
    makes its row NaN, a NaN output element stays NaN; other rows are untouched."""
    w, t, h, d = 2, 5, 3, 4
    rng = np.random.default_rng(11)
    out = rng.standard_normal((w, t, h, d)).astype(np.float32)
    lse = rng.standard_normal((w, t, h)).astype(np.float32)
    lse[1, 1] = -np.inf           # row 1: only rank 0 has keys
    lse[:, 2] = -np.inf           # row 2: no keys anywhere
    out[:, 2] = 0.0
    lse[0, 3, 0] = np.nan         # row 3 head 0: a NaN score on rank 0
    out[1, 4, 1, 2] = np.nan      # row 4 head 1: a NaN value on rank 1
    got_out, got_lse = _merge_on_mesh(out, lse, w)
    got_out, got_lse = np.asarray(got_out), np.asarray(got_lse)
    chex.assert_shape((got_out, got_lse), ((t, h, d), (t, h)))
    l64 = lse[:, :2].astype(np.float64)  # the finite rows 0 and 1
    wts = np.exp(l64 - l64.max(axis=0))
    ref = (wts[..., None] * out[:, :2]).sum(0) / wts.sum(0)[..., None]
    chex.assert_trees_all_close(got_out[:2], ref, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(got_lse[:2], np.log(np.exp(l64).sum(0)), rtol=1e-5)
    chex.assert_trees_all_equal(got_out[2], np.zeros((h, d), np.float32))
    assert np.all(got_lse[2] == -np.inf)
    assert np.isnan(got_out[3, 0]).all() and np.isnan(got_lse[3, 0])
    chex.assert_tree_all_finite(got_out[3, 1:])
    assert np.isnan(got_out[4, 1, 2]) and np.isfinite(got_lse[4, 1])
    chex.assert_tree_all_finite((got_out[4, 0], got_out[4, 2], got_out[4, 1, :2]))


def test_invalid_dcp_settings_error():
    n_dev = len(jax.devices())
    with pytest.raises(DCPError, match=f"{n_dev + 1} ranks need {n_dev + 1} devices"):
        make_dcp_mesh(n_dev + 1)
    with pytest.raises(DCPError, match="dcp_world_size: 8 ranks need 8 devices"):
        mesh_for_config(_config(8))
    with pytest.raises(ConfigError, match="dcp_interleave"):
        _config(2, dcp_interleave=64)
    with pytest.raises(DCPError, match="dcp_interleave"):
        make_dcp_mesh(2, interleave=64)
    with pytest.raises(DCPError, match="dcp_world_size"):
        make_dcp_mesh(0)
    mesh = make_dcp_mesh(2)
    with pytest.raises(DCPError, match="config has 4 ranks but the mesh axis 'dcp' has 2"):
        check_config_mesh(_config(4), mesh)
    md = stage_dummy_batch(1, _config(2))
    with pytest.raises(DCPError, match="kv_shards"):
        dcp_msa_attention(jnp.zeros((8, HQ, D)), jnp.zeros((8, HKV, DI)),
                          jnp.zeros((4, 3, HKV, PAGE_SIZE, 2 * D)), jnp.zeros((2, 3, PAGE_SIZE, DI)),
                          md, mesh, scale=SCALE)


def test_lowers_for_two_h200s():
    """The W = 2 program at a benchmark shape lowers for CUDA on an abstract 2 x H200 mesh:
    the scores, select and decode on Mosaic GPU (no Triton kernel), and the collectives
    (2 query all-gathers, 2 candidate all-gathers, pmax + 2 psums)."""
    from jax.sharding import AbstractDevice, AbstractMesh, NamedSharding, PartitionSpec as P

    from pallas_kernels._lowering import H200, custom_call_counts, triton_calls
    w, b, length = 2, 16, 32768
    mesh = AbstractMesh((w,), ("dcp",), abstract_device=AbstractDevice(*H200, "cuda"))
    pl_ = length // PAGE_SIZE // w
    cfg = RunnerConfig(max_num_seqs=b, max_num_batched_tokens=b, max_model_len=length,
                       bucket_sizes=(b,), dcp_world_size=w)
    md = stage_batch(np.ones(b, np.int64), np.full(b, length - 1),
                     1 + np.arange(b)[:, None] * pl_ + np.arange(pl_)[None], cfg)
    spec = lambda shape, dtype, s: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=NamedSharding(mesh, s))
    md = jax.tree.map(lambda a: spec(a.shape, a.dtype, P()), md)
    args = (spec((b, 16, 128), jnp.bfloat16, P("dcp")), spec((b, 1, 128), jnp.bfloat16, P("dcp")),
            spec((w, 1 + b * pl_, 1, PAGE_SIZE, 256), jnp.bfloat16, P("dcp")),
            spec((w, 1 + b * pl_, PAGE_SIZE, 128), jnp.bfloat16, P("dcp")), md)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(lambda *a: dcp_msa_attention(*a, mesh=mesh, scale=128 ** -0.5)).trace(
            *args).lower(lowering_platforms=("cuda",)).as_text()
    assert triton_calls(text) == []
    # the scores, the select (16 tokens) and the decode (16 rows per rank)
    assert custom_call_counts(text)["mosaic"] == 3
    assert text.count("stablehlo.all_gather") == 4
    assert text.count("stablehlo.all_reduce") == 3

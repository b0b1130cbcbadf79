"""msa_attention on staged metadata: kernels == references, == dense below 2048, the seed bug.

The poison page is a finite sentinel whose read shows: K = 0 and V = 1000 in the KV cache
(the real values are standard normal), and index-K rows of +-100 (a block on it would score
100 * |sum(index_q)| and be selected).
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_msa_runner.config import RunnerConfig
from jax_msa_runner.batch.staging import stage_batch
from jax_msa_runner.batch.validate import MetadataInvariantError, validate_metadata
from jax_msa_runner.attention.msa import msa_attention, msa_attention_reference
from _helpers import INTERPRET
from pallas_kernels import PAGE_SIZE

HQ, HKV, D, DI = 16, 1, 64, 32
SCALE = D ** -0.5
CONFIG = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=4096,
                      bucket_sizes=(8, 16))


def _caches(seed, num_pages, dtype=jnp.float32, poison_page=None):
    k1, k2 = jax.random.split(jax.random.key(seed))
    kv = jax.random.normal(k1, (num_pages, HKV, PAGE_SIZE, 2 * D), dtype)
    ik = jax.random.normal(k2, (num_pages, PAGE_SIZE, DI), dtype)
    if poison_page is not None:
        kv = kv.at[poison_page, :, :, :D].set(0.0).at[poison_page, :, :, D:].set(1000.0)
        sign = jnp.where(jnp.arange(PAGE_SIZE) % 2 == 0, 100.0, -100.0)
        ik = ik.at[poison_page].set(jnp.broadcast_to(sign[:, None], (PAGE_SIZE, DI)).astype(dtype))
    return kv, ik


def _queries(seed, t, dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(seed + 1))
    return (jax.random.normal(k1, (t, HQ, D), dtype), jax.random.normal(k2, (t, HKV, DI), dtype))


def _batch(seed, sched, comp):
    """Stages a real batch over a random page permutation; the last page is left unused."""
    rng = np.random.default_rng(seed)
    need = [-(-(s + c) // PAGE_SIZE) for s, c in zip(sched, comp)]
    num_pages = sum(need) + 2  # page 0 null, last page never referenced (poison slot)
    perm = rng.permutation(np.arange(1, num_pages - 1))
    rows, o = [], 0
    for n in need:
        rows.append(perm[o:o + n])
        o += n
    md = stage_batch(np.array(sched), np.array(comp), rows, CONFIG)
    validate_metadata(md, CONFIG)
    return md, num_pages


def _dense_attention(q, kv, md):
    """Dense causal attention per real token over all its request's keys (f32)."""
    bt, ri, kvl = (np.asarray(x) for x in (md.block_table, md.req_indices, md.kv_lens))
    kv = np.asarray(kv, np.float32)
    out = np.zeros(q.shape, np.float32)
    for t in np.flatnonzero(np.asarray(md.token_mask)):
        n = int(kvl[t])
        pages = bt[ri[t], :-(-n // PAGE_SIZE)]
        keys = kv[pages].transpose(1, 0, 2, 3).reshape(HKV, -1, 2 * D)[:, :n]  # [Hkv, n, 2D]
        qg = np.asarray(q[t], np.float32).reshape(HKV, HQ // HKV, D)
        s = np.einsum("hgd,hkd->hgk", qg, keys[..., :D]) * SCALE
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[t] = np.einsum("hgk,hkd->hgd", p, keys[..., D:]).reshape(HQ, D)
    return out


@pytest.mark.parametrize("prefill", [False, True])
def test_kernels_match_reference_on_staged_batch(prefill):
    # Decode rows past 16 pages, a spec-decode row (3 tokens) and a prefill chunk with prefix.
    sched, comp = [1, 3, 6], [2900, 2200, 130]
    md, num_pages = _batch(0, sched, comp)
    kv, ik = _caches(1, num_pages, poison_page=num_pages - 1)
    q, iq = _queries(2, md.num_tokens_padded)
    out, lse, sel = msa_attention(q, iq, kv, ik, md, scale=SCALE, prefill=prefill,
                                  interpret=INTERPRET)
    ref_out, ref_lse, ref_sel = msa_attention_reference(q, iq, kv, ik, md, scale=SCALE)
    mask = np.asarray(md.token_mask)
    chex.assert_shape(out, (md.num_tokens_padded, HQ, D))
    chex.assert_shape(sel, (md.num_tokens_padded, HKV, 16))
    chex.assert_trees_all_equal(np.sort(np.asarray(sel)[mask], -1),
                                np.sort(np.asarray(ref_sel)[mask], -1))
    chex.assert_tree_all_finite(out[mask])
    chex.assert_trees_all_close(out[mask], ref_out[mask], rtol=2e-3, atol=2e-3)
    chex.assert_trees_all_close(lse[mask], ref_lse[mask], rtol=2e-3, atol=2e-3)


def test_equals_dense_attention_below_2048():
    sched, comp = [1, 4, 5], [700, 1500, 2040]  # every position < 2048
    md, num_pages = _batch(3, sched, comp)
    assert int(np.asarray(md.positions).max()) < 2048
    kv, ik = _caches(4, num_pages, poison_page=num_pages - 1)
    q, iq = _queries(5, md.num_tokens_padded)
    out, _, _ = msa_attention(q, iq, kv, ik, md, scale=SCALE, interpret=INTERPRET)
    mask = np.asarray(md.token_mask)
    chex.assert_trees_all_close(np.asarray(out)[mask], _dense_attention(q, kv, md)[mask],
                                rtol=2e-3, atol=2e-3)


def test_stale_positions_are_rejected_and_harmless():
    """The seed bug: seq_len 4096 with stale positions 0. The validator rejects the metadata;
    the kernels, given it anyway, read 1 page (the selector's [0, -1 x 15]) and nothing else."""
    md, num_pages = _batch(6, [4], [4092])
    assert md.max_pages == 32
    # Poison the page of the last block-table entry, where a wrapped -1 would land: its K = 0
    # would score like a real key and its V = 1000 would dominate the output.
    kv, ik = _caches(7, num_pages, poison_page=int(np.asarray(md.block_table)[0, -1]))
    stale = md.replace(positions=jnp.zeros_like(md.positions),
                       num_valid_pages=jnp.where(md.token_mask, 1, 0))
    with pytest.raises(MetadataInvariantError, match="selector/consumer page count mismatch"):
        validate_metadata(stale, CONFIG)
    q, iq = _queries(8, md.num_tokens_padded)
    out, _, sel = msa_attention(q, iq, kv, ik, stale, scale=SCALE, interpret=INTERPRET)
    mask = np.asarray(md.token_mask)
    expected_sel = np.full((16,), -1, np.int32)
    expected_sel[0] = 0
    chex.assert_trees_all_equal(np.asarray(sel)[mask][:, 0], np.tile(expected_sel, (4, 1)))
    chex.assert_tree_all_finite(out[mask])
    # Same as attending over the one selected page with its 128 keys all visible.
    ref_out, _, _ = msa_attention_reference(q, iq, kv, ik, stale, scale=SCALE)
    chex.assert_trees_all_close(out[mask], ref_out[mask], rtol=2e-3, atol=2e-3)
    page0 = np.asarray(kv, np.float32)[int(np.asarray(md.block_table)[0, 0]), 0]
    s = np.einsum("thd,kd->thk", np.asarray(q, np.float32)[mask], page0[:, :D]) * SCALE
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    chex.assert_trees_all_close(np.asarray(out)[mask], np.einsum("thk,kd->thd", p, page0[:, D:]),
                                rtol=2e-3, atol=2e-3)

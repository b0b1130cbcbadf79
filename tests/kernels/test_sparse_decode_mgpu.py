"""Mosaic GPU sparse decode against ``sparse_decode_reference``, and its CUDA lowering.

On a CPU backend the kernel runs in Mosaic GPU interpret mode without being asked
(``interpret=None``); on the H200 the same tests run it compiled. Each batch draws a fresh
seed (printed on failure): random kv lengths (not multiples of 128), padded rows, -1 /
out-of-range / repeated / unconsumed ids, several tokens per request. Every block-table entry
that no token may consume (unselected blocks, blocks past a request's length, the last column
where a wrapped -1 lands) points at a finite poison page (K = 0, V = 1000) at the last cache
index (where a wrapped page id lands): a read of it shows in the output. Keys past a request's
length hold NaN, so masking and the zeroing of V rows past ``kv_len`` are checked too.

Interpreted clusters of more than 2 CTAs need as many concurrent XLA CPU threads: on a CPU
backend those cases run in a subprocess with ``PJRT_NPROC`` raised.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _decode_batch import POISON_V, build_batch, decode_specs as _specs
from _helpers import fresh_seed
from pallas_kernels import PAGE_SIZE, TOPK
from pallas_kernels._l2_hint import EVICT_FIRST_POLICY
from pallas_kernels._lowering import lower_for_cuda
from pallas_kernels.sparse_decode import sparse_decode_reference
from pallas_kernels._shapes import NUM_SMS_H200
from pallas_kernels.sparse_decode_mgpu import (ROWS, SMEM_BYTES, STAGES, default_evict_first,
                                               default_exchange, default_splits, default_stages,
                                               merge_tasks, smem_budget, smem_bytes,
                                               sparse_decode_mgpu)

ON_GPU = jax.default_backend() == "gpu"


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    """A kernel that raised inside the Mosaic GPU interpreter leaves its state behind; reset it
    so one failure does not cascade into the next test."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    interpret_pallas_call.reset_gpu_interpret_mode_state()
    yield


TOL = dict(atol=2e-2, rtol=2e-2)  # bf16 output, P rounded to bf16 before P V


def check_matches_reference(seed, hq, hkv, d, num_splits, num_stages, long_first,
                            approx_math=True, exchange=None, num_v_stages=None):
    """Kernel vs reference on one fresh batch; raises AssertionError naming the seed."""
    args, _ = build_batch(seed, hq=hq, hkv=hkv, d=d, long_first=long_first)
    args = tuple(jnp.asarray(a) for a in args)
    scale = d ** -0.5
    out, lse = sparse_decode_mgpu(*args, scale=scale, num_splits=num_splits,
                                  num_stages=num_stages, approx_math=approx_math,
                                  exchange=exchange, num_v_stages=num_v_stages)
    ref_out, ref_lse = sparse_decode_reference(*args, scale=scale)
    t = args[0].shape[0]
    chex.assert_shape((out, lse), ((t, hq, d), (t, hq)))
    assert out.dtype == args[0].dtype and lse.dtype == jnp.float32
    chex.assert_tree_all_finite(out)
    msg = (f"seed {seed}, splits {num_splits}, stages {num_stages} (V: {num_v_stages}), "
           f"exchange {exchange}")
    assert float(jnp.max(jnp.abs(out.astype(jnp.float32)))) < 0.1 * POISON_V, \
        f"poison page read ({msg})"
    try:
        chex.assert_trees_all_close(out.astype(jnp.float32), ref_out.astype(jnp.float32), **TOL)
        chex.assert_trees_all_close(lse, ref_lse, atol=1e-3, rtol=1e-4)
    except AssertionError as e:
        raise AssertionError(f"{msg}: {e}") from None
    assert bool(jnp.all((lse == -jnp.inf) == (args[5][:, None] == 0))), msg


# (hq, hkv, d, num_splits, num_stages, long_first): the 16/1 D=128 target layout with 16
# consumed pages; GQA groups of 4 and 6 (padded to 8 rows), two KV heads, D=64; every ring;
# a group of 64 on 2 splits (16 merge tasks, 8 per CTA); the default from 67 rows on (one
# split, 2-deep ring).
IN_PROCESS = [(16, 1, 128, 1, 3, True), (16, 1, 128, 2, 2, False), (8, 2, 64, 1, 1, False),
              (12, 2, 64, 2, 1, False), (64, 1, 128, 2, 1, False), (16, 1, 128, 1, 2, False)]
# Then: the largest cluster at the target layout (16/1 on 16 splits, the long request first);
# B=16's default at 16/1 (4 splits, 2-deep); clusters of 8 over more than half the SMs (one
# stage: the half-SM budget); a group of 24 on 4 splits, so the 6 merge tasks of the global
# exchange fall unevenly (2 on CTAs 0 and 1, 1 on CTAs 2 and 3); two KV heads at D=64 on 16
# splits, where the cluster exchange's merge has 4 head dims x 8 group rows per CTA (fewer
# elements than threads).
BIG_CLUSTERS = [(16, 1, 128, 16, 1, True), (16, 1, 128, 4, 2, False), (16, 1, 128, 8, 1, False),
                (24, 1, 128, 4, 1, False), (8, 2, 64, 16, 1, False)]


@pytest.mark.parametrize("hq,hkv,d,num_splits,num_stages,long_first", IN_PROCESS)
def test_matches_reference(hq, hkv, d, num_splits, num_stages, long_first):
    check_matches_reference(fresh_seed(), hq, hkv, d, num_splits, num_stages, long_first)


@pytest.mark.parametrize("hq,hkv,d,num_splits,num_stages,long_first", IN_PROCESS[:2])
def test_precise_math_matches_reference(hq, hkv, d, num_splits, num_stages, long_first):
    """``approx_math=False`` (the library exp2/log2) meets the same tolerance; the default's
    approximate instructions are what the other tests check (compiled on the GPU; the
    interpreter computes exactly either way)."""
    check_matches_reference(fresh_seed(), hq, hkv, d, num_splits, num_stages, long_first,
                            approx_math=False)


@pytest.mark.parametrize("hq,hkv,d,num_splits,num_stages,long_first",
                         [IN_PROCESS[1], IN_PROCESS[3], IN_PROCESS[4]])
def test_non_default_exchange(hq, hkv, d, num_splits, num_stages, long_first):
    """The tests above run the default exchange: "cluster" where it fits when compiled,
    "global" when interpreted. Compiled, "global" meets the same tolerance; interpreted,
    "cluster" (stores into a peer CTA's shared memory) is refused by name."""
    if ON_GPU:
        check_matches_reference(fresh_seed(), hq, hkv, d, num_splits, num_stages, long_first,
                                exchange="global")
        return
    with pytest.raises(ValueError, match="exchange 'cluster' needs the compiled kernel"):
        check_matches_reference(fresh_seed(), hq, hkv, d, num_splits, num_stages, long_first,
                                exchange="cluster")


@pytest.mark.parametrize("num_splits,num_stages,num_v_stages", [(1, 2, 1), (1, 1, 3), (2, 3, 1)])
def test_v_ring_of_another_depth_matches_reference(num_splits, num_stages, num_v_stages):
    """K and V rings of different depths: each page's K and V land in different slots, and
    the first issue loop fills each ring to its own depth."""
    check_matches_reference(fresh_seed(), 16, 1, 128, num_splits, num_stages, True,
                            num_v_stages=num_v_stages)


@pytest.fixture(scope="module")
def big_cluster_failures():
    """On a CPU backend: every BIG_CLUSTERS case, each on a fresh seed, checked in ONE
    subprocess with ``PJRT_NPROC`` raised (one interpreter start for all of them; the
    ``xdist_group`` keeps the cases on one worker). Returns ``{case index: error text}`` for
    the cases that failed; the subprocess itself must exit cleanly."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    cases = json.dumps([[fresh_seed(), *case] for case in BIG_CLUSTERS])
    code = ("import json, sys, traceback; sys.path[:0] = sys.argv[1:4]\n"
            "import test_sparse_decode_mgpu as m\n"
            "failed = {}\n"
            "for i, case in enumerate(json.loads(sys.argv[4])):\n"
            "    try:\n"
            "        m.check_matches_reference(*case)\n"
            "    except Exception:\n"
            "        failed[i] = traceback.format_exc()[-4000:]\n"
            "print('FAILED ' + json.dumps(failed))\n")
    env = dict(os.environ, PJRT_NPROC="32", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code, root, os.path.dirname(here), here, cases],
                          env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED ")][-1]
    return {int(k): v for k, v in json.loads(line[len("FAILED "):]).items()}


@pytest.mark.xdist_group("sparse_decode_big_clusters")
@pytest.mark.parametrize("case", range(len(BIG_CLUSTERS)),
                         ids=["-".join(map(str, c)) for c in BIG_CLUSTERS])
def test_matches_reference_big_clusters(case, request):
    if ON_GPU:
        check_matches_reference(fresh_seed(), *BIG_CLUSTERS[case])
        return
    failures = request.getfixturevalue("big_cluster_failures")
    assert case not in failures, failures[case]


@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("num_splits", [1, 2])
def test_nan_in_consumed_page_reaches_output_and_poison_shows(num_splits):
    """Token 0: NaN in one consumed key -> its rows' out and lse are NaN. Token 1: NaN in
    one consumed value row -> its out is NaN, its lse finite. Token 2: one slot consumes a
    block whose table entry is the poison page -> V = 1000 shows. Other rows: unchanged."""
    seed = fresh_seed()
    hq, hkv, d = 16, 1, 128
    (q, kv, sel, bt, req, lens), poison = build_batch(seed, hq=hq, hkv=hkv, d=d, tokens=4)
    kv = np.array(kv)
    bt = np.array(bt)
    sel = np.array(sel)
    for tok, part in ((0, slice(0, d)), (1, slice(d, 2 * d))):
        n = -(-int(lens[tok]) // PAGE_SIZE)
        j = int(np.flatnonzero((sel[tok, 0, :min(n, TOPK)] >= 0)
                               & (sel[tok, 0, :min(n, TOPK)] < n))[-1])  # a consumed slot
        blk = int(sel[tok, 0, j])
        key = min(PAGE_SIZE, int(lens[tok]) - blk * PAGE_SIZE) - 1  # a visible key
        kv[bt[req[tok], blk], 0, key, part] = np.nan
    # token 2 (request 2): point its first consumed block at the poison page
    n2 = -(-int(lens[2]) // PAGE_SIZE)
    sel[2, 0, 0] = n2 - 1
    bt[req[2], n2 - 1] = poison
    args = tuple(jnp.asarray(a) for a in (q, kv, sel, bt, req, lens))
    out, lse = sparse_decode_mgpu(*args, scale=d ** -0.5, num_splits=num_splits)
    ref_out, ref_lse = sparse_decode_reference(*args, scale=d ** -0.5)
    out = np.asarray(out.astype(jnp.float32))
    lse = np.asarray(lse)
    msg = f"seed {seed}"
    assert np.isnan(out[0]).all() and np.isnan(lse[0]).all(), msg
    assert np.isnan(out[1]).all() and np.isfinite(lse[1]).all(), msg
    assert (np.abs(out[2]) > 1.0).any() and np.isfinite(out[2]).all(), msg  # poison counted
    chex.assert_trees_all_close(out[2:], np.asarray(ref_out[2:].astype(jnp.float32)), **TOL)
    chex.assert_trees_all_close(lse[1:], np.asarray(ref_lse[1:]), atol=1e-3, rtol=1e-4)


def test_empty_batch_and_all_padded_rows():
    d = 64
    z = lambda *s: jnp.zeros(s, jnp.int32)  # noqa: E731
    out, lse = sparse_decode_mgpu(jnp.zeros((0, 8, d), jnp.bfloat16),
                                  jnp.zeros((3, 2, PAGE_SIZE, 2 * d), jnp.bfloat16),
                                  z(0, 2, TOPK), z(1, 4), z(0), z(0), scale=1.0)
    chex.assert_shape((out, lse), ((0, 8, d), (0, 8)))
    q = jnp.ones((2, 8, d), jnp.bfloat16)
    kv = jnp.full((3, 2, PAGE_SIZE, 2 * d), jnp.nan, jnp.bfloat16)  # never read
    out, lse = sparse_decode_mgpu(q, kv, z(2, 2, TOPK), z(1, 4), z(2), z(2), scale=1.0,
                                  num_splits=2)
    chex.assert_trees_all_equal(out, jnp.zeros_like(q))
    assert bool(jnp.all(lse == -jnp.inf))


@pytest.mark.parametrize("kw,match,exc", [
    (dict(d=32), "head dim D", ValueError),
    (dict(dtype=jnp.float32), "bf16 or f16", TypeError),
    (dict(num_splits=32), "num_splits must be one of", ValueError),
    (dict(num_stages=4), "num_stages", ValueError),
    (dict(num_v_stages=0), "num_v_stages must be one of", ValueError),
    (dict(hq=64, num_splits=1, num_stages=3, num_v_stages=3), "3 \\(V: 3\\)", ValueError),
    (dict(hq=128), "GQA group Hq/Hkv = 128 exceeds 64", ValueError),
    (dict(hq=64, num_splits=1, num_stages=3), "bytes of shared memory", ValueError),
    (dict(exchange="dsmem"), "exchange must be one of", ValueError),
    (dict(hq=64, num_splits=2, num_stages=3, exchange="cluster"),
     "exchange 'cluster' needs [0-9]+ bytes", ValueError),
])
def test_rejects_unsupported_arguments(kw, match, exc):
    d, dtype, hq = kw.pop("d", 128), kw.pop("dtype", jnp.bfloat16), kw.pop("hq", 16)
    with pytest.raises(exc, match=match):
        lower_for_cuda(sparse_decode_mgpu, *_specs(4, hq, 1, d, dtype=dtype), scale=1.0,
                       interpret=False, **kw)


def test_default_config_fits_shared_memory():
    assert [default_splits(r) for r in (1, 4, 5, 8, 9, 16, 17, 32, 63, 64, 66, 67, 128, 512)] \
        == [16, 16, 16, 8, 8, 4, 4, 2, 2, 2, 2, 1, 1, 1]
    for splits in (1, 2, 4, 8, 16):
        for d in (64, 128):
            for stages in STAGES:  # every ring fits a group of 16, the merge's reuse included
                assert smem_bytes(d, stages, splits, group=16) <= SMEM_BYTES
                merge = d * ROWS * 4 + ROWS * 4 if splits > 1 else 0  # the published state
                assert smem_bytes(d, stages, splits) >= max(2 * stages * PAGE_SIZE * d * 2,
                                                            merge)
    # merge tasks of 64 head dims x 8 group rows, spread over the S CTAs
    assert [merge_tasks(128, 16, 16), merge_tasks(128, 64, 2), merge_tasks(64, 8, 16),
            merge_tasks(128, 24, 4)] == [1, 8, 1, 2]
    assert smem_bytes(128, 1, 2) >= 8 * 2 * 64 * 8 * 4  # a group of 64 on 2 splits: 16 tiles
    assert default_stages(128, 1) == 2 and default_stages(128, 2) == 2  # 2-deep at most
    assert default_stages(128, 8) == 2  # both pages of a split in flight
    assert default_stages(128, 16) == 1  # one page per CTA
    assert default_stages(64, 1) == 2


def test_default_exchange_is_cluster_where_its_receive_buffer_fits():
    """The default splits of a group of 16 at D 128 exchange through the cluster's shared
    memory; a group of 64 on clusters of 8 over more than half the SMs (half an SM's shared
    memory each) does not fit there and goes through global memory."""
    for rows in (1, 4, 16, 32):  # 16/1 and 64/4 at B = 1, 16/1 at B = 16, 64/4 at B = 8
        s = default_splits(rows)
        st = default_stages(128, s, rows)
        assert default_exchange(128, s, st, rows, group=16) == "cluster", rows
        assert smem_bytes(128, st, s, group=16, exchange="cluster") <= smem_budget(s, rows)
    assert default_exchange(128, 8, 1, 16, group=64) == "global"
    # the V ring's depth counts: 2 splits of a group of 64 fit the cluster exchange beside
    # 2-deep rings, not beside a 3-deep V ring
    assert default_exchange(128, 2, 2, 64, group=64) == "cluster"
    assert default_exchange(128, 2, 2, 64, group=64, num_v_stages=3) == "global"
    for splits in (2, 4, 8, 16):  # receive buffers: D / S head dims and an LSE row per split
        assert (smem_bytes(128, 1, splits, group=16, exchange="cluster")
                - smem_bytes(128, 1, 1, group=16)) == splits * (128 // splits + 1) * 16 * 4


def test_default_ring_fits_the_budget_of_every_row_count():
    for rows in (1, 8, 9, 16, 32, 64, 128, 133, 200, 264, 512):
        s = default_splits(rows)
        assert smem_bytes(128, default_stages(128, s, rows), s) <= smem_budget(s, rows)
    assert smem_budget(8, 16) == SMEM_BYTES // 2 and default_stages(128, 8, 16) == 1


@pytest.mark.parametrize("rows", [1, 4, 8, 9, 16, 64])
def test_default_stages_leave_room_for_two_ctas_when_clusters_of_8_fill_the_gpu(rows):
    """Clusters of 8 over more than half the SMs: a CTA's ring keeps to half of an SM's
    shared memory (two CTAs per SM); fewer CTAs keep the deepest ring that fits."""
    crowded = rows * 8 > NUM_SMS_H200 // 2
    for d in (64, 128):
        stages = default_stages(d, 8, rows)
        if crowded:
            assert smem_bytes(d, stages, 8) <= SMEM_BYTES // 2
        else:
            assert stages == default_stages(d, 8)
    assert default_stages(128, 8, rows) == (1 if rows * 8 > NUM_SMS_H200 // 2 else 2)
    assert default_stages(128, 2, rows) == 2  # smaller clusters: unaffected


@pytest.mark.parametrize("rows", [128, 132, 133, 192, 256, 264])
def test_one_split_over_more_rows_than_sms_keeps_to_half_an_sm(rows):
    """From 133 rows on, one split per row keeps to half an SM's shared memory, so that two
    CTAs share an SM and up to 264 rows run as one wave: a 1-deep ring at D 128 (a 2-deep
    one at D 64 still fits); up to 132 rows the 2-deep ring stays. Each fits its budget with
    the largest GQA group."""
    crowded = rows > NUM_SMS_H200
    assert default_splits(rows) == 1
    assert smem_budget(1, rows) == (SMEM_BYTES // 2 if crowded else SMEM_BYTES)
    assert default_stages(128, 1, rows) == (1 if crowded else 2)
    assert default_stages(64, 1, rows) == 2
    for d in (64, 128):
        assert smem_bytes(d, default_stages(d, 1, rows), 1, group=ROWS) <= smem_budget(1, rows)


def _mosaic_calls(text):
    return [line for line in text.splitlines() if "stablehlo.custom_call" in line]


@pytest.mark.parametrize("hq,hkv", [(16, 1), (64, 4)])
@pytest.mark.parametrize("batch", [1, 16, 64, 128])
def test_lowers_for_h200_as_one_kernel(hq, hkv, batch):
    """The benchmark shapes lower to exactly one Mosaic GPU custom call and no other op that
    would be a kernel launch (the split merge is inside the kernel)."""
    text = lower_for_cuda(sparse_decode_mgpu, *_specs(batch, hq, hkv, pages=65536,
                                                      cols=65536 // PAGE_SIZE),
                          scale=128 ** -0.5, interpret=False)
    calls = _mosaic_calls(text)
    assert len(calls) == 1 and "@mosaic_gpu" in calls[0], calls
    for op in ("stablehlo.pad", "stablehlo.concatenate", "stablehlo.reduce", "stablehlo.gather",
               "stablehlo.dynamic_slice", "stablehlo.while"):
        assert op not in text, op


@pytest.mark.parametrize("num_splits,num_stages,num_v_stages", [
    (1, 1, None), (1, 2, None), (2, 3, None), (4, 1, None), (8, 2, None), (16, 1, None),
    (1, 2, 1)])
def test_tunables_lower_for_h200(num_splits, num_stages, num_v_stages):
    text = lower_for_cuda(sparse_decode_mgpu, *_specs(16, 64, 4), scale=1.0, interpret=False,
                          num_splits=num_splits, num_stages=num_stages,
                          num_v_stages=num_v_stages)
    assert len(_mosaic_calls(text)) == 1


@pytest.mark.parametrize("approx_math", [True, False])
def test_approx_math_lowers_to_fast_exp2(approx_math):
    """``approx_math=True`` lowers exp2 and log2 to ``ex2.approx`` and ``lg2.approx``."""
    text = lower_for_cuda(sparse_decode_mgpu, *_specs(16, 16, 1), scale=1.0, interpret=False,
                          approx_math=approx_math)
    assert len(_mosaic_calls(text)) == 1
    for marker in ("ex2.approx", "lg2.approx"):
        assert (marker in text) == approx_math, marker


@pytest.mark.parametrize("exchange", ["cluster", "global"])
def test_exchange_lowers_to_its_transport(exchange):
    """Compiled for the H200 with 16 splits, the cluster exchange stores into peers' shared
    memory (``st.async``, counted by a relaxed remote ``mbarrier.arrive.expect_tx``) and
    needs no acquire/release fences; the global exchange fences its publish and stores into
    no peer."""
    text = lower_for_cuda(sparse_decode_mgpu, *_specs(1, 16, 1), scale=1.0, interpret=False,
                          num_splits=16, num_stages=1, exchange=exchange)
    assert len(_mosaic_calls(text)) == 1
    for marker in ("st.async.cluster.shared::cluster",
                   "mbarrier.arrive.expect_tx.relaxed.cluster.shared::cluster"):
        assert (marker in text) == (exchange == "cluster"), marker
    assert "mbarrier.arrive.expect_tx.release" not in text
    assert ("fence.acq_rel.cluster" in text) == (exchange == "global")


def test_default_evict_first_is_clusters_of_at_most_two_in_one_wave():
    rows = (1, 16, 31, 32, 64, 66, 67, 128, 132, 133, 256)
    assert [default_evict_first(default_splits(r), r) for r in rows] == \
        [False, False, False, True, True, True, True, True, True, False, False]
    assert [default_evict_first(s, r) for s, r in ((2, 67), (4, 32), (1, 133))] == \
        [False, False, False]


@pytest.mark.parametrize("batch,l2_evict_first,tagged", [
    (32, None, True), (64, None, True), (128, None, True), (16, None, False), (16, True, True),
    (64, False, False)])
def test_page_loads_take_the_evict_first_policy_where_asked(batch, l2_evict_first, tagged):
    """The page loads are lowered with the evict-first L2 policy exactly where asked (by
    default: clusters of at most 2 in one wave), and the policy does not reach a kernel
    lowered later."""
    text = lower_for_cuda(sparse_decode_mgpu, *_specs(batch, 16, 1), scale=1.0, interpret=False,
                          l2_evict_first=l2_evict_first)
    assert len(_mosaic_calls(text)) == 1
    assert (EVICT_FIRST_POLICY in text) == tagged
    assert "L2::cache_hint" not in text  # the hint is an operand, added by the NVVM lowering
    later = lower_for_cuda(sparse_decode_mgpu, *_specs(64, 16, 1), scale=1.0, interpret=False,
                           l2_evict_first=False)
    assert EVICT_FIRST_POLICY not in later


def test_l2_hint_falls_back_to_plain_loads_without_its_jax_internals(monkeypatch):
    """Where jax's lowering lacks the op the hint attaches to, the kernel still lowers, with
    a warning and without the policy."""
    from pallas_kernels import _l2_hint
    monkeypatch.setattr(_l2_hint, "_ASYNC_LOAD", "mosaic_gpu.no_such_op")
    # scale 0.5: a call no other test makes, so the kernel is traced here, not taken from a cache
    with pytest.warns(UserWarning, match="no place for an L2 cache hint"):
        text = lower_for_cuda(sparse_decode_mgpu, *_specs(64, 16, 1), scale=0.5,
                              interpret=False, l2_evict_first=True)
    assert len(_mosaic_calls(text)) == 1 and EVICT_FIRST_POLICY not in text


@pytest.mark.parametrize("num_splits", [1, 2])
def test_l2_policy_does_not_change_results(num_splits):
    """The same batch with and without the evict-first page loads gives identical bits
    (compiled on the GPU; interpreted, the policy's markers are skipped)."""
    args, _ = build_batch(fresh_seed(), hq=16, hkv=1, d=128, long_first=True)
    args = tuple(jnp.asarray(a) for a in args)
    runs = [sparse_decode_mgpu(*args, scale=128 ** -0.5, num_splits=num_splits,
                               l2_evict_first=flag)
            for flag in (True, False)]
    chex.assert_tree_all_finite(runs[0][0])  # out (lse is -inf on padded rows)
    chex.assert_trees_all_equal(runs[0], runs[1])


@pytest.mark.parametrize("pdl", [True, False])
def test_pdl_marks_the_kernel(pdl):
    """``pdl=True`` (the default) lowers to a kernel marked for programmatic dependent launch,
    with the grid-dependency wait (before any input read) and the early launch of dependents;
    ``pdl=False`` to one without either."""
    text = lower_for_cuda(sparse_decode_mgpu, *_specs(16, 16, 1), scale=1.0, interpret=False,
                          pdl=pdl)
    assert len(_mosaic_calls(text)) == 1
    for marker in ("mosaic_gpu.uses_pdl", "griddepcontrol.wait",
                   "griddepcontrol.launch_dependents"):
        assert (marker in text) == pdl, marker

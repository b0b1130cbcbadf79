"""MSA sparse decode on the Pallas Mosaic GPU backend (Hopper): the API and semantics of
:func:`pallas_kernels.sparse_decode.sparse_decode`, in one kernel launch.

Kernel: grid ``(T, Hkv)``; each (token, KV head) row runs on a cluster of ``S = num_splits``
CTAs of one warpgroup each (``S`` up to 16, a non-portable cluster size that Hopper allows).
Every CTA reads the token's 16 block ids and metadata as scalars, applies the safety boundary,
gathers the 16 page ids from the block table and ranks the consumed slots (stable order), so no
later step has a dependent global load. CTA ``c`` of the cluster owns the consumed slots
``c, c + S, c + 2S, ...``: it streams their pages through rings of shared-memory buffers
(``num_stages`` deep for K, ``num_v_stages`` for V) with TMA copies (K and V of a page,
``[128, D]`` each, separate barriers; the page id is a dynamic TMA coordinate; with
``l2_evict_first`` the page loads mark their L2 lines as the first to be replaced) and runs
the online softmax (base 2, the hardware's approximate ``exp2``, finite mask value) with wgmma
in transposed form, so that the GQA group (padded to a multiple of 8) is the wgmma's N and no
row is padding: ``S^T = K Q^T`` (keys on M, the softmax reduces over them across the warps),
``P`` stored transposed as ``[group, 128]``, ``acc^T += V^T P^T`` (head dim on M). A slot's
next K is issued as soon as ``S^T`` has read it. With ``S > 1`` the split merge happens inside
the kernel. Each CTA normalises its state
(``out^T [D, group]`` f32 and the base-2 LSE); split ``k`` weighs ``2^(lse_k - max lse)``.
Two transports (``exchange``): ``"cluster"``: every thread stores its registers of the state
straight into the shared memory of the CTA that merges those head dims (``st.async``; CTA
``o`` merges ``[o D / S, (o + 1) D / S)`` of every group row, into receive buffers of its own)
and the bytes are counted by one barrier in the receiver (each sender announces its bytes there
with a relaxed arrival; the barrier is initialised before the page loop and published to the
cluster at the hardware cluster barrier, whose wait comes after the loop); each CTA waits for
its S shares, merges them and writes its head dims to the output from registers.
``"global"``: each CTA publishes its state in outputs by TMA, the cluster meets at a cluster
barrier (with acquire/release fences), and the merge runs in tasks of 64 head dims x 8
group rows (CTA ``c`` takes tasks ``c, c + S, ...``), gathered by TMA into the finished ring
and written as ``[8, 64]`` blocks through shared memory. The interpreter has no store into a
peer CTA's shared memory, so interpreted kernels take the global transport.
With ``S = 1`` the output leaves through shared memory by TMA, only the group's real rows.
With ``pdl`` (the default) the kernel is launched with programmatic dependent launch: it waits
for the previous kernel's writes (``griddepcontrol.wait``) before its first input read and lets
the next kernel launch once its page loop is done.

Safety boundary (as the Triton kernel and the reference): a slot ``j`` is consumed iff
``j < min(ceil(kv_len / 128), 16)`` and its block id is in ``[0, min(ceil(kv_len / 128), P))``;
other slots are replaced by block 0 before the block-table read and never loaded. The request
row is clamped to ``[0, R)`` and the page id to ``[0, N)``. Keys ``blk * 128 + i >= kv_len`` are
masked, and their V rows are zeroed in shared memory before ``P V`` (0 * garbage stays 0).
NaN in a consumed key or value reaches the row's output (no guard turns it into 0); a row with
no visible key gives zeros and ``lse = -inf``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _cluster_exchange as cluster_exchange
from pallas_kernels import _l2_hint as l2_hint
from pallas_kernels._interpret import mosaic_interpret_params
from pallas_kernels._shapes import NUM_SMS_H200, PAGE_SIZE, SMEM_BYTES, TOPK
from pallas_kernels.sparse_decode import LN2, LOG2E, MASK, validate_inputs

ROWS = 64  # the largest GQA group; the length of the published LSE rows and the lse staging
SPLITS = (1, 2, 4, 8, 16)  # cluster sizes (16: a non-portable size, which Hopper allows)
STAGES = (1, 2, 3)
MAX_DEFAULT_STAGES = 2  # a 2-deep ring measured faster than a 3-deep one (bench/RESULTS.md)
HEAD_DIMS = (64, 128)  # multiples of the 64-element (128-byte) swizzle tile; register budget
SMEM_RESERVE = 4 * 1024  # barriers, reduction scratch, alignment
FILL_CTAS = 64  # default splits: smallest power of two with rows * splits >= this (max 16)
MERGE_ROWS = 64  # a merge task's head dims: the rows of its [64, 8] f32 WGMMA-layout tiles
MERGE_COLS = 8  # a merge task's group rows (the tiles' columns)
TILE_BYTES = MERGE_ROWS * MERGE_COLS * 4  # one [64, 8] f32 merge tile
PROFILE_EVENTS = 256  # named-region events per warpgroup and call when profiling
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_TILE = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # 16-bit wgmma operands
EXCHANGES = ("cluster", "global")  # how a split's state reaches the CTAs that merge it
_MERGE_COL = plgpu.Layout.WGMMA.reduce(0)  # a [8] vector along a merge tile's columns


def padded_rows(num_q_heads: int, num_kv_heads: int) -> int:
    """Rows of the group that are copied in and out: the GQA group rounded up to 8."""
    g = num_q_heads // num_kv_heads
    return -(-g // 8) * 8


def default_splits(num_rows: int) -> int:
    """Cluster size for ``num_rows = T * Hkv`` rows: the smallest power of two (<= 16) with
    ``num_rows * splits >= 64`` CTAs, so small batches spread their pages over the SMs;
    clusters of 16 (one page per CTA) only while ``num_rows * 16`` CTAs fit one per SM. Up
    to 66 rows take at least two splits, so that one wave of up to 132 CTAs streams the pages
    with evict-first loads (:func:`default_evict_first`); from 67 rows on, one CTA streams a
    row's 16 pages and nothing is merged."""
    cap = SPLITS[-1]
    if num_rows * 16 > NUM_SMS_H200:
        cap = min(cap, 8)
    splits = 2 if 2 * num_rows <= NUM_SMS_H200 else 1  # two splits while they fit one wave
    while splits < cap and num_rows * splits < FILL_CTAS:
        splits *= 2
    return splits


def default_evict_first(num_splits: int, num_rows: int) -> bool:
    """Whether the page loads take an evict-first L2 policy by default: with clusters of at
    most 2 whose ``num_rows * num_splits`` CTAs fit one wave (one per SM), where it measured
    faster (bench/RESULTS.md); larger clusters and grids of several waves keep the normal
    policy."""
    return num_splits <= 2 and num_rows * num_splits <= NUM_SMS_H200


def merge_tasks(head_dim: int, group: int, num_splits: int) -> int:
    """Merge tasks of one CTA: ``ceil(D / 64 * group / 8 / S)`` (``group`` padded to 8)."""
    return -(-(head_dim // MERGE_ROWS) * (group // MERGE_COLS) // num_splits)


def smem_bytes(head_dim: int, num_stages: int, num_splits: int, itemsize: int = 2,
               group: int = ROWS, exchange: str = "global", num_v_stages: int | None = None
               ) -> int:
    """Shared memory of one CTA for a GQA group of ``group`` rows (a multiple of 8; default
    the largest): the K ring (``num_stages`` deep) and V ring (``num_v_stages``, default as
    deep) and P, Q, the output/LSE staging and a reserve, plus the split merge's buffers.
    ``exchange="global"``: the ring's memory is reused after the page loop (this split's
    state, then the S tiles of each of its merge tasks and the peers' LSE rows).
    ``"cluster"``: receive buffers of their own (peers write them while this CTA may still be
    in its page loop): ``D / S`` head dims x ``group`` f32 and an LSE row per split."""
    nv = num_stages if num_v_stages is None else num_v_stages
    ring = (num_stages + nv) * PAGE_SIZE * head_dim * itemsize + group * PAGE_SIZE * itemsize
    q = group * head_dim * itemsize
    fixed = q + ROWS * 4 + SMEM_RESERVE
    if num_splits == 1:
        return ring + fixed
    if exchange == "cluster":
        return ring + fixed + head_dim * group * 4 + num_splits * group * 4
    tiles = merge_tasks(head_dim, group, num_splits) * num_splits
    stage = MERGE_COLS * MERGE_ROWS * itemsize
    publish = head_dim * group * 4 + group * 4
    gather = tiles * TILE_BYTES + num_splits * ROWS * 4
    return max(ring, publish, gather) + fixed + stage


def smem_budget(num_splits: int, num_rows: int) -> int:
    """Shared memory a CTA keeps to. Half an SM's, so that two CTAs fit per SM: with clusters
    of 8 or more over more than half the SMs (``num_rows * S > 66`` CTAs), so every cluster
    finds room in one GPC and the grid runs as one wave (at one CTA per SM some clusters wait
    for a second); and with one split over more rows than SMs, so up to 264 rows run as one
    wave instead of two. Otherwise all of it."""
    if num_splits >= 8 and num_rows * num_splits > NUM_SMS_H200 // 2:
        return SMEM_BYTES // 2
    if num_splits == 1 and num_rows > NUM_SMS_H200:
        return SMEM_BYTES // 2
    return SMEM_BYTES


def default_stages(head_dim: int, num_splits: int, num_rows: int = 1) -> int:
    """Deepest ring (<= :data:`MAX_DEFAULT_STAGES`, and <= the ``ceil(16 / S)`` pages of a
    split) that fits :func:`smem_budget`."""
    pages = -(-TOPK // num_splits)
    budget = smem_budget(num_splits, num_rows)
    for stages in range(MAX_DEFAULT_STAGES, 0, -1):
        if stages <= pages and smem_bytes(head_dim, stages, num_splits) <= budget:
            return stages
    return 1


def default_exchange(head_dim: int, num_splits: int, num_stages: int, num_rows: int,
                     group: int = ROWS, num_v_stages: int | None = None) -> str:
    """``"cluster"`` (split states written straight into the merging CTA's shared memory)
    where its receive buffer fits :func:`smem_budget` beside the rings (V ``num_v_stages``
    deep, default as the K ring), else ``"global"``."""
    need = smem_bytes(head_dim, num_stages, num_splits, group=group, exchange="cluster",
                      num_v_stages=num_v_stages)
    return "cluster" if need <= smem_budget(num_splits, num_rows) else "global"


@plgpu.inline_mgpu()
def _cluster_fence(_ctx):
    """Every thread: ``fence.acq_rel.cluster`` then a warpgroup barrier. Before a cluster
    barrier arrival it publishes the thread's global stores to the cluster; after the wait it
    orders the following loads after the peers' stores."""
    mgpu_utils.inline_ptx("fence.acq_rel.cluster;", has_side_effects=True)
    mgpu_utils.warpgroup_barrier()


def _normalise(acc_t, m, l):
    """(out^T, lse2) of an unnormalised state: ``acc_t [D', G]`` f32 divided by ``l [G]``,
    ``lse2 = m + log2 l`` (base 2). ``l == 0`` only for a row with no visible key (acc is 0
    there): zeros and -inf; NaN stays NaN."""
    l_div = jnp.where(l == 0.0, 1.0, l)
    out_t = acc_t / lax.broadcast_in_dim(l_div, acc_t.shape, [1])
    return out_t, jnp.where(l == 0.0, -jnp.inf, m + jnp.log2(l_div))


def _merge_splits(num_splits, load_out, load_lse):
    """Merge of ``S`` normalised split states of one task: ``load_out(k)`` and
    ``load_lse(k)`` give split k's ``[64, 8]`` f32 out^T tile and its base-2 LSE broadcast
    over the tile's rows. Returns (out^T tile, natural-log lse ``[8]``). Splits without a
    visible key (lse -inf) weigh 0; a row no split saw gives zeros and -inf; NaN propagates."""
    top = functools.reduce(jnp.maximum, [load_lse(k) for k in range(num_splits)])
    top = jnp.where(top == -jnp.inf, 0.0, top)
    total, acc_t = None, None
    for k in range(num_splits):
        w = jnp.exp2(load_lse(k) - top)
        term = w * load_out(k)
        total = w if total is None else total + w
        acc_t = term if acc_t is None else acc_t + term
    div = jnp.where(total == 0.0, 1.0, total)
    lse = jnp.where(total == 0.0, -jnp.inf, (top + jnp.log2(div)) * LN2)
    return acc_t / div, lse.max(axis=0)


def _decode_body(*refs, num_splits, num_stages, num_v_stages, head_dim, group, num_pages, num_rows,
                 num_cols, scale_log2, dtype, interpreting, pdl, exchange, approx_math,
                 evict_first):
    s_, ns, nv, d = num_splits, num_stages, num_v_stages, head_dim
    via_global = s_ > 1 and exchange == "global"
    req_ref, len_ref, sel_ref, bt_ref, q_ref, kv_ref, o_ref, lse_ref = refs[:8]
    rest = refs[8:]
    if via_global:
        apart_ref, lpart_ref = rest[:2]
        rest = rest[2:]
    q_smem, ring, lse_stage, kbar, vbar, qbar = rest[:6]
    if via_global:  # the ring's memory, reused after the page loop by the split merge
        (k_smem, v_smem, pt_smem), (apub_smem, lpub_smem), (g_smem, l_smem) = ring
        o_stage, cbar, tbar, lbar = rest[6:]
    else:
        k_smem, v_smem, pt_smem = ring
    if s_ > 1 and not via_global:  # every split's state of my head dims, and its LSE rows
        recv_out, recv_lse, mbar = rest[6:]

    t = lax.axis_index("t")
    h = lax.axis_index("h")
    c = lax.axis_index("c") if s_ > 1 else jnp.int32(0)

    if pdl and not interpreting:  # launched early: wait for the previous kernel's writes
        with jax.named_scope("pdl_wait"):
            plgpu.griddepcontrol_wait()
    # Q: the group's rows, zero-padded to a multiple of 8 (independent of the metadata)
    plgpu.copy_gmem_to_smem(q_ref.at[t, h], q_smem, qbar)
    if s_ > 1 and not via_global:
        cluster_exchange.init_receive_barrier(mbar)

    # Metadata as scalars: the safety boundary, the page ids, the rank of each consumed slot.
    with jax.named_scope("metadata"):
        kv_len = jnp.maximum(len_ref[t], 0)
        req = jnp.clip(req_ref[t], 0, num_rows - 1)
        n_blocks = (kv_len + PAGE_SIZE - 1) // PAGE_SIZE
        n_use = jnp.minimum(n_blocks, TOPK)
        bound = jnp.minimum(n_blocks, num_cols)
        blks, ranks = [], []
        n_valid = jnp.int32(0)
        for j in range(TOPK):
            raw = sel_ref[t, h, j]
            ok = (j < n_use) & (raw >= 0) & (raw < bound)
            blks.append(jnp.where(ok, raw, 0))  # boundary: before the block-table read
            ranks.append(jnp.where(ok, n_valid, TOPK))  # TOPK: picked by no step
            n_valid = n_valid + ok.astype(jnp.int32)
        pages = [jnp.clip(bt_ref[req, b], 0, num_pages - 1) for b in blks]

    def lookup(pos):
        """(page id, block id) of the consumed slot of rank ``pos``."""
        page = jnp.int32(0)
        blk = jnp.int32(0)
        for j in range(TOPK):
            hit = ranks[j] == pos
            page = jnp.where(hit, pages[j], page)
            blk = jnp.where(hit, blks[j], blk)
        return page, blk

    n_mine = jnp.maximum(n_valid - c + s_ - 1, 0) // s_  # my ranks: c, c + S, ...

    def issue(i, slot, parts):
        """TMA copies of my ``i``-th page into ``slot`` of the K ring (part 0) and/or of the
        V ring (part 1)."""
        page, _ = lookup(c + i * s_)
        with l2_hint.evict_first(evict_first):
            for part in parts:
                dst, bar = (k_smem, kbar) if part == 0 else (v_smem, vbar)
                plgpu.copy_gmem_to_smem(kv_ref.at[page, h, :, pl.ds(part * d, d)],
                                        dst.at[slot], bar.at[slot])

    with jax.named_scope("issue"):
        for i in range(max(ns, nv)):
            parts = tuple(p for p, depth in enumerate((ns, nv)) if i < depth)
            pl.when(i < n_mine)(functools.partial(issue, i, i, parts))
    with jax.named_scope("q_wait"):
        plgpu.barrier_wait(qbar)

    def step(i, carry):
        acc, m, l = carry
        slot, v_slot = lax.rem(i, ns), lax.rem(i, nv)
        _, blk = lookup(c + i * s_)
        n_keys = jnp.clip(kv_len - blk * PAGE_SIZE, 0, PAGE_SIZE)
        with jax.named_scope("k_wait"):
            plgpu.barrier_wait(kbar.at[slot])

        def qk(acc_ref):  # S^T = K Q^T: keys on the wgmma's M, the group on its N
            plgpu.wgmma(acc_ref, k_smem.at[slot], q_smem.transpose((1, 0)))
            return acc_ref[...]

        with jax.named_scope("qk_dot"):
            st = pl.run_scoped(qk, plgpu.ACC((PAGE_SIZE, group), jnp.float32))
            # K of this slot is read: the next page's K streams from here on
            pl.when(i + ns < n_mine)(lambda: issue(i + ns, slot, parts=(0,)))
        with jax.named_scope("softmax"):  # over the keys: axis 0, across the warps
            key = plgpu.broadcasted_iota(jnp.int32, (PAGE_SIZE, group), 0,
                                         layout=plgpu.Layout.WGMMA)
            st = jnp.where(key < n_keys, st * scale_log2, MASK)
            m_new = jnp.maximum(m, st.max(axis=0))
            alpha = jnp.exp2(m - m_new)
            pt = jnp.exp2(st - lax.broadcast_in_dim(m_new, st.shape, [1]))
            l_new = alpha * l + pt.sum(axis=0)
        with jax.named_scope("p_store"):  # P [group, 128]: P V's B operand, read transposed
            pt_smem.transpose((1, 0))[...] = pt.astype(dtype)
            plgpu.commit_smem()
        with jax.named_scope("v_wait"):
            plgpu.barrier_wait(vbar.at[v_slot])

        @pl.when(n_keys < PAGE_SIZE)
        def _zero_tail():  # keys past kv_len: V rows become 0 so that P V ignores them
            v_ref = v_smem.at[v_slot]
            row = plgpu.broadcasted_iota(jnp.int32, (PAGE_SIZE, d), 0,
                                         layout=plgpu.Layout.WGMMA)
            v_ref[...] = jnp.where(row < n_keys, v_ref[...], jnp.zeros((PAGE_SIZE, d), dtype))
            plgpu.commit_smem()

        def pv(acc_ref):  # out^T += V^T P^T: the head dim on M, the group on N
            plgpu.wgmma(acc_ref, v_smem.at[v_slot].transpose((1, 0)),
                        pt_smem.transpose((1, 0)))

        with jax.named_scope("pv"):
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
            if interpreting:  # the interpreter has no accumulator initialised from a value
                acc = acc + pl.run_scoped(lambda r: (pv(r), r[...])[1],
                                          plgpu.ACC((d, group), jnp.float32))
            else:  # accumulate in place
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        pl.when(i + nv < n_mine)(lambda: issue(i + nv, v_slot, parts=(1,)))  # V slot is free
        return acc, m_new, l_new

    col_layout = plgpu.Layout.WGMMA.reduce(0)
    init = (plgpu.layout_cast(jnp.zeros((d, group), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((group,), MASK, jnp.float32), col_layout),
            plgpu.layout_cast(jnp.zeros((group,), jnp.float32), col_layout))
    acc, m, l = lax.fori_loop(0, n_mine, step, init)  # acc^T [D, group], m and l [group]
    if pdl and not interpreting:  # the next kernel may start its prologue (it waits for us)
        plgpu.griddepcontrol_launch_dependents()

    if s_ == 1:
        with jax.named_scope("store"):
            out_t, lse2 = _normalise(acc, m, l)
            q_smem.transpose((1, 0))[...] = out_t.astype(dtype)  # Q is no longer read
            lse_stage.at[pl.ds(0, group)][...] = lse2 * LN2
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, o_ref.at[t, h])
            plgpu.copy_smem_to_gmem(lse_stage.at[pl.ds(0, group)], lse_ref.at[t, h])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        return

    out_t, lse2 = _normalise(acc, m, l)
    if not via_global:
        # Straight into the merging CTAs' shared memory, counted by each receiver's barrier;
        # then each CTA merges its D / S head dims of every group row.
        with jax.named_scope("exchange"):
            cluster_exchange.cluster_wait()
            lse_t = lax.broadcast_in_dim(lse2, out_t.shape, [1])
            cluster_exchange.send_state(out_t, lse_t, recv_out, recv_lse, mbar)
        with jax.named_scope("receive_wait"):
            cluster_exchange.wait_received(mbar)
        with jax.named_scope("merge"):
            cluster_exchange.merge_received(approx_math)(recv_out, recv_lse, o_ref.at[t, h],
                                                          lse_ref.at[t, h])
        return

    # Through global memory, in tasks of 64 head dims x 8 group rows: task i = (block
    # i // (group / 8) of the head dim, block i % (group / 8) of the group), merged by CTA
    # i % S. Publish (out^T [D, group] f32, lse2), meet the cluster, then gather my tasks' S
    # tiles and the peers' LSE rows by TMA.
    col_blocks = group // MERGE_COLS
    num_tasks = (d // MERGE_ROWS) * col_blocks
    my_tasks = merge_tasks(d, group, s_)

    def _tile(n):
        """(task, head-dim rows, group columns) of my n-th task, task c + n * S."""
        task = c + n * s_
        return (task, pl.ds(lax.div(task, col_blocks) * MERGE_ROWS, MERGE_ROWS),
                pl.ds(lax.rem(task, col_blocks) * MERGE_COLS, MERGE_COLS))

    def _store(task, rows, cols, out_tile, lse):
        with jax.named_scope("store"):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous task's staging
            o_stage.transpose((1, 0))[...] = out_tile.astype(dtype)
            lse_stage.at[pl.ds(0, MERGE_COLS)][...] = lse
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_stage, o_ref.at[t, h, cols, rows])
            pl.when(lax.div(task, col_blocks) == 0)(lambda: plgpu.copy_smem_to_gmem(
                lse_stage.at[pl.ds(0, MERGE_COLS)], lse_ref.at[t, h, cols]))

    with jax.named_scope("publish"):
        apub_smem[...] = out_t
        lpub_smem[...] = lse2
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(apub_smem, apart_ref.at[t, h, c])
        plgpu.copy_smem_to_gmem(lpub_smem, lpart_ref.at[t, h, c, pl.ds(0, group)])
        plgpu.wait_smem_to_gmem(0)
        _cluster_fence()
        plgpu.barrier_arrive(cbar)
    with jax.named_scope("cluster_wait"):
        plgpu.barrier_wait(cbar)
        _cluster_fence()

    def _gather(n):  # the S tiles of my n-th task into g_smem.at[n * S + k]
        _, rows, cols = _tile(n)
        for k in range(s_):
            plgpu.copy_gmem_to_smem(apart_ref.at[t, h, k, rows, cols], g_smem.at[n * s_ + k],
                                    tbar.at[n])

    def _merge_gathered(n):
        task, rows, cols = _tile(n)
        with jax.named_scope("merge"):
            plgpu.barrier_wait(tbar.at[n])

            def lse_tile(k):
                row = plgpu.load(l_smem.at[k, cols], layout=_MERGE_COL, optimized=False)
                return lax.broadcast_in_dim(row, (MERGE_ROWS, MERGE_COLS), [1])
            out_tile, lse = _merge_splits(
                s_, lambda k: plgpu.load(g_smem.at[n * s_ + k], layout=plgpu.Layout.WGMMA,
                                         optimized=False), lse_tile)
        _store(task, rows, cols, out_tile, lse)

    @pl.when(c < num_tasks)
    def _merge():
        with jax.named_scope("merge_issue"):  # every copy of my merge in flight at once
            plgpu.copy_gmem_to_smem(lpart_ref.at[t, h], l_smem, lbar)
            for n in range(my_tasks):
                pl.when(c + n * s_ < num_tasks)(functools.partial(_gather, n))
            plgpu.barrier_wait(lbar)
        for n in range(my_tasks):
            pl.when(c + n * s_ < num_tasks)(functools.partial(_merge_gathered, n))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "num_splits", "num_stages",
                                             "num_v_stages", "pdl", "approx_math", "exchange",
                                             "l2_evict_first", "profile_dir"))
def sparse_decode_mgpu(q, kv_cache, selected, block_table, req_indices, kv_lens, *, scale,
                       interpret=None, num_splits=None, num_stages=None, num_v_stages=None,
                       pdl=True, approx_math=True, exchange=None, l2_evict_first=None,
                       profile_dir=None):
    """MSA sparse decode on Mosaic GPU; arguments, results and safety boundary as
    :func:`pallas_kernels.sparse_decode.sparse_decode`.

    Args:
      q: ``[T, Hq, D]`` bf16/f16, D in {64, 128}, GQA group ``Hq / Hkv <= 64``.
      kv_cache: ``[N, Hkv, 128, 2D]`` (K = ``[..., :D]``, V = ``[..., D:]``), q's dtype.
      selected: ``[T, Hkv, 16]`` int32 block ids (-1 or out-of-range ids contribute nothing and
        load nothing). block_table: ``[R, P]`` int32 page ids; req_indices ``[T]`` int32 rows of
        it. kv_lens: ``[T]`` int32 visible keys per token (0 = padded row).
      scale: softmax scale (static).
      interpret: ``None`` interprets unless the trace targets a GPU; ``True``/``False``; or a
        ``plgpu.InterpretGPUParams``.
      num_splits: CTAs per (token, KV head) in {1, 2, 4, 8, 16} (a
        cluster; merged in the kernel); ``None``: :func:`default_splits`.
      num_stages: TMA ring depth in {1, 2, 3}; ``None``: :func:`default_stages`.
      num_v_stages: the V ring's depth in {1, 2, 3} where it differs from the K ring's;
        ``None``: ``num_stages``.
      pdl: launch with programmatic dependent launch: the kernel may start while the previous
        kernel of the stream drains and waits (``griddepcontrol.wait``) before it reads any
        input; it lets the next kernel launch once its page loop is done.
      approx_math: ``exp2`` and ``log2`` as the hardware's approximate instructions
        (``ex2.approx.ftz``, ``lg2.approx.ftz``; the default); ``False``: the precise (slower)
        library functions.
      exchange: how the splits' states reach the CTAs that merge them (``num_splits > 1``):
        ``"cluster"``, stores into the merging CTA's shared memory (compiled only);
        ``"global"``, through global memory and a cluster barrier; ``None``:
        :func:`default_exchange` compiled, ``"global"`` interpreted.
      l2_evict_first: the page loads' L2 policy: ``True``, evict-first (a page is read once);
        ``False``, the normal policy; ``None``: :func:`default_evict_first`. Values are the
        same either way.
      profile_dir: a directory: each call writes a Perfetto trace there of the kernel's named
        regions per CTA (Mosaic GPU's profiler; a debugging aid, compiled only).
    Returns:
      ``(out [T, Hq, D] q.dtype, lse [T, Hq] f32)``, lse the natural-log LSE of the scaled
      scores; rows without a visible key give zeros and -inf.
    """
    name = "sparse_decode_mgpu"
    t, hq, d, n, hkv, r, p = validate_inputs(q, kv_cache, selected, block_table, req_indices,
                                             kv_lens, name=name)
    if jnp.dtype(q.dtype) not in _DTYPES:
        raise TypeError(f"{name}: q dtype must be bf16 or f16 (wgmma operands), got {q.dtype}")
    if d not in HEAD_DIMS:
        raise ValueError(f"{name}: head dim D = q.shape[2] must be one of {HEAD_DIMS}, got {d}")
    g = hq // hkv
    if g > ROWS:
        raise ValueError(f"{name}: GQA group Hq/Hkv = {g} exceeds {ROWS} rows per CTA")
    splits = default_splits(t * hkv) if num_splits is None else num_splits
    if splits not in SPLITS:
        raise ValueError(f"{name}: num_splits must be one of {SPLITS}, got {splits}")
    stages = default_stages(d, splits, t * hkv) if num_stages is None else num_stages
    if stages not in STAGES:
        raise ValueError(f"{name}: num_stages must be one of {STAGES}, got {stages}")
    v_stages = stages if num_v_stages is None else num_v_stages
    if v_stages not in STAGES:
        raise ValueError(f"{name}: num_v_stages must be one of {STAGES}, got {v_stages}")
    evict_first = (default_evict_first(splits, t * hkv) if l2_evict_first is None
                   else bool(l2_evict_first))
    gp = padded_rows(hq, hkv)
    interpret = mosaic_interpret_params(interpret, inline_mgpu="ignore")  # skips inline fences
    if exchange is None:
        exchange = "global" if interpret is not None else default_exchange(
            d, splits, stages, t * hkv, gp, num_v_stages=v_stages)
    if exchange not in EXCHANGES:
        raise ValueError(f"{name}: exchange must be one of {EXCHANGES}, got {exchange!r}")
    if exchange == "cluster" and interpret is not None:
        raise ValueError(f"{name}: exchange 'cluster' needs the compiled kernel (interpret "
                         f"mode has no stores into a peer CTA's shared memory)")
    need = smem_bytes(d, stages, splits, group=gp, exchange=exchange, num_v_stages=v_stages)
    if need > SMEM_BYTES:
        raise ValueError(f"{name}: num_stages {stages} (V: {v_stages}) with num_splits "
                         f"{splits}, D = {d}, a GQA group of {gp} rows and exchange "
                         f"{exchange!r} needs {need} bytes: more than {SMEM_BYTES} bytes of "
                         f"shared memory")
    if t == 0:
        return jnp.zeros((0, hq, d), q.dtype), jnp.zeros((0, hq), jnp.float32)

    qg = q.reshape(t, hkv, g, d)
    if gp != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    out_type = [jax.ShapeDtypeStruct((t, hkv, gp, d), q.dtype),
                jax.ShapeDtypeStruct((t, hkv, gp), jnp.float32)]
    via_global = splits > 1 and exchange == "global"
    tiles = merge_tasks(d, gp, splits) * splits  # the tiles a CTA merges
    if via_global:  # the splits' states: out^T [D, group] f32 and the base-2 LSE
        out_type += [jax.ShapeDtypeStruct((t, hkv, splits, d, gp), jnp.float32),
                     jax.ShapeDtypeStruct((t, hkv, splits, ROWS), jnp.float32)]
    ring = (plgpu.SMEM((stages, PAGE_SIZE, d), q.dtype, transforms=_TILE),  # K ring
            plgpu.SMEM((v_stages, PAGE_SIZE, d), q.dtype, transforms=_TILE),  # V ring
            plgpu.SMEM((gp, PAGE_SIZE), q.dtype, transforms=_TILE))         # P
    if via_global:  # after the page loop: this split's state, then the peers' tiles and LSE
        ring = plgpu.RefUnion(
            ring, (plgpu.SMEM((d, gp), jnp.float32), plgpu.SMEM((gp,), jnp.float32)),
            (plgpu.SMEM((tiles, MERGE_ROWS, MERGE_COLS), jnp.float32),
             plgpu.SMEM((splits, ROWS), jnp.float32)))
    scratch = [
        plgpu.SMEM((gp, d), q.dtype, transforms=_TILE),                     # Q, then out (S=1)
        ring,
        plgpu.SMEM((ROWS,), jnp.float32),                                   # lse staging
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=v_stages),
        plgpu.Barrier(),
    ]
    if via_global:
        scratch += [plgpu.SMEM((MERGE_COLS, MERGE_ROWS), q.dtype, transforms=_TILE),  # out^T
                    plgpu.ClusterBarrier(collective_axes=("c",)),
                    plgpu.Barrier(num_arrivals=splits,  # each merge task's S tiles
                                  num_barriers=merge_tasks(d, gp, splits)),
                    plgpu.Barrier()]                     # the peers' LSE rows
    elif splits > 1:  # every split's out^T of my D / S head dims, and its base-2 LSE row
        scratch += [plgpu.SMEM((splits, d // splits, gp), jnp.float32),
                    plgpu.SMEM((splits, gp), jnp.float32),
                    plgpu.SMEM((2,), jnp.int32)]  # the receive barrier (an mbarrier)
    body = functools.partial(
        _decode_body, num_splits=splits, num_stages=stages, num_v_stages=v_stages, head_dim=d,
        group=gp, num_pages=n, num_rows=r, num_cols=p, scale_log2=float(scale) * LOG2E,
        dtype=q.dtype, interpreting=interpret is not None, pdl=bool(pdl), exchange=exchange,
        approx_math=bool(approx_math), evict_first=evict_first)
    cluster = dict(cluster=(splits,), cluster_names=("c",)) if splits > 1 else {}
    profile = dict(profile_space=PROFILE_EVENTS, profile_dir=profile_dir) if profile_dir else {}
    params = plgpu.CompilerParams(approx_math=bool(approx_math), **profile)
    outs = plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(t, hkv), grid_names=("t", "h"),
        interpret=interpret, kernel_name="msa_sparse_decode_mgpu", compiler_params=params,
        **cluster)(req_indices, kv_lens, selected, block_table, qg, kv_cache)
    o, lse = outs[0], outs[1]
    return o[:, :, :g].reshape(t, hq, d), lse[:, :, :g].reshape(t, hq)


__all__ = ["sparse_decode_mgpu", "default_splits", "default_stages", "default_exchange",
           "default_evict_first", "smem_bytes", "smem_budget", "merge_tasks", "padded_rows",
           "SPLITS", "STAGES", "HEAD_DIMS", "ROWS", "EXCHANGES"]

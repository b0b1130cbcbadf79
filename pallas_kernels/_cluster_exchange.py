"""Split states merged through a cluster's shared memory (Mosaic GPU, inside
``plgpu.inline_mgpu``), for a kernel whose cluster of ``S`` CTAs (one warpgroup each, cluster
axis x) splits one row's keys and must merge the ``S`` partial softmax states.

Each CTA holds its normalised state in registers: ``out^T [D, G]`` f32 (WGMMA layout) and the
base-2 LSE ``[G]``. CTA ``o`` merges head dims ``[o R, (o + 1) R)``, ``R = D / S``, of every
group row. The sequence, every thread of every CTA taking part:

1. :func:`init_receive_barrier` before the kernel's main loop;
2. :func:`cluster_wait` after it (every peer's barrier is initialised);
3. :func:`send_state`: a relaxed arrival that announces the bytes, then ``st.async`` of the
   registers into the owners' receive buffers (``recv_out [S, R, G]``, ``recv_lse [S, G]``
   f32, shared memory of their own);
4. :func:`wait_received`: the receive barrier's first phase (all ``S`` shares);
5. :func:`merge_received`: merge and write the head dims to the output from registers.

The interpreter has none of these instructions: interpreted kernels need another path.
"""
from __future__ import annotations

import functools

from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, gpu, llvm, memref, nvvm
from jaxlib.mlir.dialects import math as mlir_math
import numpy as np

from pallas_kernels.sparse_decode import LN2


@plgpu.inline_mgpu()
def cluster_wait(_ctx):
    """Every thread: ``barrier.cluster.wait`` (acquire) for the arrival of all the cluster's
    threads (:func:`init_receive_barrier`): every peer's receive barrier is initialised."""
    mgpu_utils.inline_ptx("barrier.cluster.wait.aligned;", has_side_effects=True)


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
def init_receive_barrier(_ctx, mbar):
    """Before the main loop: one thread initialises the receive barrier (``mbar``: 8 bytes of
    shared memory, int32 ``[2]``) for one arrival per split, the init is published to the
    cluster, and every thread arrives (relaxed) at the hardware cluster barrier; the wait
    (:func:`cluster_wait`) comes after the main loop, before the first store into a peer."""
    i32 = ir.IntegerType.get_signless(32)
    num_splits = gpu.cluster_dim_blocks(gpu.Dimension.x)
    ptr = mgpu_utils.memref_ptr(mbar)
    with mgpu_utils.when(mgpu_utils.single_thread_predicate(mgpu_utils.ThreadSubset.BLOCK)):
        nvvm.mbarrier_init(ptr, arith.index_cast(i32, num_splits))
    mgpu_utils.inline_ptx("fence.mbarrier_init.release.cluster;", has_side_effects=True)
    mgpu_utils.inline_ptx("barrier.cluster.arrive.relaxed.aligned;", has_side_effects=True)


@plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA, plgpu.RefType(),
                              plgpu.RefType(), plgpu.RefType()))
def send_state(_ctx, out_t, lse_t, recv_out, recv_lse, mbar):
    """Stores this split's state into the shared memory of the CTAs that merge it.

    ``out_t`` and ``lse_t``: ``[D, G]`` f32 (WGMMA layout), the normalised out^T and the
    base-2 LSE broadcast over the head dim. CTA ``o`` of the cluster merges head dims
    ``[o R, (o + 1) R)`` with ``R = D / S``; this CTA (rank ``k``) writes its rows of that
    range to ``recv_out[k]`` (``[S, R, G]`` f32) of CTA ``o`` and its LSE row to
    ``recv_lse[k]`` (``[S, G]`` f32) of every CTA, by ``st.async`` from registers, counted
    by the receiver's barrier ``mbar``: thread ``o < S`` arrives once on CTA ``o``'s barrier,
    expecting the bytes this CTA sends there. The arrival is relaxed: each ``st.async``
    releases its own bytes through the barrier's transaction count, and the receiver reads
    nothing else of this CTA's, so no earlier memory traffic needs ordering before the
    arrival (a release arrival costs a cluster-scope fence). Nothing waits on this side."""
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    f32 = ir.F32Type.get()
    num_splits, num_rows, group = ir.MemRefType(recv_out.type).shape
    c = mgpu_utils.c
    me = arith.index_cast(i32, gpu.cluster_block_id(gpu.Dimension.x))
    mbar_ptr = mgpu_utils.memref_ptr(mbar)
    out_ptr, lse_ptr = mgpu_utils.memref_ptr(recv_out), mgpu_utils.memref_ptr(recv_lse)
    tid = arith.remui(mgpu_utils.thread_idx(), c(128, i32))
    with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, tid, c(num_splits, i32))):
        mgpu_utils.inline_ptx(
            "mbarrier.arrive.expect_tx.relaxed.cluster.shared::cluster.b64 _, [$0], $1;",
            mgpu_utils.get_cluster_ptr(mbar_ptr, tid, generic=False),
            c((num_rows + 1) * group * 4, i32), has_side_effects=True)

    def store(ptr, offset, owner, value):
        dst = mgpu_utils.get_cluster_ptr(mgpu_utils.getelementptr(ptr, [offset], f32), owner,
                                         generic=False)
        bar = mgpu_utils.get_cluster_ptr(mbar_ptr, owner, generic=False)
        llvm.inline_asm(
            ir.Type.parse("!llvm.void"), [dst, mgpu_utils.bitcast(value, i64), bar],
            "st.async.cluster.shared::cluster.mbarrier::complete_tx::bytes.b64 [$0], $1, [$2];",
            "l,l,l", has_side_effects=True)

    for (row, col), reg in zip(out_t.layout.thread_idxs(out_t.shape),
                               np.ndindex(out_t.registers.shape), strict=True):
        row, col = arith.index_cast(i32, row), arith.index_cast(i32, col)
        owner = arith.divui(row, c(num_rows, i32))
        r = arith.remui(row, c(num_rows, i32))
        flat = arith.addi(arith.muli(arith.addi(arith.muli(me, c(num_rows, i32)), r),
                                     c(group, i32)), col)
        store(out_ptr, flat, owner, out_t.registers[reg])
        with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.eq, r, c(0, i32))):
            store(lse_ptr, arith.addi(arith.muli(me, c(group, i32)), col), owner,
                  lse_t.registers[reg])


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
def wait_received(_ctx, mbar):
    """Every thread: wait for the receive barrier's first phase (all splits' bytes)."""
    i1, i32 = ir.IntegerType.get_signless(1), ir.IntegerType.get_signless(32)
    ref = mgpu_utils.BarrierRef(mgpu_utils.memref_ptr(mbar), mgpu_utils.c(0, i32), None, 1)
    ref.wait_parity(mgpu_utils.c(0, i1))


def merge_received(approx: bool):
    """The merge of the states :func:`send_state` delivered (``approx``: ``ex2``/``lg2`` as
    the hardware's approximate instructions)."""
    def unary(instr, fn):
        if approx:
            return lambda x: llvm.inline_asm(ir.F32Type.get(), [x], f"{instr} $0, $1;", "=f,f")
        return fn

    exp2 = unary("ex2.approx.ftz.f32", mlir_math.exp2)
    log2 = unary("lg2.approx.ftz.f32", mlir_math.log2)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 4)
    def merge(_ctx, recv_out, recv_lse, out_ref, lse_ref):
        """``recv_out [S, R, G]`` and ``recv_lse [S, G]`` f32 (this CTA's range of head dims
        from every split) into ``out_ref [G, D]`` (q's dtype) and, on the cluster's CTA 0,
        ``lse_ref [G]`` f32 (natural log). Split ``k`` weighs ``2^(lse_k - max lse)``; splits
        without a visible key (lse -inf) weigh 0, a row none saw gives zeros and -inf, NaN
        propagates. One element per thread and step."""
        index, i32, f32 = ir.IndexType.get(), ir.IntegerType.get_signless(32), ir.F32Type.get()
        num_splits, num_rows, group = ir.MemRefType(recv_out.type).shape
        out_dtype = ir.MemRefType(out_ref.type).element_type
        c = mgpu_utils.c
        me = gpu.cluster_block_id(gpu.Dimension.x)
        tid = arith.index_cast(index, arith.remui(mgpu_utils.thread_idx(), c(128, i32)))
        ninf, fzero, fone = c(float("-inf"), f32), c(0.0, f32), c(1.0, f32)
        eq = arith.CmpFPredicate.OEQ
        head0 = arith.muli(me, c(num_rows, index))
        lse_writer = arith.cmpi(arith.CmpIPredicate.eq, me, c(0, index))
        total_elems = num_rows * group

        def element(e):  # e = col * R + r: consecutive threads write consecutive head dims
            col = arith.divui(e, c(num_rows, index))
            r = arith.remui(e, c(num_rows, index))
            lses = [memref.load(recv_lse, [c(k, index), col]) for k in range(num_splits)]
            top = functools.reduce(arith.maximumf, lses)
            top = arith.select(arith.cmpf(eq, top, ninf), fzero, top)
            total, acc = fzero, fzero
            for k in range(num_splits):
                w = exp2(arith.subf(lses[k], top))
                part = memref.load(recv_out, [c(k, index), r, col])
                total = arith.addf(total, w)
                acc = arith.addf(acc, arith.mulf(w, part))
            empty = arith.cmpf(eq, total, fzero)
            div = arith.select(empty, fone, total)
            memref.store(arith.truncf(out_dtype, arith.divf(acc, div)), out_ref,
                         [col, arith.addi(head0, r)])
            lse = arith.mulf(arith.addf(top, log2(div)), c(LN2, f32))
            first = arith.andi(lse_writer,
                               arith.cmpi(arith.CmpIPredicate.eq, r, c(0, index)))
            with mgpu_utils.when(first):
                memref.store(arith.select(empty, ninf, lse), lse_ref, [col])

        for j in range(-(-total_elems // 128)):
            e = arith.addi(tid, c(128 * j, index))
            if 128 * (j + 1) <= total_elems:
                element(e)
            else:
                with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, e,
                                                c(total_elems, index))):
                    element(e)

    return merge

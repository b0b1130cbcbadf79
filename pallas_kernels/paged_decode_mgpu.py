"""Dense paged decode on the Pallas Mosaic GPU backend (Hopper): split-KV flash decoding.

Contract and safety boundary: :mod:`pallas_kernels.paged_attention`. Kernel: grid
``(T, Hkv, S)``; CTA ``(t, h, c)`` (one warpgroup) owns the GQA group of token ``t`` and KV
head ``h`` (every KV byte is read once for all the group's query heads) and the ``c``-th of
``S`` contiguous runs of the token's ``n = min(ceil(kv_len / 128), P)`` pages (each run
``ceil(n / S)`` pages long). It reads the token's metadata as scalars, streams its pages'
K and V (``[128, D]`` each; the page id read from the block table is a dynamic TMA
coordinate) through rings ``num_stages`` deep, and runs the online softmax (base 2, the
hardware's ``exp2``, a finite mask value) with wgmma in transposed form, so the group
(padded to a multiple of 8) is the wgmma's N: ``S^T = K Q^T`` (keys on M), ``P`` stored as
``[group, 128]``, ``acc^T += V^T P^T``. A page's next K is issued as soon as ``S^T`` has read
it, its next V once ``P V`` has. Keys past ``kv_len`` in the last page are masked and their
V rows zeroed in shared memory (NaN there stays out). Each CTA writes its normalised state
(``out^T [D, group]`` f32, base-2 LSE) to global memory; :func:`merge_splits` combines the S
states by their LSE (one fused XLA op). A token with ``kv_len`` 0, or a run with no page,
gives zeros and ``-inf``.

:func:`default_splits` picks ``S`` from the batch so that about two CTAs per SM of an H200
stream pages from ``B = 1`` on, never more runs than the block table has pages.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._interpret import mosaic_interpret_params
from pallas_kernels._shapes import NUM_SMS_H200, PAGE_SIZE, SMEM_BYTES
from pallas_kernels.paged_attention import LN2, LOG2E, validate_inputs

HEAD_DIMS = (64, 128)  # multiples of the 64-element (128-byte) swizzle tile; register budget
MAX_GROUP = 64  # GQA group rows of one CTA (the wgmma's N; register budget)
STAGES = (1, 2, 3, 4)
DEFAULT_STAGES = 2
FILL_CTAS = 2 * NUM_SMS_H200  # default splits: T * Hkv * S >= this
MAX_SPLITS = 256
MASK = -1e30  # finite mask value for scores (base-2 units)
SMEM_RESERVE = 4 * 1024  # barriers, reduction scratch, alignment
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_TILE = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # 16-bit wgmma operands
_COL = plgpu.Layout.WGMMA.reduce(0)  # a [group] vector: one value per wgmma column


def padded_group(num_q_heads: int, num_kv_heads: int) -> int:
    """The GQA group rounded up to a multiple of 8 (the wgmma's N)."""
    return -(-(num_q_heads // num_kv_heads) // 8) * 8


def default_splits(num_rows: int, num_cols: int) -> int:
    """Runs per (token, KV head) row for ``num_rows = T * Hkv`` rows and a block table of
    ``num_cols`` pages: the smallest ``S`` with ``num_rows * S >= 2 * 132`` CTAs, at most one
    run per page and at most :data:`MAX_SPLITS`."""
    return max(1, min(-(-FILL_CTAS // max(num_rows, 1)), num_cols, MAX_SPLITS))


def smem_bytes(head_dim: int, group: int, num_stages: int, itemsize: int = 2) -> int:
    """Shared memory of one CTA: the K and V rings, P, Q, the state staging and a reserve."""
    rings = 2 * num_stages * PAGE_SIZE * head_dim * itemsize
    return (rings + group * PAGE_SIZE * itemsize + group * head_dim * itemsize
            + head_dim * group * 4 + group * 4 + SMEM_RESERVE)


def merge_splits(out_parts, lse_parts):
    """LSE merge of the S split states: out_parts ``[T, Hkv, S, D, Gp]`` f32 (out^T of each
    run, normalised), lse_parts ``[T, Hkv, S, Gp]`` f32 (base 2) -> ``(out [T, Hkv, Gp, D]
    f32, lse [T, Hkv, Gp] f32 natural log)``. Runs with ``-inf`` weigh 0; a row no run saw
    gives zeros and ``-inf``; NaN propagates."""
    top = jnp.max(lse_parts, axis=2, keepdims=True)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    w = jnp.exp2(lse_parts - top)  # [T, Hkv, S, Gp]
    total = jnp.sum(w, axis=2)
    acc = jnp.einsum("thsg,thsdg->thgd", w, out_parts, precision="highest")
    div = jnp.where(total == 0.0, 1.0, total)
    lse = jnp.where(total == 0.0, -jnp.inf, (top[:, :, 0] + jnp.log2(div)) * LN2)
    return acc / div[..., None], lse


def _decode_body(req_ref, len_ref, bt_ref, q_ref, kv_ref, opart_ref, lpart_ref,
                 q_smem, k_smem, v_smem, pt_smem, o_stage, l_stage, kbar, vbar, qbar, *,
                 num_splits, num_stages, head_dim, group, num_pages, num_rows, num_cols,
                 scale_log2, dtype):
    ns, d = num_stages, head_dim
    t, h, c = lax.axis_index("t"), lax.axis_index("h"), lax.axis_index("c")
    plgpu.copy_gmem_to_smem(q_ref.at[t, h], q_smem, qbar)

    kv_len = jnp.maximum(len_ref[t], 0)
    req = jnp.clip(req_ref[t], 0, num_rows - 1)
    n_blocks = jnp.minimum((kv_len + PAGE_SIZE - 1) // PAGE_SIZE, num_cols)
    per_run = (n_blocks + num_splits - 1) // num_splits
    first = c * per_run
    n_mine = jnp.clip(n_blocks - first, 0, per_run)

    def issue(i, slot, part):
        """TMA copy of K (part 0) or V (part 1) of my ``i``-th page into ``slot``."""
        page = jnp.clip(bt_ref[req, first + i], 0, num_pages - 1)
        dst, bar = (k_smem, kbar) if part == 0 else (v_smem, vbar)
        plgpu.copy_gmem_to_smem(kv_ref.at[page, h, :, pl.ds(part * d, d)], dst.at[slot],
                                bar.at[slot])

    for i in range(ns):
        for part in (0, 1):
            pl.when(i < n_mine)(functools.partial(issue, i, i, part))
    plgpu.barrier_wait(qbar)

    def step(i, carry):
        acc, m, l = carry
        slot = lax.rem(i, ns)
        n_keys = jnp.clip(kv_len - (first + i) * PAGE_SIZE, 0, PAGE_SIZE)
        plgpu.barrier_wait(kbar.at[slot])

        def qk(acc_ref):  # S^T = K Q^T: keys on the wgmma's M, the group on its N
            plgpu.wgmma(acc_ref, k_smem.at[slot], q_smem.transpose((1, 0)))
            return acc_ref[...]

        st = pl.run_scoped(qk, plgpu.ACC((PAGE_SIZE, group), jnp.float32))
        pl.when(i + ns < n_mine)(lambda: issue(i + ns, slot, 0))  # K of this slot is read
        key = plgpu.broadcasted_iota(jnp.int32, (PAGE_SIZE, group), 0,
                                     layout=plgpu.Layout.WGMMA)
        st = jnp.where(key < n_keys, st * scale_log2, MASK)
        m_new = jnp.maximum(m, st.max(axis=0))
        alpha = jnp.exp2(m - m_new)
        pt = jnp.exp2(st - lax.broadcast_in_dim(m_new, st.shape, [1]))
        l_new = alpha * l + pt.sum(axis=0)
        pt_smem.transpose((1, 0))[...] = pt.astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_wait(vbar.at[slot])

        @pl.when(n_keys < PAGE_SIZE)
        def _zero_tail():  # keys past kv_len: V rows become 0 so that P V ignores them
            v_ref = v_smem.at[slot]
            row = plgpu.broadcasted_iota(jnp.int32, (PAGE_SIZE, d), 0,
                                         layout=plgpu.Layout.WGMMA)
            v_ref[...] = jnp.where(row < n_keys, v_ref[...], jnp.zeros((PAGE_SIZE, d), dtype))
            plgpu.commit_smem()

        def pv(acc_ref):  # out^T += V^T P^T: the head dim on M, the group on N
            plgpu.wgmma(acc_ref, v_smem.at[slot].transpose((1, 0)), pt_smem.transpose((1, 0)))
            return acc_ref[...]

        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
        acc = acc + pl.run_scoped(pv, plgpu.ACC((d, group), jnp.float32))
        pl.when(i + ns < n_mine)(lambda: issue(i + ns, slot, 1))  # V of this slot is read
        return acc, m_new, l_new

    init = (plgpu.layout_cast(jnp.zeros((d, group), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((group,), MASK, jnp.float32), _COL),
            plgpu.layout_cast(jnp.zeros((group,), jnp.float32), _COL))
    acc, m, l = lax.fori_loop(0, n_mine, step, init)  # acc^T [D, group], m and l [group]

    l_div = jnp.where(l == 0.0, 1.0, l)
    o_stage[...] = acc / lax.broadcast_in_dim(l_div, acc.shape, [1])
    l_stage[...] = jnp.where(l == 0.0, -jnp.inf, m + jnp.log2(l_div))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_stage, opart_ref.at[t, h, c])
    plgpu.copy_smem_to_gmem(l_stage, lpart_ref.at[t, h, c])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "num_splits", "num_stages"))
def paged_decode_mgpu(q, kv_cache, block_table, req_indices, kv_lens, *, scale,
                      interpret=None, num_splits=None, num_stages=None):
    """Dense paged attention of each token over its whole context, split-KV.

    Args:
      q: ``[T, Hq, D]`` bf16/f16, D in {64, 128}, GQA group ``Hq / Hkv <= 64``.
      kv_cache: ``[N, Hkv, 128, 2D]`` (K = ``[..., :D]``, V = ``[..., D:]``), q's dtype.
      block_table: ``[R, P]`` int32; req_indices, kv_lens: ``[T]`` int32 (0 = padded token).
      scale: softmax scale (static).
      interpret: ``None`` interprets unless the trace targets a GPU; ``True``/``False``; or a
        ``plgpu.InterpretGPUParams``.
      num_splits: runs per (token, KV head) in ``[1, 256]``; ``None``: :func:`default_splits`.
      num_stages: ring depth in :data:`STAGES`; ``None``: :data:`DEFAULT_STAGES`.
    Returns:
      ``(out [T, Hq, D] q.dtype, lse [T, Hq] f32)`` as :mod:`pallas_kernels.paged_attention`.
    """
    name = "paged_decode_mgpu"
    t, hq, d, n, hkv, r, p = validate_inputs(q, kv_cache, block_table, req_indices, kv_lens,
                                             name=name)
    if jnp.dtype(q.dtype) not in DTYPES:
        raise TypeError(f"{name}: q dtype must be bf16 or f16 (wgmma operands), got {q.dtype}")
    if d not in HEAD_DIMS:
        raise ValueError(f"{name}: head dim D = q.shape[2] must be one of {HEAD_DIMS}, got {d}")
    g = hq // hkv
    if g > MAX_GROUP:
        raise ValueError(f"{name}: GQA group Hq/Hkv = {g} exceeds {MAX_GROUP} rows per CTA")
    splits = default_splits(t * hkv, p) if num_splits is None else num_splits
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"{name}: num_splits must be in [1, {MAX_SPLITS}], got {splits}")
    stages = DEFAULT_STAGES if num_stages is None else num_stages
    if stages not in STAGES:
        raise ValueError(f"{name}: num_stages must be one of {STAGES}, got {stages}")
    gp = padded_group(hq, hkv)
    need = smem_bytes(d, gp, stages)
    if need > SMEM_BYTES:
        raise ValueError(f"{name}: num_stages {stages} with D = {d} and a group of {gp} rows "
                         f"needs {need} bytes: more than {SMEM_BYTES} bytes of shared memory")
    if t == 0:
        return jnp.zeros((0, hq, d), q.dtype), jnp.zeros((0, hq), jnp.float32)

    qg = q.reshape(t, hkv, g, d)
    if gp != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    out_type = (jax.ShapeDtypeStruct((t, hkv, splits, d, gp), jnp.float32),
                jax.ShapeDtypeStruct((t, hkv, splits, gp), jnp.float32))
    scratch = [
        plgpu.SMEM((gp, d), q.dtype, transforms=_TILE),                  # Q
        plgpu.SMEM((stages, PAGE_SIZE, d), q.dtype, transforms=_TILE),   # K ring
        plgpu.SMEM((stages, PAGE_SIZE, d), q.dtype, transforms=_TILE),   # V ring
        plgpu.SMEM((gp, PAGE_SIZE), q.dtype, transforms=_TILE),          # P
        plgpu.SMEM((d, gp), jnp.float32),                                # out^T staging
        plgpu.SMEM((gp,), jnp.float32),                                  # lse staging
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(),
    ]
    body = functools.partial(
        _decode_body, num_splits=splits, num_stages=stages, head_dim=d, group=gp,
        num_pages=n, num_rows=r, num_cols=p, scale_log2=float(scale) * LOG2E, dtype=q.dtype)
    opart, lpart = plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(t, hkv, splits),
        grid_names=("t", "h", "c"), interpret=mosaic_interpret_params(interpret),
        kernel_name="paged_decode_mgpu",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(req_indices, kv_lens, block_table, qg, kv_cache)
    out, lse = merge_splits(opart, lpart)
    return (out[:, :, :g].reshape(t, hq, d).astype(q.dtype), lse[:, :, :g].reshape(t, hq))


__all__ = ["paged_decode_mgpu", "default_splits", "merge_splits", "smem_bytes",
           "padded_group", "DTYPES", "HEAD_DIMS", "MAX_GROUP", "STAGES", "MAX_SPLITS"]

"""Dense paged causal prefill attention on the Pallas Mosaic GPU backend (Hopper): the contract
of :mod:`pallas_kernels.paged_attention`, on the tiles of :func:`~pallas_kernels.paged_attention.
prefill_tiles`.

Kernel: grid ``(NT, Hq)``, one CTA per (tile, query head), FlashAttention-3 style with warp
specialisation: ``BQ / 64`` compute warpgroups (64 query rows each; with ``BQ = 128`` the two
share every K/V page load) and one memory warpgroup. Each compute warpgroup loads its Q rows
``[64, D]`` by TMA (``q_tiles.at[n, rows, h]``). The memory warpgroup streams the tile's pages
``[0, min(ceil(max_len / 128), P))`` of its request through rings of shared-memory buffers
(K and V ``[128, D]`` each, ``num_stages`` deep, one TMA barrier per slot and per part; the page
id read from the block table is a dynamic TMA coordinate, read one page ahead), and refills a
slot once every compute warpgroup has released it (a barrier per slot and part, one arrival per
compute warpgroup). Per page a compute warpgroup runs ``S = Q K^T`` on wgmma, the online
softmax in base 2 (``exp2``, a finite mask value, the accumulator rescaled by
``2^(m_old - m_new)``) and ``O += P V`` on wgmma with P from registers; at the end it divides
by the row sums and writes ``out`` and the natural-log LSE through shared memory by TMA.
The tile's bounds ``max_len`` and ``min_len`` (the largest kv_len, and the smallest non-zero
one) are reduced from ``tile_kv_lens`` in XLA beside the kernel and read as scalars.

Safety boundary: no page past the tile's ``ceil(max_len / 128)`` pages or past ``P`` is read;
the request row is clamped to ``[0, R)`` and each page id read from the block table to
``[0, N)``. The per-row causal mask (``key < kv_len[row]``) runs only on the diagonal pages,
``(p + 1) * 128 > min_len``; every earlier page is visible to every non-empty row. In the last
page the V rows of keys ``>= max_len`` are zeroed in shared memory before ``P V`` (so NaN
there cannot reach the output: ``0 * NaN = NaN``) and their scores are masked. Rows with
kv_len 0 may compute garbage on unmasked pages and are written as zeros with ``lse = -inf``;
an empty tile (all lens 0) reads no page. NaN in a consumed key or value reaches that row's
output (no guard hides it); a NaN value of a key below ``max_len`` also reaches the rows of the
tile that do not see that key (their zero weight times NaN), as in any dense attention kernel.

Interpret mode (the Mosaic GPU interpreter, CPU tests) runs the same warp-specialised kernel
with two differences: P goes to shared memory for ``P V`` (the interpreter's wgmma takes no
register operand) and the accumulator is added to a fresh one (it has no accumulator
initialised from a value).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._interpret import mosaic_interpret_params
from pallas_kernels._shapes import PAGE_SIZE, SMEM_BYTES
from pallas_kernels.paged_attention import LN2, LOG2E, check_cache_and_table

WG_ROWS = 64  # query rows of one compute warpgroup (the wgmma's M)
BLOCK_QS = (64, 128)  # tile rows: one or two compute warpgroups
HEAD_DIMS = (64, 128)  # multiples of the 64-element (128-byte) swizzle tile; register budget
STAGES = (1, 2, 3, 4)
MAX_DEFAULT_STAGES = 4  # deeper rings add nothing once a page's compute hides its load
SMEM_RESERVE = 4 * 1024  # barriers, reduction scratch, alignment
MASK = -1e30  # finite mask value for scores (base-2 units)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_TILE = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # 16-bit wgmma operands
_ROW = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector along the rows of a wgmma accumulator
_COMPUTE_REGS, _MEMORY_REGS = 232, 40  # per-thread registers with two compute warpgroups


def smem_bytes(head_dim: int, block_q: int, num_stages: int, itemsize: int = 2) -> int:
    """Shared memory of one compiled CTA: the K and V rings (``num_stages`` pages of
    ``[128, D]`` each), Q/out ``[BQ, D]``, the LSE staging ``[BQ]`` f32 and a reserve."""
    ring = 2 * num_stages * PAGE_SIZE * head_dim * itemsize
    return ring + block_q * head_dim * itemsize + block_q * 4 + SMEM_RESERVE


def default_stages(head_dim: int, block_q: int) -> int:
    """Deepest ring (<= :data:`MAX_DEFAULT_STAGES`) that fits :data:`SMEM_BYTES`: 2 at D 128
    with BQ 128, 3 at D 128 with BQ 64, 4 at D 64."""
    for stages in range(MAX_DEFAULT_STAGES, 0, -1):
        if smem_bytes(head_dim, block_q, stages) <= SMEM_BYTES:
            return stages
    return 1


def tile_bounds(tile_kv_lens):
    """``[NT, BQ]`` int32 -> ``[NT, 2]`` int32: each tile's ``max_len`` (its largest kv_len,
    0 for an empty tile) and ``min_len`` (its smallest non-zero kv_len; 0 for an empty
    tile). Negative lens count as 0."""
    lens = jnp.maximum(tile_kv_lens, 0)
    max_len = lens.max(axis=1)
    big = jnp.iinfo(jnp.int32).max
    min_len = jnp.where(lens > 0, lens, big).min(axis=1)
    return jnp.stack([max_len, jnp.where(max_len > 0, min_len, 0)], axis=1).astype(jnp.int32)


def _memory_warpgroup(req_ref, bounds_ref, bt_ref, kv_ref, k_smem, v_smem, kbar, vbar,
                      k_free, v_free, *, n, kv_head, num_stages, head_dim, num_pages, num_rows,
                      num_cols):
    """Streams the tile's pages into the rings: K and V of page ``p`` into slot
    ``p % num_stages``, each slot refilled once both parts' free barriers completed."""
    s_, d = num_stages, head_dim
    req = jnp.clip(req_ref[n], 0, num_rows - 1)
    max_len = jnp.maximum(bounds_ref[n, 0], 0)
    n_pages = jnp.minimum((max_len + PAGE_SIZE - 1) // PAGE_SIZE, num_cols)

    def page_id(p):
        """Page id of block ``p`` of the request (p is clamped into the consumed blocks: the
        look-ahead read past the last page reads the last page's entry again)."""
        p = jnp.clip(p, 0, jnp.maximum(n_pages - 1, 0))
        return jnp.clip(bt_ref[req, p], 0, num_pages - 1)

    def issue(page, slot, part):
        dst, bar = (k_smem, kbar) if part == 0 else (v_smem, vbar)
        plgpu.copy_gmem_to_smem(kv_ref.at[page, kv_head, :, pl.ds(part * d, d)],
                                dst.at[slot], bar.at[slot])

    with jax.named_scope("issue"):
        for i in range(s_):
            @pl.when(i < n_pages)
            def _first():
                page = page_id(i)
                issue(page, i, 0)
                issue(page, i, 1)

    def refill(p, page):
        nxt = page_id(p + 1)  # its latency hides behind the waits
        slot = lax.rem(p, s_)
        plgpu.barrier_wait(k_free.at[slot])
        issue(page, slot, 0)
        plgpu.barrier_wait(v_free.at[slot])
        issue(page, slot, 1)
        return nxt

    lax.fori_loop(s_, n_pages, refill, page_id(s_))


def _compute_warpgroup(bounds_ref, len_ref, q_ref, o_ref, lse_ref, qo_smem, k_smem, v_smem,
                       lse_smem, p_smem, kbar, vbar, qbar, k_free, v_free, *, n, h, w,
                       num_stages, head_dim, num_cols, scale_log2, dtype, interpreting):
    """Rows ``[64 w, 64 w + 64)`` of the tile for query head ``h``: the online softmax over
    the streamed pages, then out and lse through shared memory by TMA."""
    s_, d = num_stages, head_dim
    rows = pl.ds(w * WG_ROWS, WG_ROWS)
    q_smem = qo_smem.at[w]
    plgpu.copy_gmem_to_smem(q_ref.at[n, rows, h], q_smem, qbar.at[w])
    max_len = jnp.maximum(bounds_ref[n, 0], 0)
    min_len = jnp.maximum(bounds_ref[n, 1], 0)
    n_pages = jnp.minimum((max_len + PAGE_SIZE - 1) // PAGE_SIZE, num_cols)
    n_full = jnp.minimum(min_len // PAGE_SIZE, n_pages)  # pages every non-empty row sees whole
    row_len = plgpu.load(len_ref.at[n, rows], layout=_ROW, optimized=False)  # [64] int32

    def bcast(v, cols):  # a [64] row vector along the columns of a [64, cols] accumulator
        return lax.broadcast_in_dim(v, (WG_ROWS, cols), [0])

    def step(p, carry, *, masked):
        acc, m, l = carry
        slot = lax.rem(p, s_)
        releases = p + s_ < n_pages  # the memory warpgroup refills this slot
        with jax.named_scope("k_wait"):
            plgpu.barrier_wait(kbar.at[slot])

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
            return acc_ref[...]

        with jax.named_scope("qk"):
            s = pl.run_scoped(qk, plgpu.ACC((WG_ROWS, PAGE_SIZE), jnp.float32))
        pl.when(releases)(lambda: plgpu.barrier_arrive(k_free.at[slot]))
        with jax.named_scope("softmax"):
            s = s * scale_log2
            if masked:  # a diagonal page: each row sees its keys below its kv_len
                key = p * PAGE_SIZE + plgpu.broadcasted_iota(
                    jnp.int32, (WG_ROWS, PAGE_SIZE), 1, layout=plgpu.Layout.WGMMA)
                s = jnp.where(key < bcast(row_len, PAGE_SIZE), s, MASK)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            pr = jnp.exp2(s - bcast(m_new, PAGE_SIZE))
            l_new = l * alpha + pr.sum(axis=1)
            acc = acc * bcast(alpha, d)
            p16 = pr.astype(dtype)
        with jax.named_scope("v_wait"):
            plgpu.barrier_wait(vbar.at[slot])
        if masked:
            n_keys = jnp.clip(max_len - p * PAGE_SIZE, 0, PAGE_SIZE)

            @pl.when(n_keys < PAGE_SIZE)
            def _zero_tail():
                # Keys >= max_len: V rows become 0, so that P V ignores them. Every compute
                # warpgroup writes the same values (the rows below n_keys unchanged), so none
                # waits for another.
                v_ref = v_smem.at[slot]
                key = plgpu.broadcasted_iota(jnp.int32, (PAGE_SIZE, d), 0,
                                             layout=plgpu.Layout.WGMMA)
                v_ref[...] = jnp.where(key < n_keys, v_ref[...],
                                       jnp.zeros((PAGE_SIZE, d), dtype))
                plgpu.commit_smem()

        with jax.named_scope("pv"):
            if interpreting:  # P through shared memory; a fresh accumulator added to acc
                p_smem.at[w][...] = p16
                plgpu.commit_smem()

                def pv_scoped(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem.at[w], v_smem.at[slot])
                    return acc_ref[...]
                acc = acc + pl.run_scoped(pv_scoped, plgpu.ACC((WG_ROWS, d), jnp.float32))
            else:  # P from registers, accumulated in place
                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        pl.when(releases)(lambda: plgpu.barrier_arrive(v_free.at[slot]))
        return acc, m_new, l_new

    init = (plgpu.layout_cast(jnp.zeros((WG_ROWS, d), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((WG_ROWS,), MASK, jnp.float32), _ROW),
            plgpu.layout_cast(jnp.zeros((WG_ROWS,), jnp.float32), _ROW))
    with jax.named_scope("q_wait"):
        plgpu.barrier_wait(qbar.at[w])
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), init)
    acc, m, l = lax.fori_loop(n_full, n_pages, functools.partial(step, masked=True), carry)

    with jax.named_scope("store"):
        has = row_len > 0
        l_div = jnp.where(l == 0.0, 1.0, l)
        out = acc / bcast(l_div, d)
        out = jnp.where(bcast(row_len, d) > 0, out, 0.0)
        lse = jnp.where(has, (m + jnp.log2(l_div)) * LN2, -jnp.inf)
        q_smem[...] = out.astype(dtype)  # Q is no longer read
        lse_smem.at[w][...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[n, rows, h])
        plgpu.copy_smem_to_gmem(lse_smem.at[w], lse_ref.at[n, h, rows])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _prefill_body(req_ref, bounds_ref, len_ref, bt_ref, q_ref, kv_ref, o_ref, lse_ref,
                  qo_smem, k_smem, v_smem, lse_smem, *rest, num_compute, group, interpreting,
                  **kw):
    p_smem, rest = (rest[0], rest[1:]) if interpreting else (None, rest)
    kbar, vbar, qbar, k_free, v_free = rest
    n = lax.axis_index("n")
    h = lax.axis_index("h")
    wg = lax.axis_index("wg")
    tune = num_compute == 2 and not interpreting  # 3 warpgroups: move registers to compute

    @pl.when(wg == num_compute)
    def _memory():
        if tune:
            plgpu.set_max_registers(_MEMORY_REGS, action="decrease")
        _memory_warpgroup(req_ref, bounds_ref, bt_ref, kv_ref, k_smem, v_smem, kbar, vbar,
                          k_free, v_free, n=n, kv_head=lax.div(h, group),
                          num_stages=kw["num_stages"], head_dim=kw["head_dim"],
                          num_pages=kw["num_pages"], num_rows=kw["num_rows"],
                          num_cols=kw["num_cols"])

    @pl.when(wg < num_compute)
    def _compute():
        if tune:
            plgpu.set_max_registers(_COMPUTE_REGS, action="increase")
        _compute_warpgroup(bounds_ref, len_ref, q_ref, o_ref, lse_ref, qo_smem, k_smem, v_smem,
                           lse_smem, p_smem, kbar, vbar, qbar, k_free, v_free, n=n, h=h, w=wg,
                           num_stages=kw["num_stages"], head_dim=kw["head_dim"],
                           num_cols=kw["num_cols"], scale_log2=kw["scale_log2"],
                           dtype=kw["dtype"], interpreting=interpreting)


def _check_inputs(name, q_tiles, kv_cache, block_table, tile_req, tile_kv_lens):
    """Raise ``ValueError``/``TypeError`` naming the argument and bound; returns
    ``(NT, BQ, Hq, D, N, Hkv, R, P)``."""
    def need(cond, msg, exc=ValueError):
        if not cond:
            raise exc(f"{name}: {msg}")

    need(q_tiles.ndim == 4, f"q_tiles must be [NT, BQ, Hq, D], got shape {q_tiles.shape}")
    nt, bq, hq, d = q_tiles.shape
    need(jnp.dtype(q_tiles.dtype) in _DTYPES,
         f"q_tiles dtype must be bf16 or f16 (wgmma operands), got {q_tiles.dtype}", TypeError)
    need(bq in BLOCK_QS, f"tile rows BQ = q_tiles.shape[1] must be one of {BLOCK_QS}, got {bq}")
    need(d in HEAD_DIMS, f"head dim D = q_tiles.shape[3] must be one of {HEAD_DIMS}, got {d}")
    n, hkv = check_cache_and_table(kv_cache, block_table, hq=hq, d=d, dtype=q_tiles.dtype,
                                   q_name="q_tiles", name=name)
    need(tile_req.shape == (nt,), f"tile_req must be [NT] = {(nt,)}, got {tile_req.shape}")
    need(tile_kv_lens.shape == (nt, bq),
         f"tile_kv_lens must be [NT, BQ] = {(nt, bq)}, got {tile_kv_lens.shape}")
    for arg, val in (("block_table", block_table), ("tile_req", tile_req),
                     ("tile_kv_lens", tile_kv_lens)):
        need(val.dtype == jnp.int32, f"{arg} dtype must be int32, got {val.dtype}", TypeError)
    r, p = block_table.shape
    return nt, bq, hq, d, n, hkv, r, p


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "num_stages"))
def paged_prefill_mgpu(q_tiles, kv_cache, block_table, tile_req, tile_kv_lens, *, scale,
                       interpret=None, num_stages=None):
    """Dense paged causal attention of prefill tiles on Mosaic GPU.

    Args:
      q_tiles: ``[NT, BQ, Hq, D]`` bf16/f16, BQ in {64, 128}, D in {64, 128}: the batch's q
        rows gathered per tile (``q[where(token >= 0, token, 0)]`` of
        :func:`~pallas_kernels.paged_attention.prefill_tiles`' tokens).
      kv_cache: ``[N, Hkv, 128, 2D]`` (K = ``[..., :D]``, V = ``[..., D:]``), q's dtype.
      block_table: ``[R, P]`` int32 page ids (entries past a request's pages may hold
        anything: -1, out-of-range ids).
      tile_req: ``[NT]`` int32, each tile's request row. tile_kv_lens: ``[NT, BQ]`` int32,
        each row's visible keys (0 = empty or padded row).
      scale: softmax scale (static).
      interpret: ``None`` interprets unless the trace targets a GPU; ``True``/``False``; or a
        ``plgpu.InterpretGPUParams``.
      num_stages: K/V ring depth in {1, 2, 3, 4} (within 227 KiB of shared memory);
        ``None``: :func:`default_stages`.
    Returns:
      ``(out_tiles [NT, BQ, Hq, D] q.dtype, lse_tiles [NT, Hq, BQ] f32)``: row ``i`` of tile
      ``n``, head ``h`` attends to keys ``[0, tile_kv_lens[n, i])`` of request
      ``tile_req[n]``; lse is the natural-log LSE of the scaled scores; rows with kv_len 0
      give zeros and -inf.
    """
    name = "paged_prefill_mgpu"
    nt, bq, hq, d, n, hkv, r, p = _check_inputs(name, q_tiles, kv_cache, block_table, tile_req,
                                                tile_kv_lens)
    stages = default_stages(d, bq) if num_stages is None else num_stages
    if stages not in STAGES:
        raise ValueError(f"{name}: num_stages must be one of {STAGES}, got {stages}")
    need = smem_bytes(d, bq, stages)
    if need > SMEM_BYTES:
        raise ValueError(f"{name}: num_stages {stages} with D = {d} and BQ = {bq} needs {need} "
                         f"bytes: more than {SMEM_BYTES} bytes of shared memory")
    if nt == 0:
        return (jnp.zeros((0, bq, hq, d), q_tiles.dtype),
                jnp.zeros((0, hq, bq), jnp.float32))
    interpret = mosaic_interpret_params(interpret)
    interpreting = interpret is not None
    num_compute = bq // WG_ROWS
    dtype = q_tiles.dtype
    scratch = [
        plgpu.SMEM((num_compute, WG_ROWS, d), dtype, transforms=_TILE),  # Q, then out
        plgpu.SMEM((stages, PAGE_SIZE, d), dtype, transforms=_TILE),     # K ring
        plgpu.SMEM((stages, PAGE_SIZE, d), dtype, transforms=_TILE),     # V ring
        plgpu.SMEM((num_compute, WG_ROWS), jnp.float32),                 # lse staging
    ]
    if interpreting:  # P for P V: the interpreter's wgmma takes no register operand
        scratch.append(plgpu.SMEM((num_compute, WG_ROWS, PAGE_SIZE), dtype, transforms=_TILE))
    scratch += [
        plgpu.Barrier(num_barriers=stages),                              # K landed
        plgpu.Barrier(num_barriers=stages),                              # V landed
        plgpu.Barrier(num_barriers=num_compute),                         # Q landed
        plgpu.Barrier(num_arrivals=num_compute, num_barriers=stages),    # K slot free
        plgpu.Barrier(num_arrivals=num_compute, num_barriers=stages),    # V slot free
    ]
    body = functools.partial(
        _prefill_body, num_compute=num_compute, group=hq // hkv, interpreting=interpreting,
        num_stages=stages, head_dim=d, num_pages=n, num_rows=r, num_cols=p,
        scale_log2=float(scale) * LOG2E, dtype=dtype)
    out_type = [jax.ShapeDtypeStruct((nt, bq, hq, d), dtype),
                jax.ShapeDtypeStruct((nt, hq, bq), jnp.float32)]
    bounds = tile_bounds(tile_kv_lens)
    out, lse = plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(nt, hq), grid_names=("n", "h"),
        num_threads=num_compute + 1, thread_name="wg", interpret=interpret,
        kernel_name="paged_prefill_mgpu",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(tile_req, bounds, tile_kv_lens, block_table, q_tiles, kv_cache)
    return out, lse


__all__ = ["paged_prefill_mgpu", "default_stages", "smem_bytes", "tile_bounds", "BLOCK_QS",
           "HEAD_DIMS", "STAGES", "WG_ROWS"]

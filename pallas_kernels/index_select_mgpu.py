"""MSA indexer and top-16 page select on the Pallas Mosaic GPU backend (Hopper): a scores
kernel and a select kernel, both launched with programmatic dependent launch (PDL), so the
select's launch overlaps the scores kernel. Three entry points, each with the arguments,
results and safety boundary of its Triton counterpart: :func:`msa_index_select_mgpu` (both
kernels: :func:`pallas_kernels.index_select.msa_index_select`), :func:`msa_index_scores_mgpu`
(the scores alone: :func:`pallas_kernels.index_scores.msa_index_scores`) and
:func:`sparse_topk_select_mgpu` (the select alone:
:func:`pallas_kernels.topk_select.sparse_topk_select`).

Scores kernel: grid ``(G,)``, one warpgroup per CTA, a persistent stream: the ``W = T * P``
(token, block-table column) items are split into G contiguous ranges, one per CTA, so every
CTA streams about ``W / G`` index-K pages through one TMA ring (the page id a dynamic
coordinate, read from the block table when the copy is issued), across token boundaries. An
item whose column is at or past the token's ``nvp = positions // 128 + 1`` is not read; it
scores -inf, as in the Triton indexer (a given ``num_valid_pages`` may count it). A read item
takes ``S^T = K Q^T`` with wgmma in transposed form (the page's 128 keys on M, the query heads
on N = 8, column n holding head ``n % H``; Q is reloaded when the token changes), applies the
causal mask ``b * 128 + i <= position`` and takes each column's max over the keys: the block
score of each head. Scores go to f32 ``[T, H, width]`` (head-major; for the select ``width``
is a multiple of 128 and columns ``>= P`` are not written, alone it is P).

Select kernel: grid ``(T, H / R)``, one warpgroup, ``R = 4`` heads per CTA when 4 divides H
(warp w takes head ``h R + w``), else ``R = 1`` (every warp takes head h and computes the
same picks). A warp loads its head's whole ``[Pp]`` score row (``Pp / 32`` per lane), applies
the selector's rules (:mod:`pallas_kernels.topk_select`: forced local/init blocks, NaN as
-inf, ties to the smaller id, -1 for fewer than 16 picks), maps them to int32 keys of the same
order, and takes 16 rounds of (max key, smallest id with it), each an int32 reduction inside
the warp, so no round waits on a cross-warp barrier; it ranks the winners in ascending order
and stores them, one 16-id row per head.

Safety boundary: as :func:`pallas_kernels.index_scores.msa_index_scores` (request rows clamped
to ``[0, R)``, page ids to ``[0, N)``, block-table columns below ``min(nvp, P)`` only) and the
selector (counts clamped to ``[0, P]``).

Shapes / dtypes:
  index_q          [T, H, Di]   bf16 | f16 | float8_e4m3fn, H <= 8, Di in {64, 128}
  index_k_cache    [N, 128, Di] index_q's dtype (e4m3 queries over an e4m3 cache: an fp8 x fp8
                                wgmma with f32 accumulation, as vLLM's fp8 indexer)
  block_table      [R, P]       int32, P <= 1024 (the select holds a token's scores in registers)
  req_indices      [T]          int32
  positions        [T]          int32
  num_valid_pages  [T]          int32 (optional; default positions // 128 + 1)
  result           [T, H, 16]   int32 (the scores alone: [T, H, P] f32)
  scores           [T, H, P]    f32, P <= 1024 (the select alone's input)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.experimental.mosaic.gpu as mgpu

from pallas_kernels._interpret import mosaic_interpret_params
from pallas_kernels._shapes import NUM_SMS_H200, PAGE_SIZE, SMEM_BYTES, TOPK
from pallas_kernels.index_scores import validate_index_inputs
from pallas_kernels.index_select import num_valid_pages_of
from pallas_kernels.topk_select import prepare_scores, validate_scores, validate_selection

ROWS = 64  # rows of the query tile in shared memory (row r holds head r % H)
QCOLS = 8  # wgmma N: the query heads (the tile's first rows, transposed)
MAX_HEADS = 8  # index heads per token (the scores kernel copies H scores per page)
MAX_PAGES = 1024  # block-table columns: the select holds Pp / 32 <= 32 scores per lane
HEAD_DIMS = (64, 128)
ROW_TILE = 128  # the select's row layout tile (32 lanes x 4): rows are whole tiles
STAGES = (1, 2, 3, 4, 5, 6)  # TMA ring depths of the scores kernel
DEFAULT_STAGES = 2
MAX_CTAS_PER_SM = 4  # the scores kernel's default grid: at most this many CTAs per SM
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float8_e4m3fn))
_NO_ID = 2 ** 30  # larger than any block id
_NEG_INF_KEY = -1 - 0x7F800000  # _ordered_key(-inf)
_TAKEN = -2 ** 31  # below every _ordered_key: a block already picked


def _smem_tiling(dtype, di: int) -> tuple:
    """Tiling and swizzle of a ``[rows, Di]`` wgmma operand in shared memory: rows of at most
    128 bytes per swizzle period (Di = 64 in fp8 is a 64-byte row)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, di * itemsize)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def first_item(g, num_items: int, num_ctas: int):
    """``floor(g * num_items / num_ctas)``, the first item of CTA ``g`` (int32 ``g``), without
    forming ``g * num_items`` (it may pass 2^31)."""
    q, r = divmod(num_items, num_ctas)
    return g * q + g * r // num_ctas


def _scores_body(q_ref, k_ref, bt_ref, req_ref, pos_ref, sc_ref, a_smem, k_ring, sc_smem, kbar,
                 *, num_heads, num_ctas, num_stages, num_pages, num_rows, max_pages, dtype, pdl):
    """CTA g of ``num_ctas`` scores the items ``[g W / G, (g + 1) W / G)`` of the flattened
    ``W = T * P`` (token, block-table column) items through one TMA ring, in transposed form."""
    g = lax.axis_index("g")
    ns = num_stages
    n_items = sc_ref.shape[0] * max_pages
    lo = first_item(g, n_items, num_ctas)
    n_mine = first_item(g + 1, n_items, num_ctas) - lo
    if pdl:  # launched early: wait for the previous kernel's writes
        plgpu.griddepcontrol_wait()

    def item(i):
        """(token, column, position, request row, read?) of my item i."""
        t, col = jnp.divmod(lo + i, max_pages)
        pos = pos_ref[t]
        read = col < jnp.minimum(num_valid_pages_of(pos), max_pages)
        return t, col, pos, jnp.clip(req_ref[t], 0, num_rows - 1), read

    def issue(i, slot):
        _, col, _, req, read = item(i)

        @pl.when(read)
        def _():
            page = jnp.clip(bt_ref[req, col], 0, num_pages - 1)
            plgpu.copy_gmem_to_smem(k_ref.at[page], k_ring.at[slot], kbar.at[slot])

    for i in range(ns):
        pl.when(i < n_mine)(functools.partial(issue, i, i))

    rows = plgpu.broadcasted_iota(jnp.int32, (ROWS, q_ref.shape[-1]), 0,
                                  layout=plgpu.Layout.WGMMA)
    keys = plgpu.broadcasted_iota(jnp.int32, (PAGE_SIZE, QCOLS), 0, layout=plgpu.Layout.WGMMA)

    def load_queries(t):  # row r = head r % H; B = the first QCOLS rows, transposed
        a = None
        for h in range(num_heads):
            qh = plgpu.load(q_ref.at[t, h], layout=plgpu.Layout.WGMMA.reduce(0),
                            optimized=False).astype(jnp.float32)
            qh = lax.broadcast_in_dim(qh, rows.shape, [1])
            a = qh if a is None else jnp.where(rows % num_heads == h, qh, a)
        a_smem[...] = a.astype(dtype)
        plgpu.commit_smem()

    def step(i, _):
        t, col, pos, _, read = item(i)
        slot = lax.rem(i, ns)

        @pl.when(read)
        def _score():
            pl.when((i == 0) | (col == 0))(lambda: load_queries(t))  # a new token
            plgpu.barrier_wait(kbar.at[slot])

            def dot(acc_ref):  # S^T = K Q^T [128, 8]: keys on M, heads on N
                plgpu.wgmma(acc_ref, k_ring.at[slot],
                            a_smem.at[pl.ds(0, QCOLS)].transpose((1, 0)))
                return acc_ref[...]

            st = pl.run_scoped(dot, plgpu.ACC((PAGE_SIZE, QCOLS), jnp.float32))
            st = jnp.where(col * PAGE_SIZE + keys <= pos, st, -jnp.inf)
            row = lax.rem(i, 2)  # two rows: a row is rewritten only after a later barrier
            sc_smem.at[row][...] = st.max(axis=0)
            plgpu.commit_smem()
            for hh in range(num_heads):
                sc_ref[t, hh, col] = sc_smem[row, hh]

        @pl.when(jnp.logical_not(read))
        def _unread():  # past the position: -inf (a given num_valid_pages may reach it)
            for hh in range(num_heads):
                sc_ref[t, hh, col] = jnp.float32(-jnp.inf)
            plgpu.commit_smem()  # the barrier a read item has: a score row is reused at i + 2

        pl.when(i + ns < n_mine)(lambda: issue(i + ns, slot))  # the slot is free again
        return 0

    lax.fori_loop(0, n_mine, step, 0)
    if pdl:  # the select may launch (it waits for this grid's writes)
        plgpu.griddepcontrol_launch_dependents()


def heads_per_select(num_heads: int) -> int:
    """Heads of one select CTA: four (one per warp) when they divide ``H``, else one (every
    warp computing the same picks)."""
    return 4 if num_heads % 4 == 0 else 1


def _rows_layout(rows: int):
    """A ``[rows, Pp]`` block of score rows (``Pp`` a multiple of 128): row r on warp r
    (``rows == 4``) or on every warp (``rows == 1``); lane l holds elements ``4l .. 4l + 3`` of
    each 128, so a reduction along a row stays inside its warp (one ``redux.sync``)."""
    tiling = mgpu.fragmented_array.Tiling(((rows, ROW_TILE), (ROW_TILE // 32,)))
    warps = (-3,) if rows == 4 else (mgpu.fragmented_array.Replicated(4),)
    return plgpu.Layout.TILED(tiling, warp_dims=warps, lane_dims=(-2,), vector_dim=-1)


def _select_body(sc_ref, count_ref, o_ref, o_smem, *, max_pages, local_blocks, init_blocks,
                 counts_are_positions, pdl):
    t = lax.axis_index("t")
    rows = o_smem.shape[0]
    h0 = lax.axis_index("h") * rows
    layout = _rows_layout(rows)
    if pdl:  # launched early: wait for the previous kernel's writes
        plgpu.griddepcontrol_wait()
    nvp = num_valid_pages_of(count_ref[t]) if counts_are_positions else count_ref[t]
    x = plgpu.load(sc_ref.at[t, pl.ds(h0, rows)], layout=layout, optimized=False)
    ids = plgpu.broadcasted_iota(jnp.int32, x.shape, 1, layout=layout)
    x = prepare_scores(x, ids, nvp, max_pages=max_pages, topk=TOPK, local_blocks=local_blocks,
                       init_blocks=init_blocks)
    key = _ordered_key(x)

    def along_rows(v, shape):  # [rows] -> [rows, n], in the rows' layout
        return plgpu.layout_cast(lax.broadcast_in_dim(v, shape, (0,)), layout)

    wins = []  # round r's pick per row, -1 once only -inf is left
    for _ in range(TOPK):
        m = key.max(axis=1)
        # The smallest id with the max key, as a max (int32 max is a redux.sync; min is not).
        pick = _NO_ID - jnp.where(key == along_rows(m, key.shape), _NO_ID - ids, 0).max(axis=1)
        wins.append(jnp.where(m > _NEG_INF_KEY, pick, -1))
        key = jnp.where(ids == along_rows(pick, key.shape), _TAKEN, key)
    if pdl:
        plgpu.griddepcontrol_launch_dependents()

    # Ascending order, -1 last: rank[a] = #{b : id[b] < id[a] or (== and b < a)}.
    sort_ids = [jnp.where(w < 0, _NO_ID, w) for w in wins]
    slot = plgpu.broadcasted_iota(jnp.int32, o_smem.shape, 1, layout=layout)
    out = None
    for a in range(TOPK):
        before = [(sort_ids[b] <= sort_ids[a]) if b < a else (sort_ids[b] < sort_ids[a])
                  for b in range(TOPK) if b != a]
        rank = functools.reduce(jnp.add, [b.astype(jnp.int32) for b in before])
        term = jnp.where(slot == along_rows(rank, slot.shape),
                         along_rows(wins[a], slot.shape), 0)
        out = term if out is None else out + term
    o_smem[...] = out
    plgpu.commit_smem()
    for r in range(rows):
        plgpu.copy_smem_to_gmem(o_smem.at[r, pl.ds(0, TOPK)], o_ref.at[t, h0 + r])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _ordered_key(x):
    """f32 -> int32 in the same order (no NaN: the selector maps it to -inf first)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, jnp.int32(2 ** 31 - 1) - bits, bits)


def _check_scores(name, index_q, index_k_cache, num_stages, num_ctas):
    """The scores kernel's own bounds (ValueError / TypeError naming the argument)."""
    _, h, di = index_q.shape
    if jnp.dtype(index_q.dtype) not in DTYPES or index_k_cache.dtype != index_q.dtype:
        raise TypeError(f"{name}: index_q and index_k_cache must both be bf16, both f16 or both "
                        f"float8_e4m3fn, got {index_q.dtype} and {index_k_cache.dtype}")
    if h > MAX_HEADS:
        raise ValueError(f"{name}: index heads H = {h} exceeds {MAX_HEADS}")
    if di not in HEAD_DIMS:
        raise ValueError(f"{name}: Di must be one of {HEAD_DIMS}, got {di}")
    if num_stages not in STAGES:
        raise ValueError(f"{name}: num_stages must be one of {STAGES}, got {num_stages}")
    if num_ctas is not None and num_ctas < 1:
        raise ValueError(f"{name}: num_ctas must be >= 1, got {num_ctas}")
    if _smem_bytes(num_stages, di, index_q.dtype) > SMEM_BYTES:
        raise ValueError(f"{name}: num_stages {num_stages} needs more than {SMEM_BYTES} bytes "
                         f"of shared memory")


def _check_pages(name, max_pages):
    if max_pages > MAX_PAGES:
        raise ValueError(f"{name}: {max_pages} pages per row; the select holds at most "
                         f"{MAX_PAGES}")


def _smem_bytes(num_stages: int, di: int, dtype) -> int:
    """Shared memory of one scores CTA: the ring, the query tile, two score rows, a reserve."""
    itemsize = jnp.dtype(dtype).itemsize
    return num_stages * PAGE_SIZE * di * itemsize + ROWS * di * itemsize + 2 * QCOLS * 4 + 1024


def default_num_ctas(num_items: int, num_stages: int, di: int, dtype) -> int:
    """The scores kernel's grid for ``num_items = T * P`` items: as many CTAs as fit on the
    SMs at once by shared memory (at most :data:`MAX_CTAS_PER_SM` per SM), at most one per
    item."""
    per_sm = max(1, min(MAX_CTAS_PER_SM, SMEM_BYTES // _smem_bytes(num_stages, di, dtype)))
    return max(1, min(num_items, per_sm * NUM_SMS_H200))


def _scores(index_q, index_k_cache, block_table, req_indices, positions, *, width, num_ctas,
            num_stages, params, pdl):
    """The scores kernel: f32 ``[T, H, width]``, ``width >= P``; columns ``>= P`` are not
    written."""
    t, h, di = index_q.shape
    r, p = block_table.shape
    tiling = _smem_tiling(index_q.dtype, di)
    return plgpu.kernel(
        functools.partial(_scores_body, num_heads=h, num_ctas=num_ctas, num_stages=num_stages,
                          num_pages=index_k_cache.shape[0], num_rows=r, max_pages=p,
                          dtype=index_q.dtype, pdl=pdl),
        out_type=jax.ShapeDtypeStruct((t, h, width), jnp.float32),
        scratch_types=[plgpu.SMEM((ROWS, di), index_q.dtype, transforms=tiling),
                       plgpu.SMEM((num_stages, PAGE_SIZE, di), index_q.dtype, transforms=tiling),
                       plgpu.SMEM((2, QCOLS), jnp.float32),
                       plgpu.Barrier(num_barriers=num_stages)],
        grid=(num_ctas,), grid_names=("g",), interpret=params,
        # The body's own barriers order its shared memory (no automatic barrier around each
        # load and store): the query tile and a ring slot are rewritten only after the
        # commit_smem barrier of the last item that read them (after its wgmma wait), and a
        # score row two items later, after the barrier of the item between.
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True),
        kernel_name="msa_index_scores_mgpu",
    )(index_q, index_k_cache, block_table, req_indices, positions)


def _whole_row_tiles(pages: int) -> int:
    """The select's row length for ``pages`` scores: rounded up to whole ROW_TILEs."""
    return pl.cdiv(pages, ROW_TILE) * ROW_TILE


def _select(scores, counts, *, max_pages, local_blocks, init_blocks, counts_are_positions,
            params, pdl):
    """The select kernel over f32 ``scores [T, H, Pp]`` (``Pp`` a multiple of 128, columns
    ``>= max_pages`` ignored) and int32 ``counts [T]`` (positions, or num_valid_pages)."""
    t, h, _ = scores.shape
    rows = heads_per_select(h)
    return plgpu.kernel(
        functools.partial(_select_body, max_pages=max_pages, local_blocks=local_blocks,
                          init_blocks=init_blocks, counts_are_positions=counts_are_positions,
                          pdl=pdl),
        out_type=jax.ShapeDtypeStruct((t, h, TOPK), jnp.int32),
        scratch_types=[plgpu.SMEM((rows, ROW_TILE), jnp.int32)],
        grid=(t, h // rows), grid_names=("t", "h"), interpret=params,
        kernel_name="msa_topk_select_mgpu",
    )(scores, counts)


def _params_and_pdl(interpret, pdl):
    """(interpret params, pdl): PDL only for a compiled launch."""
    params = mosaic_interpret_params(interpret)
    return params, bool(pdl) and params is None


def _launch(name, index_q, index_k_cache, max_pages, num_ctas, num_stages, interpret, pdl):
    """(grid, stages, interpret params, pdl) of a call, after the scores kernel's checks: None
    picks the defaults; the grid has at most one CTA per item."""
    t, _, di = index_q.shape
    ns = DEFAULT_STAGES if num_stages is None else num_stages
    _check_scores(name, index_q, index_k_cache, ns, num_ctas)
    items = t * max_pages
    g = (default_num_ctas(items, ns, di, index_q.dtype) if num_ctas is None
         else min(num_ctas, items))
    return (max(1, g), ns) + _params_and_pdl(interpret, pdl)


@functools.partial(jax.jit, static_argnames=("interpret", "num_ctas", "num_stages", "pdl"))
def msa_index_scores_mgpu(index_q, index_k_cache, block_table, req_indices, positions, *,
                          interpret=None, num_ctas=None, num_stages=None, pdl=True):
    """Block scores ``[T, H, P]`` f32, as :func:`pallas_kernels.index_scores.msa_index_scores`
    (same arguments, results and safety boundary), with the Mosaic GPU scores kernel.

    ``num_ctas``, ``num_stages``, ``pdl``, ``interpret``: as :func:`msa_index_select_mgpu`.
    """
    validate_index_inputs(index_q, index_k_cache, block_table, req_indices, positions)
    p = block_table.shape[1]
    g, ns, params, pdl = _launch("msa_index_scores_mgpu", index_q, index_k_cache, p, num_ctas,
                                 num_stages, interpret, pdl)
    return _scores(index_q, index_k_cache, block_table, req_indices, positions, width=p,
                   num_ctas=g, num_stages=ns, params=params, pdl=pdl)


@functools.partial(jax.jit, static_argnames=("topk", "local_blocks", "init_blocks", "interpret",
                                             "pdl", "counts_are_positions"))
def sparse_topk_select_mgpu(scores, num_valid_pages, *, topk=TOPK, local_blocks=1,
                            init_blocks=0, interpret=None, pdl=True, counts_are_positions=False):
    """Selected block ids ``[T, H, 16]`` int32, as
    :func:`pallas_kernels.topk_select.sparse_topk_select` (same arguments, rules and results:
    ``scores [T, H, P]`` f32, ``P <= 1024``; ``num_valid_pages [T]`` int32), with the Mosaic GPU
    select kernel; ``topk`` must be 16. A row whose P is not a multiple of 128 is padded in XLA
    first. ``counts_are_positions``: the second argument holds the tokens' positions and the
    kernel counts ``positions // 128 + 1`` pages itself (no launch for the count). ``pdl``,
    ``interpret``: as :func:`msa_index_select_mgpu`.
    """
    validate_scores(scores, num_valid_pages, topk, local_blocks, init_blocks)
    name = "sparse_topk_select_mgpu"
    if topk != TOPK:
        raise ValueError(f"{name}: topk must be {TOPK}, got {topk}")
    p = scores.shape[-1]
    _check_pages(name, p)
    padded = _whole_row_tiles(p)
    if padded != p:
        scores = jnp.pad(scores, ((0, 0), (0, 0), (0, padded - p)), constant_values=-jnp.inf)
    params, pdl = _params_and_pdl(interpret, pdl)
    return _select(scores, num_valid_pages, max_pages=p, local_blocks=local_blocks,
                   init_blocks=init_blocks, counts_are_positions=counts_are_positions,
                   params=params, pdl=pdl)


@functools.partial(jax.jit, static_argnames=("local_blocks", "init_blocks", "interpret",
                                             "num_ctas", "num_stages", "pdl"))
def msa_index_select_mgpu(index_q, index_k_cache, block_table, req_indices, positions,
                          num_valid_pages=None, *, local_blocks=1, init_blocks=0,
                          interpret=None, num_ctas=None, num_stages=None, pdl=True):
    """Selected block ids ``[T, H, 16]`` int32, as
    :func:`pallas_kernels.index_select.msa_index_select` (same arguments, results and safety
    boundary), with the two Mosaic GPU kernels.

    ``num_ctas``: the scores kernel's grid, >= 1 (None: :func:`default_num_ctas`; at most one
    CTA per (token, column) item). ``num_stages``: its TMA ring depth, one of :data:`STAGES`
    (None: :data:`DEFAULT_STAGES`). ``pdl``: programmatic dependent launch for both kernels
    (ignored when interpreting). ``interpret``: None interprets unless the trace targets a GPU.
    """
    validate_index_inputs(index_q, index_k_cache, block_table, req_indices, positions)
    t = index_q.shape[0]
    validate_selection(t, num_valid_pages, TOPK, local_blocks, init_blocks)
    name = "msa_index_select_mgpu"
    p = block_table.shape[1]
    g, ns, params, pdl = _launch(name, index_q, index_k_cache, p, num_ctas, num_stages,
                                 interpret, pdl)
    _check_pages(name, p)
    scores = _scores(index_q, index_k_cache, block_table, req_indices, positions,
                     width=_whole_row_tiles(p), num_ctas=g, num_stages=ns, params=params,
                     pdl=pdl)
    given = num_valid_pages is not None
    return _select(scores, num_valid_pages if given else positions, max_pages=p,
                   local_blocks=local_blocks, init_blocks=init_blocks,
                   counts_are_positions=not given, params=params, pdl=pdl)


__all__ = ["msa_index_scores_mgpu", "sparse_topk_select_mgpu", "msa_index_select_mgpu",
           "default_num_ctas", "first_item", "heads_per_select", "MAX_HEADS", "MAX_PAGES",
           "HEAD_DIMS", "STAGES", "DTYPES"]

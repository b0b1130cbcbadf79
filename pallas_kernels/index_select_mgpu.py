"""MSA indexer and top-16 page select on the Pallas Mosaic GPU backend (Hopper): a scores
kernel and a select kernel, both launched with programmatic dependent launch (PDL), so the
select's launch overlaps the scores kernel. Three entry points, each with the arguments,
results and safety boundary of its Triton counterpart: :func:`msa_index_select_mgpu` (both
kernels: :func:`pallas_kernels.index_select.msa_index_select`), :func:`msa_index_scores_mgpu`
(the scores alone: :func:`pallas_kernels.index_scores.msa_index_scores`) and
:func:`sparse_topk_select_mgpu` (the select alone:
:func:`pallas_kernels.topk_select.sparse_topk_select`).

Scores kernel: grid ``(T, C)``, one warpgroup per CTA; CTA ``(t, c)`` owns the pages
``[c * ppp, (c + 1) * ppp)`` of token t below its ``nvp = positions // 128 + 1``. It builds the
dot's 64 rows from the token's H query rows (row r holds head ``r % H``), streams its index-K
pages through a TMA ring (the page id a dynamic coordinate, read from the block table when the
copy is issued) and takes ``S = Q K^T`` with wgmma. The causal mask keeps keys
``b * 128 + i <= position``; the block score of head h is row h's max. The chunk's scores go
to f32 ``[T, H, width]`` (head-major; for the select ``width`` is a multiple of 128, alone it is
P); pages at or past ``nvp`` score -inf, as in the Triton indexer (a given
``num_valid_pages`` may count them).

Select kernel: grid ``(T, H)``, one warpgroup; every warp of CTA ``(t, h)`` loads head h's
whole ``[Pp]`` score row (``Pp / 32`` per lane), applies the selector's rules
(:mod:`pallas_kernels.topk_select`: forced local/init blocks, NaN as -inf, ties to the smaller
id, -1 for fewer than 16 picks), maps them to int32 keys of the same order, and takes 16 rounds
of (max key, smallest id with it), each an int32 reduction inside the warp (the four warps
compute the same picks, so no round waits on a cross-warp barrier); it ranks the winners in
ascending order and stores them.

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
from pallas_kernels._shapes import PAGE_SIZE, SMEM_BYTES, TOPK
from pallas_kernels.index_scores import default_pages_per_program, validate_index_inputs
from pallas_kernels.index_select import num_valid_pages_of
from pallas_kernels.topk_select import prepare_scores, validate_scores, validate_selection

ROWS = 64  # wgmma M: the dot's rows (row r holds query head r % H)
MAX_HEADS = 8  # index heads per token (the scores kernel copies H scores per page)
MAX_PAGES = 1024  # block-table columns: the select holds Pp / 32 <= 32 scores per lane
HEAD_DIMS = (64, 128)
ROW_TILE = 128  # the select's row layout tile (32 lanes x 4): rows are whole tiles
STAGES = (1, 2, 3)
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


def _scores_body(q_ref, k_ref, bt_ref, req_ref, pos_ref, sc_ref, a_smem, k_ring, sc_smem, kbar,
                 *, num_heads, ppp, num_stages, num_pages, num_rows, max_pages, dtype, pdl):
    width = sc_ref.shape[-1]
    t = lax.axis_index("t")
    c = lax.axis_index("c")
    ns = num_stages
    if pdl:  # launched early: wait for the previous kernel's writes
        plgpu.griddepcontrol_wait()
    req = jnp.clip(req_ref[t], 0, num_rows - 1)
    pos = pos_ref[t]
    nvp = jnp.minimum(num_valid_pages_of(pos), max_pages)
    start = c * ppp
    n_mine = jnp.clip(nvp - start, 0, ppp)

    def issue(j, slot):
        page = jnp.clip(bt_ref[req, start + j], 0, num_pages - 1)
        plgpu.copy_gmem_to_smem(k_ref.at[page], k_ring.at[slot], kbar.at[slot])

    for i in range(ns):
        pl.when(i < n_mine)(functools.partial(issue, i, i))

    # The dot's A: row r = query head r % H (each head read once, broadcast over its rows).
    rows = plgpu.broadcasted_iota(jnp.int32, (ROWS, q_ref.shape[-1]), 0,
                                  layout=plgpu.Layout.WGMMA)
    a = None
    for h in range(num_heads):
        qh = plgpu.load(q_ref.at[t, h], layout=plgpu.Layout.WGMMA.reduce(0),
                        optimized=False).astype(jnp.float32)
        qh = lax.broadcast_in_dim(qh, rows.shape, [1])
        a = qh if a is None else jnp.where(rows % num_heads == h, qh, a)
    a_smem[...] = a.astype(dtype)
    plgpu.commit_smem()
    cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, PAGE_SIZE), 1, layout=plgpu.Layout.WGMMA)

    def step(j, _):
        slot = lax.rem(j, ns)
        plgpu.barrier_wait(kbar.at[slot])

        def dot(acc_ref):
            plgpu.wgmma(acc_ref, a_smem, k_ring.at[slot].transpose((1, 0)))
            return acc_ref[...]

        s = pl.run_scoped(dot, plgpu.ACC((ROWS, PAGE_SIZE), jnp.float32))
        s = jnp.where((start + j) * PAGE_SIZE + cols <= pos, s, -jnp.inf)
        sc_smem.at[j][...] = s.max(axis=1)
        pl.when(j + ns < n_mine)(lambda: issue(j + ns, slot))  # the slot is free again
        return 0

    lax.fori_loop(0, n_mine, step, 0)
    # Pages past the position score -inf (a given num_valid_pages may reach them).
    none = jnp.where(cols < 0, 0.0, -jnp.inf).max(axis=1)

    def unread(j, _):
        sc_smem.at[j][...] = none
        return 0

    lax.fori_loop(n_mine, ppp, unread, 0)
    if pdl:  # the select may launch (it waits for this grid's writes)
        plgpu.griddepcontrol_launch_dependents()
    plgpu.commit_smem()  # every thread's rows, before the scalar reads below

    def store(j, _):  # head-major, so the select reads each head's row contiguously
        def write():
            for hh in range(num_heads):
                sc_ref[t, hh, start + j] = sc_smem[j, hh]

        if pl.cdiv(max_pages, ppp) * ppp > width:  # the last chunk reaches past the output
            pl.when(start + j < width)(write)
        else:
            write()
        return 0

    lax.fori_loop(0, ppp, store, 0)


def _row_layout():
    """A ``[Pp]`` row (``Pp`` a multiple of 128) held whole by every warp of the warpgroup (lane
    l: elements ``4l .. 4l + 3`` of each 128), so a reduction over it stays inside the warp:
    one ``redux.sync`` and no cross-warp barrier."""
    tiling = mgpu.fragmented_array.Tiling(((ROW_TILE,), (ROW_TILE // 32,)))
    return plgpu.Layout.TILED(tiling, warp_dims=(mgpu.fragmented_array.Replicated(4),),
                              lane_dims=(-2,), vector_dim=-1)


def _select_body(sc_ref, count_ref, o_ref, o_smem, *, max_pages, local_blocks, init_blocks,
                 counts_are_positions, pdl):
    t = lax.axis_index("t")
    h = lax.axis_index("h")
    if pdl:  # launched early: wait for the previous kernel's writes
        plgpu.griddepcontrol_wait()
    nvp = num_valid_pages_of(count_ref[t]) if counts_are_positions else count_ref[t]
    x = plgpu.load(sc_ref.at[t, h], layout=_row_layout(), optimized=False)
    ids = plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=_row_layout())
    x = prepare_scores(x, ids, nvp, max_pages=max_pages, topk=TOPK, local_blocks=local_blocks,
                       init_blocks=init_blocks)
    key = _ordered_key(x)

    wins = []  # round r's pick, -1 once only -inf is left
    for _ in range(TOPK):
        m = key.max()
        # The smallest id with the max key, as a max (int32 max is a redux.sync; min is not).
        pick = _NO_ID - jnp.where(key == m, _NO_ID - ids, 0).max()
        wins.append(jnp.where(m > _NEG_INF_KEY, pick, -1))
        key = jnp.where(ids == pick, _TAKEN, key)
    if pdl:
        plgpu.griddepcontrol_launch_dependents()

    # Ascending order, -1 last: rank[a] = #{b : id[b] < id[a] or (== and b < a)}.
    sort_ids = [jnp.where(w < 0, _NO_ID, w) for w in wins]
    slot = plgpu.broadcasted_iota(jnp.int32, (128,), 0, layout=plgpu.Layout.WG_STRIDED((128,), 1))
    out = None
    for a in range(TOPK):
        before = [(sort_ids[b] <= sort_ids[a]) if b < a else (sort_ids[b] < sort_ids[a])
                  for b in range(TOPK) if b != a]
        rank = functools.reduce(jnp.add, [b.astype(jnp.int32) for b in before])
        term = jnp.where(slot == rank, wins[a], 0)
        out = term if out is None else out + term
    o_smem[...] = out
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, TOPK)], o_ref.at[t, h])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _ordered_key(x):
    """f32 -> int32 in the same order (no NaN: the selector maps it to -inf first)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, jnp.int32(2 ** 31 - 1) - bits, bits)


def _check_scores(name, index_q, index_k_cache, num_stages, ppp):
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
    if not 1 <= ppp <= 64:
        raise ValueError(f"{name}: pages_per_program must be in [1, 64], got {ppp}")
    ring_bytes = num_stages * PAGE_SIZE * di * index_q.dtype.itemsize
    if ring_bytes + ROWS * di * index_q.dtype.itemsize + ppp * ROWS * 4 > SMEM_BYTES:
        raise ValueError(f"{name}: num_stages {num_stages} needs more than {SMEM_BYTES} bytes "
                         f"of shared memory")


def _check_pages(name, max_pages):
    if max_pages > MAX_PAGES:
        raise ValueError(f"{name}: {max_pages} pages per row; the select holds at most "
                         f"{MAX_PAGES}")


def _scores(index_q, index_k_cache, block_table, req_indices, positions, *, width, ppp,
            num_stages, params, pdl):
    """The scores kernel: f32 ``[T, H, width]``, ``width >= min(P, ceil(P / ppp) * ppp)``;
    columns ``>= P`` below ``ceil(P / ppp) * ppp`` hold -inf, later ones are not written."""
    t, h, di = index_q.shape
    r, p = block_table.shape
    tiling = _smem_tiling(index_q.dtype, di)
    return plgpu.kernel(
        functools.partial(_scores_body, num_heads=h, ppp=ppp, num_stages=num_stages,
                          num_pages=index_k_cache.shape[0], num_rows=r, max_pages=p,
                          dtype=index_q.dtype, pdl=pdl),
        out_type=jax.ShapeDtypeStruct((t, h, width), jnp.float32),
        scratch_types=[plgpu.SMEM((ROWS, di), index_q.dtype, transforms=tiling),
                       plgpu.SMEM((num_stages, PAGE_SIZE, di), index_q.dtype, transforms=tiling),
                       plgpu.SMEM((ppp, ROWS), jnp.float32),
                       plgpu.Barrier(num_barriers=num_stages)],
        grid=(t, pl.cdiv(p, ppp)), grid_names=("t", "c"), interpret=params,
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
    return plgpu.kernel(
        functools.partial(_select_body, max_pages=max_pages, local_blocks=local_blocks,
                          init_blocks=init_blocks, counts_are_positions=counts_are_positions,
                          pdl=pdl),
        out_type=jax.ShapeDtypeStruct((t, h, TOPK), jnp.int32),
        scratch_types=[plgpu.SMEM((128,), jnp.int32)],
        grid=(t, h), grid_names=("t", "h"), interpret=params, kernel_name="msa_topk_select_mgpu",
    )(scores, counts)


def _params_and_pdl(interpret, pdl):
    """(interpret params, pdl): PDL only for a compiled launch."""
    params = mosaic_interpret_params(interpret)
    return params, bool(pdl) and params is None


def _launch(pages_per_program, num_stages, num_tokens, max_pages, interpret, pdl):
    """(ppp, stages, interpret params, pdl) of a call: None picks the defaults."""
    ppp = (default_pages_per_program(num_tokens, max_pages) if pages_per_program is None
           else pages_per_program)
    ns = min(3, ppp) if num_stages is None else num_stages
    return (ppp, ns) + _params_and_pdl(interpret, pdl)


@functools.partial(jax.jit, static_argnames=("interpret", "pages_per_program", "num_stages",
                                             "pdl"))
def msa_index_scores_mgpu(index_q, index_k_cache, block_table, req_indices, positions, *,
                          interpret=None, pages_per_program=None, num_stages=None, pdl=True):
    """Block scores ``[T, H, P]`` f32, as :func:`pallas_kernels.index_scores.msa_index_scores`
    (same arguments, results and safety boundary), with the Mosaic GPU scores kernel.

    ``pages_per_program``, ``num_stages``, ``pdl``, ``interpret``: as
    :func:`msa_index_select_mgpu`.
    """
    validate_index_inputs(index_q, index_k_cache, block_table, req_indices, positions)
    p = block_table.shape[1]
    ppp, ns, params, pdl = _launch(pages_per_program, num_stages, index_q.shape[0], p,
                                   interpret, pdl)
    _check_scores("msa_index_scores_mgpu", index_q, index_k_cache, ns, ppp)
    return _scores(index_q, index_k_cache, block_table, req_indices, positions, width=p,
                   ppp=ppp, num_stages=ns, params=params, pdl=pdl)


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
                                             "pages_per_program", "num_stages", "pdl"))
def msa_index_select_mgpu(index_q, index_k_cache, block_table, req_indices, positions,
                          num_valid_pages=None, *, local_blocks=1, init_blocks=0,
                          interpret=None, pages_per_program=None, num_stages=None, pdl=True):
    """Selected block ids ``[T, H, 16]`` int32, as
    :func:`pallas_kernels.index_select.msa_index_select` (same arguments, results and safety
    boundary), with the two Mosaic GPU kernels.

    ``pages_per_program``: pages per scores CTA in [1, 64] (None: the Triton indexer's default).
    ``num_stages``: TMA ring depth in {1, 2, 3} (None: min(3, pages)). ``pdl``: programmatic
    dependent launch for both kernels (ignored when interpreting). ``interpret``: None
    interprets unless the trace targets a GPU.
    """
    validate_index_inputs(index_q, index_k_cache, block_table, req_indices, positions)
    t = index_q.shape[0]
    validate_selection(t, num_valid_pages, TOPK, local_blocks, init_blocks)
    p = block_table.shape[1]
    ppp, ns, params, pdl = _launch(pages_per_program, num_stages, t, p, interpret, pdl)
    name = "msa_index_select_mgpu"
    _check_scores(name, index_q, index_k_cache, ns, ppp)
    _check_pages(name, p)
    width = _whole_row_tiles(pl.cdiv(p, ppp) * ppp)
    scores = _scores(index_q, index_k_cache, block_table, req_indices, positions, width=width,
                     ppp=ppp, num_stages=ns, params=params, pdl=pdl)
    given = num_valid_pages is not None
    return _select(scores, num_valid_pages if given else positions, max_pages=p,
                   local_blocks=local_blocks, init_blocks=init_blocks,
                   counts_are_positions=not given, params=params, pdl=pdl)


__all__ = ["msa_index_scores_mgpu", "sparse_topk_select_mgpu", "msa_index_select_mgpu",
           "MAX_HEADS", "MAX_PAGES", "HEAD_DIMS", "STAGES", "DTYPES"]

"""MoE routed experts on the Pallas Mosaic GPU backend (Hopper): the contract of
:mod:`pallas_kernels.moe_experts` (f32 ``[T, H]``) as a decode kernel (gate_up, swigluoai and
down fused per (slot, intermediate tile)) and a prefill grouped GEMM (two launches), for bf16
expert weights and fp8 ones of both formats (MXFP8 E8M0 per 32 inputs, 128x128 f32 blocks),
the fp8 weights read as fp8 and dequantized in registers before a bf16 x bf16 -> f32 wgmma.

Routing (jax.numpy, once per call, :func:`~pallas_kernels.moe_experts.group_copies`): the
``n = T*k`` copies sorted by local expert, each expert's rows cut into *slots* of at most
``tile_c`` rows (default: T rounded up to 8, at most 128; an expert holds at most T copies of
distinct-expert routings, so normally one slot per touched expert). Inputs are indexed by
*aligned* rows (each expert's group starts at a multiple of 8: a TMA load into swizzled
shared memory needs an 8-row-aligned offset): ``xs [A + tile_c, H]`` bf16 holds the x row of
each aligned row (``A = n + 7 min(E, n)``; ``tile_c`` padding rows so a slot's box never
leaves the array). Outputs are indexed by sorted rows. The slot table (expert, first aligned
row, first sorted row, rows) and the number of used slots reach the kernels in one int32
vector. Only the used slots are worked on: an expert without copies is never read, each
touched expert's weights are read once per slot (once, normally).

Every kernel computes in transposed form, as :mod:`pallas_kernels.fp8_matmul_mgpu`: ``y^T
[rows, copies] = W [rows, K] xs^T [K, copies]``, the weight rows the wgmma's M (64 per
instruction; fp8 rows dequantized in registers, bf16 rows straight from shared memory as a
transposed operand) and the slot's copies its N (``tile_c``, a multiple of 8), so a decode
slot of one copy pads to 8 columns, not 64. Outputs are written by rows (copies), each slot
exactly its own rows through a ladder of TMA boxes of 2^b rows from an unswizzled staging
buffer (ragged_dot_mgpu's store); an f32 result is stored as its high and low 16-bit halves
(Hopper's transposed shared-memory store moves 16-bit elements only), joined by XLA (exact).

Both kernels are persistent: ``G`` CTAs (``num_ctas``; default one or two per SM of an H200,
by shared memory, at most the static bound of work items) loop over the used work items ``w
= pid, pid + G, ...`` (``w < used slots x tiles``, read from the slot table; CTAs past them
exit at once, reading nothing), one warpgroup each, with one TMA ring per operand stream
(one barrier per ring slot; step ``i`` refills the ring slot of step ``i - 1`` after a
warpgroup barrier, as fp8_matmul_mgpu; defaults: 4 stages, or 3 where that lets two CTAs
share an SM).

Decode (:func:`moe_decode_mgpu`), work item (slot s of expert e, intermediate tile j of
``tile_i`` columns: 64 up to 64 copies, so 48 items per touched expert at I = 3072, else
128), ``I / tile_i`` tiles per slot so that a few touched experts still spread over all SMs
(``tile_k`` 128; ``tile_h`` 128 rows for fp8 down tiles, 64 for bf16 or ``tile_c`` > 64):
  1. gate/up: for each 64-column sub-tile u of the tile, ``gate^T, up^T [64, tile_c]`` over
     ``H / tile_k`` steps (ring of the gate rows, up rows (fp8 ``[64, tile_k]`` or bf16
     ``[tile_k, 64]``) and the slot's x tile ``[tile_c, tile_k]``), then swigluoai in
     registers, rounded to bf16 into shared memory (``act [tile_c, 64]`` per sub-tile: the
     intermediate never leaves the SM).
  2. down: over ``H / tile_h`` steps (ring of the down rows ``[tile_h, tile_i]`` (fp8; with
     MXFP8 the 16-byte E8M0 box holding the tile's exponents) or ``[tile_i, tile_h]`` (bf16),
     its first stages issued with step 1's), ``y^T [tile_h, tile_c] = down_rows act^T``,
     written as the slot's rows of the partial ``P [I / tile_i, n, H]`` (double-buffered
     staging). XLA sums P over the tiles and scatters the rows back to the tokens with their
     weights.
Prefill (:func:`moe_prefill_mgpu`): launch 1, work item (slot, 64-column tile of I): step 1
of the decode kernel with the activation written to the slot's aligned rows of ``act [A +
tile_c, I]`` bf16 in HBM; launch 2, work item (slot, ``tile_n`` = 128-row tile of H): ``y^T
[tile_n, tile_c] = down_rows act^T`` over ``I / down_tile_k`` steps (128), the slot's rows of
``y [n, H]`` f32. The routing permutation is computed once for both.

Scales (fp8), per work item: MXFP8 gate_up: the tile's gate rows and up rows of exponents
(``[tile_i, H/32]`` each); MXFP8 down: decode, a ``[tile_h, 16]`` box per step in the ring;
prefill, the ``[tile_n, I/32]`` rows; 128x128 blocks: the expert's whole f32 scale matrix
(read as scalars). Scale columns are padded to 16 bytes when they are not already (a copy;
the serving shapes need none).

Safety: every TMA box lies inside its array (xs and act carry ``tile_c`` padding rows; the
weight tiles are inside by the shape checks). Rows past a slot's copies hold other copies,
padding or (act) unwritten memory: they only produce output columns that are never stored,
and the rows of P / y that no slot writes (past the local copies) hold garbage that the
combine masks (``where``, so NaN there is dropped too). x rows of padding tokens and other ranks'
copies are never loaded into a used column, so NaN there stays out.

Limits: x bf16; H a multiple of 128 (``tile_k`` / ``tile_h`` divide it), I a multiple of 64
(decode: of ``tile_i``); the interpreter's wgmma reads A from shared memory only, so
interpreted fp8 kernels route the dequantized tile through shared memory (``a_in_smem``).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._interpret import mosaic_interpret_params
from pallas_kernels._shapes import NUM_SMS_H200, SMEM_BYTES
from pallas_kernels.fp8_matmul import BLOCK, E8M0_BIAS, MX_GROUP
from pallas_kernels.moe_experts import (MoeShapes, check_moe_inputs, combine_copies,
                                        group_copies, slot_bound)

ROWS = 64  # wgmma M per instruction: weight rows per dequantized chunk, sub-tile of I
ALIGN = 8  # wgmma N granularity: a slot's copies pad to a multiple of 8
MAX_TILE_C = 128  # copies per slot: two [64, tile_c] f32 accumulators stay in registers
MX_BOX = 16  # E8M0 bytes per TMA row (TMA's 16-byte minimum)
SCALE_COLS = 8  # MXFP8 exponents are read as [64, 8] blocks (the WGMMA layout's column tile)
TILE_KS = (64, 128)  # inputs per step
DECODE_TILE_IS = (64, 128)  # intermediate columns per decode work item (1 or 2 sub-tiles)
TILE_HS = (64, 128)  # decode: hidden rows per down step
PREFILL_TILE_NS = (64, 128)  # prefill down: hidden rows per work item
STAGES = (2, 3, 4, 5, 6)
SLOT_FIELDS = 4  # (expert, first aligned row, first sorted row, rows)
SMEM_ALIGN = 1024  # Mosaic GPU aligns every shared-memory buffer to 1 KiB
SMEM_RESERVE = 2 * 1024  # barriers
TWO_PER_SM = 113 * 1024  # two CTAs of at most this much shared memory share an SM (228 KiB,
#                          1 KiB of each CTA reserved)
WEIGHT_FORMATS = ("dense", "mxfp8", "block128")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _tiling(dtype, minor: int) -> tuple:
    """Tiling + swizzle of a shared-memory tile whose rows are ``minor`` elements of dtype."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, minor * itemsize)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _buf(shape, dtype) -> int:
    """Bytes of one shared-memory buffer, aligned as Mosaic GPU allocates it."""
    n = jnp.dtype(dtype).itemsize
    for d in shape:
        n *= d
    return _round_up(n, SMEM_ALIGN)


def _mx_cols(n: int) -> int:
    """E8M0 columns of ``n`` inputs, padded to 16-byte rows."""
    return _round_up(n // MX_GROUP, MX_BOX)


def _blk_cols(n: int) -> int:
    """128x128-block scale columns of ``n`` inputs, padded to 16-byte rows (4 f32)."""
    return _round_up(-(-n // BLOCK), 4)


def _div(a, b: int):
    return a // b if isinstance(a, int) else lax.div(a, jnp.int32(b))


def _rem(a, b: int):
    return a % b if isinstance(a, int) else lax.rem(a, jnp.int32(b))


# --------------------------------------------------------------------------- configs

class DecodeConfig(NamedTuple):
    """The static launch of one decode call."""
    shapes: MoeShapes
    tile_c: int  # copies per slot (wgmma N)
    tile_i: int  # intermediate columns per work item
    tile_k: int  # gate/up: inputs (H) per step
    tile_h: int  # down: hidden rows per step
    stages: int  # gate/up ring depth
    down_stages: int  # down ring depth
    num_ctas: int
    a_in_smem: bool

    @property
    def num_slots(self) -> int:
        return slot_bound(self.shapes.copies, self.shapes.e, self.tile_c)

    @property
    def i_tiles(self) -> int:
        return self.shapes.i // self.tile_i

    @property
    def subs(self) -> int:
        return self.tile_i // ROWS


class PrefillConfig(NamedTuple):
    """The static launch of one prefill call (both kernels)."""
    shapes: MoeShapes
    tile_c: int  # copies per slot (wgmma N)
    tile_k: int  # gate/up: inputs (H) per step
    stages: int
    tile_n: int  # down: hidden rows per work item
    down_tile_k: int  # down: inputs (I) per step
    down_stages: int
    num_ctas: int
    down_num_ctas: int
    a_in_smem: bool

    @property
    def num_slots(self) -> int:
        return slot_bound(self.shapes.copies, self.shapes.e, self.tile_c)


def _pair_smem(s: MoeShapes, tile_c: int, tile_k: int, stages: int, subs: int,
               a_in_smem: bool) -> int:
    """The gate/up step's buffers: x ring, weight ring, MXFP8 exponent rows, A staging."""
    wdt = jnp.bfloat16 if s.gate_up_fmt == "dense" else jnp.float8_e4m3fn
    n = _buf((stages, tile_c, tile_k), jnp.bfloat16) + _buf((stages, 2, ROWS, tile_k), wdt)
    if s.gate_up_fmt == "mxfp8":
        n += _buf((2, subs * ROWS, _mx_cols(s.h)), jnp.uint8)
    if s.gate_up_fmt == "block128":
        n += _buf((-(-2 * s.i // BLOCK), _blk_cols(s.h)), jnp.float32)
    if a_in_smem and s.gate_up_fmt != "dense":
        n += _buf((2, ROWS, tile_k), jnp.bfloat16)
    return n


def decode_smem_bytes(s: MoeShapes, tile_c: int, tile_i: int, tile_k: int, tile_h: int,
                      stages: int, down_stages: int, a_in_smem: bool = False) -> int:
    """Shared memory of one decode CTA (the output staging aliases the gate/up buffers)."""
    subs = tile_i // ROWS
    pair = _pair_smem(s, tile_c, tile_k, stages, subs, a_in_smem)
    if s.gate_up_fmt == "block128":  # the expert's block scales stay outside the union
        blk = _buf((-(-2 * s.i // BLOCK), _blk_cols(s.h)), jnp.float32)
        pair -= blk
    else:
        blk = 0
    staging = 2 * _buf((2, tile_c, tile_h), jnp.uint16)
    wdt = jnp.bfloat16 if s.down_fmt == "dense" else jnp.float8_e4m3fn
    down = _buf((down_stages, tile_i, tile_h), wdt)
    if s.down_fmt == "mxfp8":
        down += _buf((down_stages, tile_h, MX_BOX), jnp.uint8)
    if s.down_fmt == "block128":
        down += _buf((-(-s.h // BLOCK), _blk_cols(s.i)), jnp.float32)
    if a_in_smem and s.down_fmt != "dense":
        down += _buf((subs, tile_h, ROWS), jnp.bfloat16)
    act = _buf((subs, tile_c, ROWS), jnp.bfloat16)
    return max(pair, staging) + blk + down + act + SMEM_RESERVE


def prefill_smem_bytes(s: MoeShapes, tile_c: int, tile_k: int, stages: int,
                       a_in_smem: bool = False) -> int:
    """Shared memory of one gate/up prefill CTA (the output staging aliases the rings)."""
    pair = _pair_smem(s, tile_c, tile_k, stages, 1, a_in_smem)
    if s.gate_up_fmt == "block128":
        blk = _buf((-(-2 * s.i // BLOCK), _blk_cols(s.h)), jnp.float32)
        pair -= blk
    else:
        blk = 0
    return max(pair, _buf((tile_c, ROWS), jnp.bfloat16)) + blk + SMEM_RESERVE


def prefill_down_smem_bytes(s: MoeShapes, tile_c: int, tile_n: int, tile_k: int,
                            stages: int, a_in_smem: bool = False) -> int:
    """Shared memory of one down prefill CTA (the output staging aliases the rings)."""
    wdt = jnp.bfloat16 if s.down_fmt == "dense" else jnp.float8_e4m3fn
    ring = _buf((stages, tile_c, tile_k), jnp.bfloat16) + _buf((stages, tile_n, tile_k), wdt)
    if a_in_smem and s.down_fmt != "dense":
        ring += _buf((tile_n, tile_k), jnp.bfloat16)
    extra = 0
    if s.down_fmt == "mxfp8":
        extra = _buf((tile_n, _mx_cols(s.i)), jnp.uint8)
    if s.down_fmt == "block128":
        extra = _buf((-(-s.h // BLOCK), _blk_cols(s.i)), jnp.float32)
    staging = 2 * _buf((tile_c, tile_n), jnp.uint16)
    return max(ring, staging) + extra + SMEM_RESERVE


def unsupported_reason(s: MoeShapes, x_dtype) -> str | None:
    """Why the kernels do not take a call of these sizes (None: they do). Static."""
    if jnp.dtype(x_dtype) != jnp.dtype(jnp.bfloat16):
        return f"x dtype must be bfloat16, got {jnp.dtype(x_dtype)}"
    if s.h % 128:
        return f"H = {s.h} must be a multiple of 128"
    if s.i % ROWS:
        return f"I = {s.i} must be a multiple of {ROWS}"
    return None


def _tile_c(copies_per_expert: int, tile_c) -> int:
    if tile_c is None:
        return min(_round_up(max(copies_per_expert, 1), ALIGN), MAX_TILE_C)
    if not isinstance(tile_c, int) or tile_c < ALIGN or tile_c % ALIGN or tile_c > MAX_TILE_C:
        raise ValueError(f"tile_c must be a multiple of {ALIGN} in [{ALIGN}, {MAX_TILE_C}], "
                         f"got {tile_c!r}")
    return tile_c


def _check_choice(name: str, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)} (or None), got {value!r}")


def _ctas(work: int, smem: int, interpreting: bool, num_ctas) -> int:
    if num_ctas is not None:
        if not isinstance(num_ctas, int) or num_ctas < 1:
            raise ValueError(f"num_ctas must be a positive int (or None), got {num_ctas!r}")
        return num_ctas
    if interpreting:
        return max(1, min(work, 2))
    per_sm = 2 if smem <= TWO_PER_SM else 1
    return max(1, min(work, per_sm * NUM_SMS_H200))


def _fit_stages(fn, name: str, stages, steps: int, budget: int = SMEM_BYTES) -> int:
    """``stages`` checked, or the deepest of 4..3 (<= steps) that lets two CTAs share an SM,
    else the deepest of 4..2 whose ``fn(stages)`` fits ``budget``."""
    if stages is not None:
        _check_choice(name, stages, STAGES)
        need = fn(stages)
        if need > budget:
            raise ValueError(f"{name} = {stages} needs {need} bytes of shared memory, more "
                             f"than {budget}")
        return stages
    deepest = max(min(4, steps), 2)
    for st in range(deepest, 2, -1):  # two CTAs per SM with >= 3 stages each, if that fits
        if fn(st) <= TWO_PER_SM:
            return st
    for st in range(deepest, 1, -1):
        if fn(st) <= budget:
            return st
    raise ValueError(f"the tiles need {fn(2)} bytes of shared memory with 2 stages, more "
                     f"than {budget}")


def default_decode_tile_i(s: MoeShapes) -> int:
    """64 columns (``I / 64`` work items per touched expert: under EP a decode step touches
    few of a rank's experts) up to 64 copies, else 128 (half the partials)."""
    if s.i % 128 or s.copies <= 64:
        return 64
    return 128


def make_decode_config(s: MoeShapes, *, tile_c=None, tile_i=None, tile_k=None, tile_h=None,
                       stages=None, down_stages=None, num_ctas=None, a_in_smem=False,
                       interpreting=False) -> DecodeConfig:
    """The decode launch for sizes ``s``: defaults for the tunables left None, the others
    validated (ValueError naming the tunable and its bound)."""
    tc = _tile_c(s.t, tile_c)  # an expert holds at most T copies (k distinct experts)
    ti = default_decode_tile_i(s) if tile_i is None else tile_i
    _check_choice("tile_i", ti, DECODE_TILE_IS)
    if s.i % ti:
        raise ValueError(f"tile_i = {ti} must divide I = {s.i}")
    tk = 128 if tile_k is None else tile_k
    _check_choice("tile_k", tk, TILE_KS)
    if tile_h is None:  # down tiles of 16 KiB at tile_i = 128: fp8 128 rows, bf16 64
        th = 128 if tc <= 64 and s.down_fmt != "dense" else 64
    else:
        th = tile_h
    _check_choice("tile_h", th, TILE_HS)
    if th * tc > ROWS * 256:
        raise ValueError(f"tile_h * tile_c = {th * tc} exceeds {ROWS * 256} (the f32 "
                         f"accumulator)")
    if s.h % tk or s.h % th:
        raise ValueError(f"H = {s.h} must be a multiple of tile_k = {tk} and tile_h = {th}")
    ds = 3 if down_stages is None else down_stages
    _check_choice("down_stages", ds, STAGES)
    steps = (ti // ROWS) * (s.h // tk)
    st = _fit_stages(lambda n: decode_smem_bytes(s, tc, ti, tk, th, n, ds, a_in_smem),
                     "stages", stages, steps)
    smem = decode_smem_bytes(s, tc, ti, tk, th, st, ds, a_in_smem)
    work = slot_bound(s.copies, s.e, tc) * (s.i // ti)
    return DecodeConfig(s, tc, ti, tk, th, st, ds, _ctas(work, smem, interpreting, num_ctas),
                        bool(a_in_smem))


def make_prefill_config(s: MoeShapes, *, tile_c=None, tile_k=None, stages=None, tile_n=None,
                        down_tile_k=None, down_stages=None, num_ctas=None, a_in_smem=False,
                        interpreting=False) -> PrefillConfig:
    """The prefill launches for sizes ``s`` (as :func:`make_decode_config`)."""
    tc = _tile_c(s.t, tile_c)
    tk = 128 if tile_k is None else tile_k
    _check_choice("tile_k", tk, TILE_KS)
    if s.h % tk:
        raise ValueError(f"H = {s.h} must be a multiple of tile_k = {tk}")
    st = _fit_stages(lambda n: prefill_smem_bytes(s, tc, tk, n, a_in_smem), "stages", stages,
                     s.h // tk)
    tn = 128 if tile_n is None else tile_n
    _check_choice("tile_n", tn, PREFILL_TILE_NS)
    if s.h % tn:
        raise ValueError(f"H = {s.h} must be a multiple of tile_n = {tn}")
    if tn * tc > ROWS * 256:
        raise ValueError(f"tile_n * tile_c = {tn * tc} exceeds {ROWS * 256} (the f32 "
                         f"accumulator)")
    if down_tile_k is None:
        dk = 128 if s.i % 128 == 0 else 64
        if prefill_down_smem_bytes(s, tc, tn, dk, 3, a_in_smem) > SMEM_BYTES:
            dk = 64
    else:
        dk = down_tile_k
    _check_choice("down_tile_k", dk, TILE_KS)
    if s.i % dk:
        raise ValueError(f"I = {s.i} must be a multiple of down_tile_k = {dk}")
    ds = _fit_stages(lambda n: prefill_down_smem_bytes(s, tc, tn, dk, n, a_in_smem),
                     "down_stages", down_stages, s.i // dk)
    slots = slot_bound(s.copies, s.e, tc)
    g1 = _ctas(slots * (s.i // ROWS), prefill_smem_bytes(s, tc, tk, st, a_in_smem),
               interpreting, num_ctas)
    g2 = _ctas(slots * (s.h // tn), prefill_down_smem_bytes(s, tc, tn, dk, ds, a_in_smem),
               interpreting, num_ctas)
    return PrefillConfig(s, tc, tk, st, tn, dk, ds, g1, g2, bool(a_in_smem))


# --------------------------------------------------------------------------- in-kernel pieces

def _e8m0_block(s_ref, col8):
    """f32 ``2^(e - 127)`` of the E8M0 bytes ``s_ref[:, 8 col8 : 8 col8 + 8]`` (``s_ref``: 64
    rows), ``[64, 8]`` in the WGMMA layout (exact: the f32 bits are built from e)."""
    e = plgpu.load(s_ref.at[:, pl.ds(col8 * SCALE_COLS, SCALE_COLS)],
                   layout=plgpu.Layout.WGMMA, optimized=False).astype(jnp.int32)
    bits = jnp.where(e == 0, jnp.int32(1 << 22), e << 23)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _dequant(w_ref, fmt: str, *, mx=None, block=None):
    """bf16 ``[64, K]`` (WGMMA layout) of the fp8 rows ``w_ref [64, K]`` (shared memory)
    times their scales, in f32 then rounded once. ``mx``: ``(s_ref [64, cols] uint8, first)``,
    the exponent of 32-column group g in column ``first + g`` (first dynamic; the K / 32
    groups inside one 8-column block); ``block``: the f32 scale (K <= 128, one block)."""
    kw = w_ref.shape[-1]
    w8 = plgpu.load(w_ref, layout=plgpu.Layout.WGMMA_UPCAST_2X)
    w = plgpu.layout_cast(w8, plgpu.Layout.WGMMA).astype(jnp.float32)  # exact (via f16)
    if fmt == "mxfp8":
        s_ref, first = mx
        blk = _e8m0_block(s_ref, _div(first, SCALE_COLS))
        cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, SCALE_COLS), 1,
                                      layout=plgpu.Layout.WGMMA)
        c0 = _rem(first, SCALE_COLS)
        parts = []
        for g in range(kw // MX_GROUP):
            scale = jnp.sum(jnp.where(cols == c0 + g, blk, 0.0), axis=1)  # column c0 + g
            part = w[:, g * MX_GROUP:(g + 1) * MX_GROUP]
            parts.append(part * plgpu.layout_cast(
                lax.broadcast_in_dim(scale, part.shape, [0]), plgpu.Layout.WGMMA))
        w = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
    else:
        w = w * block
    return w.astype(jnp.bfloat16)


def _swigluoai(gate, up, alpha: float, limit: float):
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1.0) * gate * jax.nn.sigmoid(alpha * gate)


def _split_f32(y):
    """f32 -> (high, low) uint16 halves of its bits."""
    bits = lax.bitcast_convert_type(y, jnp.uint32)
    hi = lax.shift_right_logical(bits, jnp.uint32(16)).astype(jnp.uint16)
    lo = (bits & jnp.uint32(0xFFFF)).astype(jnp.uint16)
    return hi, lo


def join_f32(hi, lo):
    """The f32 whose bits are ``hi << 16 | lo`` (uint16 halves; XLA side)."""
    bits = (hi.astype(jnp.uint32) << 16) | lo.astype(jnp.uint32)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _store_rows(src, dst, start, rows, max_rows: int):
    """TMA-stores rows ``[0, rows)`` of ``src [max_rows, W]`` (unswizzled shared memory) to
    rows ``[start, start + rows)`` of ``dst [R, W]``, as boxes of 2^b rows (one per set bit
    of ``rows``, largest first; no commit: the caller commits the group)."""
    off = 0
    n = 1 << (max_rows.bit_length() - 1)
    while n >= 1:
        @pl.when((rows & n) != 0)
        def _store(off=off, n=n):
            plgpu.copy_smem_to_gmem(src.at[pl.ds(off, n)], dst.at[pl.ds(start + off, n)],
                                    commit_group=False)
        off = off + (rows & n)
        n //= 2


class _Slot(NamedTuple):
    expert: jax.Array
    start: jax.Array  # first aligned row (inputs; a multiple of 8)
    out: jax.Array  # first sorted row (outputs)
    rows: jax.Array


def _read_slot(meta_ref, s) -> _Slot:
    f = 1 + SLOT_FIELDS * s
    return _Slot(meta_ref[f], pl.multiple_of(meta_ref[f + 1], ALIGN), meta_ref[f + 2],
                 meta_ref[f + 3])


def _persistent(meta_ref, tiles: int, num_ctas: int, item):
    """Runs ``item(slot, tile)`` for work items ``pid, pid + G, ...`` below used slots x
    ``tiles`` (the tile index fastest). Each item starts behind a warpgroup barrier and an
    async-proxy fence: the previous item's shared-memory reads and writes are over before its
    TMA loads refill the buffers."""
    pid = lax.axis_index("g")
    work = meta_ref[0] * tiles
    count = lax.div(jnp.maximum(work - pid + (num_ctas - 1), 0), jnp.int32(num_ctas))

    def body(it, carry):
        w = pid + it * num_ctas
        plgpu.commit_smem()
        item(_read_slot(meta_ref, lax.div(w, jnp.int32(tiles))), lax.rem(w, jnp.int32(tiles)))
        return carry

    lax.fori_loop(0, count, body, 0)


class _GateUp:
    """Step 1: ``gate^T, up^T [64, tile_c]`` of a 64-column sub-tile over H, through a ring of
    (gate rows, up rows, x tile)."""

    def __init__(self, *, s: MoeShapes, tile_c, tile_k, stages, subs, a_in_smem, xs_ref,
                 gu_ref, x_ring, w_ring, bars, s_rows, s_blk, a_smem):
        self.s, self.tc, self.tk, self.ns, self.subs = s, tile_c, tile_k, stages, subs
        self.a_in_smem = a_in_smem
        self.xs_ref, self.gu_ref = xs_ref, gu_ref
        self.x_ring, self.w_ring, self.bars = x_ring, w_ring, bars
        self.s_rows, self.s_blk, self.a_smem = s_rows, s_blk, a_smem
        self.ksteps = s.h // tile_k
        self.steps = subs * self.ksteps

    @classmethod
    def of(cls, cfg, subs: int, xs_ref, gu_ref, pair_refs: dict, scr: dict) -> "_GateUp":
        """The step of a decode or prefill launch ``cfg`` over its scratch buffers."""
        return cls(s=cfg.shapes, tile_c=cfg.tile_c, tile_k=cfg.tile_k, stages=cfg.stages,
                   subs=subs, a_in_smem=cfg.a_in_smem, xs_ref=xs_ref, gu_ref=gu_ref,
                   x_ring=pair_refs["x_ring"], w_ring=pair_refs["w_ring"], bars=scr["bars1"],
                   s_rows=pair_refs.get("s_rows"), s_blk=scr.get("s_gu"),
                   a_smem=pair_refs.get("a_smem"))

    def rows(self, j, u):
        """First gate row and first up row of sub-tile u of intermediate tile j."""
        og = j * (self.subs * ROWS) + u * ROWS
        return og, self.s.i + og

    def issue(self, t, slot, e, j, start):
        u, kk = _div(t, self.ksteps), _rem(t, self.ksteps)
        k0 = kk * self.tk
        bar = self.bars.at[slot]
        plgpu.copy_gmem_to_smem(self.xs_ref.at[pl.ds(start, self.tc), pl.ds(k0, self.tk)],
                                self.x_ring.at[slot], bar)
        for half, o in enumerate(self.rows(j, u)):
            if self.s.gate_up_fmt == "dense":
                src = self.gu_ref.at[e, pl.ds(k0, self.tk), pl.ds(o, ROWS)]
            else:
                src = self.gu_ref.at[e, pl.ds(o, ROWS), pl.ds(k0, self.tk)]
            plgpu.copy_gmem_to_smem(src, self.w_ring.at[slot, half], bar)

    def prologue(self, e, j, start):
        for t in range(min(self.ns, self.steps)):
            self.issue(t, t, e, j, start)

    def _a(self, slot, half, u, kk, row0):
        """The A operand of one half at step (u, kk): a transposed smem view (bf16) or the
        dequantized registers."""
        fmt = self.s.gate_up_fmt
        if fmt == "dense":
            return self.w_ring.at[slot, half].transpose((1, 0))
        w_ref = self.w_ring.at[slot, half]
        if fmt == "mxfp8":
            return _dequant(w_ref, fmt, mx=(self.s_rows.at[half, pl.ds(u * ROWS, ROWS)],
                                            kk * (self.tk // MX_GROUP)))
        scale = self.s_blk[_div(row0, BLOCK), _div(kk * self.tk, BLOCK)]
        return _dequant(w_ref, fmt, block=scale)

    def run(self, u: int, e, j, start):
        """The sub-tile's accumulators (f32 ``[64, tile_c]`` each), refilling the ring."""
        rows = self.rows(j, u)
        fmt = self.s.gate_up_fmt

        def refill(t):
            nxt = t - 1 + self.ns
            pl.when((t >= 1) & (nxt < self.steps))(
                lambda: self.issue(nxt, lax.rem(t - 1, self.ns), e, j, start))

        def scope(acc_g, acc_u):
            accs = (acc_g, acc_u)

            def step(kk, carry):
                t = u * self.ksteps + kk
                slot = lax.rem(t, self.ns)
                x_t = self.x_ring.at[slot].transpose((1, 0))  # x^T [tile_k, tile_c]
                plgpu.barrier_wait(self.bars.at[slot])
                if fmt == "dense" or not self.a_in_smem:
                    plgpu.commit_smem()  # every thread past step t - 1
                    refill(t)
                    for half in range(2):
                        plgpu.wgmma(accs[half], self._a(slot, half, u, kk, rows[half]), x_t)
                else:
                    for half in range(2):
                        self.a_smem.at[half][...] = self._a(slot, half, u, kk, rows[half])
                    plgpu.commit_smem()  # A visible to the wgmma; every thread past t - 1
                    refill(t)
                    for half in range(2):
                        plgpu.wgmma(accs[half], self.a_smem.at[half], x_t)
                plgpu.wgmma_wait(0)
                return carry

            lax.fori_loop(0, self.ksteps, step, 0)
            return acc_g[...], acc_u[...]

        return pl.run_scoped(scope, plgpu.ACC((ROWS, self.tc), jnp.float32),
                             plgpu.ACC((ROWS, self.tc), jnp.float32))


def _gate_up_scratch(s: MoeShapes, tile_c, tile_k, stages, subs, a_in_smem):
    """The gate/up buffers (a dict; the block-scale matrix separately)."""
    dense = s.gate_up_fmt == "dense"
    wdt = jnp.bfloat16 if dense else jnp.float8_e4m3fn
    w_shape = (stages, 2, tile_k, ROWS) if dense else (stages, 2, ROWS, tile_k)
    d = dict(x_ring=plgpu.SMEM((stages, tile_c, tile_k), jnp.bfloat16,
                               transforms=_tiling(jnp.bfloat16, tile_k)),
             w_ring=plgpu.SMEM(w_shape, wdt, transforms=_tiling(wdt, w_shape[-1])))
    if a_in_smem and not dense:
        d["a_smem"] = plgpu.SMEM((2, ROWS, tile_k), jnp.bfloat16,
                                 transforms=_tiling(jnp.bfloat16, tile_k))
    if s.gate_up_fmt == "mxfp8":
        d["s_rows"] = plgpu.SMEM((2, subs * ROWS, _mx_cols(s.h)), jnp.uint8)
    return d


def _gate_up_blk(s: MoeShapes):
    return plgpu.SMEM((-(-2 * s.i // BLOCK), _blk_cols(s.h)), jnp.float32)


def _issue_gate_up_scales(s: MoeShapes, gus_ref, s_rows, s_blk, e, j, tile_i, sbar):
    """Issues the work item's gate/up scales; returns the arrivals it owes ``sbar``."""
    if s.gate_up_fmt == "mxfp8":
        plgpu.copy_gmem_to_smem(gus_ref.at[e, pl.ds(j * tile_i, tile_i)], s_rows.at[0], sbar)
        plgpu.copy_gmem_to_smem(gus_ref.at[e, pl.ds(s.i + j * tile_i, tile_i)], s_rows.at[1],
                                sbar)
    elif s.gate_up_fmt == "block128":
        plgpu.copy_gmem_to_smem(gus_ref.at[e], s_blk, sbar)


def _scale_arrivals(fmt: str, kind: str) -> int:
    if kind == "gate_up":
        return {"mxfp8": 2, "block128": 1}.get(fmt, 0)
    return {"block128": 1}.get(fmt, 0)  # down: the block matrix once per item


def _gate_up_refs(it, s: MoeShapes):
    """(slot table, xs, gate_up values, gate_up scales or None) off the kernel's refs."""
    meta_ref, xs_ref, gu_ref = next(it), next(it), next(it)
    return meta_ref, xs_ref, gu_ref, next(it) if s.gate_up_fmt != "dense" else None


# --------------------------------------------------------------------------- decode kernel

def _decode_body(*refs, cfg: DecodeConfig, alpha: float, limit: float, **scr):
    s = cfg.shapes
    it = iter(refs)
    meta_ref, xs_ref, gu_ref, gus_ref = _gate_up_refs(it, s)
    dn_ref = next(it)
    dns_ref = next(it) if s.down_fmt != "dense" else None
    phi_ref, plo_ref = next(it), next(it)
    pair_refs, (o_hi, o_lo) = scr["union"]
    tc, ti, th, nd = cfg.tile_c, cfg.tile_i, cfg.tile_h, cfg.down_stages
    hsteps = s.h // th
    d_ring, ds_ring, bars2 = scr["d_ring"], scr.get("ds_ring"), scr["bars2"]
    act, s_dn = scr["act"], scr.get("s_dn")
    a2 = scr.get("a2_smem")
    sbar = scr.get("sbar")
    dfmt = s.down_fmt
    gate_up = _GateUp.of(cfg, cfg.subs, xs_ref, gu_ref, pair_refs, scr)

    def item(slot: _Slot, j):
        e, start, out, rows = slot
        i0 = j * ti
        mx_col0 = _div(i0, MX_GROUP * MX_BOX) * MX_BOX  # the 16-byte E8M0 box of the tile

        def issue_down(h, dslot):
            h0 = h * th
            bar = bars2.at[dslot]
            if dfmt == "dense":
                plgpu.copy_gmem_to_smem(dn_ref.at[e, pl.ds(i0, ti), pl.ds(h0, th)],
                                        d_ring.at[dslot], bar)
            else:
                plgpu.copy_gmem_to_smem(dn_ref.at[e, pl.ds(h0, th), pl.ds(i0, ti)],
                                        d_ring.at[dslot], bar)
                if dfmt == "mxfp8":
                    plgpu.copy_gmem_to_smem(dns_ref.at[e, pl.ds(h0, th), pl.ds(mx_col0, MX_BOX)],
                                            ds_ring.at[dslot], bar)

        if sbar is not None:
            _issue_gate_up_scales(s, gus_ref, pair_refs.get("s_rows"), scr.get("s_gu"), e, j,
                                  ti, sbar)
            if dfmt == "block128":
                plgpu.copy_gmem_to_smem(dns_ref.at[e], s_dn, sbar)
        for h in range(min(nd, hsteps)):
            issue_down(h, h)
        gate_up.prologue(e, j, start)
        if sbar is not None:
            plgpu.barrier_wait(sbar)

        # 1. gate/up and swigluoai: act [tile_c, 64] bf16 per sub-tile, in shared memory
        for u in range(cfg.subs):
            g, up = gate_up.run(u, e, j, start)
            act.at[u].transpose((1, 0))[...] = _swigluoai(g, up, alpha, limit).astype(
                jnp.bfloat16)
        plgpu.commit_smem()

        # 2. down: y^T [tile_h, tile_c] per step, the slot's rows of P[j]
        def refill(h):
            nxt = h - 1 + nd
            pl.when((h >= 1) & (nxt < hsteps))(lambda: issue_down(nxt, lax.rem(h - 1, nd)))

        def step(h, carry):
            dslot = lax.rem(h, nd)
            plgpu.barrier_wait(bars2.at[dslot])
            plgpu.commit_smem()  # every thread past step h - 1
            refill(h)

            def scope(acc):
                if dfmt == "dense":
                    for u in range(cfg.subs):
                        plgpu.wgmma(acc, d_ring.at[dslot, pl.ds(u * ROWS, ROWS)].transpose((1, 0)),
                                    act.at[u].transpose((1, 0)))
                else:
                    for r in range(th // ROWS):
                        rws = pl.ds(r * ROWS, ROWS)
                        if dfmt == "mxfp8":
                            a = _dequant(d_ring.at[dslot, rws], dfmt,
                                         mx=(ds_ring.at[dslot, rws],
                                             _div(i0, MX_GROUP) - mx_col0))
                        else:
                            a = _dequant(d_ring.at[dslot, rws], dfmt,
                                         block=s_dn[_div(h * th + r * ROWS, BLOCK),
                                                    _div(i0, BLOCK)])
                        for u in range(cfg.subs):
                            a_u = a[:, u * ROWS:(u + 1) * ROWS] if cfg.subs > 1 else a
                            if cfg.a_in_smem:
                                a2.at[u, rws][...] = a_u
                            else:
                                plgpu.wgmma(acc.at[rws], a_u, act.at[u].transpose((1, 0)))
                    if cfg.a_in_smem:
                        plgpu.commit_smem()
                        for u in range(cfg.subs):
                            plgpu.wgmma(acc, a2.at[u], act.at[u].transpose((1, 0)))
                plgpu.wgmma_wait(0)
                return acc[...]

            y = pl.run_scoped(scope, plgpu.ACC((th, tc), jnp.float32))
            hi, lo = _split_f32(y)
            buf = lax.rem(h, 2)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # step h - 2 read this buffer
            o_hi.at[buf].transpose((1, 0))[...] = hi
            o_lo.at[buf].transpose((1, 0))[...] = lo
            plgpu.commit_smem()
            cols = pl.ds(h * th, th)
            _store_rows(o_hi.at[buf], phi_ref.at[j, :, cols], out, rows, tc)
            _store_rows(o_lo.at[buf], plo_ref.at[j, :, cols], out, rows, tc)
            plgpu.commit_smem_to_gmem_group()
            return carry

        lax.fori_loop(0, hsteps, step, 0)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # staging free (aliases step 1)

    _persistent(meta_ref, cfg.i_tiles, cfg.num_ctas, item)


def _decode_scratch(cfg: DecodeConfig) -> dict:
    s = cfg.shapes
    tc, ti, th, nd = cfg.tile_c, cfg.tile_i, cfg.tile_h, cfg.down_stages
    pair = _gate_up_scratch(s, tc, cfg.tile_k, cfg.stages, cfg.subs, cfg.a_in_smem)
    staging = (plgpu.SMEM((2, tc, th), jnp.uint16), plgpu.SMEM((2, tc, th), jnp.uint16))
    if s.down_fmt == "dense":
        d_ring = plgpu.SMEM((nd, ti, th), jnp.bfloat16, transforms=_tiling(jnp.bfloat16, th))
    else:
        d_ring = plgpu.SMEM((nd, th, ti), jnp.float8_e4m3fn,
                            transforms=_tiling(jnp.float8_e4m3fn, ti))
    d = dict(union=plgpu.RefUnion(pair, staging), d_ring=d_ring,
             act=plgpu.SMEM((cfg.subs, tc, ROWS), jnp.bfloat16,
                            transforms=_tiling(jnp.bfloat16, ROWS)),
             bars1=plgpu.Barrier(num_arrivals=3, num_barriers=cfg.stages),
             bars2=plgpu.Barrier(num_arrivals=2 if s.down_fmt == "mxfp8" else 1,
                                 num_barriers=nd))
    if s.down_fmt == "mxfp8":
        d["ds_ring"] = plgpu.SMEM((nd, th, MX_BOX), jnp.uint8)
    if s.down_fmt == "block128":
        d["s_dn"] = plgpu.SMEM((-(-s.h // BLOCK), _blk_cols(s.i)), jnp.float32)
    if s.gate_up_fmt == "block128":
        d["s_gu"] = _gate_up_blk(s)
    if cfg.a_in_smem and s.down_fmt != "dense":
        d["a2_smem"] = plgpu.SMEM((cfg.subs, th, ROWS), jnp.bfloat16,
                                  transforms=_tiling(jnp.bfloat16, ROWS))
    arrivals = _scale_arrivals(s.gate_up_fmt, "gate_up") + _scale_arrivals(s.down_fmt, "down")
    if arrivals:
        d["sbar"] = plgpu.Barrier(num_arrivals=arrivals)
    return d


# --------------------------------------------------------------------------- prefill kernels

def _prefill_gate_up_body(*refs, cfg: PrefillConfig, alpha: float, limit: float, **scr):
    s = cfg.shapes
    it = iter(refs)
    meta_ref, xs_ref, gu_ref, gus_ref = _gate_up_refs(it, s)
    act_ref = next(it)
    pair_refs, o_act = scr["union"]
    sbar = scr.get("sbar")
    tc = cfg.tile_c
    gate_up = _GateUp.of(cfg, 1, xs_ref, gu_ref, pair_refs, scr)

    def item(slot: _Slot, j):
        e, start, _, rows = slot
        if sbar is not None:
            _issue_gate_up_scales(s, gus_ref, pair_refs.get("s_rows"), scr.get("s_gu"), e, j,
                                  ROWS, sbar)
        gate_up.prologue(e, j, start)
        if sbar is not None:
            plgpu.barrier_wait(sbar)
        g, up = gate_up.run(0, e, j, start)
        o_act.transpose((1, 0))[...] = _swigluoai(g, up, alpha, limit).astype(jnp.bfloat16)
        plgpu.commit_smem()
        _store_rows(o_act, act_ref.at[:, pl.ds(j * ROWS, ROWS)], start, rows, tc)
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # staging free (aliases the ring)

    _persistent(meta_ref, s.i // ROWS, cfg.num_ctas, item)


def _prefill_down_body(*refs, cfg: PrefillConfig, **scr):
    s = cfg.shapes
    it = iter(refs)
    meta_ref, act_ref, dn_ref = next(it), next(it), next(it)
    dns_ref = next(it) if s.down_fmt != "dense" else None
    yhi_ref, ylo_ref = next(it), next(it)
    (a_ring, w_ring, *a_smem), (o_hi, o_lo) = scr["union"]
    a_smem = a_smem[0] if a_smem else None
    bars, sbar, s_sc = scr["bars"], scr.get("sbar"), scr.get("s_dn")
    tc, tn, tk, ns = cfg.tile_c, cfg.tile_n, cfg.down_tile_k, cfg.down_stages
    fmt = s.down_fmt
    ksteps = s.i // tk

    def item(slot: _Slot, j):
        e, start, out, rows = slot
        h0 = j * tn

        def issue(t, rslot):
            k0 = t * tk
            bar = bars.at[rslot]
            plgpu.copy_gmem_to_smem(act_ref.at[pl.ds(start, tc), pl.ds(k0, tk)],
                                    a_ring.at[rslot], bar)
            if fmt == "dense":
                src = dn_ref.at[e, pl.ds(k0, tk), pl.ds(h0, tn)]
            else:
                src = dn_ref.at[e, pl.ds(h0, tn), pl.ds(k0, tk)]
            plgpu.copy_gmem_to_smem(src, w_ring.at[rslot], bar)

        if fmt == "mxfp8":
            plgpu.copy_gmem_to_smem(dns_ref.at[e, pl.ds(h0, tn)], s_sc, sbar)
        elif fmt == "block128":
            plgpu.copy_gmem_to_smem(dns_ref.at[e], s_sc, sbar)
        for t in range(min(ns, ksteps)):
            issue(t, t)
        if sbar is not None:
            plgpu.barrier_wait(sbar)

        def refill(t):
            nxt = t - 1 + ns
            pl.when((t >= 1) & (nxt < ksteps))(lambda: issue(nxt, lax.rem(t - 1, ns)))

        def scope(acc):
            def step(t, carry):
                rslot = lax.rem(t, ns)
                b = a_ring.at[rslot].transpose((1, 0))  # act^T [tile_k, tile_c]
                plgpu.barrier_wait(bars.at[rslot])
                if fmt == "dense":
                    plgpu.commit_smem()
                    refill(t)
                    plgpu.wgmma(acc, w_ring.at[rslot].transpose((1, 0)), b)
                else:
                    def a_rows(r):
                        rws = pl.ds(r * ROWS, ROWS)
                        if fmt == "mxfp8":
                            return rws, _dequant(w_ring.at[rslot, rws], fmt,
                                                 mx=(s_sc.at[rws], t * (tk // MX_GROUP)))
                        return rws, _dequant(w_ring.at[rslot, rws], fmt,
                                             block=s_sc[_div(h0 + r * ROWS, BLOCK),
                                                        _div(t * tk, BLOCK)])
                    if cfg.a_in_smem:
                        for r in range(tn // ROWS):
                            rws, a = a_rows(r)
                            a_smem.at[rws][...] = a
                        plgpu.commit_smem()
                        refill(t)
                        plgpu.wgmma(acc, a_smem, b)
                    else:
                        plgpu.commit_smem()
                        refill(t)
                        for r in range(tn // ROWS):
                            rws, a = a_rows(r)
                            plgpu.wgmma(acc.at[rws], a, b)
                plgpu.wgmma_wait(0)
                return carry

            lax.fori_loop(0, ksteps, step, 0)
            return acc[...]

        y = pl.run_scoped(scope, plgpu.ACC((tn, tc), jnp.float32))
        hi, lo = _split_f32(y)
        o_hi.transpose((1, 0))[...] = hi
        o_lo.transpose((1, 0))[...] = lo
        plgpu.commit_smem()
        _store_rows(o_hi, yhi_ref.at[:, pl.ds(h0, tn)], out, rows, tc)
        _store_rows(o_lo, ylo_ref.at[:, pl.ds(h0, tn)], out, rows, tc)
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # staging free (aliases the ring)

    _persistent(meta_ref, s.h // tn, cfg.down_num_ctas, item)


# --------------------------------------------------------------------------- wrappers

def _weight_operand(w, fmt: str):
    """The arrays a kernel reads for one expert weight: (values,) for an array, (values,
    scales) for fp8, the scales' columns padded to 16-byte rows (neutral scales)."""
    if fmt == "dense":
        return (w,)
    v, sc = w.values, w.scales
    mult, fill = (MX_BOX, E8M0_BIAS) if fmt == "mxfp8" else (4, 1.0)
    pad = -sc.shape[-1] % mult
    if pad:
        sc = jnp.pad(sc, ((0, 0), (0, 0), (0, pad)),
                     constant_values=jnp.asarray(fill, sc.dtype))
    return (v, sc)


def _route(x, experts, token_mask, s: MoeShapes, tile_c: int, first_expert):
    """Copies grouped into slots, the slot table (``[1 + 4 S]`` int32: used slots, then
    (expert, first aligned row, first sorted row, rows) per slot) and ``xs [A + tile_c, H]``,
    the x row of each aligned row (:func:`~pallas_kernels.moe_experts.aligned_rows` A)."""
    groups = group_copies(experts, token_mask, s.e, tile_c, first_expert, align=ALIGN)
    meta = jnp.concatenate([groups.num_slots[None], groups.slots.reshape(-1)])
    tokens = jnp.concatenate([groups.aligned_tokens, jnp.zeros((tile_c,), jnp.int32)])
    return groups, meta.astype(jnp.int32), x[tokens]


def _check(name, x, weights, experts, token_mask, gate_up, down, first_expert) -> MoeShapes:
    s = check_moe_inputs(x, weights, experts, token_mask, gate_up, down, first_expert, name)
    reason = unsupported_reason(s, x.dtype)
    if reason is not None:
        raise ValueError(f"{name}: {reason}")
    return s


def _a_in_smem(a_in_smem, interpret, name: str) -> bool:
    if a_in_smem is None:
        return interpret is not None
    if not a_in_smem and interpret is not None:
        raise ValueError(f"{name}: a_in_smem=False (A from registers) needs the compiled "
                         f"kernel: the interpreter's wgmma reads A from shared memory")
    return bool(a_in_smem)


_STATIC = ("alpha", "limit", "tile_c", "tile_i", "tile_k", "tile_h", "stages", "down_stages",
           "num_ctas", "a_in_smem", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def moe_decode_mgpu(x, weights, experts, token_mask, gate_up, down, first_expert=0, *,
                    alpha: float, limit: float, tile_c=None, tile_i=None, tile_k=None,
                    tile_h=None, stages=None, down_stages=None, num_ctas=None, a_in_smem=None,
                    interpret=False):
    """The contract (:mod:`pallas_kernels.moe_experts`) on the fused decode kernel (module
    docstring). ``first_expert``: int or int32 scalar (traced). Tunables (static; None: the
    default): ``tile_c`` copies per slot (multiple of 8, <= 128; default T rounded up to 8),
    ``tile_i`` in (64, 128), ``tile_k`` in (64, 128), ``tile_h`` in (64, 128), ``stages`` /
    ``down_stages`` ring depths in 2..6, ``num_ctas``, ``a_in_smem`` (interpret: True).
    ``interpret``: False (compiled), True, None (interpret unless the trace targets a GPU) or
    a ``plgpu.InterpretGPUParams``. Returns f32 [T, H]."""
    name = "moe_decode_mgpu"
    s = _check(name, x, weights, experts, token_mask, gate_up, down, first_expert)
    interpret = mosaic_interpret_params(interpret)
    a_smem = _a_in_smem(a_in_smem, interpret, name)
    cfg = make_decode_config(s, tile_c=tile_c, tile_i=tile_i, tile_k=tile_k, tile_h=tile_h,
                             stages=stages, down_stages=down_stages, num_ctas=num_ctas,
                             a_in_smem=a_smem, interpreting=interpret is not None)
    if s.t == 0:
        return jnp.zeros((0, s.h), jnp.float32)
    groups, meta, xs = _route(x, experts, token_mask, s, cfg.tile_c, first_expert)
    n = s.copies
    part = jax.ShapeDtypeStruct((cfg.i_tiles, n, s.h), jnp.uint16)
    body = functools.partial(_decode_body, cfg=cfg, alpha=float(alpha), limit=float(limit))
    phi, plo = plgpu.kernel(
        body, out_type=(part, part), scratch_types=_decode_scratch(cfg),
        grid=(cfg.num_ctas,), grid_names=("g",), interpret=interpret,
        kernel_name="moe_decode_mgpu")(
            meta, xs, *_weight_operand(gate_up, s.gate_up_fmt),
            *_weight_operand(down, s.down_fmt))
    y_rows = jnp.sum(join_f32(phi, plo), axis=0)  # over the intermediate tiles
    return combine_copies(y_rows, groups, weights)


_PSTATIC = ("alpha", "limit", "tile_c", "tile_k", "stages", "tile_n", "down_tile_k",
            "down_stages", "num_ctas", "a_in_smem", "interpret")


@functools.partial(jax.jit, static_argnames=_PSTATIC)
def moe_prefill_mgpu(x, weights, experts, token_mask, gate_up, down, first_expert=0, *,
                     alpha: float, limit: float, tile_c=None, tile_k=None, stages=None,
                     tile_n=None, down_tile_k=None, down_stages=None, num_ctas=None,
                     a_in_smem=None, interpret=False):
    """The contract on the prefill grouped GEMMs (module docstring): gate_up + swigluoai into
    ``act [n + tile_c, I]`` bf16, then down into ``y [n, H]`` f32. Tunables as
    :func:`moe_decode_mgpu`, plus ``tile_n`` (down: hidden rows per work item, 64 or 128)
    and ``down_tile_k`` / ``down_stages`` (down's K step and ring). Returns f32 [T, H]."""
    name = "moe_prefill_mgpu"
    s = _check(name, x, weights, experts, token_mask, gate_up, down, first_expert)
    interpret = mosaic_interpret_params(interpret)
    a_smem = _a_in_smem(a_in_smem, interpret, name)
    cfg = make_prefill_config(s, tile_c=tile_c, tile_k=tile_k, stages=stages, tile_n=tile_n,
                              down_tile_k=down_tile_k, down_stages=down_stages,
                              num_ctas=num_ctas, a_in_smem=a_smem,
                              interpreting=interpret is not None)
    if s.t == 0:
        return jnp.zeros((0, s.h), jnp.float32)
    tc = cfg.tile_c
    groups, meta, xs = _route(x, experts, token_mask, s, tc, first_expert)
    n = s.copies

    pair = _gate_up_scratch(s, tc, cfg.tile_k, cfg.stages, 1, cfg.a_in_smem)
    scr1 = dict(union=plgpu.RefUnion(pair, plgpu.SMEM((tc, ROWS), jnp.bfloat16)),
                bars1=plgpu.Barrier(num_arrivals=3, num_barriers=cfg.stages))
    if s.gate_up_fmt == "block128":
        scr1["s_gu"] = _gate_up_blk(s)
    if _scale_arrivals(s.gate_up_fmt, "gate_up"):
        scr1["sbar"] = plgpu.Barrier(num_arrivals=_scale_arrivals(s.gate_up_fmt, "gate_up"))
    act = plgpu.kernel(
        functools.partial(_prefill_gate_up_body, cfg=cfg, alpha=float(alpha),
                          limit=float(limit)),
        out_type=jax.ShapeDtypeStruct((xs.shape[0], s.i), jnp.bfloat16), scratch_types=scr1,
        grid=(cfg.num_ctas,), grid_names=("g",), interpret=interpret,
        kernel_name="moe_prefill_gate_up_mgpu")(
            meta, xs, *_weight_operand(gate_up, s.gate_up_fmt))

    tn, dk, nd = cfg.tile_n, cfg.down_tile_k, cfg.down_stages
    dense = s.down_fmt == "dense"
    wdt = jnp.bfloat16 if dense else jnp.float8_e4m3fn
    w_shape = (nd, dk, tn) if dense else (nd, tn, dk)
    ring = [plgpu.SMEM((nd, tc, dk), jnp.bfloat16, transforms=_tiling(jnp.bfloat16, dk)),
            plgpu.SMEM(w_shape, wdt, transforms=_tiling(wdt, w_shape[-1]))]
    if cfg.a_in_smem and not dense:
        ring.append(plgpu.SMEM((tn, dk), jnp.bfloat16, transforms=_tiling(jnp.bfloat16, dk)))
    staging = (plgpu.SMEM((tc, tn), jnp.uint16), plgpu.SMEM((tc, tn), jnp.uint16))
    scr2 = dict(union=plgpu.RefUnion(tuple(ring), staging),
                bars=plgpu.Barrier(num_arrivals=2, num_barriers=nd))
    if s.down_fmt == "mxfp8":
        scr2["s_dn"] = plgpu.SMEM((tn, _mx_cols(s.i)), jnp.uint8)
    if s.down_fmt == "block128":
        scr2["s_dn"] = plgpu.SMEM((-(-s.h // BLOCK), _blk_cols(s.i)), jnp.float32)
    if not dense:
        scr2["sbar"] = plgpu.Barrier(num_arrivals=1)
    y = jax.ShapeDtypeStruct((n, s.h), jnp.uint16)
    yhi, ylo = plgpu.kernel(
        functools.partial(_prefill_down_body, cfg=cfg), out_type=(y, y), scratch_types=scr2,
        grid=(cfg.down_num_ctas,), grid_names=("g",), interpret=interpret,
        kernel_name="moe_prefill_down_mgpu")(
            meta, act, *_weight_operand(down, s.down_fmt))
    return combine_copies(join_f32(yhi, ylo), groups, weights)


__all__ = ["moe_decode_mgpu", "moe_prefill_mgpu", "make_decode_config", "make_prefill_config",
           "DecodeConfig", "PrefillConfig", "unsupported_reason", "decode_smem_bytes",
           "prefill_smem_bytes", "prefill_down_smem_bytes", "default_decode_tile_i",
           "join_f32", "MAX_TILE_C", "TILE_KS", "DECODE_TILE_IS", "TILE_HS",
           "PREFILL_TILE_NS", "STAGES"]

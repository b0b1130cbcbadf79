"""Weight-only fp8 matmul on the Pallas Mosaic GPU backend (Hopper): ``y [T, N] = x [T, K]
@ dequantize(w [N, K]).T``, bf16 activations, f32 accumulation, for both scale formats of
:mod:`pallas_kernels.fp8_matmul` (MXFP8 E8M0 per 32 inputs, fp8 128x128 blocks).

Hopper has no MXFP8 MMA: the weight stays fp8 in HBM (one byte per element read) and is
dequantized inside the kernel, before a bf16 x bf16 -> f32 wgmma.

Kernel: grid ``(T_pad / tile_t, N_pad / tile_n, k_splits)``, one warpgroup per CTA. CTA
``(t, n, s)`` owns the output tile ``[tile_t, tile_n]`` and the K chunk ``[s Kc, (s + 1) Kc)``,
``Kc = K_pad / k_splits``, in ``Kc / tile_k`` steps. The wgmma runs in transposed form,
``y^T [tile_n, tile_t] += W [tile_n, tile_k] x^T [tile_k, tile_t]``: the weight rows are the
wgmma's M (64 per instruction), the tokens its N (a multiple of 8), so a decode batch of a
few tokens pads to 8 rows, not 64.
- Scales: loaded once per CTA before the K loop (MXFP8: its ``tile_n`` rows of the chunk's
  E8M0 bytes, ``[tile_n, Kc / 32]`` uint8; blocks: the f32 scale row of its 128-row block).
- Ring: ``num_stages`` slots, each the fp8 weight tile ``[tile_n, tile_k]`` and the x tile
  ``[tile_t, tile_k]`` bf16, filled by TMA copies (one barrier per slot). Step ``i`` waits
  for its slot, then (after a warpgroup barrier) refills the slot of step ``i - 1``, whose
  weight tile every thread has read and whose wgmma every thread has waited for, with step
  ``i - 1 + num_stages``.
- Dequantization, in registers, 64 weight rows at a time: the fp8 rows are read from shared
  memory in 32-bit words, fp8 -> f32 (via f16, exact), times the scale of each element's
  group (MXFP8: for each 32 columns a per-row 2^(e-127), built from the exponent bits, exact;
  blocks: one f32 scalar per 128 columns), rounded to bf16. The bf16 tile is the wgmma's A
  operand straight from registers (compiled), or through one of two bf16 buffers in shared
  memory (``a_in_smem``; the interpreter's wgmma reads A from shared memory only).
- Output: with one K split, ``y^T`` is stored transposed into shared memory and written by TMA
  as ``[tile_t, tile_n]`` of ``y [T_pad, N_pad]`` in ``out_dtype`` (16-bit); otherwise (or for
  an f32 output) each split writes its f32 ``[tile_n, tile_t]`` partial to ``[k_splits, N_pad,
  T_pad]`` and the wrapper sums the splits, transposes and casts (one XLA fusion).

Padding (in the wrapper, never a read out of bounds): x rows to ``T_pad`` (a multiple of
``tile_t``, itself a multiple of 8) with zeros; when ``N % tile_n`` or ``K % (tile_k *
k_splits)`` is not 0, the weight values with zeros and its scales with neutral ones (a copy
of the weight per call: the serving shapes avoid it); block scales' columns to a multiple of
4 (16-byte rows for the copy). The result is sliced back to ``[T, N]``.

Shapes / dtypes:
  x        [..., K]  bfloat16
  w        Fp8Weight 2-D: values float8_e4m3fn [N, K]; scales uint8 [N, K/32] (MXFP8, K % 32
           == 0) or float32 [ceil(N/128), ceil(K/128)] (blocks)
  result   [..., N]  out_dtype (bfloat16 default; float16 or float32)
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
from pallas_kernels.fp8_matmul import (BLOCK, E8M0_BIAS, MX_GROUP, Fp8Weight,
                                       check_activations, expected_scales_shape)

ROWS = 64  # wgmma M: weight rows per instruction and per dequantization chunk
TILE_NS = (64, 128)  # weight rows per CTA (divide the 128-row scale block)
TILE_KS = (64, 128, 256)  # inputs per step (a multiple of the 64-element bf16 swizzle row)
STAGES = (2, 3, 4, 5, 6)  # >= 2: step i refills the slot of step i - 1 (1 would wait on itself)
K_SPLITS = (1, 2, 4, 8, 16)
TOKEN_ALIGN = 8  # wgmma N granularity: x rows pad to a multiple of 8
MAX_ACC = ROWS * 256  # tile_n * tile_t: f32 accumulator elements (128 registers per thread)
MAX_K = 32768  # inputs: the CTA's scales stay in shared memory
DTYPES = (jnp.dtype(jnp.bfloat16),)  # activations (the wgmma runs bf16 x bf16)
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
MAX_DEFAULT_STAGES = 4
FILL_CTAS = 2 * NUM_SMS_H200  # default k_splits: smallest with at least this many CTAs
MIN_STEPS_PER_SPLIT = 4  # default k_splits keeps at least this many K steps per CTA
SMEM_RESERVE = 2 * 1024  # barriers and alignment
MX_SCALE_ALIGN = 512  # MXFP8 with k_splits > 1: K and Kc multiples of 512 (16-byte scale rows)
SCALE_COLS = 8  # MXFP8 scales are read as [64, 8] blocks (the WGMMA layout's column tile)
ROW_ALIGN = 16  # bytes: TMA needs every global row stride (and bulk copy size) a multiple


def _tiling(dtype, minor: int) -> tuple:
    """Tiling + swizzle of a shared-memory tile whose rows are ``minor`` elements of dtype."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, minor * itemsize)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


class Config(NamedTuple):
    """The static launch of one call (every field a Python int/str)."""
    fmt: str
    t: int
    n: int
    k: int
    tile_t: int
    tile_n: int
    tile_k: int
    num_stages: int
    k_splits: int
    t_pad: int
    n_pad: int
    k_pad: int
    a_in_smem: bool

    @property
    def steps(self) -> int:
        """K steps of one CTA."""
        return self.k_pad // (self.k_splits * self.tile_k)

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.t_pad // self.tile_t, self.n_pad // self.tile_n, self.k_splits)

    @property
    def direct_out(self) -> bool:
        """The kernel writes ``y [T_pad, N_pad]`` itself (else f32 split partials)."""
        return self.k_splits == 1


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def token_tile(t: int, tile_n: int) -> int:
    """Default ``tile_t`` for ``t`` tokens: all of them (rounded up to 8) while the
    accumulator fits (``tile_n * tile_t <= 64 * 256``), else the same split into equal
    multiples of 8."""
    cap = MAX_ACC // tile_n
    t8 = _round_up(max(t, 1), TOKEN_ALIGN)
    tiles = -(-t8 // cap)
    return _round_up(-(-t8 // tiles), TOKEN_ALIGN)


def default_tile_n(t: int, n: int) -> int:
    """64 weight rows per CTA (the most CTAs; one token tile up to 256 tokens)."""
    del t, n
    return 64


def default_tile_k(k: int) -> int:
    """128 inputs per step, or 64 where 128 would pad K and 64 would not."""
    return 64 if k % 128 and k % 64 == 0 else 128


def smem_bytes(fmt: str, tile_t: int, tile_n: int, tile_k: int, num_stages: int,
               k_splits: int, k_pad: int, out_dtype=jnp.bfloat16, a_in_smem: bool = False
               ) -> int:
    """Shared memory of one CTA: the ring (and two bf16 A buffers with ``a_in_smem``), whose
    memory the output staging reuses, the scales and a reserve."""
    ring = num_stages * (tile_n * tile_k + tile_t * tile_k * 2)
    if a_in_smem:
        ring += 2 * tile_n * tile_k * 2
    direct = k_splits == 1 and jnp.dtype(out_dtype).itemsize == 2
    out = tile_t * tile_n * (2 if direct else 4)
    kc = k_pad // k_splits
    scales = (tile_n * _round_up(kc // MX_GROUP, ROW_ALIGN) if fmt == "mxfp8"
              else 4 * _round_up(-(-k_pad // BLOCK), 4))
    return max(ring, out) + _round_up(scales, 128) + SMEM_RESERVE


def _mx_splits_ok(fmt: str, k_pad: int, k_splits: int) -> bool:
    """MXFP8 scales of a K chunk are one 2-D TMA box: 16-byte rows and chunks."""
    if fmt != "mxfp8" or k_splits == 1:
        return True
    kc = k_pad // k_splits
    return k_pad % MX_SCALE_ALIGN == 0 and kc % MX_SCALE_ALIGN == 0 and kc // MX_GROUP <= 256


def default_k_splits(fmt: str, ctas: int, k_pad: int, tile_k: int) -> int:
    """The smallest of 1, 2, 4 giving ``ctas * splits >= 2 * 132`` CTAs (two per SM), else 4;
    fewer where a split would keep under :data:`MIN_STEPS_PER_SPLIT` steps (or MXFP8 chunks
    would lose their 16-byte alignment)."""
    best = 1
    for s in K_SPLITS[:3]:
        steps, rem = divmod(k_pad // tile_k, s)
        if rem or steps < MIN_STEPS_PER_SPLIT or not _mx_splits_ok(fmt, k_pad, s):
            break
        best = s
        if ctas * s >= FILL_CTAS:
            break
    return best


def _bound_error(name: str, value, allowed) -> ValueError:
    return ValueError(f"fp8_matmul_mgpu: {name} must be one of {tuple(allowed)} (or None), "
                      f"got {value!r}")


def make_config(t: int, n: int, k: int, fmt: str, *, out_dtype=jnp.bfloat16, tile_n=None,
                tile_k=None, tile_t=None, num_stages=None, k_splits=None,
                a_in_smem: bool = False) -> Config:
    """The launch for ``t`` tokens of an ``[n, k]`` weight in ``fmt``: defaults for the
    tunables left None, each given one validated (ValueError naming it and its bound).
    ``a_in_smem``: the dequantized tile goes through shared memory (interpret mode)."""
    name = "fp8_matmul_mgpu"
    if k > MAX_K:
        raise ValueError(f"{name}: K = {k} exceeds {MAX_K} (the CTA's scales stay in shared "
                         f"memory)")
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"{name}: out_dtype must be one of {[str(d) for d in OUT_DTYPES]}, "
                         f"got {jnp.dtype(out_dtype)}")
    tn = default_tile_n(t, n) if tile_n is None else tile_n
    if tn not in TILE_NS:
        raise _bound_error("tile_n", tile_n, TILE_NS)
    tk = default_tile_k(k) if tile_k is None else tile_k
    if tk not in TILE_KS:
        raise _bound_error("tile_k", tile_k, TILE_KS)
    if tile_t is None:
        tt = token_tile(t, tn)
    else:
        tt = tile_t
        if (not isinstance(tt, int) or tt < TOKEN_ALIGN or tt % TOKEN_ALIGN
                or tn * tt > MAX_ACC):
            raise ValueError(f"{name}: tile_t must be a multiple of {TOKEN_ALIGN} in "
                             f"[{TOKEN_ALIGN}, {MAX_ACC // tn}] for tile_n = {tn} (the f32 "
                             f"accumulator holds tile_n * tile_t <= {MAX_ACC}), got {tile_t!r}")
    t_pad = _round_up(max(t, 1), tt)
    n_pad = _round_up(n, tn)
    grid_tn = (t_pad // tt) * (n_pad // tn)
    if k_splits is None:
        ks = default_k_splits(fmt, grid_tn, _round_up(k, tk), tk)
    else:
        ks = k_splits
        if ks not in K_SPLITS:
            raise _bound_error("k_splits", k_splits, K_SPLITS)
    k_pad = _round_up(k, tk * ks)
    if not _mx_splits_ok(fmt, k_pad, ks):
        raise ValueError(f"{name}: k_splits = {ks} with MXFP8 needs K and K / k_splits "
                         f"multiples of {MX_SCALE_ALIGN} and K / k_splits <= "
                         f"{256 * MX_GROUP} (16-byte scale rows), got K = {k_pad}")
    budget = SMEM_BYTES
    if num_stages is None:
        steps = k_pad // (tk * ks)
        ns = STAGES[0]
        for s in range(max(min(MAX_DEFAULT_STAGES, steps), STAGES[0]), STAGES[0] - 1, -1):
            if smem_bytes(fmt, tt, tn, tk, s, ks, k_pad, out_dtype, a_in_smem) <= budget:
                ns = s
                break
    else:
        ns = num_stages
        if ns not in STAGES:
            raise _bound_error("num_stages", num_stages, STAGES)
    need = smem_bytes(fmt, tt, tn, tk, ns, ks, k_pad, out_dtype, a_in_smem)
    if need > budget:
        raise ValueError(f"{name}: num_stages = {ns} with tile_t = {tt}, tile_n = {tn}, "
                         f"tile_k = {tk}, k_splits = {ks} and K = {k_pad} needs {need} bytes "
                         f"of shared memory, more than {budget}")
    return Config(fmt, t, n, k, tt, tn, tk, ns, ks, t_pad, n_pad, k_pad, bool(a_in_smem))


def unsupported_reason(x_shape: tuple[int, ...], w: Fp8Weight,
                       x_dtype=jnp.bfloat16) -> str | None:
    """Why the kernel does not take ``x [..., K]`` of ``x_dtype`` times ``w`` (None: it
    does). Static: shapes and dtypes only. Limits: a valid 2-D :class:`Fp8Weight`, bf16 x,
    ``1 <= N`` and ``1 <= K <= MAX_K``. A weight that needs padding (``N % 64``, ``K %
    (tile_k * k_splits)``) is taken, at the cost of a per-call copy of it."""
    try:
        check_activations(jax.ShapeDtypeStruct(tuple(x_shape), x_dtype), w, "fp8_matmul")
    except ValueError as e:
        return str(e)
    if jnp.dtype(x_dtype) not in DTYPES:
        return f"x dtype must be bfloat16, got {jnp.dtype(x_dtype)}"
    n, k = w.values.shape
    if k > MAX_K:
        return f"K = {k} exceeds {MAX_K} (the CTA's scales stay in shared memory)"
    if n < 1 or k < 1:
        return f"empty weight {tuple(w.values.shape)}"
    return None


def supported(x_shape: tuple[int, ...], w: Fp8Weight, x_dtype=jnp.bfloat16) -> bool:
    """Whether :func:`fp8_matmul_mgpu` takes ``x [..., K]`` (``x_dtype``) times ``w``."""
    return unsupported_reason(x_shape, w, x_dtype) is None


def _e8m0_block(s_smem, rows, j8):
    """f32 ``2^(e - 127)`` of the E8M0 bytes ``s_smem[rows, 8 j8 : 8 j8 + 8]``, ``[64, 8]`` in
    the WGMMA layout (exact: the f32 bits are built from the exponent)."""
    e = plgpu.load(s_smem.at[rows, pl.ds(j8 * SCALE_COLS, SCALE_COLS)],
                   layout=plgpu.Layout.WGMMA, optimized=False).astype(jnp.int32)
    bits = jnp.where(e == 0, jnp.int32(1 << 22), e << 23)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _column(block, cols, c):
    """Column ``c`` (dynamic) of a ``[64, 8]`` WGMMA-layout block as a ``[64]`` row vector:
    a masked sum along the columns (one non-zero term; a reduction inside each quad)."""
    return jnp.sum(jnp.where(cols == c, block, 0.0), axis=1)


def _fp8_body(x_ref, w_ref, s_ref, out_ref, ring, s_smem, bars, sbar, *, cfg: Config,
              direct_dtype, a_in_smem: bool):
    tt, tn, tk, ns, steps = cfg.tile_t, cfg.tile_n, cfg.tile_k, cfg.num_stages, cfg.steps
    (x_ring, w_ring, *a_smem), o_smem = ring  # the output staging reuses the ring's memory
    t_idx = lax.axis_index("t")
    n_idx = lax.axis_index("n")
    s_idx = lax.axis_index("s") if cfg.k_splits > 1 else 0
    t0 = t_idx * tt
    n0 = n_idx * tn
    kc0 = s_idx * (steps * tk)  # first input of my K chunk

    # Scales, once: MXFP8 my rows of the chunk's E8M0 bytes; blocks the f32 row of my block.
    if cfg.fmt == "mxfp8":
        if cfg.k_splits == 1:
            src = s_ref.at[pl.ds(n0, tn)]  # whole rows: one contiguous copy
        else:
            src = s_ref.at[pl.ds(n0, tn), pl.ds(kc0 // MX_GROUP, steps * tk // MX_GROUP)]
    else:
        src = s_ref.at[n0 // BLOCK]
    plgpu.copy_gmem_to_smem(src, s_smem, sbar)

    def issue(i, slot):
        k0 = kc0 + i * tk
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(t0, tt), pl.ds(k0, tk)], x_ring.at[slot],
                                bars.at[slot])
        plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(n0, tn), pl.ds(k0, tk)], w_ring.at[slot],
                                bars.at[slot])

    for i in range(min(ns, steps)):
        issue(i, i)
    plgpu.barrier_wait(sbar)

    cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, SCALE_COLS), 1, layout=plgpu.Layout.WGMMA)

    def dequant(i, slot, rows):
        """bf16 ``[64, tile_k]`` (WGMMA layout) of the fp8 rows ``rows`` of step i's tile."""
        w8 = plgpu.load(w_ring.at[slot, rows], layout=plgpu.Layout.WGMMA_UPCAST_2X)
        w = plgpu.layout_cast(w8, plgpu.Layout.WGMMA).astype(jnp.float32)  # exact (via f16)
        if cfg.fmt == "mxfp8":  # groups of 32 (2, 4 or 8 per step): one [64, 8] scale block
            groups = tk // MX_GROUP
            first = i * groups  # my first scale column
            block = _e8m0_block(s_smem, rows, first // SCALE_COLS)
            parts = []
            for g in range(groups):
                scale = _column(block, cols, lax.rem(first, SCALE_COLS) + g)
                part = w[:, g * MX_GROUP:(g + 1) * MX_GROUP]
                parts.append(part * plgpu.layout_cast(
                    lax.broadcast_in_dim(scale, part.shape, [0]), plgpu.Layout.WGMMA))
        else:  # one f32 scalar per 128 columns
            width = min(tk, BLOCK)
            parts = [w[:, g * width:(g + 1) * width] * s_smem[(kc0 + i * tk + g * width) // BLOCK]
                     for g in range(tk // width)]
        a = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        return a.astype(jnp.bfloat16)

    def refill(i):
        """Step i - 1's slot is free in every thread (after a warpgroup barrier): step i - 1 +
        num_stages goes there."""
        nxt = i - 1 + ns
        pl.when((i >= 1) & (nxt < steps))(lambda: issue(nxt, lax.rem(i - 1, ns)))

    def run(acc_ref):
        def step(i, carry):
            slot = lax.rem(i, ns)
            x_t = x_ring.at[slot].transpose((1, 0))  # x^T [tile_k, tile_t]
            plgpu.barrier_wait(bars.at[slot])
            if a_in_smem:  # A through shared memory, two buffers
                buf = lax.rem(i, 2)
                for r in range(tn // ROWS):
                    rows = pl.ds(r * ROWS, ROWS)
                    a_smem[0].at[buf, rows][...] = dequant(i, slot, rows)
                plgpu.commit_smem()  # A visible to the wgmma; every thread past step i - 1
                refill(i)
                plgpu.wgmma(acc_ref, a_smem[0].at[buf], x_t)
            else:  # A from registers
                plgpu.commit_smem()  # every thread past step i - 1
                refill(i)
                for r in range(tn // ROWS):
                    rows = pl.ds(r * ROWS, ROWS)
                    plgpu.wgmma(acc_ref.at[rows], dequant(i, slot, rows), x_t)
            plgpu.wgmma_wait(0)
            return carry

        lax.fori_loop(0, steps, step, 0)
        return acc_ref[...]

    acc = pl.run_scoped(run, plgpu.ACC((tn, tt), jnp.float32))  # y^T [tile_n, tile_t]
    if direct_dtype is not None:
        o_smem.transpose((1, 0))[...] = acc.astype(direct_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[pl.ds(t0, tt), pl.ds(n0, tn)])
    else:
        o_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[s_idx, pl.ds(n0, tn), pl.ds(t0, tt)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _pad_weight(w: Fp8Weight, fmt: str, n_pad: int, k_pad: int) -> Fp8Weight:
    """``w`` padded to ``[n_pad, k_pad]``: zero values, neutral scales (1.0, E8M0 127); the
    scales' columns also to 16-byte rows (TMA's global strides): 16 E8M0 bytes, 4 f32."""
    n, k = w.values.shape
    values, scales = w.values, w.scales
    if (n_pad, k_pad) != (n, k):
        values = jnp.pad(values, ((0, n_pad - n), (0, k_pad - k)))
    want = expected_scales_shape((n_pad, k_pad), fmt)
    want = (want[0], _round_up(want[1], ROW_ALIGN // jnp.dtype(scales.dtype).itemsize))
    if tuple(scales.shape) != want:
        fill = E8M0_BIAS if fmt == "mxfp8" else 1.0
        scales = jnp.pad(scales, [(0, a - b) for a, b in zip(want, scales.shape)],
                         constant_values=jnp.asarray(fill, scales.dtype))
    return Fp8Weight(values, scales)


@functools.partial(jax.jit, static_argnames=("out_dtype", "tile_n", "tile_k", "tile_t",
                                             "num_stages", "k_splits", "a_in_smem",
                                             "interpret"))
def fp8_matmul_mgpu(x, w, *, out_dtype=jnp.bfloat16, tile_n=None, tile_k=None, tile_t=None,
                    num_stages=None, k_splits=None, a_in_smem=None, interpret=False):
    """``x @ dequantize(w).T`` on the Mosaic GPU kernel (module docstring).

    Args:
      x: ``[..., K]`` bfloat16.
      w: :class:`Fp8Weight`, values float8_e4m3fn ``[N, K]``, scales uint8 ``[N, K/32]``
        (MXFP8) or float32 ``[ceil(N/128), ceil(K/128)]`` (blocks).
      out_dtype: bfloat16 (default), float16 or float32.
      tile_n: weight rows per CTA, in :data:`TILE_NS`; None: :func:`default_tile_n`.
      tile_k: inputs per step, in :data:`TILE_KS`; None: :func:`default_tile_k`.
      tile_t: tokens per CTA, a multiple of 8 with ``tile_n * tile_t <= 16384``; None:
        :func:`token_tile`.
      num_stages: TMA ring depth, in :data:`STAGES`; None: the deepest (<= 4, <= the steps)
        that fits shared memory.
      k_splits: CTAs along K, in :data:`K_SPLITS` (their f32 partials summed by XLA); None:
        :func:`default_k_splits`.
      a_in_smem: the dequantized bf16 tile reaches the wgmma through shared memory (True) or
        from registers (False; compiled only: the interpreter's wgmma reads shared memory);
        None: registers compiled, shared memory interpreted.
      interpret: False (compiled), True, None (interpret unless the trace targets a GPU) or a
        ``plgpu.InterpretGPUParams``.
    Returns:
      ``[..., N]`` out_dtype.
    """
    fmt = check_activations(x, w, "fp8_matmul_mgpu")
    reason = unsupported_reason(x.shape, w, x.dtype)
    if reason is not None:
        raise ValueError(f"fp8_matmul_mgpu: {reason}")
    n, k = w.values.shape
    lead = x.shape[:-1]
    t = 1
    for d in lead:
        t *= d
    interpret = mosaic_interpret_params(interpret)
    if a_in_smem is None:
        a_in_smem = interpret is not None
    elif not a_in_smem and interpret is not None:
        raise ValueError("fp8_matmul_mgpu: a_in_smem=False (A from registers) needs the "
                         "compiled kernel: the interpreter's wgmma reads A from shared memory")
    cfg = make_config(t, n, k, fmt, out_dtype=out_dtype, tile_n=tile_n, tile_k=tile_k,
                      tile_t=tile_t, num_stages=num_stages, k_splits=k_splits,
                      a_in_smem=a_in_smem)
    out_dtype = jnp.dtype(out_dtype)
    if t == 0:
        return jnp.zeros((*lead, n), out_dtype)
    x2 = x.reshape(t, k)
    if (cfg.t_pad, cfg.k_pad) != (t, k):
        x2 = jnp.pad(x2, ((0, cfg.t_pad - t), (0, cfg.k_pad - k)))
    wp = _pad_weight(w, fmt, cfg.n_pad, cfg.k_pad)
    direct = cfg.direct_out and out_dtype.itemsize == 2
    tt, tn, tk, ns = cfg.tile_t, cfg.tile_n, cfg.tile_k, cfg.num_stages
    kc = cfg.k_pad // cfg.k_splits
    if fmt == "mxfp8":
        s_shape = (tn, wp.scales.shape[1] if cfg.k_splits == 1 else kc // MX_GROUP)
        s_dtype = jnp.uint8
    else:
        s_shape, s_dtype = (wp.scales.shape[1],), jnp.float32
    if direct:
        out_type = jax.ShapeDtypeStruct((cfg.t_pad, cfg.n_pad), out_dtype)
        o_smem = plgpu.SMEM((tt, tn), out_dtype, transforms=_tiling(out_dtype, tn))
    else:
        out_type = jax.ShapeDtypeStruct((cfg.k_splits, cfg.n_pad, cfg.t_pad), jnp.float32)
        o_smem = plgpu.SMEM((tn, tt), jnp.float32)
    ring = [plgpu.SMEM((ns, tt, tk), jnp.bfloat16, transforms=_tiling(jnp.bfloat16, tk)),
            plgpu.SMEM((ns, tn, tk), jnp.float8_e4m3fn,
                       transforms=_tiling(jnp.float8_e4m3fn, tk))]
    if a_in_smem:
        ring.append(plgpu.SMEM((2, tn, tk), jnp.bfloat16, transforms=_tiling(jnp.bfloat16, tk)))
    scratch = [
        plgpu.RefUnion(tuple(ring), o_smem),  # x ring, fp8 ring (, A); then the output
        plgpu.SMEM(s_shape, s_dtype),         # scales
        plgpu.Barrier(num_arrivals=2, num_barriers=ns),
        plgpu.Barrier(),
    ]
    body = functools.partial(_fp8_body, cfg=cfg, direct_dtype=out_dtype if direct else None,
                             a_in_smem=a_in_smem)
    out = plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=cfg.grid,
        grid_names=("t", "n", "s"), interpret=interpret,
        kernel_name="fp8_weight_matmul_mgpu")(x2, wp.values, wp.scales)
    if not direct:
        out = out.sum(axis=0).T
    return out[:t, :n].astype(out_dtype).reshape(*lead, n)


__all__ = ["fp8_matmul_mgpu", "supported", "unsupported_reason", "make_config", "Config",
           "default_tile_n", "default_tile_k", "default_k_splits", "token_tile", "smem_bytes",
           "TILE_NS", "TILE_KS", "STAGES", "K_SPLITS", "MAX_K", "DTYPES", "OUT_DTYPES"]

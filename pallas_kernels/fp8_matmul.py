"""Weight-only fp8 linear layers: the weight container, its checks, exact dequantization, the
jax.numpy reference matmul, and quantizers for tests and random-weight benches.

A quantized linear of the checkpoint (``docs``: /work/shared/spec/FP8_CHECKPOINTS.md) is an
:class:`Fp8Weight`: ``values`` float8_e4m3fn ``[..., N, K]`` (out x in, row-major, as on disk)
and ``scales`` in one of two formats, told apart by ``scales.dtype`` (static):

  ``"mxfp8"``     uint8   ``[..., N, K // 32]``: one E8M0 exponent per 32 consecutive inputs of
                  a row; value = fp8 * 2^(e - 127). K % 32 == 0.
  ``"block128"``  float32 ``[..., ceil(N / 128), ceil(K / 128)]``: value = fp8 * the scale of
                  its 128 x 128 block.

Activations are bf16 / f16 / f32 ``x [T, K]``; the matmul is ``x @ dequantize(w).T`` with f32
accumulation, ``[T, N]``.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

MX_GROUP = 32  # MXFP8: inputs sharing one E8M0 exponent
BLOCK = 128  # fp8 block format: the scale block is BLOCK x BLOCK
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E8M0_BIAS = 127
E8M0_MAX = 254  # 255 is NaN in E8M0: quantizers clamp to 254
FORMATS = ("mxfp8", "block128")
ACT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


class Fp8Weight(NamedTuple):
    """An fp8 e4m3 weight with its scales (a pytree: a params leaf group, shardable).

    values  float8_e4m3fn [..., N, K]
    scales  uint8 [..., N, K // 32] (MXFP8) | float32 [..., ceil(N/128), ceil(K/128)] (block)
    """
    values: jax.Array
    scales: jax.Array


def fp8_format(w: Fp8Weight) -> str:
    """``"mxfp8"`` (uint8 scales) or ``"block128"`` (float32 scales), from ``scales.dtype``;
    ValueError for any other dtype."""
    dt = jnp.dtype(w.scales.dtype)
    if dt == jnp.dtype(jnp.uint8):
        return "mxfp8"
    if dt == jnp.dtype(jnp.float32):
        return "block128"
    raise ValueError(f"fp8 weight: scales dtype must be uint8 (MXFP8 E8M0) or float32 (128x128 "
                     f"block), got {dt}")


def expected_scales_shape(values_shape: tuple[int, ...], fmt: str) -> tuple[int, ...]:
    """The scales shape of a ``values [..., N, K]`` weight in format ``fmt``."""
    *lead, n, k = values_shape
    if fmt == "mxfp8":
        return (*lead, n, k // MX_GROUP)
    return (*lead, -(-n // BLOCK), -(-k // BLOCK))


def check_fp8_weight(w: Fp8Weight, name: str = "weight") -> str:
    """Checks dtypes and shapes of ``w`` (static); returns its format. ValueError naming
    ``name``, the field and the bound otherwise."""
    if not isinstance(w, Fp8Weight):
        raise ValueError(f"{name}: expected an Fp8Weight(values, scales), got {type(w).__name__}")
    v, s = w.values, w.scales
    if jnp.dtype(v.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"{name}.values: dtype must be float8_e4m3fn, got {v.dtype}")
    if v.ndim < 2:
        raise ValueError(f"{name}.values: must be [..., N, K] (ndim >= 2), got shape {v.shape}")
    dt = jnp.dtype(s.dtype)
    if dt not in (jnp.dtype(jnp.uint8), jnp.dtype(jnp.float32)):
        raise ValueError(f"{name}.scales: dtype must be uint8 (MXFP8 E8M0 exponents) or float32 "
                         f"(128x128 block scales), got {dt}")
    fmt = fp8_format(w)
    k = v.shape[-1]
    if fmt == "mxfp8" and k % MX_GROUP:
        raise ValueError(f"{name}.values: K = {k} must be a multiple of {MX_GROUP} for MXFP8 "
                         f"(one uint8 scale per {MX_GROUP} inputs)")
    want = expected_scales_shape(tuple(v.shape), fmt)
    if tuple(s.shape) != want:
        rule = ("[..., N, K // 32]" if fmt == "mxfp8"
                else "[..., ceil(N / 128), ceil(K / 128)]")
        raise ValueError(f"{name}.scales: shape must be {rule} = {want} for {fmt} values of "
                         f"shape {tuple(v.shape)}, got {tuple(s.shape)}")
    return fmt


def e8m0_to_f32(e: jax.Array) -> jax.Array:
    """uint8 E8M0 exponents -> f32 ``2^(e - 127)``, exactly, by building the f32 bits (e = 0
    is the subnormal 2^-127; e = 255 gives inf, the checkpoint never holds it)."""
    e = e.astype(jnp.int32)
    bits = jnp.where(e == 0, jnp.int32(1 << 22), e << 23)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _block_scales_full(scales: jax.Array, n: int, k: int) -> jax.Array:
    """``[..., ceil(N/128), ceil(K/128)]`` -> ``[..., N, K]`` (each block's scale repeated)."""
    s = jnp.repeat(jnp.repeat(scales, BLOCK, axis=-2), BLOCK, axis=-1)
    return s[..., :n, :k]


def dequantize(w: Fp8Weight, dtype=jnp.float32) -> jax.Array:
    """``[..., N, K]`` in ``dtype``: fp8 times its scale, computed in f32, then cast."""
    fmt = check_fp8_weight(w, "dequantize")
    v = w.values.astype(jnp.float32)
    *_, n, k = v.shape
    if fmt == "mxfp8":
        s = jnp.repeat(e8m0_to_f32(w.scales), MX_GROUP, axis=-1)
    else:
        s = _block_scales_full(w.scales, n, k)
    return (v * s).astype(dtype)


def check_activations(x: jax.Array, w: Fp8Weight, name: str) -> str:
    """Checks ``x [..., K]`` against a 2-D ``w [N, K]``; returns the weight's format."""
    fmt = check_fp8_weight(w, f"{name}: w")
    if w.values.ndim != 2:
        raise ValueError(f"{name}: w.values must be 2-D [N, K], got shape {w.values.shape}")
    if jnp.dtype(x.dtype) not in ACT_DTYPES:
        raise ValueError(f"{name}: x dtype must be bf16, f16 or f32, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != w.values.shape[-1]:
        raise ValueError(f"{name}: x must be [..., K] with K = {w.values.shape[-1]} "
                         f"(w.values [N, K]), got shape {x.shape}")
    return fmt


def fp8_matmul_reference(x: jax.Array, w: Fp8Weight, *, out_dtype=None) -> jax.Array:
    """``x @ dequantize(w).T`` in f32 (highest precision), cast to ``out_dtype`` (default
    ``x.dtype``). x ``[T, K]`` (or ``[..., K]``) bf16 | f16 | f32, w 2-D ``[N, K]`` ->
    ``[T, N]``."""
    check_activations(x, w, "fp8_matmul_reference")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    wf = dequantize(w, jnp.float32)
    y = lax.dot_general(x.astype(jnp.float32), wf, (((x.ndim - 1,), (1,)), ((), ())),
                        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def _to_e4m3(y: jax.Array) -> jax.Array:
    """f32 -> float8_e4m3fn, round to nearest, saturating at +-448 (never NaN)."""
    return jnp.clip(y, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def quantize_mxfp8(w: jax.Array) -> Fp8Weight:
    """f32 ``[..., N, K]`` (K % 32 == 0) -> MXFP8 :class:`Fp8Weight`. Each group of 32 gets the
    smallest exponent whose scale keeps its amax within 448 (``e = ceil(log2(amax / 448)) +
    127``, clamped to [0, 254]; an all-zero group gets e = 127)."""
    w = jnp.asarray(w, jnp.float32)
    *lead, n, k = w.shape
    if k % MX_GROUP:
        raise ValueError(f"quantize_mxfp8: K = {k} must be a multiple of {MX_GROUP}")
    g = w.reshape(*lead, n, k // MX_GROUP, MX_GROUP)
    amax = jnp.max(jnp.abs(g), axis=-1)
    # frexp is exact: amax / 448 = m * 2^p, m in [0.5, 1); ceil(log2) = p - (m == 0.5).
    m, p = jnp.frexp(amax / E4M3_MAX)
    exp = jnp.where(m == 0.5, p - 1, p)
    e = jnp.where(amax > 0, exp + E8M0_BIAS, E8M0_BIAS)
    e = jnp.clip(e, 0, E8M0_MAX).astype(jnp.uint8)
    q = _to_e4m3(g / e8m0_to_f32(e)[..., None]).reshape(*lead, n, k)
    return Fp8Weight(q, e)


def quantize_block128(w: jax.Array) -> Fp8Weight:
    """f32 ``[..., N, K]`` -> 128x128-block :class:`Fp8Weight`: scale = amax / 448 of each block
    (1 for an all-zero block), values = w / scale in e4m3."""
    w = jnp.asarray(w, jnp.float32)
    *lead, n, k = w.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    pad = [(0, 0)] * len(lead) + [(0, nb * BLOCK - n), (0, kb * BLOCK - k)]
    blocks = jnp.pad(w, pad).reshape(*lead, nb, BLOCK, kb, BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    scales = jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(jnp.float32)
    q = _to_e4m3(w / _block_scales_full(scales, n, k))
    return Fp8Weight(q, scales)


__all__ = ["Fp8Weight", "fp8_format", "check_fp8_weight", "expected_scales_shape", "dequantize",
           "fp8_matmul_reference", "quantize_mxfp8", "quantize_block128", "e8m0_to_f32",
           "check_activations", "FORMATS", "MX_GROUP", "BLOCK", "E4M3_MAX", "E8M0_MAX"]

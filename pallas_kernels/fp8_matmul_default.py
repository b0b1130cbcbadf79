"""The default weight-only fp8 matmul: which implementation runs a call of ``x @
dequantize(w).T``.

- ``"mosaic"``: the Mosaic GPU kernel (:mod:`pallas_kernels.fp8_matmul_mgpu`; the weight read
  as fp8, dequantized in the kernel), for a trace that targets a GPU, a 2-D weight, bf16
  activations and at most :data:`MAX_KERNEL_TOKENS` tokens (the decode batches it is built
  for), or whenever ``interpret`` asks for it (then interpreted; the CPU tests).
- ``"xla"``: :func:`fp8_matmul_xla`, the weight dequantized by XLA and one dot, everywhere
  else (a CPU backend, f16/f32 activations, more tokens).

Shapes / dtypes: x ``[..., K]`` bf16 | f16 | f32; w :class:`Fp8Weight` 2-D (values e4m3
``[N, K]``, scales uint8 ``[N, K/32]`` or f32 ``[ceil(N/128), ceil(K/128)]``); result
``[..., N]`` in ``out_dtype`` (default x.dtype), f32 accumulation on both paths.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._interpret import resolve_interpret
from pallas_kernels.fp8_matmul import Fp8Weight, check_activations, dequantize
from pallas_kernels.fp8_matmul_mgpu import fp8_matmul_mgpu, supported

MAX_KERNEL_TOKENS = 256  # tokens (product of x's leading dims) up to which the kernel runs
BACKENDS = ("mosaic", "xla")


def fp8_matmul_xla(x: jax.Array, w: Fp8Weight, *, out_dtype=None) -> jax.Array:
    """``x [..., K] @ dequantize(w).T -> [..., N]`` as jax.numpy: the weight dequantized to
    bf16 for bf16 x (exact for MXFP8), to f32 otherwise (then a full-precision f32 dot, not
    TF32), one dot with f32 accumulation, cast to ``out_dtype`` (default x.dtype)."""
    check_activations(x, w, "fp8_matmul_xla")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    bf16 = jnp.dtype(x.dtype) == jnp.dtype(jnp.bfloat16)
    wdt = jnp.bfloat16 if bf16 else jnp.float32
    y = lax.dot_general(x.astype(wdt), dequantize(w, wdt), (((x.ndim - 1,), (1,)), ((), ())),
                        precision=None if bf16 else lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def fp8_matmul_backend(x_shape: tuple[int, ...], x_dtype, w: Fp8Weight, *,
                       interpreting: bool, on_gpu: bool) -> str:
    """``"mosaic"`` or ``"xla"`` for ``x [..., K]`` of ``x_dtype`` times ``w`` (module
    docstring). ``interpreting``: the kernel was asked for in interpret mode; ``on_gpu``: the
    trace targets a GPU."""
    if not supported(x_shape, w, x_dtype):
        return "xla"
    if interpreting:
        return "mosaic"
    tokens = 1
    for d in x_shape[:-1]:
        tokens *= d
    return "mosaic" if on_gpu and tokens <= MAX_KERNEL_TOKENS else "xla"


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "backend"))
def fp8_matmul_default(x, w, *, out_dtype=None, interpret=False, backend=None):
    """``x @ dequantize(w).T`` on the implementation :func:`fp8_matmul_backend` picks.

    x ``[..., K]`` bf16 | f16 | f32; w a 2-D :class:`Fp8Weight` ``[N, K]``; returns ``[..., N]``
    in ``out_dtype`` (default x.dtype). ``interpret``: False (compiled kernel on a GPU, XLA
    elsewhere), True or a ``plgpu.InterpretGPUParams`` (the kernel in interpret mode where it
    applies). ``backend``: None (the rule), ``"mosaic"`` or ``"xla"`` (static).
    """
    check_activations(x, w, "fp8_matmul_default")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    interpreting = interpret is not False and interpret is not None
    if backend is None:
        backend = fp8_matmul_backend(x.shape, x.dtype, w, interpreting=interpreting,
                                     on_gpu=not resolve_interpret(None))
    if backend not in BACKENDS:
        raise ValueError(f"fp8_matmul_default: backend must be one of {BACKENDS} or None, got "
                         f"{backend!r}")
    if backend == "xla":
        return fp8_matmul_xla(x, w, out_dtype=out_dtype)
    return fp8_matmul_mgpu(x, w, out_dtype=out_dtype, interpret=interpret)


__all__ = ["fp8_matmul_default", "fp8_matmul_xla", "fp8_matmul_backend", "MAX_KERNEL_TOKENS",
           "BACKENDS"]

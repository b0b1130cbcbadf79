"""The default MoE routed experts: which implementation runs a call of the contract of
:mod:`pallas_kernels.moe_experts` (f32 ``[T, H]``, this rank's experts' partial sum).

- ``"decode"``: :func:`~pallas_kernels.moe_experts_mgpu.moe_decode_mgpu` (gate_up, swigluoai
  and down fused, spread over the intermediate dimension) for at most
  :data:`DECODE_MAX_COPIES` copies ``T*k``;
- ``"prefill"``: :func:`~pallas_kernels.moe_experts_mgpu.moe_prefill_mgpu` (two grouped
  GEMMs) above;
  both for a trace that targets a GPU (compiled), or whenever ``interpret`` asks for the
  kernels (then interpreted: the CPU tests), with bf16 x and sizes the kernels take
  (:func:`~pallas_kernels.moe_experts_mgpu.unsupported_reason`);
- ``"xla"``: :func:`~pallas_kernels.moe_experts.moe_experts_xla` (two XLA ragged_dots)
  everywhere else (a CPU backend, f16/f32 activations, other sizes);
- ``"reference"`` (:func:`~pallas_kernels.moe_experts.moe_experts_reference`) only when asked.

The choice is static (shapes, dtypes, the trace's platform).
"""
from __future__ import annotations

import functools

import jax

from pallas_kernels._interpret import resolve_interpret
from pallas_kernels.moe_experts import (MoeShapes, check_moe_inputs, moe_experts_reference,
                                        moe_experts_xla)
from pallas_kernels.moe_experts_mgpu import moe_decode_mgpu, moe_prefill_mgpu, unsupported_reason

DECODE_MAX_COPIES = 64  # copies (T * k) up to which the fused decode kernel runs
BACKENDS = ("decode", "prefill", "xla", "reference")


def moe_experts_backend(s: MoeShapes, x_dtype, *, interpreting: bool, on_gpu: bool) -> str:
    """``"decode"``, ``"prefill"`` or ``"xla"`` for a call of sizes ``s`` (module
    docstring). ``interpreting``: the kernels were asked for in interpret mode; ``on_gpu``:
    the trace targets a GPU."""
    if unsupported_reason(s, x_dtype) is not None or not (interpreting or on_gpu):
        return "xla"
    return "decode" if s.copies <= DECODE_MAX_COPIES else "prefill"


@functools.partial(jax.jit, static_argnames=("alpha", "limit", "interpret", "backend"))
def moe_experts_default(x, weights, experts, token_mask, gate_up, down, *, alpha: float,
                        limit: float, first_expert=0, interpret=None, backend=None):
    """The contract on the implementation :func:`moe_experts_backend` picks.

    x [T, H]; weights [T, k] f32; experts [T, k] int32 (global ids); token_mask [T] bool;
    gate_up [E, H, 2I] / down [E, I, H] arrays in x.dtype or :class:`Fp8Weight`\\ s (values
    [E, 2I, H] / [E, H, I]); alpha, limit static floats; first_expert an int or a traced int32
    scalar (the global id of local expert 0). Returns f32 [T, H].

    ``interpret``: None (the kernels compiled when the trace targets a GPU, ``moe_experts_xla``
    otherwise), False (the same), True or a ``plgpu.InterpretGPUParams`` (the kernels
    interpreted where they apply). ``backend``: None (the rule) or one of :data:`BACKENDS`
    (static; a kernel forced on unsupported sizes raises).
    """
    s = check_moe_inputs(x, weights, experts, token_mask, gate_up, down, first_expert,
                         "moe_experts_default")
    interpreting = interpret is not None and interpret is not False
    if backend is None:
        backend = moe_experts_backend(s, x.dtype, interpreting=interpreting,
                                      on_gpu=not resolve_interpret(None))
    if backend not in BACKENDS:
        raise ValueError(f"moe_experts_default: backend must be one of {BACKENDS} or None, "
                         f"got {backend!r}")
    kw = dict(alpha=alpha, limit=limit)
    if backend in ("xla", "reference"):
        fn = moe_experts_xla if backend == "xla" else moe_experts_reference
        return fn(x, weights, experts, token_mask, gate_up, down, first_expert=first_expert,
                  **kw)
    kernel = moe_decode_mgpu if backend == "decode" else moe_prefill_mgpu
    return kernel(x, weights, experts, token_mask, gate_up, down, first_expert,
                  interpret=interpret if interpreting else False, **kw)


__all__ = ["moe_experts_default", "moe_experts_backend", "DECODE_MAX_COPIES", "BACKENDS"]

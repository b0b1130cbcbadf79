"""Mosaic GPU TMA loads that mark their lines in the L2 as the first to be replaced.

jax 0.11.2's Mosaic GPU issues every global -> shared TMA load without an L2 cache hint and
offers no option for one. :func:`evict_first` is used inside a kernel body around the copies
of data that is read once (``with evict_first(): plgpu.copy_gmem_to_smem(...)``): those loads
are emitted with ``.L2::cache_hint`` and a ``createpolicy.fractional.L2::evict_first`` policy,
so the lines they bring in replace each other before they replace lines others still need
(or dirty lines, whose write-back would compete with the loads for DRAM).

How, in two steps of the kernel's lowering:
1. Pallas lowers the body in program order to Mosaic GPU dialect ops. The context traces a
   marker (``plgpu.inline_mgpu`` with no operands, emitting no code) before and after the
   copies; the second marks the ``mosaic_gpu.async_load`` ops between the two with the unit
   attribute :data:`ATTR`.
2. Mosaic GPU lowers each dialect op through a rule. On first use, the rule of
   ``mosaic_gpu.async_load`` is wrapped to flag (per thread) that it lowers a marked op, and
   the ``nvvm`` module that the launch context emits TMA loads through is wrapped to add the
   hint operand while that flag is on. Unmarked ops lower as before.
Interpreted kernels skip the markers (``inline_mgpu="ignore"``). The hint never changes a
loaded value.
"""
from __future__ import annotations

import contextlib
import threading
import warnings

from jax.experimental.mosaic.gpu import dialect_lowering, launch_context
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm

ATTR = "jax_msa_runner.l2_evict_first"
EVICT_FIRST_POLICY = "createpolicy.fractional.L2::evict_first.b64 $0, 1.0;"
_ASYNC_LOAD = "mosaic_gpu.async_load"  # the dialect op of a Pallas TMA copy
_lowering = threading.local()  # per thread: .open, the opening markers of the contexts being
# lowered (a list of ops); .marked, whether a marked async load is being lowered (a bool)


class NvvmWithL2Hint:
    """``nvvm`` whose global -> shared TMA load takes an L2 cache hint: the 64-bit policy that
    the PTX ``policy`` (a ``createpolicy`` instruction writing ``$0``) creates in place."""

    def __init__(self, nvvm, policy: str = EVICT_FIRST_POLICY):
        self._nvvm, self._policy = nvvm, policy

    def __getattr__(self, name):
        return getattr(self._nvvm, name)

    def cp_async_bulk_tensor_shared_cluster_global(self, *args, **kwargs):
        if kwargs.get("l2_cache_hint") is None:
            kwargs["l2_cache_hint"] = llvm.inline_asm(
                ir.IntegerType.get_signless(64), [], self._policy, "=l",
                has_side_effects=False)
        return self._nvvm.cp_async_bulk_tensor_shared_cluster_global(*args, **kwargs)


class _NvvmHintingMarkedLoads(NvvmWithL2Hint):
    """``nvvm`` that adds the evict-first hint only while this thread lowers a marked op."""

    def cp_async_bulk_tensor_shared_cluster_global(self, *args, **kwargs):
        if getattr(_lowering, "marked", False):
            return super().cp_async_bulk_tensor_shared_cluster_global(*args, **kwargs)
        return self._nvvm.cp_async_bulk_tensor_shared_cluster_global(*args, **kwargs)


def _hinting_rule(rule):
    """``rule`` (the async-load lowering), run with the hint for ops marked with ATTR."""
    def lower(ctx, op):
        if ATTR not in op.attributes:
            return rule(ctx, op)
        _lowering.marked = True
        try:
            return rule(ctx, op)
        finally:
            _lowering.marked = False

    lower.hints_l2 = True
    return lower


def _install() -> bool:
    """Wraps the two jax 0.11.2 internals once; False (with a warning, loads unhinted) where
    this jax does not have them."""
    rules = getattr(dialect_lowering, "_lowerings", None)
    nvvm = getattr(launch_context, "nvvm", None)
    if not isinstance(rules, dict) or _ASYNC_LOAD not in rules or not hasattr(
            nvvm, "cp_async_bulk_tensor_shared_cluster_global"):
        warnings.warn("pallas_kernels: this jax's Mosaic GPU lowering has no place for an L2 "
                      "cache hint; TMA loads are issued without one", stacklevel=3)
        return False
    if not isinstance(nvvm, _NvvmHintingMarkedLoads):
        launch_context.nvvm = _NvvmHintingMarkedLoads(nvvm)
    if not getattr(rules[_ASYNC_LOAD], "hints_l2", False):
        rules[_ASYNC_LOAD] = _hinting_rule(rules[_ASYNC_LOAD])
    return True


def _marker_op() -> ir.Operation:
    """The marker being lowered: the custom-primitive op whose body is being populated."""
    return ir.InsertionPoint.current.block.owner.operation


@plgpu.inline_mgpu()
def _open_marker(_ctx):
    _lowering.__dict__.setdefault("open", []).append(_marker_op())


@plgpu.inline_mgpu()
def _close_marker(_ctx):
    first, last = _lowering.open.pop(), _marker_op()
    if first.block != last.block:
        raise RuntimeError("evict_first: a context must open and close in one block")
    inside = False
    for op in last.block.operations:
        op = op.operation
        if op == first:
            inside = True
        elif op == last:
            break
        elif inside and op.name == _ASYNC_LOAD:
            op.attributes[ATTR] = ir.UnitAttr.get()


@contextlib.contextmanager
def evict_first(enabled: bool = True):
    """Inside a Mosaic GPU kernel body: the TMA loads traced in this context (in its block,
    not inside a nested ``pl.when`` or loop) are issued with an evict-first L2 policy.
    ``enabled=False``: a no-op, for static switches."""
    if not enabled or not _install():
        yield
        return
    _open_marker()
    yield
    _close_marker()


__all__ = ["evict_first", "NvvmWithL2Hint", "ATTR", "EVICT_FIRST_POLICY"]

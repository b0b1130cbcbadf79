"""Pallas interpret mode of the kernels' ``interpret`` argument: ``None`` means automatic."""
from __future__ import annotations

import dataclasses

import jax

GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def resolve_interpret(interpret: bool | None) -> bool:
    """``interpret`` itself when given. For ``None``: compiled (False) when the trace targets a
    GPU, interpreted (True) otherwise; the kernels compile for GPUs only. The target is the
    device of the current abstract mesh when one is set (an abstract H200 mesh lowers for CUDA
    from a CPU host; a mesh of host devices interprets), else ``jax.default_backend()``."""
    if interpret is not None:
        return bool(interpret)
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    platform = jax.default_backend() if device is None else device.platform
    return platform not in GPU_PLATFORMS


def mosaic_interpret_params(interpret, **fields):
    """A Mosaic GPU kernel's ``interpret`` as ``plgpu.kernel`` takes it: ``None`` (compiled) or
    a ``plgpu.InterpretGPUParams``. ``interpret``: ``None`` (:func:`resolve_interpret`),
    ``True``/``False``, or an ``InterpretGPUParams``; ``fields`` override the params' fields."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if interpret is None:
        interpret = resolve_interpret(None)
    if interpret is False:
        return None
    if interpret is True:
        return plgpu.InterpretGPUParams(**fields)
    return dataclasses.replace(interpret, **fields)

"""Pallas interpret mode of the kernels' ``interpret`` argument: ``None`` means automatic."""
from __future__ import annotations

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

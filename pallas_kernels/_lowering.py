"""CUDA (Triton) lowering of Pallas kernels on a machine without a GPU.

`lower_for_cuda` traces a function and lowers it for the "cuda" platform under an abstract
mesh whose device is an H200. This runs the Pallas -> Triton-IR lowering on the CPU, so the
GPU-only errors (non power-of-two block shapes, dots with M/N/K < 16, unsupported
primitives, scalar prefetch, ...) surface in CPU tests. It does not run Triton's own
compiler (register/shared-memory limits are only seen on a real GPU).

Arguments may be concrete arrays or `jax.ShapeDtypeStruct`s; nothing is allocated.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
MOSAIC_CUSTOM_CALL = "@mosaic_gpu"
H200 = ("NVIDIA H200", 132)


def lower_for_cuda(fn: Callable[..., Any], *args: Any, device_kind: str = H200[0],
                   num_cores: int = H200[1], **kwargs: Any) -> str:
    """Lowers `fn(*args, **kwargs)` for CUDA on an abstract `device_kind` device.

    The mesh's one axis is Auto (an Explicit axis needs sharding rules that some primitives,
    e.g. ``ragged_dot``, lack). `kwargs` are bound as static (closed-over) arguments. Returns
    the StableHLO text;
    raises whatever the Pallas Triton lowering raises.
    """
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,),
                        abstract_device=AbstractDevice(device_kind, num_cores, "cuda"))
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(lambda *a: fn(*a, **kwargs)).trace(*args).lower(
            lowering_platforms=("cuda",))
    return lowered.as_text()


def triton_calls(hlo_text: str) -> list[dict[str, int | str]]:
    """The Triton custom calls of lowered text: kernel name, grid, num_warps, num_stages."""
    calls = []
    for line in hlo_text.splitlines():
        if TRITON_CUSTOM_CALL not in line:
            continue
        info: dict[str, int | str] = {}
        for key in ("grid_x", "grid_y", "grid_z", "num_warps", "num_stages"):
            m = re.search(rf"\b{key} = (\d+) : i32", line)
            if m:
                info[key] = int(m.group(1))
        m = re.search(r'\bname = "([^"]*)"', line)
        if m:
            info["name"] = m.group(1)
        calls.append(info)
    return calls


def custom_call_counts(hlo_text: str) -> dict[str, int]:
    """How many custom calls of lowered text are Mosaic GPU kernels, Triton kernels, or
    anything else: ``{"mosaic": m, "triton": t, "other": o}``."""
    counts = {"mosaic": 0, "triton": 0, "other": 0}
    for line in hlo_text.splitlines():
        if "stablehlo.custom_call" not in line:
            continue
        kind = ("mosaic" if MOSAIC_CUSTOM_CALL in line
                else "triton" if TRITON_CUSTOM_CALL in line else "other")
        counts[kind] += 1
    return counts


_FUNC = re.compile(r"^\s*func\.func\s+(?:public|private)?\s*@([\w$.\-]+)\(")
_CALL = re.compile(r"\b(?:func\.)?call @([\w$.\-]+)\(")


def _kind(line: str) -> str | None:
    if "stablehlo.custom_call" in line:
        return ("mosaic" if MOSAIC_CUSTOM_CALL in line
                else "triton" if TRITON_CUSTOM_CALL in line else "other")
    if "ragged_dot" in line and re.search(r'"?\b(?:chlo|stablehlo)\.ragged_dot\b', line):
        return "ragged_dot"
    return None


def call_site_counts(hlo_text: str, entry: str = "main") -> dict[str, int]:
    """Like :func:`custom_call_counts`, but per execution of ``entry``: a kernel inside a
    private function counts once per call of that function (jitted helpers such as the
    attention entry points are lowered once and called from every layer). Also counts
    ``ragged_dot`` ops. Both branches of a conditional and a loop body count once.
    Returns ``{"mosaic", "triton", "other", "ragged_dot"}``."""
    funcs: dict[str, tuple[dict[str, int], list[str]]] = {}
    name = None
    for line in hlo_text.splitlines():
        m = _FUNC.match(line)
        if m:
            name = m.group(1)
            funcs[name] = ({}, [])
            continue
        if name is None:
            continue
        own, calls = funcs[name]
        kind = _kind(line)
        if kind:
            own[kind] = own.get(kind, 0) + 1
        calls += _CALL.findall(line)
    if entry not in funcs:
        raise ValueError(f"hlo_text: no function @{entry}")
    memo: dict[str, dict[str, int]] = {}

    def total(fn: str, stack: tuple = ()) -> dict[str, int]:
        if fn in memo:
            return memo[fn]
        if fn in stack or fn not in funcs:
            return {}
        own, calls = funcs[fn]
        out = dict(own)
        for callee in calls:
            for k, v in total(callee, stack + (fn,)).items():
                out[k] = out.get(k, 0) + v
        memo[fn] = out
        return out

    counts = total(entry)
    return {k: counts.get(k, 0) for k in ("mosaic", "triton", "other", "ragged_dot")}

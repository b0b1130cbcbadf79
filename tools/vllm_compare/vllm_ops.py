"""Build the importable vLLM MiniMax-M3 op folder (``.vllm_ops``) from a vLLM wheel.

vLLM 0.33.0's MiniMax-M3 Triton ops live in two files of the wheel,
``vllm/models/minimax_m3/common/ops/{index_topk,sparse_attn}.py``. They import only
``vllm.platforms.current_platform`` (``is_cuda``, ``is_device_capability``,
``is_arch_support_pdl``), ``vllm.triton_utils`` (``tl``, ``triton``) and
``vllm.utils.math_utils.round_up``. The dense attention benchmark (bench/dense_attention.py)
also takes vLLM's pure-Triton paged attention, ``unified_attention`` of
``vllm/v1/attention/ops/triton_unified_attention.py``, with the Triton helpers it imports
(``vllm/v1/attention/ops/triton_attention_helpers.py``, which imports only
``vllm.triton_utils``); beyond the helpers above it asks for ``vllm.envs``
(``VLLM_BATCH_INVARIANT``), ``vllm.logger.init_logger``, ``current_platform.fp8_dtype`` and
``is_device_capability_family``, and ``vllm.v1.kv_cache_interface.KVQuantMode``. The MoE
benchmark (bench/moe.py) takes vLLM's pure-Triton fused MoE: ``fused_moe.py``,
``activation.py`` and ``moe_align_block_size.py`` of ``vllm/model_executor/layers/fused_moe``
(and the wheel's tuned kernel configs of the benchmark's expert shape, ``configs/E=16,N=3072,*``,
if any), which import the fused-MoE ``config`` / ``modular_kernel`` / ``utils`` modules,
``vllm._custom_ops`` (CUDA ops: ``moe_align_block_size``, ``moe_sum``), ``torch.ops._C``'s
``silu_and_mul_with_clamp`` (the MiniMax-M3 activation), and a few small utilities
(``next_power_of_2``, ``cdiv``, ``get_device_name_as_file_name``, ``direct_register_custom_op``,
``set_triton_allocator``, two env variables). This builder copies those files out of the wheel
(checked against the wheel's RECORD hashes) and writes stand-in modules of our own for the
helpers, so the ops import with only torch and triton installed (no vLLM install, no 336 MB
wheel at run time); the stand-ins of vLLM's CUDA ops are written to their semantics (torch for
``moe_align_block_size``, small Triton kernels for the activation, ``moe_sum`` and the fp8
per-token-group activation quantization), not vLLM's CUDA code. The output folder is built at
run time and ignored by git; nothing of vLLM is committed.

Standard library only, so it runs under any Python:
    python tools/vllm_compare/vllm_ops.py --wheel PATH_OR_DIR --out .vllm_ops
"""
from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import json
import pathlib
import sys
import zipfile

VLLM_VERSION = "0.33.0"
OPS_PACKAGE = "vllm/models/minimax_m3/common/ops"
OP_FILES = ("index_topk.py", "sparse_attn.py")
# vLLM's pure-Triton paged attention (the dense layers' kernel of its TRITON_ATTN backend).
DENSE_OPS_PACKAGE = "vllm/v1/attention/ops"
DENSE_OP_FILES = ("triton_unified_attention.py", "triton_attention_helpers.py")
# vLLM's pure-Triton fused MoE (bench/moe.py): the kernel file and the two it imports whole.
MOE_PACKAGE = "vllm/model_executor/layers/fused_moe"
MOE_OP_FILES = ("fused_moe.py", "activation.py", "moe_align_block_size.py")
# Tuned fused-MoE configs of the benchmark's per-rank expert shape (E local experts, N = the
# intermediate size), looked up by fused_moe.get_moe_configs next to fused_moe.py.
MOE_CONFIG_PREFIX = f"{MOE_PACKAGE}/configs/E=16,N=3072,"
MANIFEST = "MANIFEST.json"


def op_members() -> list[str]:
    """The wheel's op files copied into the op folder (config JSONs aside)."""
    return ([f"{OPS_PACKAGE}/{n}" for n in OP_FILES]
            + [f"{DENSE_OPS_PACKAGE}/{n}" for n in DENSE_OP_FILES]
            + [f"{MOE_PACKAGE}/{n}" for n in MOE_OP_FILES])


def put_on_path(ops_dir, member: str) -> None:
    """Check that the op folder ``ops_dir`` (built by this script) holds ``member`` (a path of
    ``op_members()``) and put the folder first on ``sys.path``, so ``import vllm...`` finds its
    copies."""
    path = str(pathlib.Path(ops_dir).resolve())
    manifest = pathlib.Path(path, MANIFEST)
    if not manifest.is_file() or member not in json.loads(manifest.read_text())["op_files"]:
        raise FileNotFoundError(f"{ops_dir}: no {member}; rebuild it with `make compare-env`")
    if path not in sys.path:
        sys.path.insert(0, path)


def config_members(names) -> list[str]:
    """The wheel's tuned fused-MoE configs of the benchmark's shape among ``names``."""
    return sorted(n for n in names if n.startswith(MOE_CONFIG_PREFIX) and n.endswith(".json"))


# Stand-ins for the vLLM helpers the op files import (our own code).
_PLATFORMS = '''"""Stand-in for vllm.platforms: just what the MiniMax-M3 ops and the unified
attention ask of current_platform."""
import torch


class _CurrentPlatform:
    """CUDA when torch sees a GPU; capability queries answered from torch."""

    @staticmethod
    def is_cuda() -> bool:
        return torch.cuda.is_available() and torch.version.cuda is not None

    @staticmethod
    def is_rocm() -> bool:
        return torch.cuda.is_available() and torch.version.hip is not None

    @classmethod
    def is_cuda_alike(cls) -> bool:
        return cls.is_cuda() or cls.is_rocm()

    @staticmethod
    def is_xpu() -> bool:
        return False

    @staticmethod
    def get_device_name(device_id: int = 0) -> str:
        return torch.cuda.get_device_name(device_id) if torch.cuda.is_available() else "cpu"

    @classmethod
    def has_device_capability(cls, capability, device_id: int = 0) -> bool:
        """At least ``capability`` (an int such as 90, or a (major, minor) pair)."""
        cap = cls.get_device_capability(device_id)
        if cap is None:
            return False
        if isinstance(capability, int):
            return cap[0] * 10 + cap[1] >= capability
        return tuple(cap) >= tuple(capability)

    @staticmethod
    def get_device_capability(device_id: int = 0):
        if not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_capability(device_id)

    @classmethod
    def is_device_capability(cls, capability, device_id: int = 0) -> bool:
        cap = cls.get_device_capability(device_id)
        if cap is None:
            return False
        if isinstance(capability, int):
            return cap[0] * 10 + cap[1] == capability
        return tuple(cap) == tuple(capability)

    @classmethod
    def is_device_capability_family(cls, capability: int, device_id: int = 0) -> bool:
        """Any <major>.x of ``capability`` (e.g. 100: 10.x), as vLLM's."""
        cap = cls.get_device_capability(device_id)
        if cap is None:
            return False
        return (cap[0] * 10 + cap[1]) // 10 == capability // 10

    @staticmethod
    def fp8_dtype():
        """The platform's fp8 type: e4m3fn on CUDA (vLLM's choice off ROCm's fnuz parts)."""
        return torch.float8_e4m3fn

    @classmethod
    def is_arch_support_pdl(cls) -> bool:
        """Programmatic dependent launch: CUDA compute capability 9.0 and newer."""
        cap = cls.get_device_capability()
        return cls.is_cuda() and cap is not None and cap[0] >= 9


current_platform = _CurrentPlatform()
'''

_TRITON_UTILS = '''"""Stand-in for vllm.triton_utils: re-exports triton and triton.language.

Under Triton's interpreter (TRITON_INTERPRET=1, CPU) two things differ from a GPU run:
- autotuning cannot benchmark (no driver), so ``triton.autotune`` keeps one of vLLM's configs:
  the one of smallest ``BLOCK_SIZE_K`` (the first where no config names it). Every config of a
  kernel computes the same result; the interpreter's cost is mostly per operation, not per
  element, and the top-k kernels' bitonic sort of a ``BLOCK_SIZE_K`` tile makes n (n + 1) / 2
  compare-and-swap steps (n = log2(BLOCK_SIZE_K)), so the smallest tile is the cheapest (64
  against 256 in the decode top-k: 21 steps, not 36; against 2048 in the prefill top-k: 21,
  not 66). Each top-k program of the comparison cases (at most 40 pages) sorts one tile with
  either config;
- Triton 3.6's interpreter stores bf16 as uint16 and gets two bf16 operations wrong:
  ``tl.dot`` multiplies the raw bit patterns as integers, and a float32 -> bf16 cast
  truncates instead of rounding. Both are fixed here to the compiled semantics: dot operands
  are widened exactly to float32 (a GPU bf16 MMA with fp32 accumulation forms the same
  exact products), and float32 -> bf16 casts round to nearest even (as fptrunc does on the
  GPU). Its float32 -> float8e4nv cast drops the carry of a rounding that overflows the
  mantissa (126.3 -> 64, not 128); it is done here by torch's float8_e4m3fn conversion
  (round to nearest even) of the value saturated to +-448, as the GPU's ``cvt.rn.satfinite``.
  vLLM's code is not touched.
- speed only: a nested ``@triton.jit`` helper call (the bitonic top-k sort makes thousands)
  re-patches triton.language on every call; inside one grid run, a helper from a module
  whose globals were already patched in that run skips the repeat (about 40% of the time).
Compiled runs use triton unchanged (vLLM's own autotuning).
"""
import os
import types

import triton as _triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreter_config(configs):
    """The config the interpreter keeps: smallest BLOCK_SIZE_K, the first among equals
    (and the first config where none names BLOCK_SIZE_K)."""
    configs = list(configs)
    sized = [c for c in configs if "BLOCK_SIZE_K" in c.kwargs]
    if not sized:
        return configs[0]
    return min(sized, key=lambda c: c.kwargs["BLOCK_SIZE_K"])


def _one_config_autotune(configs, *args, **kwargs):
    return _triton.autotune([interpreter_config(configs)], *args, **kwargs)


class _OneConfigTriton(types.ModuleType):
    """triton, except that autotune keeps one config (:func:`interpreter_config`)."""

    autotune = staticmethod(_one_config_autotune)

    def __getattr__(self, name):
        return getattr(_triton, name)


def _patch_interpreter_bf16() -> None:
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_msa_bf16_patched", False):
        return
    original_dot = builder.create_dot
    original_cast = builder.cast_impl

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        bits = np.asarray(h.data).astype(np.uint32) << np.uint32(16)
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, *args):
        return original_dot(self, widen(a), widen(b), d, *args)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
            out = np.where(np.isnan(src.data), np.uint32(0x7FC0), rounded).astype(np.uint16)
            return interpreter.TensorHandle(out, tl.bfloat16)
        return original_cast(self, src, dst_type)

    original_fp_to_fp = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            import torch
            x = np.clip(np.ascontiguousarray(src.data, dtype=np.float32), -448.0, 448.0)
            bits = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return interpreter.TensorHandle(bits, tl.float8e4nv)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp
    builder._msa_bf16_patched = True

    patched_modules: list[set[int]] = []  # per active grid run: ids of patched fn globals
    grid_call = interpreter.GridExecutor.__call__
    nested_call = interpreter.InterpretedFunction.__call__

    def run_grid(self, *args, **kwargs):
        patched_modules.append({id(self.fn.__globals__)})
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched_modules.pop()

    def call_helper(self, *args, **kwargs):
        if not patched_modules or id(self.fn.__globals__) not in patched_modules[-1]:
            if patched_modules:
                patched_modules[-1].add(id(self.fn.__globals__))
            return nested_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise interpreter.InterpreterError(repr(exc)) from exc

    interpreter.GridExecutor.__call__ = run_grid
    interpreter.InterpretedFunction.__call__ = call_helper


if INTERPRET:
    _patch_interpreter_bf16()
triton = _OneConfigTriton("triton") if INTERPRET else _triton

__all__ = ["triton", "tl", "INTERPRET"]
'''

_MATH_UTILS = '''"""Stand-in for vllm.utils.math_utils: the helpers the ops use."""


def round_up(x: int, y: int) -> int:
    """Smallest multiple of y that is >= x."""
    return -(-x // y) * y


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n < 1)."""
    return 1 if n < 1 else 1 << (n - 1).bit_length()
'''

_ENVS = '''"""Stand-in for vllm.envs: the variables the unified attention and the fused MoE read
(parsed as vLLM's)."""
import os

VLLM_BATCH_INVARIANT = bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0")))
VLLM_TUNED_CONFIG_FOLDER = os.getenv("VLLM_TUNED_CONFIG_FOLDER", None)
VLLM_TRITON_USE_TD = {"1": True, "0": False}.get(os.getenv("VLLM_TRITON_USE_TD", "").strip())
'''

_LOGGER = '''"""Stand-in for vllm.logger: init_logger, with the *_once methods of vLLM's."""
import logging


class _OnceLogger(logging.LoggerAdapter):
    def __init__(self, logger):
        super().__init__(logger, {})
        self._seen = set()

    def _once(self, level, msg, *args):
        if (level, msg, args) not in self._seen:
            self._seen.add((level, msg, args))
            self.log(level, msg, *args)

    def debug_once(self, msg, *args, **_):
        self._once(logging.DEBUG, msg, *args)

    def info_once(self, msg, *args, **_):
        self._once(logging.INFO, msg, *args)

    def warning_once(self, msg, *args, **_):
        self._once(logging.WARNING, msg, *args)


def init_logger(name: str) -> _OnceLogger:
    return _OnceLogger(logging.getLogger(name))
'''

_KV_CACHE_INTERFACE = '''"""Stand-in for vllm.v1.kv_cache_interface: the KV quantization modes
the unified attention names (values as vLLM 0.33.0's KVQuantMode; the kernel takes them as a
constexpr)."""
from enum import IntEnum


class KVQuantMode(IntEnum):
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
'''

# ---- fused MoE stand-ins (bench/moe.py): what fused_moe.py / activation.py /
# moe_align_block_size.py import beyond the helpers above. vLLM's CUDA ops are written to their
# semantics here (torch, or small Triton kernels of ours), not taken from vLLM.

_CUSTOM_OPS = '''"""Stand-in for vllm._custom_ops: the CUDA ops of vLLM's fused MoE, written to their
semantics in torch / Triton (our code, not vLLM's CUDA kernels), and, registered on import,
``torch.ops._C.silu_and_mul_with_clamp`` (the MiniMax-M3 activation that
``activation.apply_moe_activation`` calls for ``SWIGLUOAI_UNINTERLEAVE``).

- ``moe_align_block_size``: torch, free of host synchronisation (a CUDA graph holds it); about
  a dozen small kernels where vLLM's CUDA op launches one or two.
- ``moe_sum``, ``silu_and_mul_with_clamp``: one Triton kernel each, f32 arithmetic.
"""
import torch

from vllm.triton_utils import tl, triton


def moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids,
                         num_tokens_post_pad, expert_map=None, scatter_idx=None):
    """Groups the flat copies ``i = token * top_k + j`` of ``topk_ids [M, top_k]`` by expert,
    each group padded to a multiple of ``block_size``, into the caller's buffers:

      sorted_token_ids [L] int32: expert 0's copies, then expert 1's, ... (global ids
        ascending; a group's copies in copy order), each group followed by its padding; the
        padding and the unused tail hold ``topk_ids.numel()`` (no copy);
      experts_ids [L / block_size] int32: each block's expert (``expert_map``'s local id when
        given), -1 past the last group;
      num_tokens_post_pad [1] int32: the padded total, a multiple of ``block_size``.

    ``expert_map [num_experts]`` (global -> local, -1: not on this rank): copies of unmapped
    experts are dropped (vLLM's ``ignore_invalid_experts``). Experts without copies get no
    block."""
    if scatter_idx is not None:
        raise NotImplementedError("moe_align_block_size stand-in: scatter_idx is not provided")
    dev = topk_ids.device
    n = topk_ids.numel()
    flat = topk_ids.reshape(-1).to(torch.int64)
    if expert_map is not None:
        valid = expert_map.to(torch.int64)[flat.clamp(0, num_experts - 1)] >= 0
        valid &= (flat >= 0) & (flat < num_experts)
    else:
        valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))  # num_experts: dropped
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_size - 1) // block_size * block_size
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    first = torch.cumsum(counts, 0) - counts  # each key's first position among the sorted copies
    order = torch.argsort(key, stable=True)
    skey = key[order]
    rank = torch.arange(n, device=dev) - first[skey]
    length = sorted_token_ids.numel()
    pos = torch.where(skey < num_experts, starts[skey.clamp(max=num_experts - 1)] + rank,
                      torch.full_like(skey, length))  # dropped copies: a spare slot
    out = torch.full((length + 1,), n, dtype=torch.int32, device=dev)
    out.scatter_(0, pos, order.to(torch.int32))
    sorted_token_ids.copy_(out[:length])
    block_rows = torch.arange(experts_ids.numel(), device=dev, dtype=torch.int64) * block_size
    e = torch.searchsorted(ends, block_rows, right=True)  # the group holding the block's row 0
    ec = e.clamp(max=num_experts - 1)
    local = ec if expert_map is None else expert_map.to(torch.int64)[ec]
    experts_ids.copy_(torch.where(e < num_experts, local, torch.full_like(local, -1)))
    num_tokens_post_pad.copy_(ends[-1:])


@triton.jit
def _moe_sum_kernel(x_ptr, out_ptr, ids_ptr, map_ptr, K, stride_xm, stride_xj, stride_om,
                    TOPK: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < K
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        keep = inside
        if HAS_MAP:
            expert = tl.load(ids_ptr + m * TOPK + j)
            keep = inside & (tl.load(map_ptr + expert) >= 0)
        acc += tl.load(x_ptr + m * stride_xm + j * stride_xj + cols, mask=keep,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)


def moe_sum(input, output, topk_ids=None, expert_map=None):
    """``output [M, K] = sum_j input[:, j]`` of ``input [M, top_k, K]`` (f32 sums, rounded once
    to output's dtype); with ``topk_ids [M, top_k]`` and ``expert_map``, the slots whose expert
    maps to -1 are skipped (never read: the alignment dropped their rows)."""
    m, top_k, k = input.shape
    assert output.shape == (m, k) and input.stride(2) == 1 and output.stride(1) == 1
    has_map = topk_ids is not None and expert_map is not None
    ids = topk_ids.contiguous() if has_map else input
    emap = expert_map if has_map else input
    block = 1024
    _moe_sum_kernel[(m, triton.cdiv(k, block))](
        input, output, ids, emap, k, input.stride(0), input.stride(1), output.stride(0),
        TOPK=top_k, HAS_MAP=has_map, BLOCK=block)


def moe_wna16_gemm(*args, **kwargs):
    raise NotImplementedError("moe_wna16_gemm (int4/int8 weight-only CUDA kernel): not provided")


@triton.jit
def _silu_and_mul_with_clamp_kernel(x_ptr, out_ptr, D, stride_x, stride_o, limit, alpha, beta,
                                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < D
    gate = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + cols, mask=inside, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    y = gate * tl.sigmoid(alpha * gate) * (up + beta)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


@torch.library.custom_op("_C::silu_and_mul_with_clamp", mutates_args=("out",))
def silu_and_mul_with_clamp(out: torch.Tensor, input: torch.Tensor, limit: float, alpha: float,
                            beta: float) -> None:
    """``out [..., d] = g * sigmoid(alpha * g) * (clamp(up, -limit, limit) + beta)``, ``g =
    min(gate, limit)``, gate|up the two halves of ``input [..., 2d]`` (vLLM's
    SiluAndMulWithClamp; f32 arithmetic, rounded once to out's dtype)."""
    d = input.shape[-1] // 2
    x = input.reshape(-1, 2 * d)
    o = out.view(-1, d)
    assert x.stride(-1) == 1 and o.stride(-1) == 1
    block = 1024
    _silu_and_mul_with_clamp_kernel[(x.shape[0], triton.cdiv(d, block))](
        x, o, d, x.stride(0), o.stride(0), float(limit), float(alpha), float(beta), BLOCK=block)
'''

_MOE_UTILS = '''"""Stand-in for vllm.model_executor.layers.fused_moe.utils: what fused_moe.py imports of
it. ``moe_kernel_quantize_input`` covers the two schemes the benchmark runs (none; fp8 e4m3
with per-token groups of ``block_shape[1]`` inputs, vLLM's w8a8 block quantization, through a
Triton kernel of ours standing in for vLLM's CUDA ``per_token_group_fp8_quant``)."""
import torch

import vllm.envs as envs
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def enable_swap_ab(BLOCK_SIZE_M: int, BLOCK_SIZE_N: int) -> bool:
    """vLLM's rule: the swapped-operand fp8 kernel on compute capability 9.0 for M tiles
    below 64 and N tiles of at least 64."""
    return (current_platform.is_device_capability(90) and BLOCK_SIZE_M < 64
            and BLOCK_SIZE_N >= 64)


def resolve_moe_use_td() -> bool:
    """VLLM_TRITON_USE_TD: 1 / 0 force the tensor-descriptor path on / off; unset: XPU only."""
    override = envs.VLLM_TRITON_USE_TD
    return current_platform.is_xpu() if override is None else override


def warn_if_moe_use_td_ineffective(active_backend: str, is_quantized: bool = False) -> None:
    """vLLM only logs a warning here."""


@triton.jit
def _group_quant_fp8_kernel(x_ptr, q_ptr, s_ptr, group_size, groups_per_row, stride_x, eps,
                            fp8_max, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    row = g // groups_per_row
    col0 = (g % groups_per_row) * group_size
    cols = tl.arange(0, BLOCK)
    inside = cols < group_size
    x = tl.load(x_ptr + row * stride_x + col0 + cols, mask=inside, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x)), eps) * (1.0 / fp8_max)
    q = tl.minimum(tl.maximum(x / scale, -fp8_max), fp8_max)
    tl.store(q_ptr + g * group_size + cols, q.to(q_ptr.dtype.element_ty), mask=inside)
    tl.store(s_ptr + g, scale)


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int, eps: float = 1e-10):
    """``x [M, K]`` (rows contiguous, K % group_size == 0) -> (q [M, K] float8_e4m3fn, scales
    [M, K / group_size] f32): per group of ``group_size`` inputs of a row, ``scale = max(amax,
    eps) / 448`` and ``q = clamp(x / scale, -448, 448)`` rounded to e4m3 (vLLM's
    per_token_group_quant_fp8 with row-major scales and no UE8M0 rounding)."""
    m, k = x.shape
    assert k % group_size == 0 and x.stride(-1) == 1
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, k // group_size), dtype=torch.float32, device=x.device)
    if m:
        _group_quant_fp8_kernel[(m * (k // group_size),)](
            x, q, s, group_size, k // group_size, x.stride(0), eps, FP8_MAX,
            BLOCK=triton.next_power_of_2(group_size))
    return q, s


def moe_kernel_quantize_input(A, A_scale, quant_dtype, per_act_token_quant, block_shape=None,
                              **_layout_options):
    """(A, A_scale) unchanged without ``quant_dtype``; for fp8 e4m3 with a ``block_shape`` and
    dynamic scales, per-token-group quantization (groups of ``block_shape[1]``). Other schemes
    are not provided."""
    if quant_dtype is None:
        return A, A_scale
    if (quant_dtype == current_platform.fp8_dtype() and block_shape is not None
            and A_scale is None and not per_act_token_quant):
        return per_token_group_quant_fp8(A, block_shape[1])
    raise NotImplementedError(f"moe_kernel_quantize_input stand-in: quant_dtype={quant_dtype}, "
                              f"block_shape={block_shape}, static scale {A_scale is not None}, "
                              f"per-token {per_act_token_quant}")
'''

_MOE_CONFIG = '''"""Stand-in for vllm.model_executor.layers.fused_moe.config: ``_get_config_dtype_str`` (as
vLLM's: the dtype part of a tuned-config file name) and the two names that fused_moe.py's
``fused_experts`` wrapper reads. The wrapper itself is not usable here (call
``fused_experts_impl`` or the kernel launchers directly)."""
import torch


def _get_config_dtype_str(dtype, use_fp8_w8a8=False, use_fp8_w8a16=False, use_int8_w8a16=False,
                          use_int4_w4a16=False, ocp_mx_scheme=None):
    if use_fp8_w8a8:
        return "fp8_w8a8"
    if use_fp8_w8a16:
        return "fp8_w8a16"
    if use_int8_w8a16:
        return "int8_w8a16"
    if use_int4_w4a16:
        return "int4_w4a16"
    if ocp_mx_scheme is not None:
        return None
    if dtype == torch.float:
        return "float32"
    return None


class FusedMoEQuantConfig:
    """Not provided (vLLM's quantization config object)."""


FUSED_MOE_UNQUANTIZED_CONFIG = None
'''

_MOE_MODULAR_KERNEL = '''"""Stand-in for vllm.model_executor.layers.fused_moe.modular_kernel: the one static helper
fused_moe.py calls."""


class FusedMoEExpertsModular:
    @staticmethod
    def adjust_N_for_activation(N: int, activation) -> int:
        """Width of the activation's output: N // 2 for gated activations, else N."""
        return N // 2 if activation.is_gated else N
'''

_MOE_PACKAGE_INIT = '''"""Stand-in for vllm.model_executor.layers.fused_moe: ``get_config``, vLLM's override
config (set only inside its ``override_config`` context; None otherwise)."""


def get_config():
    return None
'''

_PLATFORM_UTILS = '''"""Stand-in for vllm.utils.platform_utils: the device name as tuned-config file names spell it."""
import re

from vllm.platforms import current_platform


def get_device_name_as_file_name(device_id: int = 0) -> str:
    return re.sub(r"[\\s/]+", "_", current_platform.get_device_name(device_id))
'''

_TORCH_UTILS = '''"""Stand-in for vllm.utils.torch_utils: ``direct_register_custom_op`` registers nothing here
(vLLM registers ``fused_experts`` as ``torch.ops.vllm.fused_experts``; call
``fused_experts_impl`` directly)."""


def direct_register_custom_op(op_name, op_func, mutates_args=None, fake_impl=None, **kwargs):
    return None
'''

_TRITON_ALLOCATION = '''"""Stand-in for vllm.triton_utils.allocation: Triton's scratch allocator from torch."""
import torch

from vllm.triton_utils import triton


def set_triton_allocator(device: torch.device):
    def alloc_fn(size: int, alignment: int, stream):
        return torch.empty(size, device=device, dtype=torch.int8)

    triton.set_allocator(alloc_fn)
'''


def find_wheel(path: pathlib.Path) -> pathlib.Path:
    """The vLLM wheel itself, or the single ``vllm-<VLLM_VERSION>-*.whl`` inside a folder."""
    if path.is_file():
        return path
    found = sorted(path.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if not found:
        raise FileNotFoundError(f"no vllm-{VLLM_VERSION}-*.whl in {path}")
    return found[-1]


def _record_hashes(zf: zipfile.ZipFile) -> dict[str, str]:
    """RECORD of the wheel: path -> 'sha256=<urlsafe b64, no padding>'."""
    record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
    out = {}
    # CSV: paths holding commas (the tuned MoE configs) are quoted
    for parts in csv.reader(zf.read(record).decode().splitlines()):
        if len(parts) == 3 and parts[1]:
            out[parts[0]] = parts[1]
    return out


def _sha256_record(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def build(wheel: pathlib.Path, out: pathlib.Path) -> dict:
    """Write ``out/vllm/...`` (the op files of :func:`op_members` + stand-ins + package inits)
    and a manifest.

    Returns the manifest dict (wheel name, op file and tuned-config sha256s). Raises if an op
    file is missing from the wheel or a copied file does not match the wheel's RECORD.
    """
    wheel = find_wheel(wheel)
    files: dict[str, bytes] = {}
    with zipfile.ZipFile(wheel) as zf:
        hashes = _record_hashes(zf)
        configs = config_members(zf.namelist())
        for member in op_members() + configs:
            data = zf.read(member)
            if hashes.get(member) != _sha256_record(data):
                raise ValueError(f"{member}: hash does not match the wheel's RECORD")
            files[member] = data
    packages = ["vllm", "vllm/models", "vllm/models/minimax_m3", "vllm/models/minimax_m3/common",
                OPS_PACKAGE, "vllm/utils", "vllm/v1", "vllm/v1/attention", DENSE_OPS_PACKAGE,
                "vllm/model_executor", "vllm/model_executor/layers"]
    for pkg in packages:
        files.setdefault(f"{pkg}/__init__.py", b'"""Namespace written by tools.vllm_compare.vllm_ops."""\n')
    files["vllm/platforms/__init__.py"] = _PLATFORMS.encode()
    files["vllm/triton_utils/__init__.py"] = _TRITON_UTILS.encode()
    files["vllm/utils/math_utils.py"] = _MATH_UTILS.encode()
    files["vllm/envs.py"] = _ENVS.encode()
    files["vllm/logger.py"] = _LOGGER.encode()
    files["vllm/v1/kv_cache_interface.py"] = _KV_CACHE_INTERFACE.encode()
    files["vllm/_custom_ops.py"] = _CUSTOM_OPS.encode()
    files[f"{MOE_PACKAGE}/__init__.py"] = _MOE_PACKAGE_INIT.encode()
    files[f"{MOE_PACKAGE}/config.py"] = _MOE_CONFIG.encode()
    files[f"{MOE_PACKAGE}/modular_kernel.py"] = _MOE_MODULAR_KERNEL.encode()
    files[f"{MOE_PACKAGE}/utils.py"] = _MOE_UTILS.encode()
    files["vllm/utils/platform_utils.py"] = _PLATFORM_UTILS.encode()
    files["vllm/utils/torch_utils.py"] = _TORCH_UTILS.encode()
    files["vllm/triton_utils/allocation.py"] = _TRITON_ALLOCATION.encode()
    for rel, data in files.items():
        dest = out / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
    manifest = {
        "vllm_version": VLLM_VERSION,
        "wheel": wheel.name,
        "op_files": {m: _sha256_record(files[m]) for m in op_members()},
        "config_files": {m: _sha256_record(files[m]) for m in configs},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", required=True, type=pathlib.Path,
                    help=f"vllm-{VLLM_VERSION} wheel, or a folder holding it")
    ap.add_argument("--out", default=pathlib.Path(".vllm_ops"), type=pathlib.Path)
    args = ap.parse_args(argv)
    manifest = build(args.wheel, args.out)
    print(f"built {args.out} from {manifest['wheel']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

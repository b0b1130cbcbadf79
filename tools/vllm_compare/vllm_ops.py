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
``is_device_capability_family``, and ``vllm.v1.kv_cache_interface.KVQuantMode``. This builder
copies the four files out of the wheel (checked against the wheel's RECORD hashes) and writes
small stand-in modules of our own for those helpers, so the ops import with only torch and
triton installed (no vLLM install, no 336 MB wheel at run time). The output folder is built at
run time and ignored by git; nothing of vLLM is committed.

Standard library only, so it runs under any Python:
    python tools/vllm_compare/vllm_ops.py --wheel PATH_OR_DIR --out .vllm_ops
"""
from __future__ import annotations

import argparse
import base64
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
MANIFEST = "MANIFEST.json"


def op_members() -> list[str]:
    """The wheel members copied into the op folder."""
    return ([f"{OPS_PACKAGE}/{n}" for n in OP_FILES]
            + [f"{DENSE_OPS_PACKAGE}/{n}" for n in DENSE_OP_FILES])


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
- autotuning cannot benchmark (no driver), so ``triton.autotune`` keeps the first config;
- Triton 3.6's interpreter stores bf16 as uint16 and gets two bf16 operations wrong:
  ``tl.dot`` multiplies the raw bit patterns as integers, and a float32 -> bf16 cast
  truncates instead of rounding. Both are fixed here to the compiled semantics: dot operands
  are widened exactly to float32 (a GPU bf16 MMA with fp32 accumulation forms the same
  exact products), and float32 -> bf16 casts round to nearest even (as fptrunc does on the
  GPU). vLLM's code is not touched.
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


def _first_config_autotune(configs, *args, **kwargs):
    return _triton.autotune(list(configs)[:1], *args, **kwargs)


class _FirstConfigTriton(types.ModuleType):
    """triton, except that autotune keeps the first config."""

    autotune = staticmethod(_first_config_autotune)

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

    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
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
triton = _FirstConfigTriton("triton") if INTERPRET else _triton

__all__ = ["triton", "tl", "INTERPRET"]
'''

_MATH_UTILS = '''"""Stand-in for vllm.utils.math_utils: the one helper the ops use."""


def round_up(x: int, y: int) -> int:
    """Smallest multiple of y that is >= x."""
    return -(-x // y) * y
'''

_ENVS = '''"""Stand-in for vllm.envs: the one variable the unified attention reads (as vLLM's)."""
import os

VLLM_BATCH_INVARIANT = bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0")))
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
    for line in zf.read(record).decode().splitlines():
        parts = line.rsplit(",", 2)
        if len(parts) == 3 and parts[1]:
            out[parts[0]] = parts[1]
    return out


def _sha256_record(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def build(wheel: pathlib.Path, out: pathlib.Path) -> dict:
    """Write ``out/vllm/...`` (the op files of :func:`op_members` + stand-ins + package inits)
    and a manifest.

    Returns the manifest dict (wheel name, op file sha256s). Raises if an op file is
    missing from the wheel or does not match the wheel's RECORD.
    """
    wheel = find_wheel(wheel)
    files: dict[str, bytes] = {}
    with zipfile.ZipFile(wheel) as zf:
        hashes = _record_hashes(zf)
        for member in op_members():
            data = zf.read(member)
            if hashes.get(member) != _sha256_record(data):
                raise ValueError(f"{member}: hash does not match the wheel's RECORD")
            files[member] = data
    packages = ["vllm", "vllm/models", "vllm/models/minimax_m3", "vllm/models/minimax_m3/common",
                OPS_PACKAGE, "vllm/utils", "vllm/v1", "vllm/v1/attention", DENSE_OPS_PACKAGE]
    for pkg in packages:
        files.setdefault(f"{pkg}/__init__.py", b'"""Namespace written by tools.vllm_compare.vllm_ops."""\n')
    files["vllm/platforms/__init__.py"] = _PLATFORMS.encode()
    files["vllm/triton_utils/__init__.py"] = _TRITON_UTILS.encode()
    files["vllm/utils/math_utils.py"] = _MATH_UTILS.encode()
    files["vllm/envs.py"] = _ENVS.encode()
    files["vllm/logger.py"] = _LOGGER.encode()
    files["vllm/v1/kv_cache_interface.py"] = _KV_CACHE_INTERFACE.encode()
    for rel, data in files.items():
        dest = out / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
    manifest = {
        "vllm_version": VLLM_VERSION,
        "wheel": wheel.name,
        "op_files": {m: _sha256_record(files[m]) for m in op_members()},
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

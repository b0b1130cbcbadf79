"""The fp8 side of a checkpoint: which linears are quantized, in which format, and their tensors.

Two formats (``../shared/spec/FP8_CHECKPOINTS.md``), read from ``config.json``'s
``quantization_config`` (or ``hf_quant_config.json``):

- MXFP8: ``{"quant_method": "mxfp8", "ignored_layers": [...]}`` or ModelOpt's
  ``{"quant_method": "modelopt", "quantization": {"quant_algo": "MXFP8",
  "exclude_modules": [...]}}``; ``X.weight`` float8_e4m3fn ``[out, in]`` with
  ``X.weight_scale_inv`` uint8 E8M0 ``[out, in / 32]``.
- fp8 block: ``{"quant_method": "fp8", "weight_block_size": [128, 128],
  "modules_to_not_convert": [...]}``; ``X.weight_scale_inv`` float32
  ``[ceil(out / 128), ceil(in / 128)]``.

The scale of ``X.weight`` is ``X.weight_scale_inv`` (or ``X.weight_scale``); a fused expert
tensor ``X`` (transformers' ``mlp.experts.gate_up_proj``) has ``X_scale_inv``. A module is left
unquantized when an exclusion entry names it, a prefix of it, or matches it as a glob
(``fnmatch``, also against any dotted suffix). Whether a weight is quantized follows the
tensor: an fp8 weight needs its scale and a module the config quantizes.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import struct
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from pallas_kernels.fp8_matmul import BLOCK, E8M0_MAX, MX_GROUP, expected_scales_shape

FP8_DTYPE = "F8_E4M3"  # safetensors' name of float8_e4m3fn
SCALE_SUFFIXES = ("_scale_inv", "_scale")
SCALE_DTYPES = {"mxfp8": "U8", "block128": "F32"}
NUMPY_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "U8": np.uint8, "F32": np.float32,
                "BF16": ml_dtypes.bfloat16, "F16": np.float16}


class Fp8CheckpointError(ValueError):
    """An fp8 tensor or quantization config that cannot be loaded; names the tensor or field."""


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """fmt: "mxfp8" or "block128"; excluded: module names / globs left unquantized."""

    fmt: str
    excluded: tuple[str, ...] = ()

    def quantizes(self, module: str) -> bool:
        """Whether ``module`` (a dotted name without ``.weight``) is in the quantized set."""
        parts = module.split(".")
        suffixes = [".".join(parts[i:]) for i in range(len(parts))]
        for entry in self.excluded:
            if module == entry or module.startswith(entry + ".") or entry in suffixes:
                return False
            if any(fnmatch.fnmatchcase(s, entry) for s in suffixes):
                return False
        return True


def read_quant_config(folder: str, top: Mapping[str, Any]) -> QuantConfig | None:
    """The checkpoint's QuantConfig from ``config.json`` (``top``; a VL config's text part may
    hold it too) or ``hf_quant_config.json``; None for an unquantized checkpoint."""
    qc = top.get("quantization_config")
    if qc is None and isinstance(top.get("text_config"), Mapping):
        qc = top["text_config"].get("quantization_config")
    side = os.path.join(folder, "hf_quant_config.json")
    if qc is None and os.path.exists(side):
        with open(side) as f:
            qc = json.load(f)
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise Fp8CheckpointError(f"quantization_config: must be an object, got {qc!r}")
    method = str(qc.get("quant_method", "")).lower()
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), Mapping) else qc
    algo = str(inner.get("quant_algo", "")).upper()
    if method == "mxfp8" or algo == "MXFP8":
        excluded = inner.get("ignored_layers",
                             inner.get("exclude_modules", qc.get("ignored_layers")))
        return QuantConfig("mxfp8", _names("ignored_layers", excluded))
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is None or list(block) != [BLOCK, BLOCK]:
            raise Fp8CheckpointError(f"quantization_config.weight_block_size: only "
                                     f"[{BLOCK}, {BLOCK}] blocks are supported, got {block!r}")
        if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
            raise Fp8CheckpointError(f"quantization_config.fmt: only 'e4m3' is supported, got "
                                     f"{qc.get('fmt')!r}")
        return QuantConfig("block128", _names("modules_to_not_convert",
                                              qc.get("modules_to_not_convert")))
    raise Fp8CheckpointError(f"quantization_config: quant_method {qc.get('quant_method')!r} "
                             f"(quant_algo {inner.get('quant_algo')!r}) is not supported; "
                             f"supported: 'mxfp8' (or ModelOpt MXFP8) and 'fp8' with "
                             f"[{BLOCK}, {BLOCK}] blocks")


def _names(field: str, value) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise Fp8CheckpointError(f"quantization_config.{field}: must be a list of module "
                                 f"names, got {value!r}")
    return tuple(value)


def scale_keys(weight_key: str) -> tuple[str, ...]:
    """The names a weight's scale may have, in order of preference."""
    return tuple(weight_key + s for s in SCALE_SUFFIXES)


def module_name(weight_key: str) -> str:
    """``a.b.q_proj.weight`` -> ``a.b.q_proj`` (a fused expert tensor keeps its name)."""
    return weight_key[:-len(".weight")] if weight_key.endswith(".weight") else weight_key


def expected_scale_shape(fmt: str, shape: tuple[int, ...], key: str) -> tuple[int, ...]:
    """Scale shape of an fp8 weight ``[..., out, in]`` named ``key``; Fp8CheckpointError where
    the block size does not divide ``in`` the way the format needs."""
    if fmt == "mxfp8" and shape[-1] % MX_GROUP:
        raise Fp8CheckpointError(f"{key}: MXFP8 needs the input dim to be a multiple of "
                                 f"{MX_GROUP} (one E8M0 scale per {MX_GROUP}), got {shape}")
    return expected_scales_shape(shape, fmt)


def check_scales(fmt: str, key: str, scales: np.ndarray) -> None:
    """Value checks of a scale tensor: no E8M0 exponent 255 (NaN); block scales finite, > 0."""
    if fmt == "mxfp8":
        bad = np.argwhere(scales > E8M0_MAX)
        if bad.size:
            raise Fp8CheckpointError(f"{key}: E8M0 exponent 255 (NaN) at index "
                                     f"{tuple(int(i) for i in bad[0])}; valid exponents are "
                                     f"0..{E8M0_MAX}")
    else:
        bad = np.argwhere(~(np.isfinite(scales) & (scales > 0)))
        if bad.size:
            idx = tuple(int(i) for i in bad[0])
            raise Fp8CheckpointError(f"{key}: block scale {float(scales[idx])!r} at index {idx}; "
                                     f"scales must be finite and > 0")


class RawTensors:
    """Tensors of one safetensors file read from its header and a memory map (safetensors'
    numpy reader cannot return float8 arrays). ``get(key)`` -> a read-only numpy view."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        self.header = header
        self.offset = 8 + n
        self._map = None

    def dtype(self, key: str) -> str:
        return self.header[key]["dtype"]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.header[key]["shape"])

    def get(self, key: str) -> np.ndarray:
        info = self.header[key]
        if info["dtype"] not in NUMPY_DTYPES:
            raise Fp8CheckpointError(f"{key}: dtype {info['dtype']} is not readable here")
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        start, end = info["data_offsets"]
        raw = self._map[self.offset + start:self.offset + end]
        return raw.view(NUMPY_DTYPES[info["dtype"]]).reshape(info["shape"])


__all__ = ["Fp8CheckpointError", "QuantConfig", "read_quant_config", "scale_keys", "module_name",
           "expected_scale_shape", "check_scales", "RawTensors", "FP8_DTYPE", "SCALE_DTYPES"]

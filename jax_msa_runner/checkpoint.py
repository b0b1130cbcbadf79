"""Load a Hugging Face MiniMax-M3 checkpoint folder into ``model.init_params``' pytree.

A folder holds ``config.json`` and ``*.safetensors`` shards (listed by
``model.safetensors.index.json`` when there are several). Two weight-name schemes are
accepted, text-only or VL (text weights under ``language_model.`` / ``model.language_model.``):

- released: ``block_sparse_moe.gate.weight``, ``block_sparse_moe.e_score_correction_bias``,
  per-expert ``block_sparse_moe.experts.{e}.w1/w2/w3.weight`` (gate, down, up),
  ``block_sparse_moe.shared_experts.{gate,up,down}_proj.weight``, ``mlp.{gate,up,down}_proj``,
  ``self_attn.index_{q,k}_{proj,norm}``;
- transformers' ``save_pretrained``: ``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``,
  fused ``mlp.experts.gate_up_proj [E, 2I, H]`` and ``mlp.experts.down_proj [E, H, I]``,
  ``mlp.gate_up_proj.weight [2I, H]``, ``self_attn.indexer.{q,k}_{proj,norm}``.

Linear weights are stored ``[out, in]`` and become ``[in, out]`` here; gate and up halves
are fused as ``[gate | up]``. An fp8 checkpoint's quantized linears (float8_e4m3fn weights
with MXFP8 or 128x128 block scales, ``fp8_checkpoint``) stay fp8: ``Fp8Weight(values
[..., out, in], scales)`` as on disk, gate and up as ``[gate; up]`` rows. Vision-tower,
projector and MTP weights (and layers past a ``num_layers`` truncation) are skipped, reported
in one log line. Params are read one at a time (memory-mapped files, one host buffer per
param) and placed on their devices before the next is read, so the model is never held twice
in host memory.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
from typing import Callable

import jax
import ml_dtypes
import numpy as np

from jax_msa_runner.config import ModelConfig
from jax_msa_runner.fp8_checkpoint import (FP8_DTYPE, NUMPY_DTYPES, SCALE_DTYPES,
                                           Fp8CheckpointError, QuantConfig, RawTensors,
                                           check_scales, expected_scale_shape, module_name,
                                           read_quant_config, scale_keys)
from jax_msa_runner.model import init_params
from pallas_kernels.fp8_matmul import BLOCK, Fp8Weight, expected_scales_shape

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# Where the text model's weights live: (prefix of embed/norm/layers, key of the LM head).
TEXT_PREFIXES = (("model.", "lm_head.weight"),
                 ("language_model.model.", "language_model.lm_head.weight"),
                 ("model.language_model.", "lm_head.weight"))
VISION_PREFIXES = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.",
                   "model.multi_modal_projector.", "patch_merge_mlp.", "visual.", "model.visual.")
MTP_PATTERN = re.compile(r"(^|\.)mtp\.")
# Released names -> transformers' names (applied to the key without its text prefix).
RELEASED_TO_CANONICAL = (
    (re.compile(r"\.block_sparse_moe\.e_score_correction_bias$"), ".mlp.gate.e_score_correction_bias"),
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.self_attn\.index_(q|k)_(proj|norm)\."), r".self_attn.indexer.\1_\2."),
)
CANONICAL_TO_RELEASED = (
    (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".block_sparse_moe.e_score_correction_bias"),
    (re.compile(r"\.mlp\.(gate|experts|shared_experts)\."), r".block_sparse_moe.\1."),
    (re.compile(r"\.self_attn\.indexer\.(q|k)_(proj|norm)\."), r".self_attn.index_\1_\2."),
)

# layer params that may come as fp8 weights with scales (every other param is never quantized)
QUANTIZABLE = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "index_q_proj", "index_k_proj",
                         "gate_up_proj", "down_proj", "shared_gate_up", "shared_down",
                         "experts_gate_up", "experts_down"})
ShardingFn = Callable[[str, tuple[int, ...]], "jax.sharding.Sharding | None"]
PutFn = Callable[[str, np.ndarray], "jax.Array"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or key at fault."""


# ---- how each param is built from checkpoint tensors ------------------------------------------

Reader = Callable[[int, "int | None"], np.ndarray]  # (source index, expert or None) -> array


@dataclasses.dataclass(frozen=True)
class _Form:
    """One way to build a param: its canonical source keys, their expected shapes, a
    ``fill(out, read)`` writing the dense param ``[in, out]`` into the preallocated host array
    ``out``, and for a quantizable linear ``fill_fp8(values, scales, read, read_scale, rows)``
    writing its fp8 values ``[..., out, in]`` and scales as on disk (``rows(n)``: the scale
    rows of ``n`` weight rows)."""

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    fill: Callable[[np.ndarray, Reader], None]
    fill_fp8: Callable | None = None


def _direct(key, shape):
    def fill(out, read):
        out[...] = read(0, None)
    return _Form((key,), (tuple(shape),), fill)


def _transposed(key, shape):
    def fill(out, read):
        out[...] = read(0, None).T

    def fill_fp8(values, scales, read, read_scale, rows):
        values[...] = read(0, None)
        scales[...] = read_scale(0, None)
    return _Form((key,), (tuple(shape[::-1]),), fill, fill_fp8)


def _split_gate_up(gate_key, up_key, shape):
    """[H, 2I] from gate [I, H] and up [I, H] (fp8: [2I, H] = [gate; up])."""
    half = shape[1] // 2

    def fill(out, read):
        out[:, :half] = read(0, None).T
        out[:, half:] = read(1, None).T

    def fill_fp8(values, scales, read, read_scale, rows):
        values[:half], values[half:] = read(0, None), read(1, None)
        scales[:rows(half)], scales[rows(half):] = read_scale(0, None), read_scale(1, None)
    return _Form((gate_key, up_key), ((half, shape[0]),) * 2, fill, fill_fp8)


def _fused_experts(key, shape):
    """[E, A, B] from a fused [E, B, A], read expert by expert (fp8: [E, B, A] as on disk)."""
    def fill(out, read):
        for e in range(shape[0]):
            out[e] = read(0, e).T

    def fill_fp8(values, scales, read, read_scale, rows):
        for e in range(shape[0]):
            values[e], scales[e] = read(0, e), read_scale(0, e)
    return _Form((key,), ((shape[0], shape[2], shape[1]),), fill, fill_fp8)


def _per_expert(key_fmt, shape):
    """[E, I, H] (down) from E tensors [H, I] named key_fmt.format(e) (fp8: [E, H, I])."""
    E = shape[0]

    def fill(out, read):
        for e in range(E):
            out[e] = read(e, None).T

    def fill_fp8(values, scales, read, read_scale, rows):
        for e in range(E):
            values[e], scales[e] = read(e, None), read_scale(e, None)
    return _Form(tuple(key_fmt.format(e) for e in range(E)), ((shape[2], shape[1]),) * E, fill,
                 fill_fp8)


def _per_expert_gate_up(w1_fmt, w3_fmt, shape):
    """[E, H, 2I] from E gate tensors w1 [I, H] and E up tensors w3 [I, H] (fp8: [E, 2I, H])."""
    E, H, half = shape[0], shape[1], shape[2] // 2

    def fill(out, read):
        for e in range(E):
            out[e, :, :half] = read(e, None).T
            out[e, :, half:] = read(E + e, None).T

    def fill_fp8(values, scales, read, read_scale, rows):
        r = rows(half)
        for e in range(E):
            values[e, :half], values[e, half:] = read(e, None), read(E + e, None)
            scales[e, :r], scales[e, r:] = read_scale(e, None), read_scale(E + e, None)
    keys = tuple(w1_fmt.format(e) for e in range(E)) + tuple(w3_fmt.format(e) for e in range(E))
    return _Form(keys, ((half, H),) * (2 * E), fill, fill_fp8)


def _layer_forms(name: str, shape: tuple[int, ...]) -> list[_Form]:
    """Forms of one layer param (canonical keys relative to ``layers.{i}.``)."""
    simple_t = {"q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
                "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
                "index_q_proj": "self_attn.indexer.q_proj.weight",
                "index_k_proj": "self_attn.indexer.k_proj.weight",
                "router": "mlp.gate.weight", "down_proj": "mlp.down_proj.weight",
                "shared_down": "mlp.shared_experts.down_proj.weight"}
    direct = {"input_norm": "input_layernorm.weight",
              "post_attention_norm": "post_attention_layernorm.weight",
              "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
              "index_q_norm": "self_attn.indexer.q_norm.weight",
              "index_k_norm": "self_attn.indexer.k_norm.weight",
              "router_bias": "mlp.gate.e_score_correction_bias"}
    if name in simple_t:
        return [_transposed(simple_t[name], shape)]
    if name in direct:
        return [_direct(direct[name], shape)]
    if name in ("gate_up_proj", "shared_gate_up"):
        p = "mlp." if name == "gate_up_proj" else "mlp.shared_experts."
        return [_transposed(p + "gate_up_proj.weight", shape),
                _split_gate_up(p + "gate_proj.weight", p + "up_proj.weight", shape)]
    if name == "experts_gate_up":
        return [_fused_experts("mlp.experts.gate_up_proj", shape),
                _per_expert_gate_up("mlp.experts.{}.w1.weight", "mlp.experts.{}.w3.weight", shape)]
    if name == "experts_down":
        return [_fused_experts("mlp.experts.down_proj", shape),
                _per_expert("mlp.experts.{}.w2.weight", shape)]
    raise AssertionError(f"no checkpoint mapping for layer param {name!r}")


# ---- fp8 weights -----------------------------------------------------------------------------

def _fp8_sources(pname: str, form: _Form, keys: list[str], tensor_info,
                 quant: QuantConfig | None) -> tuple[str, tuple[str, ...]] | None:
    """(format, the scale key of each source key) when the param's source weights are fp8,
    None when they are not. Fp8CheckpointError naming the tensor on a scale of a non-fp8
    weight, an fp8 weight of a param that is never quantized or of a module the config leaves
    unquantized, a missing scale or one of the wrong dtype or shape, and gate/up halves whose
    block scales cannot be joined."""
    infos = [tensor_info(k) for k in keys]
    found = [next((s for s in scale_keys(k) if tensor_info(s) is not None), None) for k in keys]
    fp8 = [dt == FP8_DTYPE for dt, _ in infos]
    if not any(fp8):
        for k, s, (dt, _) in zip(keys, found, infos):
            if s is not None:
                raise Fp8CheckpointError(f"{s}: a scale for {k}, which is {dt}, not float8_e4m3fn")
        return None
    first = keys[fp8.index(True)]
    if form.fill_fp8 is None or pname.rsplit(".", 1)[-1] not in QUANTIZABLE:
        raise Fp8CheckpointError(f"{first}: float8_e4m3fn weight for param {pname!r}, which is "
                                 f"never quantized (routers, norms, embeddings and the LM head "
                                 f"stay unquantized)")
    if not all(fp8):
        other = keys[fp8.index(False)]
        raise Fp8CheckpointError(f"{other}: {infos[fp8.index(False)][0]}, but {first} of the "
                                 f"same param {pname!r} is float8_e4m3fn")
    if quant is None:
        raise Fp8CheckpointError(f"{first}: float8_e4m3fn weight, but config.json has no "
                                 f"quantization_config")
    for k, s, (_, shape) in zip(keys, found, infos):
        if not quant.quantizes(module_name(k)):
            raise Fp8CheckpointError(f"{k}: float8_e4m3fn weight of {module_name(k)!r}, which "
                                     f"the quantization_config leaves unquantized (excluded: "
                                     f"{list(quant.excluded)})")
        if s is None:
            raise Fp8CheckpointError(f"{k}: float8_e4m3fn weight without its scale "
                                     f"{scale_keys(k)[0]!r}")
        s_dtype, s_shape = tensor_info(s)
        if s_dtype != SCALE_DTYPES[quant.fmt]:
            raise Fp8CheckpointError(f"{s}: scale dtype {s_dtype}; the {quant.fmt} format needs "
                                     f"{SCALE_DTYPES[quant.fmt]}")
        want = expected_scale_shape(quant.fmt, shape, k)
        if s_shape != want:
            raise Fp8CheckpointError(f"{s}: scale shape {s_shape}; the {quant.fmt} format needs "
                                     f"{want} for the weight's {shape}")
        if quant.fmt == "block128" and len(keys) > 1 and shape[-2] % BLOCK:
            raise Fp8CheckpointError(f"{k}: {shape[-2]} rows, not a multiple of the {BLOCK}-row "
                                     f"scale block, so the gate and up halves of {pname!r} cannot "
                                     f"be joined into one block-scaled weight")
    return quant.fmt, tuple(found)


def _fill_fp8(form: _Form, shape: tuple[int, ...], fmt: str, keys: list[str],
              skeys: tuple[str, ...], raw_tensor) -> tuple[np.ndarray, np.ndarray]:
    """Host (values float8_e4m3fn [..., out, in], scales uint8 | f32) of a param whose dense
    layout is ``shape [..., in, out]``; the scale values are checked (``check_scales``)."""
    vshape = (*shape[:-2], shape[-1], shape[-2])
    values = np.empty(vshape, ml_dtypes.float8_e4m3fn)
    scales = np.empty(expected_scales_shape(vshape, fmt), NUMPY_DTYPES[SCALE_DTYPES[fmt]])
    for s in skeys:
        check_scales(fmt, s, raw_tensor(s))

    def read(j, expert):
        t = raw_tensor(keys[j])
        return t if expert is None else t[expert]

    def read_scale(j, expert):
        t = raw_tensor(skeys[j])
        return t if expert is None else t[expert]

    form.fill_fp8(values, scales, read, read_scale,
                  (lambda n: n) if fmt == "mxfp8" else (lambda n: n // BLOCK))
    return values, scales


# ---- files -----------------------------------------------------------------------------------

def _shard_files(folder: str) -> list[str]:
    index = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: has no 'weight_map'")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.exists(os.path.join(folder, name)):
                raise CheckpointError(f"{index}: lists shard {name!r}, which is not in {folder}")
        return [os.path.join(folder, name) for name in files]
    files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files (and no {INDEX_FILE})")
    return [os.path.join(folder, n) for n in files]


def _open(stack: contextlib.ExitStack, path: str):
    from safetensors import safe_open
    try:
        return stack.enter_context(safe_open(path, framework="numpy"))
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
        raise CheckpointError(f"{path}: not a complete safetensors file, truncated or corrupt "
                              f"({type(e).__name__}: {e})") from e


def _text_prefix(keys) -> tuple[str, str]:
    for base, head in TEXT_PREFIXES:
        if base + "embed_tokens.weight" in keys:
            return base, head
    raise CheckpointError("missing key 'model.embed_tokens.weight' (nor "
                          "'language_model.model.embed_tokens.weight' / "
                          "'model.language_model.embed_tokens.weight'): not a MiniMax-M3 "
                          "text checkpoint")


def _canonical(rest: str) -> str:
    for pattern, repl in RELEASED_TO_CANONICAL:
        rest = pattern.sub(repl, "." + rest)[1:]
    return rest


# ---- the loader ------------------------------------------------------------------------------

def load(path: str | os.PathLike, *, dtype: str = "bfloat16", sharding: ShardingFn | None = None,
         num_layers: int | None = None, put: PutFn | None = None) -> tuple[ModelConfig, dict]:
    """Read a checkpoint folder: returns (ModelConfig, params).

    dtype: the model dtype ("float32" or "bfloat16"); the router weight and bias stay f32.
    sharding: optional ``sharding(param_path, shape) -> Sharding | None`` (param paths like
    ``"embed"``, ``"layers.3.experts_gate_up"``); None places a param on the default device.
    num_layers: keep only the first layers (the rest of the stack is skipped).
    put: optional ``put(param_path, host array or Fp8Weight of host arrays) -> jax.Array or
    Fp8Weight`` used instead of ``sharding``
    (e.g. ``attention.parallel.param_putter(mesh)``: each device receives only its shard,
    gate|up params in the tensor-parallel layout).
    fp8 checkpoints (``quantization_config`` MXFP8 or 128x128 fp8 blocks, see
    ``fp8_checkpoint``): each quantized linear becomes an ``Fp8Weight(values, scales)`` with
    the values float8_e4m3fn ``[..., out, in]`` as on disk (gate|up: ``[gate; up]`` rows) and
    the scales uint8 / f32 as on disk, placed as ``"{param}.values"`` / ``"{param}.scales"``;
    ``dtype`` is then the dtype of every other param and of the compute.
    Raises CheckpointError naming the file or key on a missing, unexpected or mis-shaped
    weight or scale, an fp8 weight the config does not quantize, a bad scale value and on a
    truncated or unreadable shard; ConfigError on a bad ``config.json``.
    """
    try:
        return _load(os.fspath(path), dtype=dtype, sharding=sharding, num_layers=num_layers,
                     put=put)
    except Fp8CheckpointError as e:
        raise CheckpointError(str(e)) from None


def _load(folder: str, *, dtype: str, sharding: ShardingFn | None, num_layers: int | None,
          put: PutFn | None) -> tuple[ModelConfig, dict]:
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: not a checkpoint folder")
    if not os.path.exists(os.path.join(folder, "config.json")):
        raise CheckpointError(f"{folder}: no config.json")
    config = ModelConfig.from_hf_config(folder, num_layers=num_layers, dtype=dtype)
    with open(os.path.join(folder, "config.json")) as f:
        quant = read_quant_config(folder, json.load(f))
    expected = jax.eval_shape(lambda: init_params(config))

    with contextlib.ExitStack() as stack:
        files = _shard_files(folder)
        handles, owner = [], {}
        for fi, fpath in enumerate(files):
            h = _open(stack, fpath)
            handles.append(h)
            for key in h.keys():
                if key in owner:
                    raise CheckpointError(f"key {key!r} is in two shards: "
                                          f"{files[owner[key]]} and {fpath}")
                owner[key] = fi
        base, head = _text_prefix(owner)

        def tensor_info(key: str) -> tuple[str, tuple[int, ...]] | None:
            """(safetensors dtype, shape) of checkpoint key ``key``; None when absent."""
            if key not in owner:
                return None
            sl = handles[owner[key]].get_slice(key)
            return sl.get_dtype(), tuple(sl.get_shape())
        released = any(".block_sparse_moe." in k or ".self_attn.index_" in k for k in owner)

        # canonical name -> checkpoint key; everything else is skipped or unexpected
        canon, skipped = {}, {"vision": 0, "MTP": 0, "layers past num_layers": 0}
        unexpected = []
        layer_re = re.compile(r"^layers\.(\d+)\.")
        for key in owner:
            if MTP_PATTERN.search(key):
                skipped["MTP"] += 1
            elif key.startswith(VISION_PREFIXES):
                skipped["vision"] += 1
            elif key == head:
                canon["lm_head.weight"] = key
            elif key.startswith(base):
                rest = key[len(base):]
                m = layer_re.match(rest)
                if m and int(m.group(1)) >= config.num_layers:
                    skipped["layers past num_layers"] += 1
                else:
                    canon[_canonical(rest)] = key
            else:
                unexpected.append(key)

        def shown(ckey: str) -> str:
            """A missing canonical key, spelled in the checkpoint's own scheme."""
            if not released or ckey.startswith(("embed_tokens", "norm", "lm_head")):
                name = ckey
            else:
                name = "." + ckey
                layer = int(layer_re.match(ckey).group(1))
                for pattern, repl in CANONICAL_TO_RELEASED:
                    if pattern.pattern.startswith(r"\.mlp") and not config.layer_is_moe[layer]:
                        continue
                    name = pattern.sub(repl, name)
                name = name[1:]
            return head if ckey == "lm_head.weight" else base + name

        # the plan: (param path, expected ShapeDtypeStruct, chosen form, ckpt keys)
        plan = []

        def choose(pname, spec, forms, prefix=""):
            if released:  # a missing weight is then reported by its released (split) name
                forms = forms[::-1]
            best = None
            for form in forms:
                keys = [prefix + k for k in form.keys]
                present = sum(k in canon for k in keys)
                if present == len(keys):
                    for k, want in zip(keys, form.shapes):
                        got = tuple(handles[owner[canon[k]]].get_slice(canon[k]).get_shape())
                        if got != want:
                            raise CheckpointError(f"wrong shape for {canon[k]!r}: checkpoint has "
                                                  f"{got}, the config expects {want}")
                    ckeys = [canon[k] for k in keys]
                    plan.append((pname, spec, form, ckeys,
                                 _fp8_sources(pname, form, ckeys, tensor_info, quant)))
                    return
                if best is None or present > best[0]:
                    best = (present, form, keys)
            _, form, keys = best
            missing = [(k, s) for k, s in zip(keys, form.shapes) if k not in canon]
            k, s = missing[0]
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise CheckpointError(f"missing key {shown(k)!r} (expected shape {s}){more} for "
                                  f"param {pname!r}")

        choose("embed", expected["embed"], [_direct("embed_tokens.weight", expected["embed"].shape)])
        for i, layer in enumerate(expected["layers"]):
            for name, spec in layer.items():
                choose(f"layers.{i}.{name}", spec, _layer_forms(name, spec.shape), f"layers.{i}.")
        choose("final_norm", expected["final_norm"],
               [_direct("norm.weight", expected["final_norm"].shape)])
        if "lm_head" in expected:
            choose("lm_head", expected["lm_head"],
                   [_transposed("lm_head.weight", expected["lm_head"].shape)])
        elif "lm_head.weight" in canon:  # tied embeddings: a saved copy of the embedding
            skipped["tied lm_head"] = 1
            del canon["lm_head.weight"]
        used = {k for _, _, _, keys, _ in plan for k in keys}
        used |= {k for *_, fp8 in plan if fp8 is not None for k in fp8[1]}
        unexpected += sorted(k for k in canon.values() if k not in used)
        if unexpected:
            raise CheckpointError(f"unexpected key {unexpected[0]!r}"
                                  + (f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else "")
                                  + f": not a weight of this {config.num_layers}-layer model")
        if any(skipped.values()):
            log.info("checkpoint %s: skipped %d weights (%s)", folder, sum(skipped.values()),
                     ", ".join(f"{k}: {v}" for k, v in skipped.items() if v))

        # shard by shard: params in the order of the first file they read
        plan.sort(key=lambda p: owner[p[3][0]])
        flat = {}
        raw: dict[int, RawTensors] = {}

        def raw_tensor(key: str) -> np.ndarray:
            fi = owner[key]
            if fi not in raw:
                raw[fi] = RawTensors(files[fi])
            return raw[fi].get(key)

        def place(pname: str, host: np.ndarray) -> jax.Array:
            if put is not None:
                return put(pname, host)
            target = sharding(pname, tuple(host.shape)) if sharding is not None else None
            return jax.device_put(host, target)

        for pname, spec, form, keys, fp8 in plan:
            if fp8 is None:
                def read(j, expert, keys=keys):
                    sl = handles[owner[keys[j]]].get_slice(keys[j])
                    return np.asarray(sl[expert] if expert is not None else sl[:])
                host = np.empty(spec.shape, spec.dtype)
                form.fill(host, read)
                flat[pname] = place(pname, host)
                del host
                continue
            fmt, skeys = fp8
            values, scales = _fill_fp8(form, tuple(spec.shape), fmt, keys, skeys, raw_tensor)
            if put is not None:
                flat[pname] = put(pname, Fp8Weight(values, scales))
            else:
                flat[pname] = Fp8Weight(place(pname + ".values", values),
                                        place(pname + ".scales", scales))
            del values, scales
    params = {"embed": flat["embed"], "final_norm": flat["final_norm"],
              "layers": tuple({name: flat[f"layers.{i}.{name}"] for name in layer}
                              for i, layer in enumerate(expected["layers"]))}
    if "lm_head" in expected:
        params["lm_head"] = flat["lm_head"]
    return config, params


__all__ = ["CheckpointError", "load"]

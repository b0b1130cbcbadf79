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
are fused as ``[gate | up]``. Vision-tower, projector and MTP weights (and layers past a
``num_layers`` truncation) are skipped, reported in one log line. Params are read one at a
time (memory-mapped files, one host buffer per param) and placed on their devices before
the next is read, so the model is never held twice in host memory.
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
import numpy as np

from jax_msa_runner.config import ModelConfig
from jax_msa_runner.model import init_params

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

ShardingFn = Callable[[str, tuple[int, ...]], "jax.sharding.Sharding | None"]
PutFn = Callable[[str, np.ndarray], "jax.Array"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or key at fault."""


# ---- how each param is built from checkpoint tensors ------------------------------------------

Reader = Callable[[int, "int | None"], np.ndarray]  # (source index, expert or None) -> array


@dataclasses.dataclass(frozen=True)
class _Form:
    """One way to build a param: its canonical source keys, their expected shapes, and a
    ``fill(out, read)`` writing the param into the preallocated host array ``out``."""

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    fill: Callable[[np.ndarray, Reader], None]


def _direct(key, shape):
    def fill(out, read):
        out[...] = read(0, None)
    return _Form((key,), (tuple(shape),), fill)


def _transposed(key, shape):
    def fill(out, read):
        out[...] = read(0, None).T
    return _Form((key,), (tuple(shape[::-1]),), fill)


def _split_gate_up(gate_key, up_key, shape):
    """[H, 2I] from gate [I, H] and up [I, H]."""
    half = shape[1] // 2

    def fill(out, read):
        out[:, :half] = read(0, None).T
        out[:, half:] = read(1, None).T
    return _Form((gate_key, up_key), ((half, shape[0]),) * 2, fill)


def _fused_experts(key, shape):
    """[E, A, B] from a fused [E, B, A], read expert by expert."""
    def fill(out, read):
        for e in range(shape[0]):
            out[e] = read(0, e).T
    return _Form((key,), ((shape[0], shape[2], shape[1]),), fill)


def _per_expert(key_fmt, shape):
    """[E, I, H] (down) from E tensors [H, I] named key_fmt.format(e)."""
    E = shape[0]

    def fill(out, read):
        for e in range(E):
            out[e] = read(e, None).T
    return _Form(tuple(key_fmt.format(e) for e in range(E)), ((shape[2], shape[1]),) * E, fill)


def _per_expert_gate_up(w1_fmt, w3_fmt, shape):
    """[E, H, 2I] from E gate tensors w1 [I, H] and E up tensors w3 [I, H]."""
    E, H, half = shape[0], shape[1], shape[2] // 2

    def fill(out, read):
        for e in range(E):
            out[e, :, :half] = read(e, None).T
            out[e, :, half:] = read(E + e, None).T
    keys = tuple(w1_fmt.format(e) for e in range(E)) + tuple(w3_fmt.format(e) for e in range(E))
    return _Form(keys, ((half, H),) * (2 * E), fill)


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
    put: optional ``put(param_path, host array) -> jax.Array`` used instead of ``sharding``
    (e.g. ``attention.parallel.param_putter(mesh)``: each device receives only its shard,
    gate|up params in the tensor-parallel layout).
    Raises CheckpointError naming the file or key on a missing, unexpected or mis-shaped
    weight and on a truncated or unreadable shard; ConfigError on a bad ``config.json``.
    """
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: not a checkpoint folder")
    if not os.path.exists(os.path.join(folder, "config.json")):
        raise CheckpointError(f"{folder}: no config.json")
    config = ModelConfig.from_hf_config(folder, num_layers=num_layers, dtype=dtype)
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
        if any(k.endswith("_scale_inv") or k.endswith(".weight_scale") for k in owner):
            raise CheckpointError("quantized checkpoint (weight scales found, e.g. "
                                  f"{next(k for k in owner if 'scale' in k)!r}): only "
                                  "float32 / bfloat16 / float16 weights are supported")
        base, head = _text_prefix(owner)
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
                    plan.append((pname, spec, form, [canon[k] for k in keys]))
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
        used = {k for *_, keys in plan for k in keys}
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
        for pname, spec, form, keys in plan:
            def read(j, expert, keys=keys):
                sl = handles[owner[keys[j]]].get_slice(keys[j])
                return np.asarray(sl[expert] if expert is not None else sl[:])
            host = np.empty(spec.shape, spec.dtype)
            form.fill(host, read)
            if put is not None:
                flat[pname] = put(pname, host)
            else:
                target = sharding(pname, tuple(spec.shape)) if sharding is not None else None
                flat[pname] = jax.device_put(host, target)
            del host
    params = {"embed": flat["embed"], "final_norm": flat["final_norm"],
              "layers": tuple({name: flat[f"layers.{i}.{name}"] for name in layer}
                              for i, layer in enumerate(expected["layers"]))}
    if "lm_head" in expected:
        params["lm_head"] = flat["lm_head"]
    return config, params


__all__ = ["CheckpointError", "load"]

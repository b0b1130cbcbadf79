"""Write our params as a Hugging Face MiniMax-M3 checkpoint folder (tests only).

``scheme="released"``: per-expert ``block_sparse_moe.experts.{e}.w1/w2/w3``, split
gate/up projections, ``self_attn.index_*`` and a legacy ``config.json``;
``scheme="transformers"``: fused ``mlp.experts.gate_up_proj [E, 2I, H]`` /
``down_proj [E, H, I]``, ``mlp.gate.*``, ``self_attn.indexer.*`` and transformers' config
names. ``fp8="mxfp8" | "block128"`` stores every quantizable linear as float8_e4m3fn with
its ``weight_scale_inv`` (our quantizers) and adds the ``quantization_config``.
``vl=True`` nests the text model (released: ``language_model.model.*``,
transformers: ``model.language_model.*``) and adds vision and MTP weights (which the loader
must skip).
"""
from __future__ import annotations

import json
import os
import re

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jax_msa_runner.config import ModelConfig
from pallas_kernels.fp8_matmul import quantize_block128, quantize_mxfp8

# checkpoint keys of the linears an fp8 checkpoint quantizes (both schemes)
QUANTIZED_KEY = re.compile(r"\.(self_attn\.(q|k|v|o)_proj"
                           r"|self_attn\.(index_|indexer\.)(q|k)_proj"
                           r"|mlp\.(gate_up|gate|up|down)_proj"
                           r"|shared_experts\.(gate_up|gate|up|down)_proj"
                           r"|experts\.\d+\.w[123])\.weight$|\.experts\.(gate_up|down)_proj$")


def hf_config(c: ModelConfig, scheme: str) -> dict:
    common = {
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "rotary_dim": c.rotary_dim, "rms_norm_eps": c.rms_norm_eps,
        "intermediate_size": c.moe_intermediate_size, "dense_intermediate_size": c.intermediate_size,
        "shared_intermediate_size": c.shared_intermediate_size,
        "num_local_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok,
        "routed_scaling_factor": c.routed_scaling_factor, "swiglu_alpha": c.swiglu_alpha,
        "swiglu_limit": c.swiglu_limit, "tie_word_embeddings": c.tie_word_embeddings,
    }
    if scheme == "released":
        return {**common, "rope_theta": c.rope_theta, "moe_layer_freq": list(c.moe_layer_freq),
                "use_routing_bias": c.use_routing_bias, "scoring_func": "sigmoid",
                "n_shared_experts": 1 if c.shared_intermediate_size else 0,
                "hidden_act": "swigluoai",
                "sparse_attention_config": {
                    "use_sparse_attention": True, "sparse_attention_freq": list(c.sparse_attention_freq),
                    "sparse_num_index_heads": c.num_index_heads, "sparse_index_dim": c.index_dim,
                    "sparse_block_size": 128, "sparse_topk_blocks": 16, "sparse_init_block": 0,
                    "sparse_local_block": 1, "sparse_score_type": "max"}}
    return {**common, "model_type": "minimax_m3_vl_text",
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                                "partial_rotary_factor": c.rotary_dim / c.head_dim},
            "layer_types": ["minimax_m3_sparse" if m else "full_attention" for m in c.layer_is_msa],
            "mlp_layer_types": ["sparse" if m else "dense" for m in c.layer_is_moe],
            "index_n_heads": c.num_index_heads, "index_head_dim": c.index_dim,
            "index_block_size": 128, "index_topk_blocks": 16, "index_local_blocks": 1}


def hf_tensors(params: dict, c: ModelConfig, scheme: str) -> dict[str, np.ndarray]:
    """Our params as checkpoint tensors (text keys without any VL prefix)."""
    p = lambda a: np.asarray(a)  # noqa: E731
    t = lambda a: np.ascontiguousarray(np.asarray(a).T)  # noqa: E731
    rel = scheme == "released"
    out = {"model.embed_tokens.weight": p(params["embed"]), "model.norm.weight": p(params["final_norm"])}
    if "lm_head" in params:
        out["lm_head.weight"] = t(params["lm_head"])
    for i, L in enumerate(params["layers"]):
        pre = f"model.layers.{i}."
        out[pre + "input_layernorm.weight"] = p(L["input_norm"])
        out[pre + "post_attention_layernorm.weight"] = p(L["post_attention_norm"])
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[pre + f"self_attn.{n}.weight"] = t(L[n])
        out[pre + "self_attn.q_norm.weight"] = p(L["q_norm"])
        out[pre + "self_attn.k_norm.weight"] = p(L["k_norm"])
        if "index_q_proj" in L:
            idx = "self_attn.index_{}_" if rel else "self_attn.indexer.{}_"
            out[pre + idx.format("q") + "proj.weight"] = t(L["index_q_proj"])
            out[pre + idx.format("k") + "proj.weight"] = t(L["index_k_proj"])
            out[pre + idx.format("q") + "norm.weight"] = p(L["index_q_norm"])
            out[pre + idx.format("k") + "norm.weight"] = p(L["index_k_norm"])

        def gate_up(prefix, w):  # w [H, 2I]
            half = w.shape[1] // 2
            if rel:
                out[prefix + "gate_proj.weight"] = t(w[:, :half])
                out[prefix + "up_proj.weight"] = t(w[:, half:])
            else:
                out[prefix + "gate_up_proj.weight"] = t(w)

        if "router" in L:
            moe = pre + ("block_sparse_moe." if rel else "mlp.")
            out[moe + "gate.weight"] = t(L["router"])
            if "router_bias" in L:
                out[moe + ("e_score_correction_bias" if rel else "gate.e_score_correction_bias")] = \
                    p(L["router_bias"])
            gu, dn = np.asarray(L["experts_gate_up"]), np.asarray(L["experts_down"])
            if rel:
                half = gu.shape[2] // 2
                for e in range(gu.shape[0]):
                    out[moe + f"experts.{e}.w1.weight"] = t(gu[e, :, :half])
                    out[moe + f"experts.{e}.w3.weight"] = t(gu[e, :, half:])
                    out[moe + f"experts.{e}.w2.weight"] = t(dn[e])
            else:
                out[moe + "experts.gate_up_proj"] = np.ascontiguousarray(gu.transpose(0, 2, 1))
                out[moe + "experts.down_proj"] = np.ascontiguousarray(dn.transpose(0, 2, 1))
            if "shared_gate_up" in L:
                gate_up(moe + "shared_experts.", np.asarray(L["shared_gate_up"]))
                out[moe + "shared_experts.down_proj.weight"] = t(L["shared_down"])
        else:
            gate_up(pre + "mlp.", np.asarray(L["gate_up_proj"]))
            out[pre + "mlp.down_proj.weight"] = t(L["down_proj"])
    return out


def quantize_tensors(tensors: dict[str, np.ndarray], fmt: str, excluded=()) -> dict:
    """Every quantizable linear (``QUANTIZED_KEY``, not named in ``excluded``) as fp8 values
    ``X`` + ``X_scale_inv`` (uint8 E8M0 for "mxfp8", f32 128x128 blocks for "block128")."""
    quantize = quantize_mxfp8 if fmt == "mxfp8" else quantize_block128
    out = {}
    for k, v in tensors.items():
        if QUANTIZED_KEY.search(k) and not any(k.startswith(e) for e in excluded):
            w = quantize(np.asarray(v, np.float32))
            out[k], out[k + "_scale_inv"] = np.asarray(w.values), np.asarray(w.scales)
        else:
            out[k] = v
    return out


def quant_config(fmt: str, excluded=()) -> dict:
    """The ``quantization_config`` of an fp8 checkpoint written by ``quantize_tensors``."""
    if fmt == "mxfp8":
        return {"quant_method": "mxfp8", "ignored_layers": ["lm_head", *excluded]}
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head", *excluded]}


def write_checkpoint(folder, params: dict, c: ModelConfig, *, scheme: str = "transformers",
                     num_shards: int = 1, vl: bool = False, store_dtype=None,
                     fp8: str | None = None, fp8_excluded=()) -> dict[str, np.ndarray]:
    """Write ``folder``; returns the tensors written (by checkpoint key). fp8: quantize the
    linears (``quantize_tensors``; modules named in ``fp8_excluded`` stay unquantized)."""
    os.makedirs(folder, exist_ok=True)
    tensors = hf_tensors(params, c, scheme)
    if vl:  # released: language_model.model.* / language_model.lm_head; transformers:
        rng = np.random.default_rng(0)  # model.language_model.* / lm_head
        if scheme == "released":
            tensors = {("language_model." + k): v for k, v in tensors.items()}
            vision = ("vision_tower.vision_model.embeddings.patch_embedding.weight",
                      "multi_modal_projector.linear_1.weight")
            mtp = "language_model.model.mtp.0.eh_proj.weight"
        else:
            tensors = {(k if k == "lm_head.weight" else "model.language_model." + k[len("model."):]): v
                       for k, v in tensors.items()}
            vision = ("model.vision_tower.embeddings.proj.weight",
                      "model.multi_modal_projector.linear_1.weight")
            mtp = "model.language_model.mtp.layers.0.eh_proj.weight"
        tensors[vision[0]] = rng.normal(size=(8, 3, 2, 2)).astype(np.float32)
        tensors[vision[1]] = rng.normal(size=(4, 8)).astype(np.float32)
        tensors[mtp] = rng.normal(size=(4, 4)).astype(np.float32)
    if store_dtype is not None:
        tensors = {k: v.astype(store_dtype) for k, v in tensors.items()}
    cfg = hf_config(c, scheme)
    if fp8 is not None:
        tensors = quantize_tensors(tensors, fp8, fp8_excluded)
        cfg["quantization_config"] = quant_config(fp8, fp8_excluded)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "minimax_m3_vl", "text_config": cfg} if vl else cfg, f)
    keys = sorted(tensors)
    if num_shards == 1:
        save_file(tensors, os.path.join(folder, "model.safetensors"))
    else:
        weight_map = {}
        for s in range(num_shards):
            name = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
            part = {k: tensors[k] for k in keys[s::num_shards]}
            save_file(part, os.path.join(folder, name))
            weight_map.update({k: name for k in part})
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return tensors


BF16 = ml_dtypes.bfloat16

"""The transformers side of the parity check (runs in the reference venv, CPU torch).

Builds a tiny random ``MiniMaxM3VLForCausalLM`` (transformers 5.23.0) of three layers: dense
attention + dense MLP, then two MSA (indexer) + MoE layers; re-draws its weights at unit
scale (the library's 0.02 init gives near-tied logits), saves it with ``save_pretrained``
and records, per prompt: the prefill logits (eager attention, where the indexer's block
selection is applied as an attention mask), each MoE layer's chosen experts (top-k of
sigmoid(router logits) + e_score_correction_bias, from the recorded router logits), and
greedy ``generate`` tokens.

    python tools/hf_reference/hf_side.py --out DIR --num-kv-heads 2 --seed 0 \
        --prompt-lens 100,3000 --decode-steps 16

writes ``DIR/checkpoint/`` (the saved model) and ``DIR/reference.npz``. With
``--released-vl`` it also writes ``DIR/released_vl/``: the same text weights under the
released VL names (``language_model.`` prefix, per-expert ``block_sparse_moe.experts.{e}.w1/w2/w3``,
split gate/up projections, ``self_attn.index_*``), a legacy ``text_config``
(``sparse_attention_config``, ``moe_layer_freq``), and a few vision and MTP weights; it
checks that transformers' own VL loader (``MiniMaxM3SparseForConditionalGeneration``,
through its checkpoint conversion mapping) reads back exactly the text model's weights and
per-layer attention / MLP types.

With ``--fp8`` (prompts ``--fp8-prompt-lens``, default 100,300) it also builds a separate tiny
model (``shared_intermediate_size=64``, so every linear input is a multiple of 32; seed + 100),
rounds its weights to bf16 and quantizes every quantizable linear (attention q/k/v/o, indexer
q/k, dense MLP, shared and routed experts; not the router gate, biases, norms, embedding,
LM head) with the quantizers below, in two formats:

- ``DIR/fp8_mxfp8/``: released VL names and config plus ``quantization_config``
  ``{"quant_method": "mxfp8", "ignored_layers": [...]}``; ``X.weight`` float8_e4m3fn
  ``[out, in]``, ``X.weight_scale_inv`` uint8 ``[out, in/32]`` (E8M0). Layer 0's o_proj is
  listed in ``ignored_layers`` and stored unquantized;
- ``DIR/fp8_block128/``: transformers' save_pretrained names and config plus the fp8 block
  ``quantization_config``; ``X.weight`` float8_e4m3fn, ``X.weight_scale_inv`` f32
  ``[ceil(out/128), ceil(in/128)]`` (fused experts: ``gate_up_proj_scale_inv`` /
  ``down_proj_scale_inv``, per expert on the last two axes);

non-quantized tensors in bf16. ``DIR/reference_fp8.npz`` holds ``fp8_ids_{n}`` and the f32
eager prefill logits ``[n, vocab]`` of the bf16-rounded model (``fp8_unquantized_logits_{n}``)
and of each format's exact dequantization (``fp8_mxfp8_logits_{n}``, ``fp8_block128_logits_{n}``).
The outputs of a run without ``--fp8`` are unchanged by it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import numpy as np


def tiny_config(num_kv_heads: int, vocab_size: int, shared_intermediate_size: int = 48):
    from transformers import MiniMaxM3VLTextConfig
    return MiniMaxM3VLTextConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=num_kv_heads, head_dim=32, rotary_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        dense_intermediate_size=96, intermediate_size=32,
        shared_intermediate_size=shared_intermediate_size,
        num_local_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.0,
        index_n_heads=num_kv_heads, index_head_dim=32, index_block_size=128,
        index_topk_blocks=16, index_local_blocks=1,
        layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        bos_token_id=None, eos_token_id=None, pad_token_id=None, max_position_embeddings=8192)


def redraw_weights(model, seed: int) -> None:
    """Unit-scale weights: matrices N(0, 1/fan_in), norms 0.1 N(0, 1) (Gemma 1 + w), the
    routing bias 0.1 N(0, 1), the embedding N(0, 1)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()) + sorted(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name:
                continue
            if name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:  # [out, in] or [E, out, in]
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def dense_logits(model, x) -> np.ndarray:
    """Prefill logits with the indexer's block mask replaced by the plain causal mask: what
    the model gives without the sparse selection (the negative control)."""
    import torch
    indexers = [layer.self_attn.indexer for layer in model.model.layers
                if layer.self_attn.indexer is not None]
    for ix in indexers:
        ix.build_block_mask = lambda block_indices, attention_mask, *a, **k: attention_mask
    try:
        with torch.no_grad():
            return model(input_ids=x, use_cache=False).logits[0].float().numpy()
    finally:
        for ix in indexers:
            del ix.build_block_mask


def released_name(key: str) -> str:
    """transformers' text key -> the released VL name (the inverse of transformers'
    minimax_m3_vl conversion mapping, for everything but the split tensors)."""
    if key == "lm_head.weight":
        return "language_model.lm_head.weight"
    key = "language_model." + key
    key = key.replace(".mlp.gate.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias")
    key = re.sub(r"\.mlp\.(gate|shared_experts)\.", r".block_sparse_moe.\1.", key)
    return re.sub(r"\.self_attn\.indexer\.(q|k)_(proj|norm)\.", r".self_attn.index_\1_\2.", key)


def released_split(key: str, v) -> list[tuple[str, object]]:
    """One tensor of transformers' text state dict -> [(released VL name, tensor)]: fused
    expert tensors split per expert (``gate_up_proj [E, 2I, H]`` -> w1 (gate), w3 (up)
    ``[I, H]``; ``down_proj [E, H, I]`` -> w2 ``[H, I]``), dense / shared ``gate_up_proj.weight
    [2I, H]`` split into gate_proj / up_proj ``[I, H]``. Splits are along rows, so they apply
    as well to MXFP8 scales ``[..., rows, in / 32]`` of the same key."""
    name = released_name(key)
    if key.endswith(".mlp.experts.gate_up_proj"):
        half = v.shape[1] // 2
        out = []
        for e in range(v.shape[0]):
            base = name.replace(".mlp.experts.gate_up_proj", f".block_sparse_moe.experts.{e}.")
            out += [(base + "w1.weight", v[e, :half].clone()), (base + "w3.weight", v[e, half:].clone())]
        return out
    if key.endswith(".mlp.experts.down_proj"):
        return [(name.replace(".mlp.experts.down_proj", f".block_sparse_moe.experts.{e}.w2.weight"),
                 v[e].clone()) for e in range(v.shape[0])]
    if key.endswith("gate_up_proj.weight"):
        half = v.shape[0] // 2
        return [(name.replace("gate_up_proj", "gate_proj"), v[:half].clone()),
                (name.replace("gate_up_proj", "up_proj"), v[half:].clone())]
    return [(name, v.clone())]


def released_extras(dtype=None) -> dict:
    """A few vision-tower, projector and MTP tensors (the loader skips them)."""
    import torch
    dtype = dtype or torch.float32
    return {"vision_tower.vision_model.pre_layrnorm.weight": torch.ones(16, dtype=dtype),
            "multi_modal_projector.linear_1.weight": torch.zeros(32, 16, dtype=dtype),
            "language_model.model.mtp.0.eh_proj.weight": torch.zeros(4, 4, dtype=dtype)}


def released_vl_config(cfg) -> dict:
    """The released VL ``config.json`` of text config ``cfg``: a legacy ``text_config``
    (``sparse_attention_config``, ``moe_layer_freq``) and a tiny ``vision_config``."""
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    legacy = {
        "model_type": "minimax_m3_vl_text", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "swigluoai",
        "rope_theta": cfg.rope_parameters["rope_theta"], "rotary_dim": cfg.rotary_dim,
        "partial_rotary_factor": cfg.rope_parameters["partial_rotary_factor"],
        "intermediate_size": cfg.intermediate_size, "dense_intermediate_size": cfg.dense_intermediate_size,
        "shared_intermediate_size": cfg.shared_intermediate_size, "n_shared_experts": 1,
        "num_local_experts": cfg.num_local_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "scoring_func": "sigmoid", "use_routing_bias": True,
        "routed_scaling_factor": cfg.routed_scaling_factor, "swiglu_alpha": cfg.swiglu_alpha,
        "swiglu_limit": cfg.swiglu_limit, "tie_word_embeddings": False, "num_mtp_modules": 1,
        "bos_token_id": None, "eos_token_id": None,
        "moe_layer_freq": [int(t == "sparse") for t in cfg.mlp_layer_types],
        "sparse_attention_config": {
            "use_sparse_attention": True, "sparse_index_dim": cfg.index_head_dim,
            "sparse_num_index_heads": cfg.index_n_heads, "sparse_topk_blocks": cfg.index_topk_blocks,
            "sparse_block_size": cfg.index_block_size, "sparse_score_type": "max",
            "sparse_init_block": 0, "sparse_local_block": cfg.index_local_blocks,
            "sparse_attention_freq": [int(t == "minimax_m3_sparse") for t in cfg.layer_types]},
    }
    return {"model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
            "text_config": legacy, "vision_config": vision, "projector_hidden_size": 32}


def write_released_vl(model, cfg, folder: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import MiniMaxM3SparseForConditionalGeneration
    state = model.state_dict()
    out = {name: t for key, v in state.items() for name, t in released_split(key, v)}
    out.update(released_extras())
    os.makedirs(folder, exist_ok=True)
    save_file(out, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(released_vl_config(cfg), f)
    # transformers' VL loader must read back the text model exactly
    vl = MiniMaxM3SparseForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    got = vl.state_dict()
    for key, v in state.items():
        mapped = key if key == "lm_head.weight" else key.replace("model.", "model.language_model.", 1)
        if mapped not in got or not torch.equal(got[mapped], v):
            raise SystemExit(f"released_vl: transformers reads {mapped} differently")
    tc = vl.config.text_config
    for field in ("layer_types", "mlp_layer_types", "index_n_heads", "index_head_dim", "rope_parameters"):
        if getattr(tc, field) != getattr(cfg, field):
            raise SystemExit(f"released_vl: legacy config gives {field}={getattr(tc, field)!r}, "
                             f"expected {getattr(cfg, field)!r}")


# ---- fp8 checkpoints (--fp8) -----------------------------------------------------------------

E4M3_MAX = 448.0
MX_GROUP, BLOCK = 32, 128
# transformers' text keys of the quantized linears (weights [out, in], fused experts [E, out, in])
QUANTIZED = re.compile(r"\.(self_attn\.([qkvo]_proj|indexer\.[qk]_proj)\.weight"
                       r"|mlp\.(shared_experts\.)?(gate_up|down)_proj\.weight"
                       r"|mlp\.experts\.(gate_up|down)_proj)$")
MX_EXCLUDED = "model.layers.0.self_attn.o_proj.weight"  # left unquantized in the MXFP8 folder
MX_QUANT_CONFIG = {"quant_method": "mxfp8",
                   "ignored_layers": ["language_model.lm_head",
                                      "language_model.model.layers.0.self_attn.o_proj"]}
BLOCK_QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [BLOCK, BLOCK],
                      "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}


def _block_expand(scale, n: int, k: int):
    """[..., ceil(n/128), ceil(k/128)] -> [..., n, k]: each block's scale on its elements."""
    return scale.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)[..., :n, :k]


def quantize(w, fmt: str):
    """f32 ``w [..., out, in]`` -> (values float8_e4m3fn [..., out, in], scales).

    mxfp8: scales uint8 [..., out, in/32], e = clamp(ceil(log2(amax / 448)) + 127, 0, 254)
    per 32 inputs of a row (127 for an all-zero group), values = w / 2^(e-127).
    block128: scales f32 [..., ceil(out/128), ceil(in/128)] = amax / 448 per 128 x 128 block
    (1 for an all-zero block), values = w / scale. Values are clamped to +-448 before the cast.
    """
    import torch
    *lead, n, k = w.shape
    if fmt == "mxfp8":
        g = w.reshape(*lead, n, k // MX_GROUP, MX_GROUP)
        amax = g.abs().amax(-1).double()
        e = torch.where(amax > 0, torch.ceil(torch.log2(amax / E4M3_MAX)) + 127,
                        torch.full_like(amax, 127.0)).clamp(0, 254)
        q = g / torch.exp2(e - 127).float()[..., None]
        return q.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(w.shape), e.to(torch.uint8)
    rn, rk = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.nn.functional.pad(w, (0, rk * BLOCK - k, 0, rn * BLOCK - n))
    amax = padded.reshape(*lead, rn, BLOCK, rk, BLOCK).abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).float()
    q = w / _block_expand(scale, n, k)
    return q.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def dequantize(values, scales):
    """The exact f32 value of ``quantize``'s output (format told by ``scales.dtype``)."""
    import torch
    v = values.float()
    if scales.dtype == torch.uint8:
        *lead, n, k = v.shape
        mult = torch.exp2(scales.float() - 127)[..., None]
        return (v.reshape(*lead, n, k // MX_GROUP, MX_GROUP) * mult).reshape(v.shape)
    return v * _block_expand(scales, *v.shape[-2:])


def scale_name(key: str) -> str:
    """``X.weight`` -> ``X.weight_scale_inv``; fused ``...experts.gate_up_proj`` -> ``..._scale_inv``."""
    return key[:-len(".weight")] + ".weight_scale_inv" if key.endswith(".weight") else key + "_scale_inv"


def fp8_state(state: dict, fmt: str, excluded=()) -> tuple[dict, dict]:
    """bf16-valued f32 state dict -> ({key: (values, scales) for each quantized linear, else the
    bf16 tensor}, {key: the f32 weights the model runs: dequantized or unchanged})."""
    import torch
    stored, run = {}, {}
    for key, v in state.items():
        if QUANTIZED.search(key) and key not in excluded:
            stored[key] = quantize(v, fmt)
            run[key] = dequantize(*stored[key])
        else:
            stored[key], run[key] = v.to(torch.bfloat16), v
    return stored, run


def write_fp8_block128(model, stored: dict, folder: str) -> None:
    """transformers' save_pretrained names and config + BLOCK_QUANT_CONFIG; quantized weights
    float8_e4m3fn with f32 ``weight_scale_inv``, the rest bf16."""
    from safetensors.torch import save_file
    out = {}
    for key, item in stored.items():
        if isinstance(item, tuple):
            out[key], out[scale_name(key)] = item
        else:
            out[key] = item
    model.config.save_pretrained(folder)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(dtype="bfloat16", quantization_config=BLOCK_QUANT_CONFIG)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    save_file(out, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def write_fp8_mxfp8(cfg, stored: dict, folder: str) -> None:
    """Released VL names and config + MX_QUANT_CONFIG; quantized weights float8_e4m3fn with
    uint8 ``weight_scale_inv``, the rest (the excluded layer-0 o_proj included) bf16."""
    import torch
    from safetensors.torch import save_file
    out = {}
    for key, item in stored.items():
        if isinstance(item, tuple):
            out.update(released_split(key, item[0]))
            out.update((name[:-len(".weight")] + ".weight_scale_inv", t)
                       for name, t in released_split(key, item[1]))
        else:
            out.update(released_split(key, item))
    out.update(released_extras(torch.bfloat16))
    os.makedirs(folder, exist_ok=True)
    save_file(out, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**released_vl_config(cfg), "quantization_config": MX_QUANT_CONFIG}, f, indent=2)


def rel_l2(a, b) -> float:
    """||a - b|| / ||b|| (f64)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run_fp8(args) -> None:
    """A separate tiny model (shared_intermediate_size=64: every linear input a multiple of 32,
    its own seed), rounded to bf16; writes DIR/fp8_mxfp8/, DIR/fp8_block128/ and
    DIR/reference_fp8.npz: ``fp8_ids_{n}`` int32 [n]; ``fp8_{unquantized,mxfp8,block128}_logits_{n}``
    f32 [n, vocab] (eager prefill of the bf16-rounded model, then of each format's exact
    dequantization); ``fp8_{fmt}_weight_rel_l2`` (over all quantized weights)."""
    import torch
    from transformers import MiniMaxM3VLForCausalLM
    cfg = tiny_config(args.num_kv_heads, args.vocab_size, shared_intermediate_size=64)
    cfg._attn_implementation = "eager"
    model = MiniMaxM3VLForCausalLM(cfg).float().eval()
    redraw_weights(model, args.seed + 100)
    state = {k: v.to(torch.bfloat16).float() if v.is_floating_point() else v
             for k, v in model.state_dict().items()}
    lens = [int(x) for x in args.fp8_prompt_lens.split(",")]
    rng = np.random.default_rng(args.seed + 2)
    prompts = {n: rng.integers(0, args.vocab_size, n).astype(np.int32) for n in lens}

    def logits(weights: dict) -> dict:
        model.load_state_dict(weights, strict=True)
        with torch.no_grad():
            return {n: model(input_ids=torch.tensor(ids[None], dtype=torch.long),
                             use_cache=False).logits[0].float().numpy() for n, ids in prompts.items()}

    out = {f"fp8_ids_{n}": ids for n, ids in prompts.items()}
    base = logits(state)
    out.update({f"fp8_unquantized_logits_{n}": v for n, v in base.items()})
    quant_keys = [k for k in state if QUANTIZED.search(k)]
    for fmt, excluded in (("mxfp8", (MX_EXCLUDED,)), ("block128", ())):
        stored, run = fp8_state(state, fmt, excluded)
        if fmt == "mxfp8":
            write_fp8_mxfp8(cfg, stored, os.path.join(args.out, "fp8_mxfp8"))
        else:
            write_fp8_block128(model, stored, os.path.join(args.out, "fp8_block128"))
        w_err = rel_l2(np.concatenate([run[k].numpy().ravel() for k in quant_keys]),
                       np.concatenate([state[k].numpy().ravel() for k in quant_keys]))
        out[f"fp8_{fmt}_weight_rel_l2"] = np.float64(w_err)
        for n, v in logits(run).items():
            out[f"fp8_{fmt}_logits_{n}"] = v
            print(f"fp8 {fmt}: weights rel L2 {w_err:.2e}; logits ({n} tokens) vs unquantized "
                  f"rel L2 {rel_l2(v, base[n]):.2e}")
    np.savez(os.path.join(args.out, "reference_fp8.npz"), **out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-kv-heads", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--prompt-lens", default="100,3000")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--released-vl", action="store_true",
                    help="also write (and check with transformers) DIR/released_vl")
    ap.add_argument("--fp8", action="store_true",
                    help="also write DIR/fp8_mxfp8, DIR/fp8_block128 and DIR/reference_fp8.npz")
    ap.add_argument("--fp8-prompt-lens", default="100,300")
    args = ap.parse_args(argv)

    import torch
    import transformers
    from transformers import MiniMaxM3VLForCausalLM

    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    cfg = tiny_config(args.num_kv_heads, args.vocab_size)
    cfg._attn_implementation = "eager"
    model = MiniMaxM3VLForCausalLM(cfg).float().eval()
    redraw_weights(model, args.seed)
    ckpt = os.path.join(args.out, "checkpoint")
    model.save_pretrained(ckpt)
    if args.released_vl:
        write_released_vl(model, cfg, os.path.join(args.out, "released_vl"))
    moe_layers = [i for i, t in enumerate(cfg.mlp_layer_types) if t == "sparse"]
    biases = [model.model.layers[i].mlp.gate.e_score_correction_bias.detach().float() for i in moe_layers]
    k = cfg.num_experts_per_tok

    rng = np.random.default_rng(args.seed + 1)
    out = {"moe_layers": np.array(moe_layers), "transformers_version": np.array(transformers.__version__),
           "attn_implementation": np.array(model.config._attn_implementation)}
    lens = [int(x) for x in args.prompt_lens.split(",")]
    for n in lens:
        ids = rng.integers(0, args.vocab_size, n)
        x = torch.tensor(ids[None], dtype=torch.long)
        with torch.no_grad():
            res = model(input_ids=x, use_cache=False, output_router_logits=True)
            logits = res.logits[0].float().numpy()
            chosen = []
            for rl, bias in zip(res.router_logits, biases):
                scores = torch.sigmoid(rl.float().reshape(n, -1)) + bias
                chosen.append(np.sort(torch.topk(scores, k, dim=-1).indices.numpy(), axis=-1))
            gen = model.generate(x, max_new_tokens=args.decode_steps, do_sample=False,
                                 attention_mask=torch.ones_like(x))
        out[f"ids_{n}"] = ids.astype(np.int32)
        out[f"logits_{n}"] = logits.astype(np.float32)
        out[f"experts_{n}"] = np.stack(chosen).astype(np.int32)  # [moe layers, T, k] sorted
        out[f"generated_{n}"] = gen[0, n:].numpy().astype(np.int32)
        if n > cfg.index_topk_blocks * cfg.index_block_size:
            out[f"dense_logits_{n}"] = dense_logits(model, x)
    np.savez(os.path.join(args.out, "reference.npz"), **out)
    if args.fp8:
        run_fp8(args)
    with open(os.path.join(args.out, "done.json"), "w") as f:
        json.dump({"prompt_lens": lens, "num_kv_heads": args.num_kv_heads}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

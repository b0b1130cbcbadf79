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
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import numpy as np


def tiny_config(num_kv_heads: int, vocab_size: int):
    from transformers import MiniMaxM3VLTextConfig
    return MiniMaxM3VLTextConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=num_kv_heads, head_dim=32, rotary_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        dense_intermediate_size=96, intermediate_size=32, shared_intermediate_size=48,
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


def write_released_vl(model, cfg, folder: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import MiniMaxM3SparseForConditionalGeneration
    out = {}
    state = model.state_dict()
    for key, v in state.items():
        name = released_name(key)
        if key.endswith(".mlp.experts.gate_up_proj"):  # [E, 2I, H] -> w1 (gate), w3 (up) [I, H]
            half = v.shape[1] // 2
            for e in range(v.shape[0]):
                base = name.replace(".mlp.experts.gate_up_proj", f".block_sparse_moe.experts.{e}.")
                out[base + "w1.weight"] = v[e, :half].clone()
                out[base + "w3.weight"] = v[e, half:].clone()
        elif key.endswith(".mlp.experts.down_proj"):  # [E, H, I] -> w2 [H, I]
            for e in range(v.shape[0]):
                out[name.replace(".mlp.experts.down_proj",
                                 f".block_sparse_moe.experts.{e}.w2.weight")] = v[e].clone()
        elif key.endswith("gate_up_proj.weight"):  # dense MLP / shared expert: [2I, H]
            half = v.shape[0] // 2
            out[name.replace("gate_up_proj", "gate_proj")] = v[:half].clone()
            out[name.replace("gate_up_proj", "up_proj")] = v[half:].clone()
        else:
            out[name] = v.clone()
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    out["vision_tower.vision_model.pre_layrnorm.weight"] = torch.ones(16)
    out["multi_modal_projector.linear_1.weight"] = torch.zeros(32, 16)
    out["language_model.model.mtp.0.eh_proj.weight"] = torch.zeros(4, 4)
    os.makedirs(folder, exist_ok=True)
    save_file(out, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
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
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
                   "text_config": legacy, "vision_config": vision, "projector_hidden_size": 32}, f)
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
    with open(os.path.join(args.out, "done.json"), "w") as f:
        json.dump({"prompt_lens": lens, "num_kv_heads": args.num_kv_heads}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

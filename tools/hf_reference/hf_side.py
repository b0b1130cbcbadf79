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

writes ``DIR/checkpoint/`` (the saved model) and ``DIR/reference.npz``.
"""
from __future__ import annotations

import argparse
import json
import os
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-kv-heads", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--prompt-lens", default="100,3000")
    ap.add_argument("--decode-steps", type=int, default=16)
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

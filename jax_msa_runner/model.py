"""The MiniMax-M3 text model: parameters, layers and the forward pass (pure functions).

Per layer: Gemma RMSNorm -> attention -> residual -> Gemma RMSNorm -> MLP -> residual.
The MLP is a dense swigluoai MLP, or on layers with ``moe_layer_freq[i] == 1`` a mixture of
experts: a sigmoid router in f32 (``e_score_correction_bias`` added for choosing the top-k
experts only; the chosen sigmoid scores renormalised to sum 1, times
``routed_scaling_factor``), swigluoai routed experts (``pallas_kernels.moe_experts_default``:
the Mosaic GPU expert kernels on a GPU, XLA grouped matmuls elsewhere), plus one ungated
shared expert. Attention: q/k/v projections, per-head Gemma RMSNorm on q and k, partial NeoX
RoPE on the first ``rotary_dim`` channels of every head, GQA over the paged cache. Layers
with ``sparse_attention_freq[i] == 1`` are MSA layers: they also project index queries
(one head per KV head) and one shared index key, normalise and rotate them with the same
tables, write the index key into the index-K cache, and attend through
``attention.layer.msa_layer_attention`` (indexer -> page top-k -> sparse attention). Other
layers use dense paged causal attention.

A linear weight is ``[in, out]`` in the model dtype or, from an fp8 checkpoint, an
``Fp8Weight`` (values e4m3 ``[..., out, in]`` with their scales): ``linear`` runs those as
weight-only fp8 matmuls (``fp8_matmul_default``); the routed experts' fp8 weights go to the
expert kernels as they are (dequantized on chip).

Params and caches are pytrees; every shape is static per bucket. ``dcp_world_size`` is
passed through to ``attention.layer``, the one place that treats decode context
parallelism differently. ``tp_size`` / ``ep_size`` > 1: the forward runs inside the step's
shard_map over ``attention.parallel``'s 3-D mesh on this rank's param and cache shards
(heads, intermediate sizes, experts and vocabulary split as that module describes); the
partial results are summed with its collectives (``tensor_psum``, ``moe_psum``,
``vocab_embed``, ``gather_vocab``), every rank ending with the same hidden states.

Op families for profiles (``bench/step.py``): the layer functions wrap their parts in
``jax.named_scope`` ("projections": the attention and index linears; "norms": the RMSNorms,
with the RoPE of q/k and the index q/k; "attention_dense" / "attention_msa": cache writes and
attention; "moe"; "dense_mlp"; "lm_head"), which the compiled HLO's ``op_name`` metadata
carries. Scopes change no computation.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_msa_runner.attention.layer import (dense_layer_attention, msa_layer_attention,
                                            write_layer_caches)
from jax_msa_runner.attention.paged_cache import KVCaches
from jax_msa_runner.attention.parallel import (expert_offset, gather_vocab, moe_psum,
                                               tensor_psum, vocab_embed)
from jax_msa_runner.batch.metadata import BatchMetadata
from jax_msa_runner.config import ModelConfig
from pallas_kernels.fp8_matmul import Fp8Weight
from pallas_kernels.fp8_matmul_default import fp8_matmul_default
from pallas_kernels.moe_experts_default import moe_experts_default

# ---- parameters ------------------------------------------------------------------------------

def init_params(config: ModelConfig, seed: int = 0) -> dict:
    """Random weights from ``seed`` (a pytree of arrays in ``config.dtype``; MoE routers f32).

    Layer dicts: attention (q/k/v/o_proj [in, out], q/k_norm, index_* on MSA layers), the
    norms, and either a dense MLP (gate_up_proj [H, 2I], down_proj [I, H]) or, on MoE
    layers, ``init_moe_params``' entries.
    Projections ~ N(0, 1/fan_in); norm weights ~ 0.1 * N(0, 1) so the Gemma ``(1 + w)`` is
    exercised; the embedding ~ N(0, 1).
    """
    c = config
    dt = c.jnp_dtype
    keys = iter(jax.random.split(jax.random.key(seed), 4 + 24 * c.num_layers))

    def dense(shape, dtype=dt):
        fan_in = shape[-2]
        return (jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)

    def norm(n):
        return (0.1 * jax.random.normal(next(keys), (n,), jnp.float32)).astype(dt)

    layers = []
    for msa, moe in zip(c.layer_is_msa, c.layer_is_moe):
        layer = {
            "input_norm": norm(c.hidden_size),
            "q_proj": dense((c.hidden_size, c.num_heads * c.head_dim)),
            "k_proj": dense((c.hidden_size, c.num_kv_heads * c.head_dim)),
            "v_proj": dense((c.hidden_size, c.num_kv_heads * c.head_dim)),
            "o_proj": dense((c.num_heads * c.head_dim, c.hidden_size)),
            "q_norm": norm(c.head_dim),
            "k_norm": norm(c.head_dim),
            "post_attention_norm": norm(c.hidden_size),
        }
        if moe:
            layer.update(init_moe_params(c, next(keys)))
        else:
            layer.update({
                "gate_up_proj": dense((c.hidden_size, 2 * c.intermediate_size)),
                "down_proj": dense((c.intermediate_size, c.hidden_size)),
            })
        if msa:
            layer.update({
                "index_q_proj": dense((c.hidden_size, c.num_index_heads * c.index_dim)),
                "index_k_proj": dense((c.hidden_size, c.index_dim)),
                "index_q_norm": norm(c.index_dim),
                "index_k_norm": norm(c.index_dim),
            })
        layers.append(layer)
    params = {
        "embed": jax.random.normal(next(keys), (c.vocab_size, c.hidden_size), jnp.float32).astype(dt),
        "layers": tuple(layers),
        "final_norm": norm(c.hidden_size),
    }
    if not c.tie_word_embeddings:
        params["lm_head"] = dense((c.hidden_size, c.vocab_size))
    return params


def init_moe_params(config: ModelConfig, key: jax.Array) -> dict:
    """Random MoE weights of one layer.

    router [H, E] f32 ~ N(0, 1/H); router_bias [E] f32 ~ 0.1 * N(0, 1) (only present with
    ``use_routing_bias``); experts_gate_up [E, H, 2I] (gate | up halves); experts_down
    [E, I, H]; shared_gate_up [H, 2Is], shared_down [Is, H] (only with a shared expert);
    expert weights in ``config.dtype``, N(0, 1/fan_in).
    """
    c = config
    H, E, I, Is = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_intermediate_size
    k = iter(jax.random.split(key, 6))

    def w(shape, dtype=c.jnp_dtype):
        return (jax.random.normal(next(k), shape, jnp.float32) / math.sqrt(shape[-2])).astype(dtype)

    out = {"router": w((H, E), jnp.float32),
           "experts_gate_up": w((E, H, 2 * I)),
           "experts_down": w((E, I, H))}
    if c.use_routing_bias:
        out["router_bias"] = 0.1 * jax.random.normal(next(k), (E,), jnp.float32)
    if Is:
        out["shared_gate_up"] = w((H, 2 * Is))
        out["shared_down"] = w((Is, H))
    return out


# ---- building blocks -------------------------------------------------------------------------

def gemma_rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """``x * rsqrt(mean(x^2) + eps) * (1 + w)`` over the last axis, computed in f32."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def rope_tables(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin [T, rotary_dim // 2] (f32) for NeoX split-half rotation."""
    inv_freq = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    ang = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    return jnp.cos(ang), jnp.sin(ang)


def apply_partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first ``2 * cos.shape[-1]`` channels of x [T, H, Dx] (NeoX split-half)."""
    half = cos.shape[-1]
    xf = x.astype(jnp.float32)
    x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
    c, s = cos[:, None, :], sin[:, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)
    return out.astype(x.dtype)


def swigluoai(gate_up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """``(clip(up) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``; gate|up halves."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1.0) * gate * jax.nn.sigmoid(alpha * gate)


def linear(x: jax.Array, w) -> jax.Array:
    """``x [..., in] @ w`` in x.dtype: w a dense ``[in, out]`` array, or an ``Fp8Weight``
    (values ``[out, in]``) through the weight-only fp8 matmul (f32 accumulation)."""
    if isinstance(w, Fp8Weight):
        return fp8_matmul_default(x, w, out_dtype=x.dtype)
    return x @ w


def dense_mlp(x: jax.Array, gate_up, down, alpha: float, limit: float) -> jax.Array:
    """swigluoai MLP: x [T, H] @ gate_up [H, 2I] -> act [T, I] @ down [I, H] -> [T, H]
    (either weight may be an ``Fp8Weight``, see ``linear``)."""
    return linear(swigluoai(linear(x, gate_up), alpha, limit), down)


def route(x: jax.Array, router: jax.Array, bias: jax.Array | None, *, top_k: int,
          routed_scaling_factor: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sigmoid top-k routing in f32.

    x [T, H]; router [H, E] f32; bias [E] f32 or None (added to the scores for choosing only).
    Returns (weights [T, k] f32: the chosen sigmoid scores renormalised to sum 1, times
    ``routed_scaling_factor``; experts [T, k] int32, by descending biased score;
    logits [T, E] f32).
    """
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)[None, :]
    _, experts = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True) * routed_scaling_factor
    return weights, experts.astype(jnp.int32), logits


def routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, token_mask: jax.Array,
                   gate_up, down, alpha: float, limit: float) -> jax.Array:
    """Weighted sum of each token's chosen swigluoai experts (all E experts local).

    x [T, H]; weights [T, k] f32; experts [T, k] int32 in [0, E); token_mask [T] bool;
    gate_up [E, H, 2I] / down [E, I, H] in x.dtype, or ``Fp8Weight``s (values [E, 2I, H] /
    [E, H, I]). Copies of masked (padding) tokens contribute nothing. Returns [T, H] in x.dtype.
    """
    return routed_experts_partial(x, weights, experts, token_mask, gate_up, down, alpha,
                                  limit).astype(x.dtype)


def routed_experts_partial(x: jax.Array, weights: jax.Array, experts: jax.Array,
                           token_mask: jax.Array, gate_up, down, alpha: float, limit: float,
                           first_expert=0) -> jax.Array:
    """``routed_experts`` over the local experts ``[first_expert, first_expert + E_local)``
    only (gate_up [E_local, H, 2I_local], down [E_local, I_local, H], or ``Fp8Weight``s):
    copies routed to other experts contribute nothing. Returns f32 [T, H], the partial sum
    that the other ranks' partials complete. Runs ``moe_experts_default``: the Mosaic GPU
    expert kernels on a GPU (weights streamed once, fp8 dequantized on chip), XLA's grouped
    matmuls elsewhere."""
    return moe_experts_default(x, weights, experts, token_mask, gate_up, down, alpha=alpha,
                               limit=limit, first_expert=first_expert)


def moe_mlp(layer: dict, x: jax.Array, token_mask: jax.Array, config: ModelConfig,
            tp_size: int = 1, ep_size: int = 1) -> tuple[jax.Array, jax.Array]:
    """MoE MLP of one layer: x [T, H] -> ([T, H], chosen experts [T, k] int32).

    tp_size / ep_size > 1 (inside the step's shard_map): this rank's experts and
    intermediate slices; every rank routes all (replicated) tokens, computes its local
    experts, and the partial outputs are summed over "tensor" and "expert" (``moe_psum``);
    the shared expert's over "tensor".
    """
    c = config
    weights, experts, _ = route(x, layer["router"], layer.get("router_bias"),
                                top_k=c.num_experts_per_tok,
                                routed_scaling_factor=c.routed_scaling_factor)
    gate_up, down = layer["experts_gate_up"], layer["experts_down"]
    local_experts = (gate_up.values if isinstance(gate_up, Fp8Weight) else gate_up).shape[0]
    part = routed_experts_partial(x, weights, experts, token_mask, gate_up, down,
                                  c.swiglu_alpha, c.swiglu_limit,
                                  first_expert=expert_offset(local_experts, ep_size))
    out = moe_psum(part, tp_size, ep_size).astype(x.dtype)
    if c.shared_intermediate_size:
        out = out + tensor_psum(dense_mlp(x, layer["shared_gate_up"], layer["shared_down"],
                                          c.swiglu_alpha, c.swiglu_limit), tp_size)
    return out, experts


# ---- layers ----------------------------------------------------------------------------------

def _attention_block(layer: dict, x: jax.Array, kv_cache: jax.Array, index_cache, md: BatchMetadata,
                     cos, sin, *, config: ModelConfig, is_msa: bool, attention_impl: str,
                     attention_mode: str, dcp_world_size: int, interpret: bool):
    c = config
    T = x.shape[0]
    with jax.named_scope("projections"):
        q = linear(x, layer["q_proj"]).reshape(T, c.num_heads, c.head_dim)
        k = linear(x, layer["k_proj"]).reshape(T, c.num_kv_heads, c.head_dim)
        v = linear(x, layer["v_proj"]).reshape(T, c.num_kv_heads, c.head_dim)
    with jax.named_scope("norms"):
        q = apply_partial_rope(gemma_rms_norm(q, layer["q_norm"], c.rms_norm_eps), cos, sin)
        k = apply_partial_rope(gemma_rms_norm(k, layer["k_norm"], c.rms_norm_eps), cos, sin)
    if is_msa:
        with jax.named_scope("projections"):
            iq = linear(x, layer["index_q_proj"]).reshape(T, c.num_index_heads, c.index_dim)
            ik = linear(x, layer["index_k_proj"]).reshape(T, 1, c.index_dim)
        with jax.named_scope("norms"):
            iq = apply_partial_rope(gemma_rms_norm(iq, layer["index_q_norm"], c.rms_norm_eps),
                                    cos, sin)
            ik = apply_partial_rope(gemma_rms_norm(ik, layer["index_k_norm"], c.rms_norm_eps),
                                    cos, sin)
        with jax.named_scope("attention_msa"):
            kv_cache, index_cache = write_layer_caches(kv_cache, index_cache, k, v, ik[:, 0], md,
                                                       dcp_world_size=dcp_world_size)
            attn = msa_layer_attention(q, iq, kv_cache, index_cache, md, scale=c.scale,
                                       attention_impl=attention_impl, attention_mode=attention_mode,
                                       init_blocks=c.init_blocks, local_blocks=c.local_blocks,
                                       dcp_world_size=dcp_world_size, interpret=interpret)
    else:
        with jax.named_scope("attention_dense"):
            kv_cache, _ = write_layer_caches(kv_cache, None, k, v, None, md,
                                             dcp_world_size=dcp_world_size)
            attn = dense_layer_attention(q, kv_cache, md, scale=c.scale,
                                         dcp_world_size=dcp_world_size)
    with jax.named_scope("projections"):
        out = linear(attn.reshape(T, c.num_heads * c.head_dim), layer["o_proj"])
    return out, kv_cache, index_cache  # under TP: this rank's heads' partial sum


def forward_with_routing(params: dict, caches: KVCaches, token_ids: jax.Array,
                         md: BatchMetadata, *, config: ModelConfig,
                         attention_impl: str = "reference", attention_mode: str = "msa",
                         dcp_world_size: int = 1, interpret: bool = False,
                         tp_size: int = 1, ep_size: int = 1
                         ) -> tuple[jax.Array, KVCaches, tuple[jax.Array | None, ...]]:
    """``forward`` that also returns each layer's chosen experts: a tuple with one entry per
    layer, int32 [T, k] on MoE layers (by descending biased score), None on dense-MLP layers."""
    c = config
    ac = c.per_rank(tp_size) if tp_size > 1 else c  # this rank's attention heads
    x = vocab_embed(params["embed"], token_ids, tp_size)
    cos, sin = rope_tables(md.positions, c.rotary_dim, c.rope_theta)
    new_kv, new_idx, routing = [], [], []
    for i, (layer, is_msa, is_moe) in enumerate(zip(params["layers"], c.layer_is_msa,
                                                     c.layer_is_moe)):
        with jax.named_scope("norms"):
            h = gemma_rms_norm(x, layer["input_norm"], c.rms_norm_eps)
        attn, kv_i, idx_i = _attention_block(layer, h, caches.kv[i], caches.index_k[i], md, cos, sin,
                                             config=ac, is_msa=is_msa, attention_impl=attention_impl,
                                             attention_mode=attention_mode,
                                             dcp_world_size=dcp_world_size, interpret=interpret)
        x = x + tensor_psum(attn, tp_size)
        with jax.named_scope("norms"):
            h = gemma_rms_norm(x, layer["post_attention_norm"], c.rms_norm_eps)
        if is_moe:
            with jax.named_scope("moe"):
                mlp, chosen = moe_mlp(layer, h, md.token_mask, c, tp_size, ep_size)
        else:
            with jax.named_scope("dense_mlp"):
                mlp, chosen = tensor_psum(dense_mlp(h, layer["gate_up_proj"], layer["down_proj"],
                                                    c.swiglu_alpha, c.swiglu_limit), tp_size), None
        x = x + mlp
        new_kv.append(kv_i)
        new_idx.append(idx_i)
        routing.append(chosen)
    with jax.named_scope("norms"):
        x = gemma_rms_norm(x, params["final_norm"], c.rms_norm_eps)
    return x, KVCaches(kv=tuple(new_kv), index_k=tuple(new_idx)), tuple(routing)


def forward(params: dict, caches: KVCaches, token_ids: jax.Array, md: BatchMetadata, *,
            config: ModelConfig, attention_impl: str = "reference",
            attention_mode: str = "msa", dcp_world_size: int = 1,
            interpret: bool = False, tp_size: int = 1, ep_size: int = 1
            ) -> tuple[jax.Array, KVCaches]:
    """Run the stack on one step's tokens, writing their K/V (and index K) into the caches.

    token_ids [T] int32 (padding arbitrary); md: the step's staged metadata.
    dcp_world_size (static) W > 1: call inside a shard_map over "dcp"; caches are this
    rank's (leaves [N_local, ...]), md is staged with the same W (rank-local block table).
    interpret: Pallas interpret mode for attention_impl "pallas" (CPU).
    tp_size / ep_size (static) > 1: call inside the step's shard_map over the 3-D mesh with
    this rank's param and cache shards (``attention.parallel``).
    Returns (hidden [T, hidden] after the final norm (replicated under DCP / TP / EP),
    updated caches).
    """
    hidden, caches, _ = forward_with_routing(
        params, caches, token_ids, md, config=config, attention_impl=attention_impl,
        attention_mode=attention_mode, dcp_world_size=dcp_world_size, interpret=interpret,
        tp_size=tp_size, ep_size=ep_size)
    return hidden, caches


def compute_logits(params: dict, hidden: jax.Array, config: ModelConfig,
                   tp_size: int = 1) -> jax.Array:
    """LM head: hidden [..., hidden] -> logits [..., vocab] in f32 (under TP: this rank's
    vocab slice, then all-gathered)."""
    w = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    with jax.named_scope("lm_head"):
        local = hidden @ w
    return gather_vocab(local.astype(jnp.float32), tp_size)

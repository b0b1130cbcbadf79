"""A MiniMax-M3-shaped attention stack with random weights (any size).

Per layer: Gemma RMSNorm -> attention -> residual -> Gemma RMSNorm -> dense swigluoai MLP
-> residual. Attention: q/k/v projections, per-head Gemma RMSNorm on q and k, partial NeoX
RoPE on the first ``rotary_dim`` channels of every head, GQA over the paged cache. Layers
with ``sparse_attention_freq[i] == 1`` are MSA layers: they also project index queries
(one head per KV head) and one shared index key, normalise and rotate them with the same
tables, write the index key into the index-K cache (``index_cache_dtype``: the model dtype
or float8_e4m3fn: half the O(L) index-K bytes the indexer reads vs bf16), and attend through
``msa_layer_attention`` (indexer -> page top-k -> sparse attention). Other layers use dense
paged causal attention. The released model's MoE MLPs are replaced by one dense swigluoai
MLP of ``intermediate_size`` (the issue asks for the attention stack).

All functions are pure; params and caches are pytrees; every shape is static per bucket.

Decode context parallelism (spec section 7): with ``dcp_world_size = W > 1`` the step runs
inside a ``jax.shard_map`` over the mesh axis ``"dcp"`` (the runner builds it). Params,
tokens and metadata are replicated, so every rank computes every token's projections; the
caches passed to ``forward`` are the rank's own (``[N_local, ...]``): writes go only to the
owning rank (``dcp.rank_slot_mapping``), MSA layers run the distributed indexer and the
LSE-merged sparse decode (``dcp_attention.rank_msa_attention``), dense layers the
LSE-merged paged attention (``rank_dense_attention``). The attention output is identical on
every rank, hence so is the rest of the step.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_msa_runner.config import (FP8_INDEX_CACHE_DTYPE, MSA_TOPK, PAGE_SIZE, ConfigError,
                                   MSAConfig)
from jax_msa_runner.dcp import rank_slot_mapping
from jax_msa_runner.dcp_attention import DCP_AXIS, rank_dense_attention, rank_msa_attention
from jax_msa_runner.dense_attention import paged_causal_attention
from jax_msa_runner.kv_cache import KVCaches, init_kv_caches, write_index_k, write_kv
from jax_msa_runner.metadata import BatchMetadata
from pallas_kernels.msa_attention import msa_attention, msa_attention_reference

ATTENTION_IMPLS = ("pallas", "reference")
ATTENTION_MODES = ("msa", "dense")


def default_attention_impl() -> str:
    """Pallas kernels on a GPU, the jnp references elsewhere (interpret mode is too slow)."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes of the model (hashable: a jit static argument)."""

    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 16
    num_kv_heads: int = 1
    head_dim: int = 128
    rotary_dim: int = 64
    rope_theta: float = 5e6
    rms_norm_eps: float = 1e-6
    intermediate_size: int = 512
    num_index_heads: int = 1
    index_dim: int = 64
    sparse_attention_freq: tuple[int, ...] = (0, 1, 1, 1)
    topk_blocks: int = MSA_TOPK
    block_size: int = PAGE_SIZE
    init_blocks: int = 0
    local_blocks: int = 1
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    # index-K cache: "auto" (= dtype, the default), dtype's own name, or "float8_e4m3fn"
    index_cache_dtype: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "sparse_attention_freq",
                           tuple(int(bool(f)) for f in self.sparse_attention_freq))

        def req(cond, field, msg):
            if not cond:
                raise ConfigError(f"{field}: {msg}")

        req(len(self.sparse_attention_freq) == self.num_layers, "sparse_attention_freq",
            f"needs one entry per layer ({self.num_layers}), got {len(self.sparse_attention_freq)}")
        req(self.num_heads % self.num_kv_heads == 0, "num_heads",
            f"must be a multiple of num_kv_heads={self.num_kv_heads}")
        req(self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim, "rotary_dim",
            f"must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}")
        req(self.block_size == PAGE_SIZE, "block_size", f"must be {PAGE_SIZE}, got {self.block_size}")
        req(self.topk_blocks == MSA_TOPK, "topk_blocks", f"must be {MSA_TOPK}, got {self.topk_blocks}")
        if any(self.sparse_attention_freq):
            req(self.num_index_heads == self.num_kv_heads, "num_index_heads",
                f"must equal num_kv_heads={self.num_kv_heads} (one index head per KV group)")
            req(self.index_dim >= self.rotary_dim, "index_dim",
                f"must be >= rotary_dim={self.rotary_dim} (index q/k share the RoPE tables)")
        req(self.dtype in ("float32", "bfloat16"), "dtype", f"float32 or bfloat16, got {self.dtype}")
        req(self.index_cache_dtype in ("auto", self.dtype, FP8_INDEX_CACHE_DTYPE),
            "index_cache_dtype", f"one of 'auto', {self.dtype!r} (the model dtype) or "
            f"{FP8_INDEX_CACHE_DTYPE!r}, got {self.index_cache_dtype!r}")

    # ---- derived -------------------------------------------------------------------------
    @property
    def layer_is_msa(self) -> tuple[bool, ...]:
        return tuple(bool(f) for f in self.sparse_attention_freq)

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def index_cache_jnp_dtype(self):
        """dtype of the index-K cache pages ("auto": the model dtype)."""
        auto = self.index_cache_dtype == "auto"
        return self.jnp_dtype if auto else jnp.dtype(self.index_cache_dtype)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    def msa_config(self) -> MSAConfig:
        """The attention geometry as the metadata/kernel side describes it."""
        return MSAConfig(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                         head_dim=self.head_dim, num_index_heads=self.num_kv_heads,
                         index_dim=self.index_dim, init_blocks=self.init_blocks,
                         local_blocks=self.local_blocks)

    def per_rank(self, tp: int) -> "ModelConfig":
        """Attention shapes of one tensor-parallel rank (heads split, KV/index heads too)."""
        if self.num_heads % tp or self.num_kv_heads % tp:
            raise ConfigError(f"tp: {tp} must divide num_heads={self.num_heads} and "
                              f"num_kv_heads={self.num_kv_heads}")
        return dataclasses.replace(self, num_heads=self.num_heads // tp,
                                   num_kv_heads=self.num_kv_heads // tp,
                                   num_index_heads=self.num_index_heads // tp)

    # ---- constructors ----------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides) -> "ModelConfig":
        """Built-in small default: 4 layers (1 dense + 3 MSA), 16 q / 1 kv heads of dim 128,
        index dim 64 (the released model: 128; smaller keeps the CPU demo quick)."""
        return dataclasses.replace(cls(), **overrides)

    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | Mapping[str, Any], *,
                       num_layers: int | None = None, dtype: str = "bfloat16") -> "ModelConfig":
        """Build from a MiniMax-M3-style ``config.json`` (a path, its directory, or a dict).

        Reads the released field names: ``hidden_size``, ``num_hidden_layers``,
        ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rotary_dim``,
        ``rope_theta`` (or ``rope_parameters.rope_theta``), ``rms_norm_eps``, ``vocab_size``,
        ``dense_intermediate_size`` (else ``intermediate_size``), ``swiglu_alpha``,
        ``swiglu_limit``, ``tie_word_embeddings`` and ``sparse_attention_config`` with
        ``sparse_attention_freq``, ``sparse_num_index_heads``, ``sparse_index_dim``,
        ``sparse_block_size``, ``sparse_topk_blocks``, ``sparse_init_block``,
        ``sparse_local_block``, ``sparse_score_type``. A VL config's ``text_config`` is used.
        ``num_layers`` truncates the stack (keeping the freq pattern of the first layers).
        """
        if isinstance(path_or_dict, Mapping):
            cfg = dict(path_or_dict)
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                cfg = json.load(f)
        if isinstance(cfg.get("text_config"), Mapping):
            cfg = dict(cfg["text_config"])
        sparse = dict(cfg.get("sparse_attention_config") or {})
        for key in ("sparse_attention_freq", "sparse_num_index_heads", "sparse_index_dim",
                    "sparse_block_size", "sparse_topk_blocks", "sparse_init_block",
                    "sparse_local_block", "sparse_score_type"):
            if key not in sparse and key in cfg:  # tolerate flat layouts
                sparse[key] = cfg[key]

        def need(d, key):
            if key not in d:
                raise ConfigError(f"{key}: missing from the MiniMax-M3 config")
            return d[key]

        n_layers = int(need(cfg, "num_hidden_layers"))
        freq = tuple(int(bool(f)) for f in sparse.get("sparse_attention_freq", [0] * n_layers))
        if sparse.get("use_sparse_attention") is False:
            freq = (0,) * n_layers
        if sparse.get("sparse_score_type", "max") != "max":
            raise ConfigError(f"sparse_score_type: only 'max' is supported, got "
                              f"{sparse['sparse_score_type']!r}")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4)
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        if num_layers is not None:
            n_layers, freq = int(num_layers), freq[:int(num_layers)]
        return cls(
            vocab_size=int(need(cfg, "vocab_size")),
            hidden_size=int(need(cfg, "hidden_size")),
            num_layers=n_layers,
            num_heads=int(need(cfg, "num_attention_heads")),
            num_kv_heads=int(need(cfg, "num_key_value_heads")),
            head_dim=head_dim,
            rotary_dim=int(cfg.get("rotary_dim", head_dim // 2)),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            intermediate_size=int(cfg.get("dense_intermediate_size") or need(cfg, "intermediate_size")),
            num_index_heads=int(sparse.get("sparse_num_index_heads", cfg["num_key_value_heads"])),
            index_dim=int(sparse.get("sparse_index_dim", 128)),
            sparse_attention_freq=freq,
            topk_blocks=int(sparse.get("sparse_topk_blocks", MSA_TOPK)),
            block_size=int(sparse.get("sparse_block_size", PAGE_SIZE)),
            init_blocks=int(sparse.get("sparse_init_block", 0)),
            local_blocks=int(sparse.get("sparse_local_block", 1)),
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=dtype,
        )


# ---- parameters ------------------------------------------------------------------------------

def init_params(config: ModelConfig, seed: int = 0) -> dict:
    """Random weights from ``seed`` (a pytree of arrays in ``config.dtype``).

    Projections ~ N(0, 1/fan_in); norm weights ~ 0.1 * N(0, 1) so the Gemma ``(1 + w)`` is
    exercised; the embedding ~ N(0, 1).
    """
    c = config
    dt = c.jnp_dtype
    keys = iter(jax.random.split(jax.random.key(seed), 4 + 16 * c.num_layers))

    def dense(shape):
        return (jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(shape[0])).astype(dt)

    def norm(n):
        return (0.1 * jax.random.normal(next(keys), (n,), jnp.float32)).astype(dt)

    layers = []
    for msa in c.layer_is_msa:
        layer = {
            "input_norm": norm(c.hidden_size),
            "q_proj": dense((c.hidden_size, c.num_heads * c.head_dim)),
            "k_proj": dense((c.hidden_size, c.num_kv_heads * c.head_dim)),
            "v_proj": dense((c.hidden_size, c.num_kv_heads * c.head_dim)),
            "o_proj": dense((c.num_heads * c.head_dim, c.hidden_size)),
            "q_norm": norm(c.head_dim),
            "k_norm": norm(c.head_dim),
            "post_attention_norm": norm(c.hidden_size),
            "gate_up_proj": dense((c.hidden_size, 2 * c.intermediate_size)),
            "down_proj": dense((c.intermediate_size, c.hidden_size)),
        }
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


def init_caches(config: ModelConfig, num_pages: int, dcp_world_size: int = 1) -> KVCaches:
    """Empty paged caches for every layer of the model (kv in ``config.dtype``, index-K in
    ``config.index_cache_jnp_dtype``).

    dcp_world_size == 1: leaves [num_pages, ...]. W > 1: per-rank stacks [W, num_pages, ...]
    (num_pages per rank; rank d's caches are slice d, to be sharded over "dcp").
    """
    caches = init_kv_caches(num_pages, config.num_kv_heads, config.head_dim, config.index_dim,
                            config.layer_is_msa, dtype=config.jnp_dtype,
                            index_dtype=config.index_cache_jnp_dtype)
    if dcp_world_size == 1:
        return caches
    return jax.tree.map(lambda x: jnp.broadcast_to(x[None], (dcp_world_size,) + x.shape),
                        caches)


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


# ---- attention -------------------------------------------------------------------------------

def dense_layer_attention(q: jax.Array, kv_cache: jax.Array, md: BatchMetadata, *, scale: float,
                          dcp_world_size: int = 1) -> jax.Array:
    """Dense paged causal attention of one layer over the (already written) cache.

    q [T, Hq, D]; kv_cache [N, Hkv, 128, 2D]. dcp_world_size W > 1: inside a shard_map over
    "dcp" (rank-local cache, LSE merge across ranks). Returns [T, Hq, D] in q.dtype.
    """
    if dcp_world_size > 1:
        return rank_dense_attention(q, kv_cache, md, world_size=dcp_world_size, scale=scale)[0]
    out, _ = paged_causal_attention(q, kv_cache, md.block_table, md.req_indices, md.kv_lens,
                                    scale=scale)
    return out


def msa_layer_attention(q: jax.Array, index_q: jax.Array, kv_cache: jax.Array,
                        index_k_cache: jax.Array, md: BatchMetadata, *, scale: float,
                        attention_impl: str, attention_mode: str = "msa",
                        init_blocks: int = 0, local_blocks: int = 1, dcp_world_size: int = 1,
                        interpret: bool = False) -> jax.Array:
    """Attention of one MSA layer over the (already written) caches.

    q [T, Hq, D]; index_q [T, Hi, Di]; kv_cache [N, Hkv, 128, 2D]; index_k_cache [N, 128, Di].
    ``attention_mode="msa"``: block scores from positions, top-16 pages per (token, KV group)
    with the token's own page forced, sparse attention over the selected pages with
    kv_len from seq_lens (``md.kv_lens``). ``"dense"``: dense paged causal attention on the
    same caches (the baseline MSA must equal while every position < 2048).
    dcp_world_size W > 1: call inside a shard_map over "dcp" with the rank's caches
    [N_local, ...] and DCP-staged metadata; the distributed indexer + LSE-merged decode
    (needs local_blocks == 1: the token's own block is the one forced block).
    interpret: Pallas interpret mode (attention_impl "pallas" off the GPU).
    Returns [T, Hq, D] in q.dtype (identical on every rank under DCP); padded tokens give zeros.
    """
    if attention_mode not in ATTENTION_MODES:
        raise ValueError(f"attention_mode: one of {ATTENTION_MODES}, got {attention_mode!r}")
    if attention_mode == "dense":
        return dense_layer_attention(q, kv_cache, md, scale=scale, dcp_world_size=dcp_world_size)
    if dcp_world_size > 1:
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl: one of {ATTENTION_IMPLS}, got {attention_impl!r}")
        if local_blocks != 1:
            raise ConfigError(f"local_blocks: DCP forces exactly the token's own block, needs 1, "
                              f"got {local_blocks}")
        out, _, _ = rank_msa_attention(q, index_q, kv_cache, index_k_cache, md,
                                       world_size=dcp_world_size, scale=scale,
                                       use_kernels=attention_impl == "pallas",
                                       interpret=interpret, init_blocks=init_blocks)
        return out
    if attention_impl == "pallas":
        out, _, _ = msa_attention(q, index_q, kv_cache, index_k_cache, md, scale=scale,
                                  interpret=interpret, local_blocks=local_blocks,
                                  init_blocks=init_blocks)
    elif attention_impl == "reference":
        out, _, _ = msa_attention_reference(q, index_q, kv_cache, index_k_cache, md, scale=scale,
                                            local_blocks=local_blocks, init_blocks=init_blocks)
    else:
        raise ValueError(f"attention_impl: one of {ATTENTION_IMPLS}, got {attention_impl!r}")
    return out.astype(q.dtype)


def _attention_block(layer: dict, x: jax.Array, kv_cache: jax.Array, index_cache, md: BatchMetadata,
                     cos, sin, *, config: ModelConfig, is_msa: bool, attention_impl: str,
                     attention_mode: str, dcp_world_size: int, interpret: bool):
    c = config
    W = dcp_world_size
    # owner-only writes under DCP (slot -1 on every other rank)
    slots = md.slot_mapping if W == 1 else rank_slot_mapping(md, W, lax.axis_index(DCP_AXIS))
    T = x.shape[0]
    q = (x @ layer["q_proj"]).reshape(T, c.num_heads, c.head_dim)
    k = (x @ layer["k_proj"]).reshape(T, c.num_kv_heads, c.head_dim)
    v = (x @ layer["v_proj"]).reshape(T, c.num_kv_heads, c.head_dim)
    q = apply_partial_rope(gemma_rms_norm(q, layer["q_norm"], c.rms_norm_eps), cos, sin)
    k = apply_partial_rope(gemma_rms_norm(k, layer["k_norm"], c.rms_norm_eps), cos, sin)
    kv_cache = write_kv(kv_cache, k, v, slots)
    if is_msa:
        iq = (x @ layer["index_q_proj"]).reshape(T, c.num_index_heads, c.index_dim)
        ik = (x @ layer["index_k_proj"]).reshape(T, 1, c.index_dim)
        iq = apply_partial_rope(gemma_rms_norm(iq, layer["index_q_norm"], c.rms_norm_eps), cos, sin)
        ik = apply_partial_rope(gemma_rms_norm(ik, layer["index_k_norm"], c.rms_norm_eps), cos, sin)
        index_cache = write_index_k(index_cache, ik[:, 0], slots)
        attn = msa_layer_attention(q, iq, kv_cache, index_cache, md, scale=c.scale,
                                   attention_impl=attention_impl, attention_mode=attention_mode,
                                   init_blocks=c.init_blocks, local_blocks=c.local_blocks,
                                   dcp_world_size=W, interpret=interpret)
    else:
        attn = dense_layer_attention(q, kv_cache, md, scale=c.scale, dcp_world_size=W)
    out = attn.reshape(T, c.num_heads * c.head_dim) @ layer["o_proj"]
    return out, kv_cache, index_cache


def forward(params: dict, caches: KVCaches, token_ids: jax.Array, md: BatchMetadata, *,
            config: ModelConfig, attention_impl: str = "reference",
            attention_mode: str = "msa", dcp_world_size: int = 1,
            interpret: bool = False) -> tuple[jax.Array, KVCaches]:
    """Run the stack on one step's tokens, writing their K/V (and index K) into the caches.

    token_ids [T] int32 (padding arbitrary); md: the step's staged metadata.
    dcp_world_size (static) W > 1: call inside a shard_map over "dcp"; caches are this
    rank's (leaves [N_local, ...]), md is staged with the same W (rank-local block table).
    interpret: Pallas interpret mode for attention_impl "pallas" (CPU).
    Returns (hidden [T, hidden] after the final norm (replicated under DCP), updated caches).
    """
    c = config
    x = params["embed"][token_ids]
    cos, sin = rope_tables(md.positions, c.rotary_dim, c.rope_theta)
    new_kv, new_idx = [], []
    for i, (layer, is_msa) in enumerate(zip(params["layers"], c.layer_is_msa)):
        h = gemma_rms_norm(x, layer["input_norm"], c.rms_norm_eps)
        attn, kv_i, idx_i = _attention_block(layer, h, caches.kv[i], caches.index_k[i], md, cos, sin,
                                             config=c, is_msa=is_msa, attention_impl=attention_impl,
                                             attention_mode=attention_mode,
                                             dcp_world_size=dcp_world_size, interpret=interpret)
        x = x + attn
        h = gemma_rms_norm(x, layer["post_attention_norm"], c.rms_norm_eps)
        x = x + swigluoai(h @ layer["gate_up_proj"], c.swiglu_alpha, c.swiglu_limit) @ layer["down_proj"]
        new_kv.append(kv_i)
        new_idx.append(idx_i)
    x = gemma_rms_norm(x, params["final_norm"], c.rms_norm_eps)
    return x, KVCaches(kv=tuple(new_kv), index_k=tuple(new_idx))


def compute_logits(params: dict, hidden: jax.Array, config: ModelConfig) -> jax.Array:
    """LM head: hidden [..., hidden] -> logits [..., vocab] in f32."""
    w = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    return (hidden @ w).astype(jnp.float32)

"""One tensor x expert parallel rank's model on one device: its shapes, random or abstract
params, and the step inputs of a bucket (``bench/step.py``, ``jax-msa-runner lower``).

``rank_config(config, tp, ep)`` is the ModelConfig one rank of a TP x EP deployment computes
with ``tp_size = ep_size = 1`` (no collectives; what the rank's kernels see):

  * attention: query, KV and index heads / tp (the index-K cache stays whole);
  * the dense MLP's and the shared expert's intermediate sizes / tp, the vocabulary / tp
    (the embedding rows and the LM head columns of the rank);
  * routed experts: the router stays [H, E] over all E experts (every rank routes every
    token), the rank holds E / ep whole experts (``moe_intermediate_size`` unsplit: expert
    parallelism, as ``bench/real_layer.py`` counts them) and computes only the token copies
    routed to them (rank 0's experts ``[0, E / ep)``), ``model.routed_experts_partial``
    sorting the others away. ``num_experts`` stays E.

``rank_params`` builds the params of such a config with ``local_experts`` experts per MoE
layer, in bf16 or with every quantizable linear as an MXFP8 ``Fp8Weight`` (the released
checkpoint's format; router, norms, embedding and LM head stay in the model dtype), and either
distinct weights per layer or one set per layer kind (dense / MSA attention x dense MLP / MoE)
shared by every layer of that kind. ``jax.eval_shape`` of it gives the abstract params
(``ShapeDtypeStruct`` leaves, nothing allocated).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_msa_runner.attention.paged_cache import KVCaches
from jax_msa_runner.attention.parallel import init_caches
from jax_msa_runner.config import RESERVED_PAGES, ConfigError, ModelConfig
from jax_msa_runner.model import init_params
from pallas_kernels.fp8_matmul import Fp8Weight, quantize_mxfp8

WEIGHT_FORMATS = ("bf16", "fp8")
LAYER_WEIGHTS = ("shared", "distinct")
# linears stored as fp8 in the released checkpoint (jax_msa_runner.checkpoint.QUANTIZABLE)
FP8_PARAMS = ("q_proj", "k_proj", "v_proj", "o_proj", "index_q_proj", "index_k_proj",
              "gate_up_proj", "down_proj", "shared_gate_up", "shared_down", "experts_gate_up",
              "experts_down")


def rank_config(config: ModelConfig, tp: int, ep: int) -> ModelConfig:
    """The per-rank ModelConfig (module docstring). ConfigError naming ``tp`` / ``ep`` and the
    size they must divide."""
    c = config
    if tp < 1 or ep < 1:
        raise ConfigError(f"tp, ep: must be >= 1, got tp={tp}, ep={ep}")
    split = {"num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads,
             "vocab_size": c.vocab_size}
    if any(c.layer_is_msa):
        split["num_index_heads"] = c.num_index_heads
    if not all(c.layer_is_moe):
        split["intermediate_size"] = c.intermediate_size
    if any(c.layer_is_moe):
        split["shared_intermediate_size"] = c.shared_intermediate_size
        if c.num_experts % ep:
            raise ConfigError(f"ep: {ep} must divide num_experts={c.num_experts}")
    for name, size in split.items():
        if size % tp:
            raise ConfigError(f"tp: {tp} must divide {name}={size}")
    return dataclasses.replace(c, **{k: v // tp for k, v in split.items()})


def local_experts(config: ModelConfig, ep: int) -> int:
    """Routed experts one of ``ep`` expert-parallel ranks holds."""
    return config.num_experts // ep


def layer_kinds(config: ModelConfig) -> tuple[tuple[bool, bool], ...]:
    """(is_msa, is_moe) of every layer."""
    return tuple(zip(config.layer_is_msa, config.layer_is_moe))


def _kind_config(config: ModelConfig, kinds: list[tuple[bool, bool]],
                 num_local: int) -> ModelConfig:
    """A config with one layer per entry of ``kinds`` and ``num_local`` experts."""
    return dataclasses.replace(
        config, num_layers=len(kinds), sparse_attention_freq=tuple(int(m) for m, _ in kinds),
        moe_layer_freq=tuple(int(e) for _, e in kinds),
        num_experts=num_local if any(e for _, e in kinds) else config.num_experts,
        num_experts_per_tok=min(config.num_experts_per_tok, num_local))


def _to_fp8(w: jax.Array) -> Fp8Weight:
    """A dense ``[..., in, out]`` weight as MXFP8 (values ``[..., out, in]``)."""
    return quantize_mxfp8(jnp.swapaxes(w.astype(jnp.float32), -1, -2))


def _layer(seed: jax.Array, *, config: ModelConfig, kind: tuple[bool, bool], num_local: int,
           weights: str) -> dict:
    """One layer of ``kind`` from ``seed`` (traced): ``init_params``' layer with the router
    over every expert, the first ``num_local`` experts, quantized with ``weights="fp8"``."""
    c = config
    layer = dict(init_params(_kind_config(c, [kind], num_local), seed)["layers"][0])
    if kind[1]:  # the router over every expert; the rank holds the first num_local
        key = jax.random.fold_in(jax.random.key(seed), 1)
        layer["router"] = jax.random.normal(key, (c.hidden_size, c.num_experts),
                                            jnp.float32) / math.sqrt(c.hidden_size)
        if c.use_routing_bias:  # zero: a random correction bias (a trained one balances the
            # experts' loads) sends most tokens to the few experts it favours
            layer["router_bias"] = jnp.zeros((c.num_experts,), jnp.float32)
    if weights == "fp8":
        layer = {k: (_to_fp8(v) if k in FP8_PARAMS else v) for k, v in layer.items()}
    return layer


def _top(seed: jax.Array, *, config: ModelConfig, kind: tuple[bool, bool],
         num_local: int) -> dict:
    """The embedding, final norm and LM head from ``seed`` (traced)."""
    params = init_params(_kind_config(config, [kind], num_local), seed)
    return {k: v for k, v in params.items() if k != "layers"}


def rank_params(config: ModelConfig, *, num_local_experts: int, weights: str = "bf16",
                layer_weights: str = "shared", seed: int = 0) -> dict:
    """Random params of a per-rank ``config`` (``rank_config``) in ``config.dtype``.

    MoE layers hold ``num_local_experts`` experts (experts_gate_up [El, H, 2I], experts_down
    [El, I, H]; as Fp8Weight values [El, 2I, H] / [El, H, I] with ``weights="fp8"``) and the
    router over all experts (router [H, E] f32 ~ N(0, 1/H), router_bias [E] f32 zeros).
    ``layer_weights``: "distinct" (every layer its own arrays) or "shared" (one set per layer
    kind, the same arrays in every layer of that kind: ``params["layers"]`` repeats them).
    Each layer kind's builder is one jitted function (compiled once, its temporaries freed
    per layer).
    Returns the ``model.init_params`` pytree.
    """
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights: one of {WEIGHT_FORMATS}, got {weights!r}")
    if layer_weights not in LAYER_WEIGHTS:
        raise ValueError(f"layer_weights: one of {LAYER_WEIGHTS}, got {layer_weights!r}")
    kinds = layer_kinds(config)
    build = {kind: jax.jit(functools.partial(_layer, config=config, kind=kind,
                                             num_local=num_local_experts, weights=weights))
             for kind in dict.fromkeys(kinds)}
    seeds = [jnp.int32(seed + 1 + i) for i in range(len(kinds))]
    if layer_weights == "shared":
        one = {kind: build[kind](seeds[kinds.index(kind)]) for kind in build}
        layers = [one[kind] for kind in kinds]
    else:
        layers = [build[kind](s) for kind, s in zip(kinds, seeds)]
    top = jax.jit(functools.partial(_top, config=config, kind=kinds[0],
                                    num_local=num_local_experts))(jnp.int32(seed))
    return {"embed": top["embed"], "layers": tuple(layers), "final_norm": top["final_norm"],
            **({"lm_head": top["lm_head"]} if "lm_head" in top else {})}


def abstract_rank_params(config: ModelConfig, *, num_local_experts: int,
                         weights: str = "bf16") -> dict:
    """``rank_params``' pytree as ShapeDtypeStructs (nothing allocated; distinct layers)."""
    return jax.eval_shape(lambda: rank_params(config, num_local_experts=num_local_experts,
                                              weights=weights, layer_weights="distinct"))


def cache_pages(num_reqs: int, context: int, page_size: int) -> int:
    """KV pages for ``num_reqs`` requests of ``context`` tokens each, plus the reserved ones."""
    return len(RESERVED_PAGES) + num_reqs * -(-context // page_size)


def abstract_caches(config: ModelConfig, num_pages: int) -> KVCaches:
    """The caches of ``num_pages`` pages per layer as ShapeDtypeStructs."""
    return jax.eval_shape(lambda: init_caches(config, num_pages, None))


def tree_bytes(tree) -> int:
    """Bytes of every leaf (arrays or ShapeDtypeStructs) of ``tree``."""
    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
                   for x in jax.tree_util.tree_leaves(tree)))


def unique_bytes(tree) -> int:
    """Bytes of the distinct arrays of ``tree`` (a shared array counts once)."""
    seen, total = set(), 0
    for x in jax.tree_util.tree_leaves(tree):
        if id(x) not in seen:
            seen.add(id(x))
            total += math.prod(x.shape) * np.dtype(x.dtype).itemsize
    return int(total)

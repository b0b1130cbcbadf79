"""MoE MLP: routing, the routed experts against a per-token NumPy loop, padding, config, the
expert kernels in the lowering for an H200."""
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import numpy.testing as npt
import pytest

from jax_msa_runner.attention.parallel import init_caches
from jax_msa_runner.batch.staging import stage_batch
from jax_msa_runner.config import ConfigError, ModelConfig, RunnerConfig
from jax_msa_runner.model import (forward, forward_with_routing, init_moe_params, init_params,
                                  moe_mlp, route, routed_experts)
from pallas_kernels._lowering import custom_call_counts, lower_for_cuda
from pallas_kernels.moe_experts_default import DECODE_MAX_COPIES


def _swigluoai(gu, alpha=1.702, limit=7.0):
    g, u = np.split(gu, 2, axis=-1)
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    return (u + 1) * g / (1 + np.exp(-alpha * g))


def _np_route(x, router, bias, k, scale):
    logits = x.astype(np.float64) @ router.astype(np.float64)
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + (0 if bias is None else bias)
    experts = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(scores, experts, -1)
    return w / w.sum(-1, keepdims=True) * scale, experts


def _np_moe(layer, x, cfg):
    """Per-token loop over the chosen experts, plus the shared expert."""
    lay = {k: np.asarray(v, np.float64) for k, v in layer.items()}
    w, experts = _np_route(x, lay["router"], lay.get("router_bias"), cfg.num_experts_per_tok,
                           cfg.routed_scaling_factor)
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(experts[t]):
            h = _swigluoai(x[t] @ lay["experts_gate_up"][e]) @ lay["experts_down"][e]
            out[t] += w[t, j] * h
    if cfg.shared_intermediate_size:
        out += _swigluoai(x @ lay["shared_gate_up"]) @ lay["shared_down"]
    return out, experts


@pytest.mark.parametrize("T, E, k, shared, bias", [(7, 5, 3, 24, True), (33, 8, 2, 0, True),
                                                    (1, 4, 4, 16, False), (19, 16, 1, 40, True)])
def test_moe_mlp_matches_per_token_loop(T, E, k, shared, bias):
    H, I = 24, 20
    cfg = ModelConfig.tiny(hidden_size=H, num_experts=E, num_experts_per_tok=k,
                           moe_intermediate_size=I, shared_intermediate_size=shared,
                           routed_scaling_factor=2.5, use_routing_bias=bias)
    seed = T * 1000 + E
    layer = init_moe_params(cfg, jax.random.key(seed))
    assert ("router_bias" in layer) == bias and ("shared_gate_up" in layer) == bool(shared)
    x = np.random.default_rng(seed).normal(size=(T, H)).astype(np.float32) * 2
    with jax.default_matmul_precision("highest"):  # f32 matmuls, not a GPU's TF32 default
        out, chosen = jax.jit(moe_mlp, static_argnums=3)(layer, jnp.asarray(x),
                                                         jnp.ones((T,), bool), cfg)
    want, want_experts = _np_moe(layer, x, cfg)
    chex.assert_shape(out, (T, H))
    chex.assert_shape(chosen, (T, k))
    npt.assert_array_equal(np.sort(np.asarray(chosen), -1), np.sort(want_experts, -1))
    chex.assert_trees_all_close(np.asarray(out, np.float64), want, rtol=2e-5, atol=2e-5)


def test_router_bias_chooses_but_does_not_weigh():
    """The bias changes which experts win; the weights stay the renormalised raw sigmoids."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(6, 8)).astype(np.float32)
    router = rng.normal(size=(8, 4)).astype(np.float32)
    bias = np.array([0.0, 0.0, 0.0, 10.0], np.float32)  # expert 3 always chosen
    w, e, logits = route(jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias), top_k=2,
                         routed_scaling_factor=2.0)
    e = np.asarray(e)
    assert (e[:, 0] == 3).all()
    scores = 1 / (1 + np.exp(-(x.astype(np.float64) @ router)))
    picked = np.take_along_axis(scores, e, -1)
    npt.assert_allclose(np.asarray(w), 2.0 * picked / picked.sum(-1, keepdims=True), rtol=1e-5)
    npt.assert_allclose(np.asarray(w).sum(-1), 2.0, rtol=1e-6)
    assert np.asarray(logits).dtype == np.float32
    w0, e0, _ = route(jnp.asarray(x), jnp.asarray(router), None, top_k=2, routed_scaling_factor=2.0)
    want_w, want_e = _np_route(x, router, None, 2, 2.0)
    npt.assert_array_equal(np.asarray(e0), want_e)
    npt.assert_allclose(np.asarray(w0), want_w, rtol=1e-5)


def test_router_is_f32_for_bf16_models():
    cfg = ModelConfig.tiny(dtype="bfloat16", hidden_size=32, moe_intermediate_size=16,
                           shared_intermediate_size=16)
    layer = init_moe_params(cfg, jax.random.key(0))
    assert layer["router"].dtype == jnp.float32 and layer["router_bias"].dtype == jnp.float32
    assert layer["experts_gate_up"].dtype == jnp.bfloat16
    x = jax.random.normal(jax.random.key(1), (9, 32), jnp.float32)
    run = jax.jit(moe_mlp, static_argnums=3)
    out_bf16, _ = run(layer, x.astype(jnp.bfloat16), jnp.ones((9,), bool), cfg)
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), layer)
    out_f32, _ = run(f32, x, jnp.ones((9,), bool), dataclasses.replace(cfg, dtype="float32"))
    assert out_bf16.dtype == jnp.bfloat16
    chex.assert_tree_all_finite(out_bf16)
    chex.assert_trees_all_close(out_bf16.astype(jnp.float32), out_f32, atol=0.15, rtol=0.05)


def test_padding_tokens_are_outside_the_groups():
    """Masked tokens (any values, even inf/nan) give zero routed output, do not change the
    real tokens' outputs, and use no expert (group sizes count real copies only)."""
    H, I, E, k, T = 16, 12, 6, 2, 11
    cfg = ModelConfig.tiny(hidden_size=H, num_experts=E, num_experts_per_tok=k,
                           moe_intermediate_size=I, shared_intermediate_size=0)
    layer = init_moe_params(cfg, jax.random.key(3))
    rng = np.random.default_rng(3)
    x = rng.normal(size=(T, H)).astype(np.float32)
    mask = np.zeros(T, bool)
    mask[:7] = True
    w, experts, _ = route(jnp.asarray(x), layer["router"], layer["router_bias"], top_k=k,
                          routed_scaling_factor=2.0)
    run = jax.jit(routed_experts, static_argnums=(6, 7))
    out = np.asarray(run(jnp.asarray(x), w, experts, jnp.asarray(mask), layer["experts_gate_up"],
                         layer["experts_down"], 1.702, 7.0))
    x_bad = x.copy()
    x_bad[7:] = np.array([np.inf, np.nan, 1e30, -1e30])[np.arange(H) % 4]
    out_bad = np.asarray(run(jnp.asarray(x_bad), w, experts, jnp.asarray(mask),
                             layer["experts_gate_up"], layer["experts_down"], 1.702, 7.0))
    npt.assert_array_equal(out[7:], 0.0)
    npt.assert_array_equal(out_bad[7:], 0.0)
    npt.assert_array_equal(out_bad[:7], out[:7])
    real = np.asarray(run(jnp.asarray(x[:7]), w[:7], experts[:7], jnp.ones(7, bool),
                          layer["experts_gate_up"], layer["experts_down"], 1.702, 7.0))
    npt.assert_allclose(out[:7], real, rtol=1e-6, atol=1e-6)


def _primitives(jaxpr) -> list[str]:
    """Every primitive of a jaxpr, through the sub-jaxprs of jit / cond / scan calls."""
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names += _primitives(inner)
    return names


def test_experts_off_the_gpu_are_two_grouped_matmuls():
    """Off a GPU the routed experts are XLA's two ragged_dot calls (moe_experts_xla): no
    per-expert loop, no dense all-experts product."""
    cfg = ModelConfig.tiny(hidden_size=16, moe_intermediate_size=8, shared_intermediate_size=0)
    layer = init_moe_params(cfg, jax.random.key(0))
    jaxpr = jax.make_jaxpr(lambda x: moe_mlp(layer, x, jnp.ones((5,), bool), cfg))(
        jnp.ones((5, 16)))
    prims = _primitives(jaxpr.jaxpr)
    assert prims.count("ragged_dot_general") + prims.count("ragged_dot") == 2, prims
    assert "scan" not in prims and "while" not in prims, prims


@pytest.mark.parametrize("t", [1, 2048])
def test_moe_mlp_lowers_to_the_expert_kernels_for_h200(t):
    """At the per-rank serving shapes (16 local experts of hidden 6144, intermediate 3072,
    top 4; bf16) the model's MoE MLP lowered for an abstract H200 runs the Mosaic GPU expert
    kernels (decode: one call; prefill: two) and no XLA ragged_dot, no Triton."""
    cfg = ModelConfig.tiny(hidden_size=6144, num_experts=16, num_experts_per_tok=4,
                           moe_intermediate_size=3072, shared_intermediate_size=0,
                           dtype="bfloat16")
    layer = jax.eval_shape(lambda: init_moe_params(cfg, jax.random.key(0)))
    x = jax.ShapeDtypeStruct((t, 6144), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((t,), jnp.bool_)
    text = lower_for_cuda(lambda lay, h, m: moe_mlp(lay, h, m, cfg)[0], layer, x, mask)
    counts = custom_call_counts(text)
    assert counts["mosaic"] == (1 if t * 4 <= DECODE_MAX_COPIES else 2), counts
    assert counts["triton"] == 0 and "ragged_dot" not in text, counts


def test_forward_padding_does_not_change_real_tokens():
    """The same two requests through a tight bucket and through one with padded tokens and
    rows: identical hidden states and expert choices on the real tokens."""
    cfg = ModelConfig.tiny(num_layers=3, sparse_attention_freq=(0, 1, 1), num_heads=4,
                           head_dim=32, rotary_dim=16, index_dim=32, hidden_size=64,
                           moe_intermediate_size=32, shared_intermediate_size=32)
    assert cfg.layer_is_moe == (False, True, True)
    params = init_params(cfg, seed=11)
    rng = np.random.default_rng(11)
    sched, comp = np.array([5, 3]), np.array([0, 0])
    toks = rng.integers(0, cfg.vocab_size, 8).astype(np.int32)
    outs = []
    # f32 matmuls at full precision: a GPU's TF32 default rounds the two buckets' shapes apart
    with jax.default_matmul_precision("highest"):
        for bucket in (8, 16):
            rc = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=bucket, max_model_len=256,
                              bucket_sizes=(bucket,))
            md = stage_batch(sched, comp, [[2], [3]], rc)
            pad = rng.integers(0, cfg.vocab_size, bucket - 8)
            padded = np.concatenate([toks, pad]).astype(np.int32)
            caches = init_caches(cfg, 4, None)
            h, _, routing = jax.jit(
                lambda p, c, t, m: forward_with_routing(p, c, t, m, config=cfg))(
                    params, caches, jnp.asarray(padded), md)
            outs.append((np.asarray(h)[:8],
                         [None if r is None else np.asarray(r)[:8] for r in routing]))
            if bucket == 16:  # forward is forward_with_routing without the routing
                h2, _ = jax.jit(lambda p, c, t, m: forward(p, c, t, m, config=cfg))(
                    params, init_caches(cfg, 4, None), jnp.asarray(padded), md)
                npt.assert_array_equal(np.asarray(h2), np.asarray(h))
    (h_a, r_a), (h_b, r_b) = outs
    chex.assert_tree_all_finite(h_a)
    npt.assert_allclose(h_a, h_b, rtol=1e-5, atol=1e-5)
    assert r_a[0] is None and r_b[0] is None
    for a, b in zip(r_a[1:], r_b[1:]):
        npt.assert_array_equal(a, b)


# ---- config -------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(moe_layer_freq=(0, 1)), r"^moe_layer_freq: needs one entry per layer \(4\), got 2"),
    (dict(num_experts=0), r"^num_experts: must be >= 1, got 0"),
    (dict(num_experts_per_tok=9), r"^num_experts_per_tok: must be in \[1, num_experts=8\], got 9"),
    (dict(num_experts_per_tok=0), r"^num_experts_per_tok: must be in \[1, num_experts=8\], got 0"),
    (dict(moe_intermediate_size=0), r"^moe_intermediate_size: must be >= 1, got 0"),
    (dict(shared_intermediate_size=-1), r"^shared_intermediate_size: must be >= 0"),
    (dict(routed_scaling_factor=0.0), r"^routed_scaling_factor: must be finite and > 0"),
    (dict(routed_scaling_factor=float("nan")), r"^routed_scaling_factor: must be finite and > 0"),
])
def test_moe_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.tiny(**kwargs)


def test_moe_layers_default_to_the_msa_layers():
    assert ModelConfig.tiny().layer_is_moe == (False, True, True, True)
    c = ModelConfig.tiny(num_layers=2, sparse_attention_freq=(0, 1))
    assert c.moe_layer_freq == (0, 1)
    assert ModelConfig.tiny(moe_layer_freq=(1, 0, 0, 1)).layer_is_moe == (True, False, False, True)
    # a config without MoE layers ignores the expert fields
    assert not any(ModelConfig.tiny(moe_layer_freq=(0,) * 4, num_experts=0).layer_is_moe)


LEGACY = {
    "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "rotary_dim": 16, "rope_theta": 5e6, "vocab_size": 300,
    "intermediate_size": 24, "dense_intermediate_size": 48, "shared_intermediate_size": 24,
    "n_shared_experts": 1, "num_local_experts": 8, "num_experts_per_tok": 2,
    "routed_scaling_factor": 2.0, "scoring_func": "sigmoid", "use_routing_bias": True,
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "moe_layer_freq": [0, 1, 1],
    "sparse_attention_config": {"use_sparse_attention": True, "sparse_attention_freq": [0, 1, 1],
                                "sparse_num_index_heads": 2, "sparse_index_dim": 32,
                                "sparse_block_size": 128, "sparse_topk_blocks": 16,
                                "sparse_init_block": 0, "sparse_local_block": 1,
                                "sparse_score_type": "max"},
}
TRANSFORMERS = {
    "model_type": "minimax_m3_vl_text", "hidden_size": 64, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rotary_dim": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
    "vocab_size": 300, "intermediate_size": 24, "dense_intermediate_size": 48,
    "shared_intermediate_size": 24, "num_local_experts": 8, "num_experts_per_tok": 2,
    "routed_scaling_factor": 2.0, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
    "hidden_act": "silu", "layer_types": ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
    "mlp_layer_types": ["dense", "sparse", "sparse"], "index_n_heads": 2, "index_head_dim": 32,
    "index_block_size": 128, "index_topk_blocks": 16, "index_local_blocks": 1,
}


def test_from_hf_config_both_schemes_agree():
    a = ModelConfig.from_hf_config(LEGACY, dtype="float32")
    b = ModelConfig.from_hf_config(TRANSFORMERS, dtype="float32")
    c = ModelConfig.from_hf_config({"text_config": TRANSFORMERS, "vision_config": {}},
                                   dtype="float32")
    assert a == b == c
    assert a.layer_is_msa == a.layer_is_moe == (False, True, True)
    assert (a.intermediate_size, a.moe_intermediate_size, a.shared_intermediate_size) == (48, 24, 24)
    assert (a.num_experts, a.num_experts_per_tok, a.num_index_heads, a.index_dim,
            a.rotary_dim) == (8, 2, 2, 32, 16)
    assert ModelConfig.from_hf_config(TRANSFORMERS, num_layers=1).layer_is_moe == (False,)


@pytest.mark.parametrize("change, match", [
    (dict(layer_types=["full_attention", "sliding", "minimax_m3_sparse"]),
     r"^layer_types\[1\]: one of \('full_attention', 'minimax_m3_sparse'\), got 'sliding'"),
    (dict(mlp_layer_types=["dense", "moe", "sparse"]),
     r"^mlp_layer_types\[1\]: one of \('dense', 'sparse'\), got 'moe'"),
    (dict(mlp_layer_types=None), r"^moe_layer_freq: missing"),
    (dict(num_local_experts=None), r"^num_local_experts: missing"),
    (dict(routed_scaling_factor=None), r"^routed_scaling_factor: missing"),
    (dict(rotary_dim=32), r"^rotary_dim: 32 disagrees with partial_rotary_factor=0.5"),
    (dict(scoring_func="softmax"), r"^scoring_func: only 'sigmoid' is supported"),
    (dict(swiglu_beta=0.5), r"^swiglu_beta: only 1.0 is supported"),
    (dict(num_experts_per_tok=9), r"^num_experts_per_tok: must be in \[1, num_experts=8\]"),
    (dict(index_n_heads=1), r"^num_index_heads: must equal num_kv_heads=2"),
])
def test_from_hf_config_errors_name_the_field(change, match):
    cfg = {**TRANSFORMERS, **{k: v for k, v in change.items() if v is not None}}
    for k, v in change.items():
        if v is None:
            del cfg[k]
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_config(cfg)


def test_from_hf_config_legacy_and_new_names_must_agree():
    both = {**LEGACY, "index_head_dim": 64}
    with pytest.raises(ConfigError, match=r"^index_head_dim: 64 disagrees with "
                                          r"sparse_attention_config.sparse_index_dim=32"):
        ModelConfig.from_hf_config(both)
    both = {**LEGACY, "layer_types": ["full_attention"] * 3}
    with pytest.raises(ConfigError, match=r"^layer_types: disagrees with sparse_attention_config"):
        ModelConfig.from_hf_config(both)

"""The MiniMax-M3-shaped model: building blocks, config loader, MSA == dense below 2048
(also with an fp8 index-K cache)."""
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import numpy.testing as npt
import pytest

from jax_msa_runner.config import ConfigError, RunnerConfig
from jax_msa_runner.attention.dense import paged_causal_attention
from jax_msa_runner.attention.parallel import init_caches
from jax_msa_runner.config import ModelConfig
from jax_msa_runner.model import (apply_partial_rope, compute_logits, forward, gemma_rms_norm,
                                  init_params, rope_tables, swigluoai)
from jax_msa_runner.batch.staging import stage_batch

# MiniMax-M3 text config with the released field names (values from the public model card).
M3_CONFIG = {
    "architectures": ["MiniMaxM3ForCausalLM"],
    "hidden_size": 6144, "num_hidden_layers": 60, "num_attention_heads": 64,
    "num_key_value_heads": 4, "head_dim": 128, "rotary_dim": 64, "rope_theta": 5000000,
    "rms_norm_eps": 1e-6, "vocab_size": 200064, "intermediate_size": 3072,
    "dense_intermediate_size": 12288, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
    "use_gemma_norm": True, "qk_norm_type": "per_head", "tie_word_embeddings": False,
    "moe_layer_freq": [0] * 3 + [1] * 57, "num_local_experts": 128, "num_experts_per_tok": 4,
    "shared_intermediate_size": 3072, "n_shared_experts": 1, "scoring_func": "sigmoid",
    "use_routing_bias": True, "routed_scaling_factor": 2.0, "hidden_act": "swigluoai",
    "sparse_attention_config": {
        "use_sparse_attention": True, "sparse_index_dim": 128, "sparse_num_index_heads": 4,
        "sparse_topk_blocks": 16, "sparse_block_size": 128, "sparse_score_type": "max",
        "sparse_init_block": 0, "sparse_local_block": 1,
        "sparse_attention_freq": [0] * 3 + [1] * 57,
        "sparse_disable_index_value": [0] * 3 + [1] * 57,
    },
}


def test_gemma_rms_norm_formula():
    x = np.random.default_rng(0).normal(size=(3, 5, 8)).astype(np.float32)
    w = np.random.default_rng(1).normal(size=(8,)).astype(np.float32)
    expect = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * (1 + w)
    npt.assert_allclose(np.asarray(gemma_rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6)), expect,
                        rtol=1e-5, atol=1e-6)


def test_partial_neox_rope():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 1, 128)).astype(np.float32)
    k = rng.normal(size=(1, 1, 128)).astype(np.float32)

    def rot(x, pos):
        cos, sin = rope_tables(jnp.array([pos]), 64, 5e6)
        return np.asarray(apply_partial_rope(jnp.asarray(x), cos, sin))

    # only the first 64 channels move; norms are kept; scores depend on the offset only
    npt.assert_array_equal(rot(q, 7)[..., 64:], q[..., 64:])
    npt.assert_allclose(np.linalg.norm(rot(q, 9)), np.linalg.norm(q), rtol=1e-5)
    a = (rot(q, 100) * rot(k, 90)).sum()
    b = (rot(q, 1010) * rot(k, 1000)).sum()
    npt.assert_allclose(a, b, rtol=1e-4)
    # NeoX split-half pairs channel i with i + 32 at frequency theta^(-2i/64)
    cos, sin = rope_tables(jnp.array([3]), 64, 5e6)
    ang = 3 * 5e6 ** (-np.arange(32) * 2 / 64)
    npt.assert_allclose(np.asarray(cos[0]), np.cos(ang), rtol=1e-5)
    r = rot(q, 3)[0, 0]
    npt.assert_allclose(r[:32], q[0, 0, :32] * np.cos(ang) - q[0, 0, 32:64] * np.sin(ang), atol=1e-5)


def test_swigluoai_formula():
    x = np.linspace(-12, 12, 40, dtype=np.float32).reshape(2, 20)
    gate, up = x[:, :10], x[:, 10:]
    g = np.minimum(gate, 7.0)
    expect = (np.clip(up, -7, 7) + 1) * g / (1 + np.exp(-1.702 * g))
    npt.assert_allclose(np.asarray(swigluoai(jnp.asarray(x), 1.702, 7.0)), expect, rtol=1e-5,
                        atol=1e-6)


def test_from_hf_config_true_shapes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": M3_CONFIG}))
    c = ModelConfig.from_hf_config(tmp_path)
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (60, 6144, 64, 4, 128)
    assert c.sparse_attention_freq[:4] == (0, 0, 0, 1) and sum(c.layer_is_msa) == 57
    assert (c.num_index_heads, c.index_dim, c.rotary_dim, c.rope_theta) == (4, 128, 64, 5e6)
    assert c.intermediate_size == 12288 and c.vocab_size == 200064
    assert c.moe_layer_freq == c.sparse_attention_freq and sum(c.layer_is_moe) == 57
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
            c.shared_intermediate_size, c.routed_scaling_factor, c.use_routing_bias) == (
        128, 4, 3072, 3072, 2.0, True)
    assert c.group_size == 16
    r = c.per_rank(4)
    assert (r.num_heads, r.num_kv_heads, r.num_index_heads) == (16, 1, 1)
    # the same model at its true shapes, without allocating it
    shapes = jax.eval_shape(lambda: init_params(ModelConfig.from_hf_config(M3_CONFIG, num_layers=4)))
    l3 = shapes["layers"][3]
    assert l3["q_proj"].shape == (6144, 64 * 128) and l3["k_proj"].shape == (6144, 4 * 128)
    assert l3["index_q_proj"].shape == (6144, 4 * 128) and l3["index_k_proj"].shape == (6144, 128)
    assert "index_q_proj" not in shapes["layers"][2]
    assert shapes["layers"][2]["gate_up_proj"].shape == (6144, 2 * 12288)  # dense MLP
    assert l3["experts_gate_up"].shape == (128, 6144, 2 * 3072)  # MoE: [E, H, 2I]
    assert l3["experts_down"].shape == (128, 3072, 6144)
    assert l3["router"].shape == (6144, 128) and l3["router"].dtype == jnp.float32
    assert l3["router_bias"].shape == (128,) and l3["shared_gate_up"].shape == (6144, 2 * 3072)
    assert "gate_up_proj" not in l3 and "router" not in shapes["layers"][2]
    assert shapes["embed"].shape == (200064, 6144)


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="sparse_attention_freq"):
        ModelConfig(num_layers=2)
    with pytest.raises(ConfigError, match="num_index_heads"):
        ModelConfig(num_index_heads=2)
    with pytest.raises(ConfigError, match="sparse_score_type"):
        ModelConfig.from_hf_config({**M3_CONFIG, "sparse_attention_config": {
            **M3_CONFIG["sparse_attention_config"], "sparse_score_type": "softmax"}})
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_hf_config({k: v for k, v in M3_CONFIG.items() if k != "hidden_size"})
    for bad, dtype in (("float16", "float32"), ("bfloat16", "float32"), ("fp8", "bfloat16"),
                       ("float8_e5m2", "bfloat16")):
        with pytest.raises(ConfigError, match=f"index_cache_dtype: one of 'auto', '{dtype}' "
                                              f"\\(the model dtype\\) or 'float8_e4m3fn', "
                                              f"got '{bad}'"):
            ModelConfig(dtype=dtype, index_cache_dtype=bad)


def test_index_cache_dtype_values():
    """auto / the model dtype's name: unchanged caches; float8_e4m3fn: fp8 index-K pages only."""
    for dtype in ("float32", "bfloat16"):
        for name, want in (("auto", dtype), (dtype, dtype), ("float8_e4m3fn", "float8_e4m3fn")):
            c = ModelConfig.tiny(dtype=dtype, index_cache_dtype=name)
            assert c.index_cache_jnp_dtype == jnp.dtype(want)
            caches = jax.eval_shape(lambda: init_caches(c, 4, None))
            assert {x.dtype for x in caches.kv} == {jnp.dtype(dtype)}
            assert [x is None for x in caches.index_k] == [not m for m in c.layer_is_msa]
            assert {x.dtype for x in caches.index_k if x is not None} == {jnp.dtype(want)}
    assert ModelConfig().index_cache_dtype == "auto"


def test_tiny_default_has_dense_and_msa_layers():
    c = ModelConfig.tiny()
    assert c.head_dim == 128 and not c.layer_is_msa[0] and sum(c.layer_is_msa) >= 2


def test_paged_attention_matches_naive():
    rng = np.random.default_rng(0)
    T, Hq, Hkv, D, N = 5, 4, 2, 8, 6
    q = rng.normal(size=(T, Hq, D)).astype(np.float32)
    cache = rng.normal(size=(N, Hkv, 128, 2 * D)).astype(np.float32)
    bt = np.array([[3, 1, 5], [2, 4, 0]], np.int32)
    req = np.array([0, 0, 1, 1, 0], np.int32)
    kv_lens = np.array([300, 5, 129, 1, 0], np.int32)
    out, lse = paged_causal_attention(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(bt),
                                      jnp.asarray(req), jnp.asarray(kv_lens), scale=0.3)
    for t in range(T):
        if kv_lens[t] == 0:
            npt.assert_array_equal(np.asarray(out[t]), 0.0)
            assert np.all(np.isneginf(np.asarray(lse[t])))
            continue
        keys = np.concatenate([cache[p] for p in bt[req[t]]], axis=1)[:, :kv_lens[t]]  # [Hkv,L,2D]
        for h in range(Hq):
            kh = keys[h // (Hq // Hkv)]
            s = kh[:, :D] @ q[t, h] * 0.3
            p = np.exp(s - s.max())
            npt.assert_allclose(np.asarray(out[t, h]), p @ kh[:, D:] / p.sum(), rtol=2e-5, atol=2e-5)
            npt.assert_allclose(float(lse[t, h]), s.max() + np.log(p.sum()), rtol=1e-5)


def _prefill_logits(params, config, rconfig, prompts, chunk, mode, return_caches=False):
    """Chunked prefill of all prompts together; returns per-prompt logits [len, V] (and the
    final caches and per-prompt pages if ``return_caches``)."""
    caches = init_caches(config, 2 + sum(-(-len(p) // 128) for p in prompts), None)
    pages, nxt = [], 2
    for p in prompts:
        n = -(-len(p) // 128)
        pages.append(list(range(nxt, nxt + n)))
        nxt += n
    step = jax.jit(lambda prm, c, t, md: forward(prm, c, t, md, config=config,
                                                 attention_impl="reference", attention_mode=mode))
    done = [0] * len(prompts)
    outs = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts)):
        rows, sched, budget = [], [], chunk  # chunk = the step's token budget
        for i, p in enumerate(prompts):
            if done[i] < len(p) and budget > 0:
                rows.append(i)
                sched.append(min(budget, len(p) - done[i]))
                budget -= sched[-1]
        md = stage_batch(np.array(sched), np.array([done[i] for i in rows]),
                         [pages[i] for i in rows], rconfig)
        toks = np.concatenate([prompts[i][done[i]:done[i] + s] for i, s in zip(rows, sched)])
        toks = np.pad(toks, (0, md.num_tokens_padded - len(toks))).astype(np.int32)
        hidden, caches = step(params, caches, jnp.asarray(toks), md)
        logits = np.asarray(compute_logits(params, hidden, config))
        off = 0
        for i, s in zip(rows, sched):
            outs[i].append(logits[off:off + s])
            off += s
            done[i] += s
    logits = [np.concatenate(o) for o in outs]
    return (logits, caches, pages) if return_caches else logits


def test_msa_logits_equal_dense_below_2048():
    """Tolerance: |MSA - dense| <= 2e-4 on f32 logits (std ~1) for prompts < 2048 tokens.

    The longer prompt reaches 16 pages, the most the top-16 selection can return, so every
    selected set is the identity and MSA must equal dense causal attention.
    """
    # small heads keep the jnp reference kernels' per-token page gathers cheap on CI
    config = ModelConfig.tiny(num_layers=2, sparse_attention_freq=(0, 1), num_heads=4,
                              head_dim=32, rotary_dim=16, index_dim=32)
    params = init_params(config, seed=3)
    rconfig = RunnerConfig(max_num_seqs=2, max_num_batched_tokens=512, max_model_len=2048,
                           bucket_sizes=(512,))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, n).astype(np.int32) for n in (2040, 300)]
    msa = _prefill_logits(params, config, rconfig, prompts, 512, "msa")
    dense = _prefill_logits(params, config, rconfig, prompts, 512, "dense")
    for m, d in zip(msa, dense):
        npt.assert_allclose(m, d, atol=2e-4, rtol=0)


def test_fp8_index_cache_msa_logits_equal_dense_below_2048():
    """float8_e4m3fn index-K cache (f32 model): the chunked prefill writes finite, non-zero fp8
    index keys for every prompt token, and MSA logits still equal dense below 2048 tokens
    (every visible page is selected). Prompts end mid-page; chunks of 192 tokens."""
    config = ModelConfig.tiny(num_layers=2, sparse_attention_freq=(0, 1), num_heads=4,
                              head_dim=32, rotary_dim=16, index_dim=32,
                              index_cache_dtype="float8_e4m3fn")
    params = init_params(config, seed=17)
    rconfig = RunnerConfig(max_num_seqs=2, max_num_batched_tokens=192, max_model_len=2048,
                           bucket_sizes=(192,))
    rng = np.random.default_rng(17)
    prompts = [rng.integers(0, config.vocab_size, n).astype(np.int32) for n in (333, 150)]
    msa, caches, pages = _prefill_logits(params, config, rconfig, prompts, 192, "msa",
                                         return_caches=True)
    dense = _prefill_logits(params, config, rconfig, prompts, 192, "dense")
    for m, d in zip(msa, dense):
        chex.assert_shape(m, d.shape)
        chex.assert_tree_all_finite(m)
        chex.assert_trees_all_close(m, d, atol=2e-4, rtol=0)
    assert caches.index_k[0] is None and caches.kv[1].dtype == jnp.float32
    assert caches.index_k[1].dtype == jnp.float8_e4m3fn
    ik = np.asarray(caches.index_k[1].astype(jnp.float32))
    written = np.concatenate([ik[pg].reshape(-1, config.index_dim)[:len(p)]
                              for pg, p in zip(pages, prompts)])  # [333 + 150, Di]
    chex.assert_tree_all_finite(written)
    assert (np.abs(written).max(axis=1) > 0).all()  # every prompt token's key was written
    npt.assert_array_equal(ik[1], 0.0)  # the dummy page stays untouched


def test_msa_layer_attention_sparse_beyond_2048():
    """Past 16 pages the selection drops pages: MSA != dense; before, MSA == dense."""
    from jax_msa_runner.attention.layer import msa_layer_attention
    rng = np.random.default_rng(0)
    T, Hq, D, Di, P = 4, 16, 128, 64, 20
    rconfig = RunnerConfig(max_num_seqs=2, max_num_batched_tokens=4, max_model_len=P * 128,
                           bucket_sizes=(4,))
    pages = list(range(2, 2 + P))
    # two requests: 2 tokens each, at positions 1998-1999 (< 2048) and 2498-2499 (> 2048)
    md = stage_batch(np.array([2, 2]), np.array([1998, 2498]), [pages[:16], pages], rconfig)
    kv = jnp.asarray(rng.normal(size=(2 + P, 1, 128, 2 * D)).astype(np.float32))
    ik = jnp.asarray(rng.normal(size=(2 + P, 128, Di)).astype(np.float32))
    q = jnp.asarray(rng.normal(size=(T, Hq, D)).astype(np.float32))
    iq = jnp.asarray(rng.normal(size=(T, 1, Di)).astype(np.float32))
    kw = dict(scale=D ** -0.5, attention_impl="reference")
    attend = jax.jit(msa_layer_attention, static_argnames=("scale", "attention_impl", "attention_mode"))
    msa = np.asarray(attend(q, iq, kv, ik, md, attention_mode="msa", **kw))
    dense = np.asarray(attend(q, iq, kv, ik, md, attention_mode="dense", **kw))
    npt.assert_allclose(msa[:2], dense[:2], atol=1e-5)
    assert np.abs(msa[2:] - dense[2:]).max() > 1e-3

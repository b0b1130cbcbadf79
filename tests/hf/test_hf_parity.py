"""Parity with transformers 5.23.0's MiniMaxM3VLForCausalLM (CPU torch, never skipped).

``tools/hf_reference/hf_side.py`` runs in the reference venv (``.venv-vllm``, built by
``make compare-env``): it builds a tiny random 3-layer model (dense attention + dense MLP,
then two MSA + MoE layers; index heads = KV heads, for 1 and 2 KV heads), saves it with
``save_pretrained`` and records prefill logits (eager attention: the indexer's top-16 block
selection is applied as a mask), each MoE layer's chosen experts, and 16 greedy
``generate`` tokens for prompts of 100 and 3000 tokens. Here the saved folder is read by
``checkpoint.load`` and served:

- prefill logits from ``jax-msa-runner logits`` (chunked prefill through the scheduler and
  the runner): ``max |ours - HF| <= 1e-4 * max |HF|`` (f32);
- chosen experts on both MoE layers: the same set for every token;
- 16 greedy decode steps through the runner: the same tokens as HF's ``generate``;
- the same weights under the released VL names with a legacy config (which transformers'
  own VL loader reads back exactly): the same ModelConfig and params;
- negative control: past 2048 tokens HF's logits without the block mask differ from HF's
  (and ours) by far more than the tolerance, so the long prompt does test the selection.
"""
import logging
import os
import subprocess
import sys
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_msa_runner.attention.parallel import init_caches
from jax_msa_runner.batch.staging import stage_batch
from jax_msa_runner.checkpoint import load
from jax_msa_runner.cli.main import main as cli_main
from jax_msa_runner.config import RESERVED_PAGES, RunnerConfig, SchedulerConfig
from jax_msa_runner.model import forward_with_routing
from jax_msa_runner.serving.kv_cache import pages_needed
from jax_msa_runner.serving.runner import ModelRunner, serve
from jax_msa_runner.serving.scheduler import Request, Scheduler

from _hf_env import HF_SIDE, REF_PYTHON, TRANSFORMERS_VERSION, check_reference_env

PROMPT_LENS = (100, 3000)
DECODE_STEPS = 16
REL_TOL = 1e-4  # max |ours - HF| / max |HF| on f32 prefill logits
CHUNK = 512  # our prefill chunk (tokens per step)


@pytest.fixture(scope="module", params=[1, 2], ids=["hkv1", "hkv2"])
def case(request, tmp_path_factory):
    """(reference arrays, checkpoint folder, our config, our params) for one KV-head count."""
    check_reference_env()
    hkv = request.param
    out = tmp_path_factory.mktemp(f"hf_hkv{hkv}")
    t0 = time.perf_counter()
    proc = subprocess.run([REF_PYTHON, HF_SIDE, "--out", str(out), "--num-kv-heads", str(hkv),
                           "--seed", str(10 + hkv), "--prompt-lens", ",".join(map(str, PROMPT_LENS)),
                           "--decode-steps", str(DECODE_STEPS), "--released-vl"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    print(f"\nHF side (Hkv={hkv}): {time.perf_counter() - t0:.1f}s")
    ref = dict(np.load(out / "reference.npz"))
    assert str(ref["transformers_version"]) == TRANSFORMERS_VERSION
    assert str(ref["attn_implementation"]) == "eager"
    config, params = load(out / "checkpoint", dtype="float32")
    return ref, out, config, params


def test_loaded_config_is_the_tiny_m3(case):
    ref, _, c, params = case
    assert c.layer_is_msa == (False, True, True) and c.layer_is_moe == (False, True, True)
    assert c.num_index_heads == c.num_kv_heads in (1, 2)
    assert (c.num_experts, c.num_experts_per_tok, c.rotary_dim, c.index_dim) == (8, 2, 16, 32)
    assert list(ref["moe_layers"]) == [1, 2]
    assert params["layers"][1]["router"].dtype == jnp.float32


def test_released_vl_names_load_the_same_params(case, caplog):
    _, out, config, params = case
    with caplog.at_level(logging.INFO, logger="jax_msa_runner.checkpoint"):
        config_r, params_r = load(out / "released_vl", dtype="float32")
    assert config_r == config  # legacy config fields == transformers' fields
    chex.assert_trees_all_equal(params_r, params)
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        "skipped 3 weights (vision: 2, MTP: 1)"]


@pytest.mark.parametrize("n", PROMPT_LENS)
def test_prefill_logits_match(case, n, tmp_path):
    ref, _, c, _ = case
    ids, want = ref[f"ids_{n}"], ref[f"logits_{n}"]
    np.save(tmp_path / "ids.npy", ids)
    rc = cli_main(["logits", "--checkpoint", str(case[1] / "checkpoint"), "--token-ids",
                   str(tmp_path / "ids.npy"), "--out", str(tmp_path / "logits.npy"),
                   "--max-num-batched-tokens", str(CHUNK)])
    assert rc == 0
    got = np.load(tmp_path / "logits.npy")
    chex.assert_shape(got, want.shape)
    chex.assert_tree_all_finite(got)
    scale = np.abs(want).max()
    err = np.abs(got - want).max() / scale
    print(f"\nprefill {n} tokens, Hkv={c.num_kv_heads}: max rel error {err:.2e}")
    assert err <= REL_TOL, err
    if f"dense_logits_{n}" in ref:  # the selection matters past 16 pages
        dense = ref[f"dense_logits_{n}"]
        limit = 16 * 128
        np.testing.assert_allclose(dense[:limit], want[:limit], atol=REL_TOL * scale, rtol=0)
        assert np.abs(dense[limit:] - want[limit:]).max() / scale > 100 * REL_TOL
        assert np.abs(dense[limit:] - got[limit:]).max() / scale > 100 * REL_TOL


@pytest.mark.parametrize("n", PROMPT_LENS)
def test_router_choices_match(case, n):
    """Our chosen experts (chunked prefill, forward_with_routing) equal HF's on every token
    of both MoE layers."""
    ref, _, c, params = case
    ids = ref[f"ids_{n}"]
    chunk = min(CHUNK, n)
    rconf = RunnerConfig(max_num_seqs=1, max_num_batched_tokens=chunk, max_model_len=n,
                         bucket_sizes=(chunk,))
    pages = list(range(len(RESERVED_PAGES), len(RESERVED_PAGES) + pages_needed(n, 1)))
    caches = init_caches(c, pages[-1] + 1, None)
    step = jax.jit(lambda p, cc, t, m: forward_with_routing(p, cc, t, m, config=c)[1:])
    chosen = [[] for _ in ref["moe_layers"]]
    for start in range(0, n, chunk):
        s = min(chunk, n - start)
        md = stage_batch(np.array([s]), np.array([start]), [pages], rconf)
        toks = np.zeros(chunk, np.int32)
        toks[:s] = ids[start:start + s]
        caches, routing = step(params, caches, jnp.asarray(toks), md)
        for j, layer in enumerate(ref["moe_layers"]):
            chosen[j].append(np.sort(np.asarray(routing[layer])[:s], axis=-1))
    ours = np.stack([np.concatenate(x) for x in chosen])
    want = ref[f"experts_{n}"]
    chex.assert_shape(ours, want.shape)
    mismatch = np.argwhere((ours != want).any(-1))
    assert mismatch.size == 0, f"{len(mismatch)} (layer, token) choices differ, first {mismatch[:5]}"


def test_greedy_decode_matches_generate(case):
    """Both prompts served together by the runner (chunked prefill, then 16 greedy decode
    steps) give HF generate's tokens."""
    ref, _, c, params = case
    longest = max(PROMPT_LENS) + DECODE_STEPS
    rc = RunnerConfig(max_num_seqs=2, max_num_batched_tokens=CHUNK, max_model_len=longest,
                      bucket_sizes=(2, CHUNK))
    num_pages = len(RESERVED_PAGES) + sum(pages_needed(n + DECODE_STEPS, 1) for n in PROMPT_LENS)
    runner = ModelRunner(c, rc, num_pages=num_pages, params=params)
    runner.warm_up()
    sched = Scheduler(SchedulerConfig.from_runner(rc, num_pages))
    for i, n in enumerate(PROMPT_LENS):
        sched.add_request(Request(i, tuple(int(t) for t in ref[f"ids_{n}"]), DECODE_STEPS))
    stats = serve(runner, sched)
    assert stats.compilations == 0
    for i, n in enumerate(PROMPT_LENS):
        got = np.array(sched.finished[i].output)
        np.testing.assert_array_equal(got, ref[f"generated_{n}"], err_msg=f"prompt of {n} tokens")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))

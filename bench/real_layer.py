"""Decode throughput of one real MiniMax-M3 dense layer + one MSA + MoE layer, per rank.

    python3 bench/real_layer.py --out DIR                  (H200; JSON + table to DIR)
    python3 bench/real_layer.py --out DIR --tp 4 --experts 32
    python3 bench/real_layer.py --out DIR --ragged-dot pallas   (jax's Pallas-Triton grouped GEMM)

Shapes: hidden 6144; attention 64/4 heads (``--tp 1``) or 16/1 (``--tp 4``), head dim 128,
index dim 128; layer 0 dense attention + dense MLP (12288), layer 1 MSA + MoE
(``--experts`` routed experts of 3072, top 4, one shared expert of 3072: 128 is the whole
model, 32 the per-rank slice of 4-way expert parallelism); bf16 weights, f32 router; a
32768-token LM head. Each point runs the runner's compiled step (``runner.serve_step``) on a
pure decode batch of B requests with L - 1 cached tokens each, and reports:

- step time (median of ``--iters``) and decode tokens/s = B / step time;
- the MoE share: the MoE MLP alone (same B, jitted) over the step time;
- the MoE's weight-read bandwidth: bytes of the experts the batch touches (the routed experts
  actually chosen, counted from the router on the bench's hidden states, plus the shared
  expert and the router) / MoE time, next to a same-bytes device copy (the copy roofline);
- the MSA step at each context over the step at the smallest context (target <= 1.5).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_msa_runner.attention.layer import default_attention_impl  # noqa: E402
from jax_msa_runner.attention.parallel import init_caches  # noqa: E402
from jax_msa_runner.batch.buckets import Bucket  # noqa: E402
from jax_msa_runner.batch.staging import pack_host_batch  # noqa: E402
from jax_msa_runner.config import ModelConfig, RunnerConfig  # noqa: E402
from jax_msa_runner.model import init_params, moe_mlp, route  # noqa: E402
from jax_msa_runner.serving.runner import pack_step_inputs, serve_step  # noqa: E402
from jax_msa_runner.serving.sampling import SamplingRows, init_penalty_state  # noqa: E402


def real_config(tp: int, experts: int, small: bool = False, layers: str = "both") -> ModelConfig:
    """Layer 0 dense + dense MLP, layer 1 MSA + MoE, at MiniMax-M3's per-rank shapes
    (``small``: a CPU smoke-test size); ``layers="msa"``: the MSA + MoE layer alone."""
    mc = _real_config(tp, experts, small)
    if layers == "msa":
        mc = dataclasses.replace(mc, num_layers=1, sparse_attention_freq=(1,), moe_layer_freq=(1,))
    return mc


def _real_config(tp: int, experts: int, small: bool) -> ModelConfig:
    if small:
        return ModelConfig(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4,
                           num_kv_heads=1, head_dim=32, rotary_dim=16, index_dim=32,
                           intermediate_size=64, sparse_attention_freq=(0, 1), num_experts=experts,
                           num_experts_per_tok=4, moe_intermediate_size=32,
                           shared_intermediate_size=32, dtype="bfloat16")
    return ModelConfig(vocab_size=32768, hidden_size=6144, num_layers=2, num_heads=64 // tp,
                       num_kv_heads=4 // tp, num_index_heads=4 // tp, head_dim=128,
                       rotary_dim=64, rope_theta=5e6, index_dim=128, intermediate_size=12288,
                       sparse_attention_freq=(0, 1), moe_layer_freq=(0, 1), num_experts=experts,
                       num_experts_per_tok=4, moe_intermediate_size=3072,
                       shared_intermediate_size=3072, routed_scaling_factor=2.0, dtype="bfloat16")


def _median_ms(fn, iters):
    jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


def run_point(params, mc, batch, context, impl, iters):
    pages = -(-context // 128)
    rc = RunnerConfig(max_num_seqs=batch, max_num_batched_tokens=batch, max_model_len=context,
                      bucket_sizes=(batch,))
    bucket = Bucket(batch, batch, rc.max_pages)
    caches = init_caches(mc, 2 + batch * pages, None)
    table = (2 + np.arange(batch * pages)).reshape(batch, pages)
    packed = pack_host_batch(np.ones(batch, np.int64), np.full(batch, context - 1), table, bucket, rc)
    rows = SamplingRows.neutral(batch)._replace(slot=np.arange(batch, dtype=np.int32))
    buf = jax.device_put(pack_step_inputs(packed, np.arange(batch) % mc.vocab_size, rows,
                                          bucket))
    step = jax.jit(functools.partial(serve_step, bucket=bucket, rconfig=rc, mconfig=mc,
                                     attention_impl=impl), donate_argnums=(1, 2))
    state = {"caches": caches, "penalties": init_penalty_state(batch, mc.vocab_size)}

    def one():
        nxt, _, state["caches"], state["penalties"], _ = step(params, state["caches"],
                                                              state["penalties"], buf)
        return nxt

    return _median_ms(one, iters)


def moe_point(params, mc, batch, iters):
    """MoE MLP time (ms), bytes of weights it reads, and a same-bytes copy time (ms)."""
    layer = params["layers"][-1]  # the MSA + MoE layer
    x = jax.random.normal(jax.random.key(batch), (batch, mc.hidden_size), jnp.float32).astype(mc.jnp_dtype)
    mask = jnp.ones((batch,), bool)
    fn = jax.jit(lambda lay, h: moe_mlp(lay, h, mask, mc)[0])
    ms = _median_ms(lambda: fn(layer, x), iters)
    _, experts, _ = route(x, layer["router"], layer.get("router_bias"), top_k=mc.num_experts_per_tok,
                          routed_scaling_factor=mc.routed_scaling_factor)
    touched = len(np.unique(np.asarray(experts)))
    per_expert = (layer["experts_gate_up"][0].nbytes + layer["experts_down"][0].nbytes)
    shared = sum(layer[k].nbytes for k in ("shared_gate_up", "shared_down", "router") if k in layer)
    nbytes = touched * per_expert + shared
    src = jnp.zeros((nbytes // 2,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + jnp.bfloat16(1))
    copy_ms = _median_ms(lambda: copy(src), iters)
    return ms, nbytes, touched, copy_ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, choices=(1, 4), default=1)
    ap.add_argument("--experts", type=int, default=128, help="routed experts on this rank")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--impl", default=None, choices=("pallas", "reference"))
    ap.add_argument("--small", action="store_true", help="CPU smoke-test shapes")
    ap.add_argument("--layers", choices=("both", "msa"), default="both",
                    help="both: the dense layer and the MSA + MoE layer; msa: the MSA + MoE "
                         "layer alone (the context-flatness target)")
    ap.add_argument("--ragged-dot", choices=("xla", "pallas"), default="xla",
                    help="lowering of jax.lax.ragged_dot on the GPU: XLA's ragged-dot "
                         "instruction (default) or jax's Pallas-Triton grouped matmul")
    args = ap.parse_args(argv)
    jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", args.ragged_dot == "pallas")
    impl = args.impl or default_attention_impl()
    mc = real_config(args.tp, args.experts, args.small, args.layers)
    params = init_params(mc, seed=0)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    dev = jax.devices()[0]
    print(f"device {dev.device_kind}, impl {impl}, ragged_dot {args.ragged_dot}, TP{args.tp} heads {mc.num_heads}/{mc.num_kv_heads}, "
          f"{mc.num_experts} experts x {mc.moe_intermediate_size} top {mc.num_experts_per_tok}")
    print(f"{'B':>4} {'ctx':>7} {'step ms':>9} {'tok/s':>10} {'moe ms':>8} {'moe %':>6} "
          f"{'moe GB/s':>9} {'copy GB/s':>9} {'vs ctx0':>7}")
    rows = []
    for b in batches:
        moe_ms, nbytes, touched, copy_ms = moe_point(params, mc, b, args.iters)
        base = None
        for c in contexts:
            try:
                ms = run_point(params, mc, b, c, impl, args.iters)
            except Exception as e:  # noqa: BLE001 - record (e.g. OOM) and keep going
                rows.append({"batch": b, "context": c, "error": f"{type(e).__name__}: {e}"[:500]})
                print(f"{b:>4} {c:>7}  ERROR {rows[-1]['error'][:100]}")
                continue
            base = base or ms
            row = {"batch": b, "context": c, "step_ms": ms, "tokens_per_s": b / (ms / 1e3),
                   "moe_ms": moe_ms, "moe_share": moe_ms / ms, "moe_bytes": nbytes,
                   "experts_touched": touched, "moe_gb_s": nbytes / (moe_ms / 1e3) / 1e9,
                   "copy_gb_s": 2 * nbytes / (copy_ms / 1e3) / 1e9,
                   "ratio_vs_smallest_context": ms / base}
            rows.append(row)
            print(f"{b:>4} {c:>7} {ms:9.3f} {row['tokens_per_s']:10.1f} {moe_ms:8.3f} "
                  f"{100 * row['moe_share']:5.1f}% {row['moe_gb_s']:9.1f} {row['copy_gb_s']:9.1f} "
                  f"{row['ratio_vs_smallest_context']:7.2f}")
            sys.stdout.flush()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "real_layer.json"), "w") as f:
        json.dump({"device": dev.device_kind, "jax": jax.__version__, "impl": impl, "tp": args.tp,
                   "layers": args.layers,
                   "ragged_dot": args.ragged_dot,
                   "model": dataclasses.asdict(mc), "iters": args.iters, "results": rows,
                   "copy_note": "copy GB/s counts read + write bytes of a same-bytes copy"}, f,
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

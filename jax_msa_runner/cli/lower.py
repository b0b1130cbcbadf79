"""`jax-msa-runner lower`: the StableHLO of one compiled forward step for an abstract H200.

``--model-config FILE [--num-layers N] --num-tokens T --context L --out FILE`` reads a
MiniMax-M3 ``config.json``, builds the step's inputs as ShapeDtypeStructs (params of
``rank_shapes.abstract_rank_params``, caches of R requests x L tokens, the int32 host buffer
of the bucket (T tokens, R rows, ceil(L / 128) pages)) -- no weight or cache is allocated --
and lowers ``serving.runner.forward_step`` with the Pallas kernels for CUDA under an abstract
H200 mesh (``pallas_kernels._lowering.lower_for_cuda``; no GPU needed). It writes the
StableHLO text to ``--out`` and prints which kernels the step runs: Mosaic GPU and Triton
custom calls, other custom calls, and ``ragged_dot`` ops, each once per call (a kernel of a
helper that every layer calls counts once per layer).

``--tp N --ep M`` lower one rank of a TP x EP deployment on its own (``rank_shapes.rank_config``:
heads, dense MLP, shared expert and vocabulary / N, experts / M; no collectives);
``--weights fp8`` makes every quantizable linear an MXFP8 ``Fp8Weight``.
"""
from __future__ import annotations

import argparse
import os
import sys

from jax_msa_runner.cli.flags import FlagError, bounded_int

MAX_NUM_SEQS = 256  # default --num-reqs: min(T, this), the runner's bucket rows


def add_lower_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the ``lower`` subcommand's flags on ``parser``."""
    parser.add_argument("--model-config", required=True, metavar="FILE",
                        help="a MiniMax-M3 config.json (or the folder holding one)")
    parser.add_argument("--num-layers", type=bounded_int(1), default=None, metavar="N",
                        help="the first N layers (>= 1, at most the config's; default all)")
    parser.add_argument("--num-tokens", type=bounded_int(1), required=True, metavar="T",
                        help="tokens of the step's bucket (>= 1)")
    parser.add_argument("--num-reqs", type=bounded_int(1), default=None, metavar="R",
                        help=f"request rows of the bucket, in [1, T] (default min(T, "
                             f"{MAX_NUM_SEQS}): T decode rows, or 1 for a prefill chunk)")
    parser.add_argument("--context", type=bounded_int(1), required=True, metavar="L",
                        help="max_model_len: block-table pages ceil(L / 128) and caches of R x L "
                             "tokens (>= 1)")
    parser.add_argument("--out", required=True, metavar="FILE", help="where to write the StableHLO")
    parser.add_argument("--tp", type=bounded_int(1), default=1, metavar="N",
                        help="lower one of N tensor-parallel ranks (per-rank shapes, >= 1)")
    parser.add_argument("--ep", type=bounded_int(1), default=1, metavar="M",
                        help="lower one of M expert-parallel ranks (experts / M, >= 1)")
    parser.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                        help="bf16 weights, or MXFP8 fp8 linears (default bf16)")
    return parser


def kernel_summary(text: str) -> dict[str, int]:
    """Kernels one execution of the step runs, from its StableHLO text: Mosaic GPU, Triton and
    other custom calls and ``ragged_dot`` ops, each counted once per call of the function
    holding it (``pallas_kernels._lowering.call_site_counts``)."""
    from pallas_kernels._lowering import call_site_counts
    return call_site_counts(text)


def lower_step(model_config: str, *, num_tokens: int, context: int, num_reqs: int | None = None,
               num_layers: int | None = None, tp: int = 1, ep: int = 1,
               weights: str = "bf16") -> tuple[str, dict]:
    """(StableHLO text, description) of ``forward_step`` for the bucket; FlagError naming the
    flag when the config or a size does not fit."""
    from jax_msa_runner.config import ConfigError, ModelConfig, RunnerConfig

    R = min(num_tokens, MAX_NUM_SEQS) if num_reqs is None else num_reqs
    if R > num_tokens:
        raise FlagError("--num-reqs", f"must be <= --num-tokens = {num_tokens}, got {R}")
    if not os.path.exists(model_config):
        raise FlagError("--model-config", f"no such file {model_config!r}")
    try:
        full = ModelConfig.from_hf_config(model_config, dtype="bfloat16")
    except (ConfigError, ValueError, OSError, KeyError) as e:
        raise FlagError("--model-config", f"{model_config}: {e}") from None
    if num_layers is not None and num_layers > full.num_layers:
        raise FlagError("--num-layers", f"must be <= the config's {full.num_layers} layers, "
                                        f"got {num_layers}")
    if num_layers is not None:
        full = ModelConfig.from_hf_config(model_config, dtype="bfloat16", num_layers=num_layers)
    from jax_msa_runner.rank_shapes import rank_config
    for flag, sizes in (("--tp", (tp, 1)), ("--ep", (1, ep))):
        try:
            rank_config(full, *sizes)
        except ConfigError as e:  # "tp: 3 must divide ...": the flag names the field
            raise FlagError(flag, str(e).split(": ", 1)[-1]) from None
    mc = rank_config(full, tp, 1)
    try:
        rconfig = RunnerConfig(max_num_seqs=R, max_num_batched_tokens=num_tokens,
                               max_model_len=context, bucket_sizes=(num_tokens,))
    except ConfigError as e:
        raise FlagError("--num-tokens/--context", str(e)) from None
    return _lower(mc, rconfig, num_local=mc.num_experts // ep, weights=weights)


def _lower(mc, rconfig, *, num_local: int, weights: str) -> tuple[str, dict]:
    import jax
    import jax.numpy as jnp

    from jax_msa_runner.batch.buckets import make_buckets
    from jax_msa_runner.rank_shapes import (abstract_caches, abstract_rank_params, cache_pages,
                                            tree_bytes)
    from jax_msa_runner.serving.runner import forward_step, host_buffer_size
    from pallas_kernels._lowering import lower_for_cuda

    bucket = make_buckets(rconfig)[0]
    params = abstract_rank_params(mc, num_local_experts=num_local, weights=weights)
    caches = abstract_caches(mc, cache_pages(bucket.num_reqs, rconfig.max_model_len,
                                             rconfig.page_size))
    buf = jax.ShapeDtypeStruct((host_buffer_size(bucket),), jnp.int32)
    text = lower_for_cuda(forward_step, params, caches, buf, bucket=bucket, rconfig=rconfig,
                          mconfig=mc, attention_impl="pallas", interpret=False)
    info = {"bucket": tuple(bucket), "layers": mc.num_layers, "msa_layers": sum(mc.layer_is_msa),
            "moe_layers": sum(mc.layer_is_moe), "heads": (mc.num_heads, mc.num_kv_heads),
            "local_experts": num_local, "weights": weights, "param_bytes": tree_bytes(params),
            "cache_bytes": tree_bytes(caches)}
    return text, info


def run_lower(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Lower, write ``args.out``, print the summary (a bad flag: ``parser.error``, exit 2)."""
    try:
        out_dir = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(out_dir):
            raise FlagError("--out", f"no such directory {out_dir!r}")
        text, info = lower_step(args.model_config, num_tokens=args.num_tokens,
                                context=args.context, num_reqs=args.num_reqs,
                                num_layers=args.num_layers, tp=args.tp, ep=args.ep,
                                weights=args.weights)
    except FlagError as e:
        parser.error(str(e))
    with open(args.out, "w") as f:
        f.write(text)
    c = kernel_summary(text)
    T, R, P = info["bucket"]
    print(f"wrote {args.out}: StableHLO of forward_step for an abstract H200, bucket T={T} R={R} "
          f"P={P}, {info['layers']} layers ({info['msa_layers']} MSA, {info['moe_layers']} MoE), "
          f"heads {info['heads'][0]}/{info['heads'][1]}, {info['local_experts']} local experts, "
          f"{info['weights']} weights ({info['param_bytes'] / 2**30:.2f} GiB abstract params, "
          f"{info['cache_bytes'] / 2**30:.2f} GiB abstract caches)")
    print(f"kernels per step: mosaic_gpu={c['mosaic']} triton={c['triton']} "
          f"other_custom_calls={c['other']} ragged_dot={c['ragged_dot']}")
    return 0


__all__ = ["add_lower_args", "kernel_summary", "lower_step", "run_lower"]

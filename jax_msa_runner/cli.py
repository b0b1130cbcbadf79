"""Command line: ``jax-msa-runner demo`` (the main job), ``buckets`` and ``compare``.

- demo: the tiny default model serves a synthetic workload (jax_msa_runner.demo).
- buckets: stages every bucket of the default RunnerConfig with each dummy kind and
  validates it (the metadata table).
- compare: the comparison against vLLM 0.33.0's operators (tools.vllm_compare.compare).
- logits: full-prompt logits of a checkpoint through the serving path (jax_msa_runner.logits).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax


def run_buckets(args: argparse.Namespace) -> int:
    """Stages every bucket of the default RunnerConfig with each dummy kind and validates it.

    Prints one row per (bucket, kind): bucket (T, R, P), real tokens and requests, the first
    staging call of the bucket (compile included, ms), the median of ``args.repeats`` further
    stagings (us), and the validator's verdict. Returns 0 when every batch is valid.
    """
    from jax_msa_runner.batch.buckets import make_buckets
    from jax_msa_runner.config import RunnerConfig
    from jax_msa_runner.batch.staging import DUMMY_KINDS, stage_dummy_batch
    from jax_msa_runner.batch.validate import MetadataInvariantError, validate_metadata

    config = RunnerConfig()
    print(f"jax {jax.__version__} on {jax.default_backend()}; {config}")
    header = (f"{'bucket (T,R,P)':>16} {'kind':>15} {'tokens':>6} {'reqs':>4} "
              f"{'compile-ms':>10} {'stage-us':>9}  valid")
    print(header)
    print("-" * len(header))
    failures = 0
    for bucket in make_buckets(config):
        for i, kind in enumerate(DUMMY_KINDS):
            def stage():
                return jax.block_until_ready(stage_dummy_batch(
                    bucket.num_tokens, config, kind=kind, profile_seq_len=args.profile_seq_len))

            t0 = time.perf_counter()
            md = stage()
            first_ms = (time.perf_counter() - t0) * 1e3
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                stage()
                times.append((time.perf_counter() - t0) * 1e6)
            try:
                validate_metadata(md, config)
                verdict = "ok"
            except MetadataInvariantError as err:
                verdict = f"INVALID: {err}"
                failures += 1
            compile_ms = f"{first_ms:10.1f}" if i == 0 else f"{'-':>10}"
            print(f"{str(tuple(bucket)):>16} {kind:>15} {int(md.query_start_loc[-1]):>6} "
                  f"{int(md.req_mask.sum()):>4} {compile_ms} "
                  f"{statistics.median(times):9.1f}  {verdict}")
    print("all buckets valid" if failures == 0 else f"{failures} invalid batches")
    return 0 if failures == 0 else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jax-msa-runner`` script."""
    parser = argparse.ArgumentParser(prog="jax-msa-runner", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from jax_msa_runner.demo import add_demo_args, run_demo

    demo = sub.add_parser("demo", help="serve a synthetic workload with the tiny default model")
    add_demo_args(demo)
    buckets = sub.add_parser("buckets", help="stage and validate every bucket of the default config")
    buckets.add_argument("--profile-seq-len", type=int, default=None,
                         help="profiling override L of the dummy sequence length")
    buckets.add_argument("--repeats", type=int, default=20,
                         help="timed stagings per (bucket, kind) after the first")
    from jax_msa_runner.logits import add_logits_args, run_logits
    add_logits_args(sub.add_parser("logits", help="full-prompt logits of a checkpoint (.npy)"))
    compare = sub.add_parser("compare", help="compare against the reference implementation",
                             add_help=False)
    compare.add_argument("rest", nargs=argparse.REMAINDER)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["compare"]:  # everything after the subcommand belongs to compare.py
        from tools.vllm_compare.compare import main as compare_main
        return compare_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "logits":
        return run_logits(args)
    return run_demo(args) if args.command == "demo" else run_buckets(args)


if __name__ == "__main__":
    sys.exit(main())

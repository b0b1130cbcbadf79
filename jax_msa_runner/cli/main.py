"""Command line: ``jax-msa-runner demo`` (the main job) and ``buckets``.

- demo: the tiny default model serves a synthetic workload (jax_msa_runner.cli.demo).
- buckets: stages every bucket of the default RunnerConfig with each dummy kind and
  validates it (the metadata table).
- lower: the StableHLO of one forward step for an abstract H200 (jax_msa_runner.cli.lower).

Every flag is checked before any work starts: a bad value exits with status 2 and one line
on stderr naming the flag and its bound.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax

from jax_msa_runner.config import RunnerConfig
from jax_msa_runner.cli.flags import FlagParser, bounded_int


def run_buckets(args: argparse.Namespace) -> int:
    """Stages every bucket of the default RunnerConfig with each dummy kind and validates it.

    Prints one row per (bucket, kind): bucket (T, R, P), real tokens and requests, the first
    staging call of the bucket (compile included, ms), the median of ``args.repeats`` further
    stagings (us), and the validator's verdict. Returns 0 when every batch is valid.
    """
    from jax_msa_runner.batch.buckets import make_buckets
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


def build_parser() -> tuple[FlagParser, dict[str, FlagParser]]:
    """The ``jax-msa-runner`` parser and its subcommands' parsers (``demo``, ``buckets``)."""
    from jax_msa_runner.cli.demo import __doc__ as demo_doc, add_demo_args
    from jax_msa_runner.cli.serve import add_serve_args

    parser = FlagParser(prog="jax-msa-runner", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    # not required=True: argparse checks required arguments before unknown ones, so
    # `jax-msa-runner --bogus` would report the missing command instead of naming --bogus
    sub = parser.add_subparsers(dest="command", metavar="command")
    demo = add_demo_args(sub.add_parser(
        "demo", help="serve a synthetic workload with the tiny default model",
        description=demo_doc, formatter_class=argparse.RawDescriptionHelpFormatter))
    buckets = sub.add_parser("buckets",
                             help="stage and validate every bucket of the default config")
    max_len = RunnerConfig.max_model_len
    buckets.add_argument("--profile-seq-len", type=bounded_int(1, max_len), default=None,
                         help=f"profiling override L of the dummy sequence length, in "
                              f"[1, {max_len}] (the default config's max_model_len)")
    buckets.add_argument("--repeats", type=bounded_int(1), default=20,
                         help="timed stagings per (bucket, kind) after the first (>= 1)")
    serve = add_serve_args(sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (tiny model)"))
    from jax_msa_runner.cli.logits import add_logits_args
    logits = add_logits_args(sub.add_parser("logits", help="full-prompt logits of a checkpoint"))
    from jax_msa_runner.cli.lower import __doc__ as lower_doc, add_lower_args
    lower = add_lower_args(sub.add_parser(
        "lower", help="StableHLO of one forward step for an abstract H200 (no GPU)",
        description=lower_doc, formatter_class=argparse.RawDescriptionHelpFormatter))
    return parser, {"demo": demo, "buckets": buckets, "serve": serve, "logits": logits,
                    "lower": lower}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jax-msa-runner`` script."""
    from jax_msa_runner.cli.demo import run_demo_command

    parser, commands = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error("a command is required: demo, serve, buckets, logits or lower")
    if args.command == "demo":
        return run_demo_command(commands["demo"], args)
    if args.command == "serve":
        from jax_msa_runner.cli.serve import run_serve
        return run_serve(args)
    if args.command == "logits":
        from jax_msa_runner.cli.logits import run_logits
        return run_logits(args)
    if args.command == "lower":
        from jax_msa_runner.cli.lower import run_lower
        return run_lower(commands["lower"], args)
    return run_buckets(args)


if __name__ == "__main__":
    sys.exit(main())

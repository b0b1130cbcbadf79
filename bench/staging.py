"""Microseconds per staged step for each bucket (jitted staging, block_until_ready, median).

Usage: python3 bench/staging.py [--repeats N] [--json PATH]
Per bucket of the default RunnerConfig (or --max-model-len / --dcp-world-size variants) it
times, on the dummy batch of the bucket's size with a long profiling override:
  host-us:   pack_host_batch (host validation + packing into one int32 buffer)
  device-us: device_put + jitted stage_packed, block_until_ready
  step-us:   stage_batch end to end (the number that matters per serving step)
"""
from __future__ import annotations

import _common  # first: repo root on sys.path, known warnings
import argparse
import json
import statistics

import jax

from _common import host_latency_s
from jax_msa_runner.batch.buckets import make_buckets
from jax_msa_runner.batch.staging import (dummy_host_batch, pack_host_batch, stage_batch,
                                          stage_packed_jit)
from jax_msa_runner.config import ConfigError, RunnerConfig


def _median_us(fn, repeats: int) -> float:
    """Median latency of fn() (one warm-up call first: compiles), microseconds."""
    return statistics.median(host_latency_s(fn, repeats=repeats, warmup=1)) * 1e6


def bench(config: RunnerConfig, repeats: int) -> list[dict]:
    """One result row per bucket: shapes, real tokens/requests and the three medians (us)."""
    rows = []
    for bucket in make_buckets(config):
        h = dummy_host_batch(bucket.num_tokens, config, kind="mixed",
                               profile_seq_len=config.max_model_len // 2)
        args = (h.num_scheduled, h.num_computed, h.block_table)
        packed = pack_host_batch(*args, bucket, config)
        host_us = _median_us(lambda: pack_host_batch(*args, bucket, config), repeats)
        device_us = _median_us(lambda: jax.block_until_ready(
            stage_packed_jit(jax.device_put(packed), bucket=bucket, config=config)), repeats)
        step_us = _median_us(lambda: jax.block_until_ready(
            stage_batch(*args, config, bucket=bucket)), repeats)
        rows.append(dict(num_tokens=bucket.num_tokens, num_reqs=bucket.num_reqs,
                         max_pages=bucket.max_pages, real_tokens=int(h.num_scheduled.sum()),
                         real_reqs=int(h.num_scheduled.size), host_us=host_us,
                         device_us=device_us, step_us=step_us))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=_common.positive_int, default=200)
    parser.add_argument("--max-model-len", type=_common.positive_int,
                        default=RunnerConfig.max_model_len)
    parser.add_argument("--dcp-world-size", type=_common.positive_int, default=1)
    parser.add_argument("--json", dest="json_path", default=None, help="write results as JSON")
    args = parser.parse_args(argv)
    try:
        config = RunnerConfig(max_model_len=args.max_model_len,
                              dcp_world_size=args.dcp_world_size)
    except ConfigError as e:
        parser.error(str(e))
    rows = bench(config, args.repeats)
    print(f"jax {jax.__version__} on {jax.default_backend()} "
          f"({jax.devices()[0].device_kind}); median of {args.repeats}")
    print(f"{'T':>5} {'R':>4} {'P':>5} {'tokens':>6} {'reqs':>4} {'host-us':>8} "
          f"{'device-us':>9} {'step-us':>8}")
    for r in rows:
        print(f"{r['num_tokens']:>5} {r['num_reqs']:>4} {r['max_pages']:>5} {r['real_tokens']:>6} "
              f"{r['real_reqs']:>4} {r['host_us']:8.1f} {r['device_us']:9.1f} {r['step_us']:8.1f}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(dict(meta=_common.run_meta(), repeats=args.repeats,
                           timer=f"host latency: median of {args.repeats} calls after one "
                                 f"warm-up, block_until_ready each",
                           config=repr(config), buckets=rows), f, indent=2)
        print(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

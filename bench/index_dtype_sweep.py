"""H200 sweep of msa_index_scores launch tunables for a bf16 vs a float8_e4m3fn index-K cache.

The serving step's context-dependent cost is the indexer's scan of the index-K cache; an fp8
cache halves its bytes (B * L * Di * 1 B). This times the scores kernel (cold L2,
`_common.time_jax`) at serving-like shapes: bf16 with its default launch, fp8 with the default
and a grid of (pages_per_program, num_warps, num_stages); it prints % of the copy bandwidth of
each dtype's own bytes, so the fp8 defaults can be chosen from data.

Usage (GPU machine): python3 bench/index_dtype_sweep.py --out DIR   -> DIR/index_dtype_sweep.json
"""
from __future__ import annotations

import _common  # first: repo root on sys.path, known warnings
import argparse
import json
import sys

import jax
import jax.numpy as jnp

from _common import add_common_args, copy_bandwidth, time_jax, timer_description, write_json
from _shapes_inputs import INDEX_DIM
from jax_msa_runner.config import FP8_INDEX_CACHE_DTYPE
from pallas_kernels import PAGE_SIZE
from pallas_kernels.index_scores import msa_index_scores

SHAPES = ((64, 131072), (16, 131072), (128, 65536))  # (B decode tokens, context L)
DTYPES = ("bfloat16", FP8_INDEX_CACHE_DTYPE)
GRID = [(ppp, w, s) for ppp in (16, 32, 64) for w in (4, 8) for s in (3, 5)]


def make_index_inputs(batch: int, context: int, dtype: str, seed: int) -> dict:
    """Random index queries (bf16) and an index-K cache in ``dtype``, random page order."""
    pages = context // PAGE_SIZE
    n = batch * pages + 1
    ks = jax.random.split(jax.random.key(seed), 3)
    perm = jax.random.permutation(ks[0], n - 1) + 1
    k = jax.random.normal(ks[1], (n, PAGE_SIZE, INDEX_DIM), jnp.bfloat16).astype(dtype)
    return dict(index_q=jax.random.normal(ks[2], (batch, 1, INDEX_DIM), jnp.bfloat16),
                index_k=k, block_table=perm.reshape(batch, pages).astype(jnp.int32),
                req_indices=jnp.arange(batch, dtype=jnp.int32),
                positions=jnp.full((batch,), context - 1, jnp.int32))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, reps=20, trials=3)
    args = p.parse_args(argv)
    if not _common.ON_GPU:
        p.error("no GPU backend: run on the GPU machine")
    bw = copy_bandwidth()["copy_Bps"]
    result = {"timer": timer_description("cold", args.reps), "copy_Bps": bw, "rows": []}
    print(f"timing: {result['timer']}; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for batch, context in SHAPES:
        for dtype in DTYPES:
            x = make_index_inputs(batch, context, dtype, seed=args.seed + batch)
            nbytes = batch * context * INDEX_DIM * jnp.dtype(dtype).itemsize
            for cfg in [None] + (GRID if dtype != "bfloat16" else []):
                kw = {} if cfg is None else dict(zip(("pages_per_program", "num_warps",
                                                      "num_stages"), cfg))
                fn = jax.jit(lambda x, kw=kw: msa_index_scores(
                    x["index_q"], x["index_k"], x["block_table"], x["req_indices"],
                    x["positions"], **kw))
                us = time_jax(fn, (x,), n=args.reps, trials=args.trials, l2="cold").us
                row = {"batch": batch, "context": context, "dtype": dtype,
                       "config": kw or "default", "us": round(us, 1),
                       "pct_copy": round(100 * nbytes / (us * 1e-6) / bw, 1)}
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
            del x
            write_json(f"{args.out}/index_dtype_sweep.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

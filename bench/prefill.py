"""Sparse prefill on the H200: `sparse_prefill` (page loads shared by a tile's tokens) against
`sparse_decode` and the Mosaic GPU `sparse_decode_mgpu` (every token loads its own 16 pages;
the same contract with kv_len = position + 1) on the same chunk of a long prompt.

One request of context L; a chunk of C query tokens at positions L-C .. L-1 (kv_len = position
+ 1), its selection from our indexer + select. Two index-query regimes: "shared" (consecutive
tokens' index queries differ by a little noise, so their top-16 pages mostly coincide, as in a
real prompt) and "random" (independent queries: the tile's page union is close to 16 x TQ, the
worst case for sharing). Cold-L2 timing (`_common.time_jax`), the copy bandwidth in the same
run, and each variant's output against `sparse_decode`'s (relative L2). Writes
OUT/prefill.json.

Usage (device tool): python3 bench/prefill.py --out "$OUT" [--sweep] [--context L --chunk C]
"""
from __future__ import annotations

import _common  # first: repo root on sys.path, known warnings
import argparse
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from _common import add_common_args, copy_bandwidth, rel_l2, time_jax, timer_description, write_json
from _shapes_inputs import HEAD_DIM, INDEX_DIM
from pallas_kernels import PAGE_SIZE, TOPK
from pallas_kernels.sparse_decode import sparse_decode
from pallas_kernels.sparse_decode_mgpu import sparse_decode_mgpu
from pallas_kernels.sparse_prefill import sparse_prefill, tile_page_union
from pallas_kernels.index_select import msa_index_select

HEAD_CONFIGS = ((16, 1), (64, 4))
# (label, sparse_prefill keywords); {} = the defaults (4 tokens per tile, 4 warps; the first run,
# h200_prefill_2026-11-30.json, had 2 stages there, now default_num_stages gives 1).
PREFILL_VARIANTS = [("prefill default", {}),
                    ("prefill tq4 s3", dict(tokens_per_tile=4, num_stages=3)),
                    ("prefill tq4 s2", dict(tokens_per_tile=4, num_stages=2)),
                    ("prefill tq2", dict(tokens_per_tile=2)),
                    ("prefill tq8", dict(tokens_per_tile=8)),
                    ("prefill tq8 s3", dict(tokens_per_tile=8, num_stages=3)),
                    ("prefill tq16", dict(tokens_per_tile=16))]

# --sweep: tokens per tile x pipeline depth x warps (the first run put 1 stage ahead of 2-3).
SWEEP_VARIANTS = [(f"prefill tq{tq} s{st} w{w}", dict(tokens_per_tile=tq, num_stages=st,
                                                      num_warps=w))
                  for tq in (2, 4, 8) for st in (1, 2) for w in (4, 8)]


def make_chunk(hq: int, hkv: int, context: int, chunk: int, regime: str, seed: int) -> dict:
    """bf16 caches of one request (random page permutation, page 0 the null page) and the
    chunk's queries; ``regime`` "shared" or "random" index queries."""
    pages = context // PAGE_SIZE
    ks = jax.random.split(jax.random.key(seed), 6)
    block_table = (jax.random.permutation(ks[0], pages) + 1).astype(jnp.int32)[None]
    index_k = jax.random.normal(ks[1], (pages + 1, PAGE_SIZE, INDEX_DIM), jnp.bfloat16)
    kv = jax.random.normal(ks[2], (pages + 1, hkv, PAGE_SIZE, 2 * HEAD_DIM), jnp.bfloat16)
    noise = jax.random.normal(ks[3], (chunk, hkv, INDEX_DIM), jnp.float32)
    if regime == "shared":
        base = jax.random.normal(ks[4], (1, hkv, INDEX_DIM), jnp.float32)
        index_q = (base + 0.1 * noise).astype(jnp.bfloat16)
    else:
        index_q = noise.astype(jnp.bfloat16)
    q = jax.random.normal(ks[5], (chunk, hq, HEAD_DIM), jnp.bfloat16)
    positions = jnp.arange(context - chunk, context, dtype=jnp.int32)
    req = jnp.zeros((chunk,), jnp.int32)
    selected = msa_index_select(index_q, index_k, block_table, req, positions)
    return dict(q=q, kv=kv, selected=jax.block_until_ready(selected), block_table=block_table,
                req_indices=req, kv_lens=positions + 1)


def union_pages(x: dict, tokens_per_tile: int) -> int:
    """Pages a prefill with ``tokens_per_tile`` loads, summed over tiles and KV heads."""
    t = x["q"].shape[0]
    pad = -t % tokens_per_tile
    sel = jnp.pad(x["selected"], ((0, pad), (0, 0), (0, 0)), constant_values=-1)
    lens = jnp.pad(x["kv_lens"], (0, pad))
    rows = jnp.pad(x["req_indices"], (0, pad))
    _, count = tile_page_union(sel, lens, rows, x["block_table"].shape[1], tokens_per_tile)
    return int(jnp.sum(count))


def bench_case(hq, hkv, context, chunk, regime, copy_bps, prefill_variants, *, reps, trials,
               seed) -> list[dict]:
    x = make_chunk(hq, hkv, context, chunk, regime, seed)
    args = (x["q"], x["kv"], x["selected"], x["block_table"], x["req_indices"], x["kv_lens"])
    scale = HEAD_DIM ** -0.5
    page_bytes = PAGE_SIZE * 2 * HEAD_DIM * 2 * hkv  # one page of every KV head
    decode = jax.jit(lambda *a: sparse_decode(*a, scale=scale))
    mosaic = jax.jit(lambda *a: sparse_decode_mgpu(*a, scale=scale))
    variants = [("decode default", decode, TOPK * chunk),  # (label, fn, pages per KV head)
                ("decode mosaic", mosaic, TOPK * chunk)]
    for label, kw in prefill_variants:
        fn = jax.jit(lambda *a, kw=kw: sparse_prefill(*a, scale=scale, **kw))
        variants.append((label, fn, union_pages(x, kw.get("tokens_per_tile", 4)) // hkv))
    ref_out, _ = jax.block_until_ready(variants[0][1](*args))
    ref_out = np.asarray(ref_out, np.float32)
    samples = {label: [] for label, _, _ in variants}
    errs = {}
    for label, fn, _ in variants:
        out, _ = jax.block_until_ready(fn(*args))
        errs[label] = rel_l2(np.asarray(out, np.float32), ref_out)
    for _ in range(trials):  # interleaved: one sample of every variant per round
        for label, fn, _ in variants:
            samples[label] += time_jax(fn, args, n=reps, trials=1, l2="cold").samples_s
    rows = []
    decode_us = statistics.median(samples["decode default"]) * 1e6
    for label, _, pages in variants:
        us = statistics.median(samples[label]) * 1e6
        row = {"hq": hq, "hkv": hkv, "context": context, "chunk": chunk, "regime": regime,
               "variant": label, "us": round(us, 2), "pages_loaded": pages,
               "speedup_vs_decode": round(decode_us / us, 2),
               "pct_copy_of_loaded_bytes": round(pages * page_bytes / (us * 1e-6) / copy_bps
                                                 * 100, 1),
               "rel_l2_vs_decode": float(errs[label])}
        rows.append(row)
        print(f"{hq}/{hkv} L={context} C={chunk} {regime:6s} {label:16s} {us:9.2f} us  "
              f"x{row['speedup_vs_decode']:5.2f} vs decode  pages {row['pages_loaded']:6d}  "
              f"{row['pct_copy_of_loaded_bytes']:5.1f}% copy  rel_l2 {row['rel_l2_vs_decode']:.1e}",
              flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, reps=20, trials=5, out_required=False)
    p.add_argument("--context", type=_common.positive_int, default=32768)
    p.add_argument("--chunk", type=_common.positive_int, default=2048)
    p.add_argument("--sweep", action="store_true",
                   help="time the tokens-per-tile x stages x warps grid instead of the variants")
    args = p.parse_args(argv)
    if args.context % PAGE_SIZE or args.chunk > args.context:
        p.error(f"--context must be a multiple of {PAGE_SIZE} and >= --chunk, got "
                f"{args.context} / {args.chunk}")
    if not _common.ON_GPU:
        p.error("no GPU backend: run on the GPU machine")
    variants = SWEEP_VARIANTS if args.sweep else PREFILL_VARIANTS
    copy = copy_bandwidth()
    result = {"timer": timer_description("cold", args.reps), "copy_Bps": copy["copy_Bps"],
              "reps": args.reps, "trials": args.trials, "sweep": args.sweep, "rows": []}
    print(f"timing: {result['timer']}; copy bandwidth {copy['copy_Bps'] / 1e12:.2f} TB/s",
          flush=True)
    for hq, hkv in HEAD_CONFIGS:
        for regime in ("shared", "random"):
            result["rows"] += bench_case(hq, hkv, args.context, args.chunk, regime,
                                         copy["copy_Bps"], variants, reps=args.reps,
                                         trials=args.trials, seed=args.seed)
            write_json(f"{args.out}/prefill.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

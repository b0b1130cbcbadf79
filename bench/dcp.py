"""Decode context parallelism on two GPUs: compiled equality and step time against one device.

For each shape (Hq 16, Hkv 1, D 128, Di 128, bf16; B decode tokens, every request at context
L) it builds the per-rank caches of W = 2 ranks (interleave 128: global block g on rank
g % W as local block g // W) and the single-device view of the same caches, stages the
decode batch twice (dcp_world_size 1 and W) and runs
  * one device: ``jax_msa_runner.attention.msa`` (index scores -> top-16 -> sparse decode);
  * DCP: ``jax_msa_runner.attention.dcp.dcp_msa_attention`` on the ``"dcp"`` mesh
    (shard_map: q all-gather, rank-local indexer, candidate all-gather, global top-16,
    rank-local sparse decode, LSE merge with pmax/psum).
Equality (compiled kernels): selected global block ids identical, out within the bf16
tolerance of tests/attention/test_dcp_attention.py (atol 4e-3, rtol 8e-3), lse within 1e-5 abs + rel.
Also timed: the indexer + top-16 select alone (one device: msa_index_scores +
sparse_topk_select; DCP: dcp_index_select with its candidate all-gather).
Timing: ``_common.time_jax`` in its warm-L2 mode (inputs already placed: q/index_q sharded
over tokens, metadata replicated, caches per rank): ``--reps`` back-to-back async calls per
trial, wall time per call, median of ``--trials``.

Usage (two H200s):   python3 bench/dcp.py --out DIR
CPU smoke (interpret mode, tiny shapes, two host devices):  python3 bench/dcp.py --out DIR --smoke
Writes DIR/dcp.json and DIR/dcp.md.
"""
from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv and "xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2").strip()

import _common  # noqa: E402  (first jax import: repo root on sys.path, known warnings)
import argparse  # noqa: E402
import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from _common import time_jax, timer_description, write_json  # noqa: E402
from jax_msa_runner.attention.dcp import (DCP_AXIS, dcp_index_select,  # noqa: E402
                                          dcp_msa_attention, make_dcp_mesh)
from jax_msa_runner.attention.msa import msa_attention  # noqa: E402
from jax_msa_runner.batch.staging import stage_batch  # noqa: E402
from jax_msa_runner.config import RunnerConfig  # noqa: E402
from pallas_kernels import PAGE_SIZE, msa_index_scores, sparse_topk_select  # noqa: E402

BF16_TOL = dict(atol=4e-3, rtol=8e-3)
LSE_TOL = dict(atol=1e-5, rtol=1e-5)


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    context: int
    hq: int = 16
    hkv: int = 1
    head_dim: int = 128
    index_dim: int = 128

    @property
    def name(self) -> str:
        return f"B{self.batch}-L{self.context // 1024}K-Hq{self.hq}-Hkv{self.hkv}"


def shapes(smoke: bool) -> list[Shape]:
    if smoke:
        return [Shape(batch=2, context=4096, hq=16, hkv=1, head_dim=16, index_dim=16)]
    return [Shape(b, l) for b in (16, 64) for l in (32768, 131072)]


def make_case(shape: Shape, world_size: int, seed: int) -> dict:
    """Per-rank caches, their single-device view and both staged batches (decode, 1 token
    per request at position L - 1).

    Rank-local page j of row r is physical page 1 + r * Pl + j on every rank (Pl = L / (128 W));
    the single-device view puts global block g of row r at page 1 + r * Pl * W + g, which holds
    rank (g % W)'s local page g // W, so the global cache is an interleave of the shards.
    """
    W, B, L = world_size, shape.batch, shape.context
    pages = L // PAGE_SIZE
    if pages % W:
        raise ValueError(f"context {L}: {pages} pages must be a multiple of W={W}")
    pl_ = pages // W
    n_local = 1 + B * pl_
    ks = jax.random.split(jax.random.key(seed), 4)
    kv_shards = jax.random.normal(
        ks[0], (W, n_local, shape.hkv, PAGE_SIZE, 2 * shape.head_dim), jnp.bfloat16)
    ik_shards = jax.random.normal(ks[1], (W, n_local, PAGE_SIZE, shape.index_dim), jnp.bfloat16)
    interleave = lambda s: jnp.concatenate(  # noqa: E731  [W, 1 + B*Pl, ...] -> [1 + B*Pl*W, ...]
        [s[0, :1], jnp.swapaxes(s[:, 1:], 0, 1).reshape((-1,) + s.shape[2:])])
    q = jax.random.normal(ks[2], (B, shape.hq, shape.head_dim), jnp.bfloat16)
    iq = jax.random.normal(ks[3], (B, shape.hkv, shape.index_dim), jnp.bfloat16)

    sched = np.ones((B,), np.int64)
    comp = np.full((B,), L - 1, np.int64)
    local_bt = 1 + np.arange(B)[:, None] * pl_ + np.arange(pl_)[None, :]
    global_bt = 1 + np.arange(B)[:, None] * pages + np.arange(pages)[None, :]
    common = dict(max_num_seqs=B, max_num_batched_tokens=B, max_model_len=L, bucket_sizes=(B,))
    md1 = stage_batch(sched, comp, global_bt, RunnerConfig(**common))
    mdw = stage_batch(sched, comp, local_bt, RunnerConfig(dcp_world_size=W, **common))
    return dict(kv_shards=kv_shards, ik_shards=ik_shards, kv=interleave(kv_shards),
                ik=interleave(ik_shards), q=q, iq=iq, md1=md1, mdw=mdw)


def compare(single, dist, mask: np.ndarray) -> dict:
    """Selection identity and out/lse differences on real tokens."""
    (o1, l1, s1), (o2, l2, s2) = (tuple(np.asarray(jax.device_get(x)) for x in r)
                                  for r in (single, dist))
    o1, o2 = o1.astype(np.float32)[mask], o2.astype(np.float32)[mask]
    l1, l2 = l1[mask], l2[mask]
    sel_equal = float(np.mean(np.all(s1[mask] == s2[mask], axis=-1)))
    out_ok = bool(np.all(np.abs(o1 - o2) <= BF16_TOL["atol"] + BF16_TOL["rtol"] * np.abs(o1)))
    lse_ok = bool(np.all(np.abs(l1 - l2) <= LSE_TOL["atol"] + LSE_TOL["rtol"] * np.abs(l1)))
    return dict(selection_rows_equal=sel_equal, out_max_abs_diff=float(np.abs(o1 - o2).max()),
                lse_max_abs_diff=float(np.abs(l1 - l2).max()), out_within_tol=out_ok,
                lse_within_tol=lse_ok, equal=bool(sel_equal == 1.0 and out_ok and lse_ok))


def bench_shape(shape: Shape, world_size: int, *, reps: int, trials: int, seed: int,
                interpret: bool) -> dict:
    mesh = make_dcp_mesh(world_size)
    dev0 = jax.devices()[0]
    case = make_case(shape, world_size, seed)
    scale = shape.head_dim ** -0.5
    # placement: single device on device 0; DCP caches per rank, queries over tokens
    single_args = jax.device_put((case["q"], case["iq"], case["kv"], case["ik"], case["md1"]),
                                 dev0)
    tok, rep, rank = (NamedSharding(mesh, P(DCP_AXIS)), NamedSharding(mesh, P()),
                      NamedSharding(mesh, P(DCP_AXIS)))
    dist_args = (jax.device_put(case["q"], tok), jax.device_put(case["iq"], tok),
                 jax.device_put(case["kv_shards"], rank), jax.device_put(case["ik_shards"], rank),
                 jax.device_put(case["mdw"], rep))
    del case

    def single_fn(q, iq, kv, ik, md):
        return msa_attention(q, iq, kv, ik, md, scale=scale, interpret=interpret)

    def dist_fn(q, iq, kv, ik, md):
        return dcp_msa_attention(q, iq, kv, ik, md, mesh, scale=scale, interpret=interpret)

    def single_select(q, iq, kv, ik, md):
        scores = msa_index_scores(iq, ik, md.block_table, md.req_indices, md.positions,
                                  interpret=interpret)
        return sparse_topk_select(scores, md.num_valid_pages, interpret=interpret)

    def dist_select(q, iq, kv, ik, md):
        return dcp_index_select(iq, ik, md, mesh, interpret=interpret)[0]

    single, dist = single_fn(*single_args), dist_fn(*dist_args)
    check = compare(single, dist, np.asarray(single_args[4].token_mask))
    t_single, t_dist, t_single_sel, t_dist_sel = (
        time_jax(f, a, n=reps, trials=trials, l2="warm").as_dict()
        for f, a in ((single_fn, single_args), (dist_fn, dist_args),
                     (single_select, single_args), (dist_select, dist_args)))
    kv_bytes = lambda a: a.size * a.dtype.itemsize  # noqa: E731
    return dict(shape=dataclasses.asdict(shape), name=shape.name, world_size=world_size,
                check=check, single=t_single, dcp=t_dist,
                speedup=t_single["us"] / t_dist["us"],
                indexer_single=t_single_sel, indexer_dcp=t_dist_sel,
                cache_bytes_single=kv_bytes(single_args[2]) + kv_bytes(single_args[3]),
                cache_bytes_per_rank=(kv_bytes(dist_args[2]) + kv_bytes(dist_args[3]))
                // world_size)


def markdown(result: dict) -> str:
    lines = [f"## DCP attention, W = {result['world_size']} vs one device ({result['meta']['device']}, {result['meta']['date']})",
             "",
             "Selections identical (fraction of rows), out/lse max |diff| (bf16 tol atol 4e-3 "
             f"rtol 8e-3); step time per call, median of trials ({result['timer']}).",
             "",
             "| shape | sel rows equal | out max diff | lse max diff | equal | one device ms "
             "| DCP ms | speedup | indexer+select ms 1 -> W | cache GiB/device 1 -> W |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        c = r["check"]
        lines.append(
            f"| {r['name']} | {c['selection_rows_equal']:.4f} | {c['out_max_abs_diff']:.2e} | "
            f"{c['lse_max_abs_diff']:.2e} | {'yes' if c['equal'] else 'NO'} | "
            f"{r['single']['us'] * 1e-3:.3f} | {r['dcp']['us'] * 1e-3:.3f} | "
            f"{r['speedup']:.2f}x | {r['indexer_single']['us'] * 1e-3:.3f} -> "
            f"{r['indexer_dcp']['us'] * 1e-3:.3f} | {r['cache_bytes_single'] / 2**30:.2f} -> "
            f"{r['cache_bytes_per_rank'] / 2**30:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_common_args(parser, reps=20, trials=5)
    parser.add_argument("--world-size", type=_common.positive_int, default=2)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, interpret mode off the GPU (CPU check of the script)")
    args = parser.parse_args(argv)
    if args.world_size > jax.device_count():
        parser.error(f"--world-size must be <= the {jax.device_count()} devices here, "
                     f"got {args.world_size}")
    interpret = not _common.ON_GPU
    if interpret and not args.smoke:
        parser.error("no GPU backend: run on the GPU machine or pass --smoke")
    reps, trials = (1, 1) if args.smoke else (args.reps, args.trials)
    results = []
    for shape in shapes(args.smoke):
        r = bench_shape(shape, args.world_size, reps=reps, trials=trials, seed=args.seed,
                        interpret=interpret)
        print({k: r[k] for k in ("name", "check", "speedup")}, flush=True)
        results.append(r)
    result = dict(meta=_common.run_meta(), timer=timer_description("warm", reps),
                  world_size=args.world_size, results=results)
    write_json(os.path.join(args.out, "dcp.json"), result)
    md = markdown(result)
    with open(os.path.join(args.out, "dcp.md"), "w") as f:
        f.write(md)
    print(md)
    return 0 if all(r["check"]["equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

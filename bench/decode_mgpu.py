"""H200 benchmark: Mosaic GPU sparse decode against the Triton sparse decode, 16 shapes.

Variants: the Mosaic GPU decode with and without programmatic dependent launch (``pdl``), with
the library ``exp2``/``log2`` instead of the default approximate instructions
(``approx_math=False``), with the split states exchanged through global memory
(``mgpu_global``), with a 2-deep ring (``mgpu_st2``; 2 splits: ``mgpu_s2_st2``), a
3-deep ring (``mgpu_st3``), a 1-deep ring that lets two CTAs share an SM (``mgpu_st1``,
``mgpu_st1_evict``; with 2 or 4 splits: ``mgpu_s2_st1``, ``mgpu_s4_st1``, each also
``_evict``) or a 2-deep K ring with a 1-deep V ring (``mgpu_k2v1``, also two per SM at a GQA
group of at most 16), with clusters of 1, 2, 4 or 8 (``mgpu_s1`` ... ``mgpu_s8``), with the
page loads' L2 evict-first hint forced on or off (``mgpu_evict``, ``mgpu_l2normal``; with a
cluster size: ``mgpu_s2_evict``, ``mgpu_s2_evict_st3``, ``mgpu_s4_evict``, ``mgpu_s8_evict``),
and the Triton decode.

Shapes: Hq/Hkv 16/1 and 64/4, D 128, B decode tokens in 1/16/64/128, every request at context
L in 8192/65536 with a random page permutation, 16 distinct selected blocks per (token, KV
head) including the local (last) block; bf16. Bytes per call: K and V of 16 pages per KV head,
``B * Hkv * 16 * 128 * 256 * 2``.

Timing: ``_common.time_jax`` with a cold L2 (the one timer of the bench scripts: ``--reps``
calls of (512 MiB flush; op), ten looped in each executable, minus as many flushes; the median
of ``--trials`` samples).

Numerics: at each shape both kernels are compared with ``sparse_decode_reference`` (relative
L2 error of out, max abs error of lse). The XLA kernel count of each op's own executable is
printed too (``_common.hlo_kernel_count``).

Usage (GPU machine): python3 bench/decode_mgpu.py --out results.json [--reps 10] [--trials 5]
  [--shapes 16/1/1/8192,...] [--variants mgpu,triton,...]
  [--sweep]  (--sweep also times every num_splits x num_stages)
  [--inputs indexer]  (bench/kernels.py's inputs, selected by our indexer)
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import _common  # noqa: F401  (imported first for its preamble: repository on sys.path, one warning filter)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _common import (hlo_kernel_count, non_negative_int, positive_int,  # noqa: E402
                     time_jax)

import _shapes_inputs  # noqa: E402
from _shapes_inputs import HEAD_DIM, Shape, all_shapes  # noqa: E402
from pallas_kernels import PAGE_SIZE, TOPK  # noqa: E402
from pallas_kernels.sparse_decode import sparse_decode, sparse_decode_reference  # noqa: E402
from pallas_kernels.sparse_decode_mgpu import (SPLITS, STAGES, default_splits,  # noqa: E402
                                               default_stages, padded_rows, smem_bytes,
                                               SMEM_BYTES, sparse_decode_mgpu)

SCALE = HEAD_DIM ** -0.5


def shape_id(shape: Shape) -> str:
    """``Hq/Hkv/B/L``: the form ``--shapes`` takes."""
    return f"{shape.hq}/{shape.hkv}/{shape.batch}/{shape.context}"


def parse_shapes(text: str) -> list[Shape]:
    return [Shape(*map(int, s.split("/"))) for s in text.split(",") if s]


def make_inputs(shape: Shape, seed: int) -> tuple:
    """(q, kv_cache, selected, block_table, req_indices, kv_lens) on the default device."""
    blocks = shape.context // PAGE_SIZE
    num_pages = shape.batch * blocks + 1  # page 0 unused
    ks = jax.random.split(jax.random.key(seed), 4)
    perm = jax.random.permutation(ks[0], num_pages - 1) + 1
    block_table = perm.reshape(shape.batch, blocks).astype(jnp.int32)
    kv = jax.random.normal(ks[1], (num_pages, shape.hkv, PAGE_SIZE, 2 * HEAD_DIM), jnp.bfloat16)
    q = jax.random.normal(ks[2], (shape.batch, shape.hq, HEAD_DIM), jnp.bfloat16)
    # 15 distinct random blocks + the local block, ascending (an indexer's top-16)
    r = jax.random.uniform(ks[3], (shape.batch, shape.hkv, blocks - 1))
    others = jax.lax.top_k(r, TOPK - 1)[1].astype(jnp.int32)
    local = jnp.full((shape.batch, shape.hkv, 1), blocks - 1, jnp.int32)
    selected = jnp.sort(jnp.concatenate([others, local], axis=-1), axis=-1)
    kv_lens = jnp.full((shape.batch,), shape.context, jnp.int32)
    req = jnp.arange(shape.batch, dtype=jnp.int32)
    return q, kv, selected, block_table, req, kv_lens


def make_indexer_inputs(shape: Shape, seed: int) -> tuple:
    """As :func:`make_inputs`, from ``bench/kernels.py``'s inputs: its caches, block table and
    queries (``_shapes_inputs.make_inputs``) and our indexer's top-16 as the selection."""
    x = _shapes_inputs.make_inputs(shape, seed)
    selected = jax.jit(_shapes_inputs.our_indexer)(x)
    return x["q"], x["kv"], selected, x["block_table"], x["req_indices"], x["kv_lens"]


INPUTS = {"random": make_inputs, "indexer": make_indexer_inputs}


def time_op(fn, args, *, reps: int, trials: int) -> dict:
    """Microseconds per call of ``fn(*args)`` with a cold L2 (``_common.time_jax``)."""
    t = time_jax(fn, args, n=reps, trials=trials, l2="cold")
    return dict(us=t.us, samples=[round(x * 1e6, 2) for x in t.samples_s],
                host_us_per_dispatch=t.host_us_per_dispatch, flush_us=t.flush_us,
                gpu_bound=t.gpu_bound)


def kernel_count(fn, args) -> int:
    """GPU kernels of the compiled op (``_common.hlo_kernel_count``)."""
    return hlo_kernel_count(jax.jit(fn).lower(*args).compile().as_text())["total"]


def errors(out, lse, ref_out, ref_lse) -> dict:
    o = np.asarray(out, np.float32)
    r = np.asarray(ref_out, np.float32)
    rel = float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30))
    return dict(rel_l2=rel, lse_max_abs=float(np.max(np.abs(np.asarray(lse) - np.asarray(ref_lse)))),
                finite=bool(np.isfinite(o).all()))


def mgpu_fn(**kw):
    return lambda q, kv, sel, bt, req, lens: sparse_decode_mgpu(
        q, kv, sel, bt, req, lens, scale=SCALE, interpret=False, **kw)


def triton_fn(q, kv, sel, bt, req, lens):
    return sparse_decode(q, kv, sel, bt, req, lens, scale=SCALE)


VARIANTS = {  # name -> op; "mgpu" and "triton" are the two defaults compared in the table
    "mgpu": mgpu_fn(),
    "mgpu_nopdl": mgpu_fn(pdl=False),
    "mgpu_precise": mgpu_fn(approx_math=False),
    "mgpu_st2": mgpu_fn(num_stages=2),
    "mgpu_s2_st2": mgpu_fn(num_splits=2, num_stages=2),
    "mgpu_s4": mgpu_fn(num_splits=4),
    "mgpu_st3": mgpu_fn(num_stages=3),
    "mgpu_st1": mgpu_fn(num_stages=1),
    "mgpu_st1_evict": mgpu_fn(num_stages=1, l2_evict_first=True),
    "mgpu_k2v1": mgpu_fn(num_stages=2, num_v_stages=1),
    "mgpu_global": mgpu_fn(exchange="global"),
    "mgpu_l2normal": mgpu_fn(l2_evict_first=False),
    "mgpu_evict": mgpu_fn(l2_evict_first=True),
    "mgpu_s1": mgpu_fn(num_splits=1),
    "mgpu_s2": mgpu_fn(num_splits=2),
    "mgpu_s2_evict": mgpu_fn(num_splits=2, l2_evict_first=True),
    "mgpu_s2_evict_st3": mgpu_fn(num_splits=2, num_stages=3, l2_evict_first=True),
    "mgpu_s4_evict": mgpu_fn(num_splits=4, l2_evict_first=True),
    "mgpu_s2_st1": mgpu_fn(num_splits=2, num_stages=1),
    "mgpu_s2_st1_evict": mgpu_fn(num_splits=2, num_stages=1, l2_evict_first=True),
    "mgpu_s4_st1": mgpu_fn(num_splits=4, num_stages=1),
    "mgpu_s4_st1_evict": mgpu_fn(num_splits=4, num_stages=1, l2_evict_first=True),
    "mgpu_s8": mgpu_fn(num_splits=8),
    "mgpu_s8_evict": mgpu_fn(num_splits=8, l2_evict_first=True),
    "triton": triton_fn,
}


def sweep_configs(hq: int, hkv: int) -> list[tuple[int, int]]:
    """(num_splits, num_stages) pairs ``--sweep`` times: rings no deeper than a split's pages
    whose shared memory, for this shape's GQA group (padded to 8 rows), fits the SM."""
    group = padded_rows(hq, hkv)
    return [(s, st) for s in SPLITS for st in STAGES
            if st <= -(-TOPK // s) and smem_bytes(HEAD_DIM, st, s, group=group) <= SMEM_BYTES]


def bench_shape(shape: Shape, *, reps: int, trials: int, seed: int, sweep: bool,
                variants: list[str], inputs: str = "random") -> dict:
    args = INPUTS[inputs](shape, seed)
    jax.block_until_ready(args)
    ref = sparse_decode_reference(*args, scale=SCALE)
    rows = shape.batch * shape.hkv
    splits = default_splits(rows)
    row = dict(shape=shape_id(shape), inputs=inputs, hq=shape.hq, hkv=shape.hkv,
               batch=shape.batch, context=shape.context, bytes=shape.decode_bytes,
               mgpu_config=dict(num_splits=splits,
                                num_stages=default_stages(HEAD_DIM, splits, rows)))
    for name in variants:
        fn = VARIANTS[name]
        try:
            out = jax.jit(fn)(*args)
            row[f"{name}_err"] = errors(*out, *ref)
            row[f"{name}_kernels"] = kernel_count(fn, args)
            row[name] = time_op(fn, args, reps=reps, trials=trials)
        except Exception as e:  # a failing kernel must not hide the other shapes
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
    if "us" in row.get("mgpu", {}) and "us" in row.get("triton", {}):
        row["speedup_vs_triton"] = row["triton"]["us"] / row["mgpu"]["us"]
    if sweep:
        row["sweep"] = []
        for s, st in sweep_configs(shape.hq, shape.hkv):
            try:
                t = time_op(mgpu_fn(num_splits=s, num_stages=st), args, reps=reps,
                            trials=max(1, trials // 2))["us"]
            except Exception as e:
                t = f"{type(e).__name__}: {str(e)[:200]}"
            row["sweep"].append(dict(num_splits=s, num_stages=st, us=t))
    del args, ref
    return row


def table(rows: list[dict], variants: list[str]) -> str:
    """Markdown: the two defaults, their ratio, and one column per other variant timed."""
    extra = [v for v in variants if v not in ("mgpu", "triton")]
    head = ("| Hq/Hkv | B | L | mgpu us | triton us | triton/mgpu | mgpu TB/s | mgpu cfg "
            "| mgpu rel L2 | triton rel L2 | kernels mgpu/triton |"
            + "".join(f" {v} us |" for v in extra))
    lines = [head, "|" + "---|" * (11 + len(extra))]
    for r in rows:
        def us(k):  # "-": not run; "err": it raised (the JSON has the message)
            v = r.get(k, {}).get("us")
            return f"{v:.1f}" if v is not None else ("err" if f"{k}_error" in r else "-")
        m = r.get("mgpu", {}).get("us")
        tbs = f"{r['bytes'] / (m * 1e-6) / 1e12:.2f}" if m else "-"
        sp = f"{r['speedup_vs_triton']:.2f}x" if "speedup_vs_triton" in r else "-"
        cfg = r["mgpu_config"]
        err = lambda k: f"{r[k]['rel_l2']:.1e}" if k in r else "-"  # noqa: E731
        lines.append(
            f"| {r['hq']}/{r['hkv']} | {r['batch']} | {r['context']} | {us('mgpu')} | "
            f"{us('triton')} | {sp} | {tbs} | S{cfg['num_splits']} st{cfg['num_stages']} | "
            f"{err('mgpu_err')} | {err('triton_err')} | "
            f"{r.get('mgpu_kernels', '-')}/{r.get('triton_kernels', '-')} |"
            + "".join(f" {us(v)} |" for v in extra))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--reps", type=positive_int, default=20)
    ap.add_argument("--trials", type=positive_int, default=3)
    ap.add_argument("--seed", type=non_negative_int, default=0)
    ap.add_argument("--shapes", default="", help="comma list Hq/Hkv/B/L (default: all 16)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--inputs", choices=tuple(INPUTS), default="random",
                    help="random selections (default) or bench/kernels.py's inputs and our "
                         "indexer's selection")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma list of {', '.join(VARIANTS)}")
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    shapes = parse_shapes(a.shapes) if a.shapes else all_shapes()
    dev = jax.devices()[0]
    result = dict(device=str(dev.device_kind), jax=jax.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M:%S"), reps=a.reps, trials=a.trials,
                  method=f"_common.time_jax, {_common.timer_description('cold', a.reps)}; "
                         f"median of trials",
                  rows=[])
    print(f"{dev.device_kind}, jax {jax.__version__}", flush=True)
    for sh in shapes:
        t0 = time.perf_counter()
        row = bench_shape(sh, reps=a.reps, trials=a.trials, seed=a.seed, sweep=a.sweep,
                          variants=variants, inputs=a.inputs)
        row["bench_s"] = round(time.perf_counter() - t0, 1)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(a.out, "w") as f:  # partial results survive a timeout
            json.dump(result, f, indent=1)
    ok = [r["speedup_vs_triton"] for r in result["rows"] if r.get("speedup_vs_triton", 0) > 0]
    if ok:
        result["geomean_speedup_vs_triton"] = float(np.exp(np.mean(np.log(ok))))
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(table(result["rows"], variants))
    if ok:
        print(f"geomean triton/mgpu over {len(ok)} shapes: "
              f"{result['geomean_speedup_vs_triton']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

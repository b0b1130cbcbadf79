"""H200 benchmark of the MSA kernels against vLLM 0.33.0's Triton ops and the copy roofline.

For the 16 shapes of ../shared/anchors/H200_BASELINE.md (Hq/Hkv 16/1 and 64/4, B decode
tokens in 1/16/64/128, every request at context L in 8192/65536) it times, in one run:
  * indexer + select: ours `msa_index_select` (msa_index_scores + sparse_topk_select) vs vLLM's
    `minimax_m3_index_decode`; bytes = the visible index-K rows, B*L*128*2;
  * sparse decode: ours `sparse_decode` vs vLLM's `minimax_m3_sparse_attn_decode` on the
    same selection; bytes = K and V of 16 pages per KV head, B*Hkv*16*128*256*2;
  * the device-to-device copy bandwidth (the roofline), measured in the same process;
  * per shape, the same copy kernel moving decode's bytes (half read, half written) under the
    same cold-L2 timing: what a plain stream of that size costs here, flush write-back and
    launch included (a reference beside the roofline, not a replacement for it).

Timing. Both sides are timed with a 256 MiB L2 flush before every call (cold L2): JAX as
wall(n x (flush; f)) - wall(n x flush) with async dispatch (the flush keeps the GPU busy, so
host dispatch is hidden); vLLM with `triton.testing.do_bench` (CUDA events around each call
after the same kind of flush, a 256 MiB rewrite, median; the flush leaves dirty L2 lines whose
write-back the timed kernel pays, on both sides). Each figure is the median of
`--trials` trials, and the two sides are interleaved per shape.

Usage (on the GPU machine): python3 bench/kernels.py --out DIR [--vllm-ops .vllm_ops]
Writes DIR/kernels.json, DIR/kernels.md (the results table) and DIR/roofline.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import warnings

import numpy as np

warnings.filterwarnings("ignore", category=DeprecationWarning)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tools.vllm_compare.compare import rel_l2  # noqa: E402
from pallas_kernels.index_scores import msa_index_scores  # noqa: E402
from pallas_kernels.sparse_decode import sparse_decode  # noqa: E402
from pallas_kernels.topk_select import msa_index_select  # noqa: E402

PAGE = 128
TOPK = 16
HEAD_DIM = 128
INDEX_DIM = 128
HEAD_CONFIGS = ((16, 1), (64, 4))
BATCHES = (1, 16, 64, 128)
CONTEXTS = (8192, 65536)


@dataclasses.dataclass(frozen=True)
class Shape:
    hq: int
    hkv: int
    batch: int
    context: int

    @property
    def indexer_bytes(self) -> int:
        return self.batch * self.context * INDEX_DIM * 2

    @property
    def decode_bytes(self) -> int:
        return self.batch * self.hkv * TOPK * PAGE * 2 * HEAD_DIM * 2


def all_shapes() -> list[Shape]:
    return [Shape(hq, hkv, b, l) for hq, hkv in HEAD_CONFIGS for b in BATCHES for l in CONTEXTS]


def make_inputs(shape: Shape, seed: int) -> dict:
    """Random bf16 caches with a random page permutation; page 0 is the null page."""
    pages_per_req = shape.context // PAGE
    num_pages = shape.batch * pages_per_req + 1
    ks = jax.random.split(jax.random.key(seed), 5)
    perm = jax.random.permutation(ks[0], num_pages - 1) + 1
    block_table = perm.reshape(shape.batch, pages_per_req).astype(jnp.int32)
    index_k = jax.random.normal(ks[1], (num_pages, PAGE, INDEX_DIM), jnp.bfloat16)
    kv = jax.random.normal(ks[2], (num_pages, shape.hkv, PAGE, 2 * HEAD_DIM), jnp.bfloat16)
    index_q = jax.random.normal(ks[3], (shape.batch, shape.hkv, INDEX_DIM), jnp.bfloat16)
    q = jax.random.normal(ks[4], (shape.batch, shape.hq, HEAD_DIM), jnp.bfloat16)
    seq_lens = jnp.full((shape.batch,), shape.context, jnp.int32)
    return dict(index_q=index_q, index_k=index_k, kv=kv, q=q, block_table=block_table,
                req_indices=jnp.arange(shape.batch, dtype=jnp.int32),
                positions=seq_lens - 1, seq_lens=seq_lens, kv_lens=seq_lens)


def our_indexer(x: dict) -> jax.Array:
    """Scores + select: two kernel launches (nvp is derived from positions in the select)."""
    return msa_index_select(x["index_q"], x["index_k"], x["block_table"], x["req_indices"],
                            x["positions"])


def our_decode(x: dict, selected: jax.Array) -> tuple[jax.Array, jax.Array]:
    return sparse_decode(x["q"], x["kv"], selected, x["block_table"], x["req_indices"],
                         x["kv_lens"], scale=HEAD_DIM ** -0.5)


# --------------------------------------------------------------------------- timing

_FLUSH_ELEMS = 64 * 1024 * 1024  # 256 MiB of f32: larger than the 50 MiB L2


def _flush(buf):
    """Rewrites the 256 MiB buffer: evicts the L2, as ``triton.testing.do_bench``'s ``zero_()``
    does. The ~50 MiB of dirty lines it leaves are written back during the timed call (extra
    DRAM traffic both sides pay). A read pass instead (a sum) left part of the previous call's
    inputs in L2 on the H200 (decode measured above the copy bandwidth): not a cold L2."""
    return buf + 1.0


def time_jax(fn, args, *, reps: int, trials: int) -> list[float]:
    """Seconds per call of fn(*args) with a cold L2, one sample per trial.

    Two executables: (flush; barrier; fn) and flush alone, each dispatched `reps` times
    back to back (async, so host dispatch hides behind the 256 MiB flush); the sample is
    the wall-time difference per call. The optimization barrier makes fn wait for the
    flush inside one executable, so the two never overlap.
    """
    def flushed_call(buf, a):
        buf = _flush(buf)
        buf, a = jax.lax.optimization_barrier((buf, a))
        return buf, fn(*a)

    with_fn = jax.jit(flushed_call, donate_argnums=0)
    flush_only = jax.jit(lambda buf, a: (_flush(buf), None), donate_argnums=0)
    buf = jnp.zeros((_FLUSH_ELEMS,), jnp.float32)

    def run(step) -> float:
        nonlocal buf
        buf, out = step(buf, args)  # warm-up / compile
        jax.block_until_ready((buf, out))
        t0 = time.perf_counter()
        for _ in range(reps):
            buf, out = step(buf, args)
        jax.block_until_ready((buf, out))
        return time.perf_counter() - t0

    return [max((run(with_fn) - run(flush_only)) / reps, 1e-9) for _ in range(trials)]


def scale_copy(a):
    """The roofline's copy kernel: reads and writes ``a`` once."""
    return a * jnp.asarray(1.0009765625, a.dtype)


def same_traffic_copy_input(nbytes: int) -> jax.Array:
    """A bf16 array whose :func:`scale_copy` moves ``nbytes`` (half read, half written)."""
    return jnp.ones((nbytes // 4,), jnp.bfloat16)


def copy_bandwidth(nbytes: int = 2 << 30) -> dict:
    """Device-to-device copy bandwidth, bytes read + written per second (JAX, and torch)."""
    n = nbytes // 2
    x = jnp.ones((n,), jnp.bfloat16)
    copy = jax.jit(scale_copy)
    jax.block_until_ready(copy(x))
    ts = []
    for _ in range(20):
        t0 = time.perf_counter()
        jax.block_until_ready(copy(x))
        ts.append(time.perf_counter() - t0)
    res = {"jax_scale_copy_Bps": 2 * nbytes / min(ts)}
    try:
        import torch
        import triton.testing

        src = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        t = triton.testing.do_bench(lambda d=dst, s=src: d.copy_(s), rep=200) * 1e-3
        res["torch_copy_Bps"] = 2 * nbytes / t
        del src, dst
    except Exception as e:  # torch is optional for the roofline
        res["torch_copy_err"] = repr(e)
    del x
    res["copy_Bps"] = max(v for k, v in res.items() if k.endswith("_Bps"))
    return res


# --------------------------------------------------------------------------- vLLM side

def load_vllm(ops_dir: str):
    """vLLM 0.33.0's MiniMax-M3 decode ops from the carried `.vllm_ops` folder, or None."""
    if not ops_dir or not os.path.isdir(ops_dir):
        return None
    sys.path.insert(0, os.path.abspath(ops_dir))
    from vllm.models.minimax_m3.common.ops.index_topk import minimax_m3_index_decode
    from vllm.models.minimax_m3.common.ops.sparse_attn import minimax_m3_sparse_attn_decode
    return minimax_m3_index_decode, minimax_m3_sparse_attn_decode


def vllm_case(ops, shape: Shape, x: dict, selected: jax.Array, *, trials: int) -> dict:
    """vLLM's indexer on the inputs, and its decode on OUR selection (same inputs both sides)."""
    import torch
    import triton.testing

    index_decode, attn_decode = ops
    t = {k: torch.from_dlpack(v) for k, v in x.items()}

    def indexer():
        return index_decode(t["index_q"], t["index_k"], t["block_table"], t["seq_lens"],
                            shape.context, TOPK, 0, 1, shape.hkv, 1, 1)

    vllm_sel = indexer()  # [Hkv, B, 16]
    sel = torch.from_dlpack(selected).transpose(0, 1).contiguous()
    out = torch.empty_like(t["q"])

    def decode():
        attn_decode(t["q"], t["kv"], sel, t["block_table"], t["seq_lens"], shape.hkv,
                    HEAD_DIM ** -0.5, out, 1)

    decode()
    torch.cuda.synchronize()
    ti = [triton.testing.do_bench(indexer, return_mode="median") * 1e-3 for _ in range(trials)]
    td = [triton.testing.do_bench(decode, return_mode="median") * 1e-3 for _ in range(trials)]
    return {"vllm_indexer_s": ti, "vllm_decode_s": td,
            "vllm_selected": np.asarray(vllm_sel.transpose(0, 1).cpu()),  # [B, Hkv, 16]
            "vllm_out": out.float().cpu().numpy()}


# --------------------------------------------------------------------------- main

def selection_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of (token, head) rows whose selected sets (ignoring -1) are equal."""
    rows = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    same = [set(x[x >= 0].tolist()) == set(y[y >= 0].tolist()) for x, y in zip(*rows)]
    return float(np.mean(same))


def bench_shape(shape: Shape, ops, *, reps: int, trials: int, seed: int) -> dict:
    """Times both sides on the same inputs, interleaved over two rounds; medians of all samples."""
    x = make_inputs(shape, seed)
    indexer = jax.jit(our_indexer)
    decode = jax.jit(our_decode)
    selected = jax.block_until_ready(indexer(x))
    out, _ = jax.block_until_ready(decode(x, selected))
    row = dataclasses.asdict(shape) | {"indexer_bytes": shape.indexer_bytes,
                                       "decode_bytes": shape.decode_bytes}
    copy = jax.jit(scale_copy)
    copy_in = same_traffic_copy_input(shape.decode_bytes)
    samples = {k: [] for k in ("ours_indexer_s", "ours_decode_s", "copy_decode_bytes_s",
                               "vllm_indexer_s", "vllm_decode_s")}
    for _ in range(2):
        samples["ours_indexer_s"] += time_jax(indexer, (x,), reps=reps, trials=trials)
        samples["ours_decode_s"] += time_jax(decode, (x, selected), reps=reps, trials=trials)
        samples["copy_decode_bytes_s"] += time_jax(copy, (copy_in,), reps=reps, trials=trials)
        if ops is None or "vllm_err" in row:
            continue
        try:
            v = vllm_case(ops, shape, x, selected, trials=trials)
        except Exception as e:
            row["vllm_err"] = repr(e)[:500]
            continue
        samples["vllm_indexer_s"] += v["vllm_indexer_s"]
        samples["vllm_decode_s"] += v["vllm_decode_s"]
        row["selection_agree"] = selection_agreement(np.asarray(selected), v["vllm_selected"])
        row["decode_rel_err_vs_vllm"] = rel_l2(np.asarray(out, np.float32), v["vllm_out"])
    for k, v in samples.items():
        if v:
            row[k] = statistics.median(v)
            row[k[:-2] + "_samples_us"] = [round(s * 1e6, 2) for s in v]
    del x, copy_in
    return row


def sweep_shape(shape: Shape, *, reps: int, trials: int, seed: int) -> list[dict]:
    """Times the kernels' launch tunables on one shape (median us per config)."""
    x = make_inputs(shape, seed)
    selected = jax.block_until_ready(jax.jit(our_indexer)(x))
    rows = []
    def timed(kernel, f, args, kw):
        try:
            t = statistics.median(time_jax(f, args, reps=reps, trials=trials))
            rows.append({"kernel": kernel, **kw, "us": round(t * 1e6, 2)})
        except Exception as e:  # e.g. a configuration that exceeds shared memory
            rows.append({"kernel": kernel, **kw, "err": repr(e)[:200]})

    # (keys_per_step, num_splits, num_warps, num_stages): 21 configs. Stages must fit 227 KiB:
    # 128 keys = 64 KiB/stage (<= 3), 64 keys = 32 KiB/stage (<= 6; <= 3 -> 2 programs/SM).
    decode_grid = (
        [(128, sp, 4, st) for sp in (1, 2, 4) for st in (2, 3)]
        + [(128, 1, 8, st) for st in (2, 3)]
        + [(64, 1, w, st) for w in (4, 8) for st in (3, 4, 6)]
        + [(64, 2, 4, 3), (64, 2, 4, 4), (64, 2, 8, 3), (64, 4, 4, 3), (64, 8, 4, 3)]
        + [(kps, 16, 4, 2) for kps in (64, 128)])
    for kps, splits, warps, stages in decode_grid:
        kw = dict(keys_per_step=kps, num_splits=splits, num_warps=warps, num_stages=stages)
        timed("decode", jax.jit(lambda x, sel, kw=kw: sparse_decode(
            x["q"], x["kv"], sel, x["block_table"], x["req_indices"], x["kv_lens"],
            scale=HEAD_DIM ** -0.5, **kw)), (x, selected), kw)
    for ppp in (4, 8, 16, 32):
        for warps in (4, 8):
            for stages in (2, 3):
                kw = dict(pages_per_program=ppp, num_warps=warps, num_stages=stages)
                timed("index_scores", jax.jit(lambda x, kw=kw: msa_index_scores(
                    x["index_q"], x["index_k"], x["block_table"], x["req_indices"],
                    x["positions"], **kw)), (x,), kw)
    del x
    return rows


def markdown(result: dict) -> str:
    bw = result["copy"]["copy_Bps"]
    lines = [f"Device: {result['device']}; date {result['date']}; copy bandwidth "
             f"{bw / 1e12:.2f} TB/s (read + write), measured in the same run.", "",
             "| Hq/Hkv | B | L | ours idx+sel us | vLLM idx us | speedup | idx % copy BW "
             "| ours decode us | vLLM decode us | speedup | decode % copy BW "
             "| same-bytes copy us | sel agree | rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        oi, od = r["ours_indexer_s"], r["ours_decode_s"]
        vi, vd = r.get("vllm_indexer_s"), r.get("vllm_decode_s")
        sp = lambda v, o: f"{v / o:.2f}x" if v else "n/a"  # noqa: E731
        us = lambda s: f"{s * 1e6:.1f}" if s else "n/a"  # noqa: E731
        lines.append(
            f"| {r['hq']}/{r['hkv']} | {r['batch']} | {r['context']} | {us(oi)} | {us(vi)} | "
            f"{sp(vi, oi)} | {100 * r['indexer_bytes'] / oi / bw:.0f}% | {us(od)} | {us(vd)} | "
            f"{sp(vd, od)} | {100 * r['decode_bytes'] / od / bw:.0f}% | "
            f"{us(r.get('copy_decode_bytes_s'))} | {r.get('selection_agree', 'n/a')} | {r.get('decode_rel_err_vs_vllm', float('nan')):.1e} |")
    dec = [r["vllm_decode_s"] / r["ours_decode_s"] for r in result["rows"] if r.get("vllm_decode_s")]
    idx = [r["vllm_indexer_s"] / r["ours_indexer_s"] for r in result["rows"] if r.get("vllm_indexer_s")]
    if dec:
        lines += ["", f"Geometric-mean speedup vs vLLM: decode {math.exp(np.mean(np.log(dec))):.2f}x "
                      f"(min {min(dec):.2f}x), indexer+select {math.exp(np.mean(np.log(idx))):.2f}x "
                      f"(min {min(idx):.2f}x)."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bw = result["copy"]["copy_Bps"] / 1e9
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, bytes_key, label, marker in (
            ("ours_indexer_s", "indexer_bytes", "ours indexer+select", "o"),
            ("vllm_indexer_s", "indexer_bytes", "vLLM indexer", "x"),
            ("ours_decode_s", "decode_bytes", "ours sparse decode", "s"),
            ("vllm_decode_s", "decode_bytes", "vLLM sparse decode", "+")):
        pts = [(r[bytes_key], r[bytes_key] / r[key] / 1e9) for r in result["rows"] if r.get(key)]
        if pts:
            ax.scatter(*zip(*pts), label=label, marker=marker)
    ax.axhline(bw, color="k", ls="--", label=f"copy roofline {bw:.0f} GB/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes moved per call")
    ax.set_ylabel("achieved GB/s")
    ax.set_title(f"MSA kernels on {result['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--vllm-ops", default=".vllm_ops")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shapes", default="all", help="'all' or a comma list of indices")
    p.add_argument("--sweep", default="", help="comma list of shape indices to sweep tunables on")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    ops = load_vllm(args.vllm_ops)
    shapes = all_shapes()
    if args.shapes != "all":
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    result = {"device": str(jax.devices()[0].device_kind), "date": time.strftime("%Y-%m-%d"),
              "vllm": ops is not None, "copy": copy_bandwidth(), "rows": []}
    print(f"copy bandwidth {result['copy']['copy_Bps'] / 1e12:.2f} TB/s", flush=True)
    for shape in shapes:
        row = bench_shape(shape, ops, reps=args.reps, trials=args.trials, seed=args.seed)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, "kernels.json"), "w") as f:
            json.dump(result, f, indent=1)
    if args.sweep:
        result["sweep"] = {}
        for i in args.sweep.split(","):
            sh = all_shapes()[int(i)]
            rows = sweep_shape(sh, reps=args.reps, trials=args.trials, seed=args.seed)
            result["sweep"][str(sh)] = rows
            for kernel in ("decode", "index_scores"):
                ok = sorted((r for r in rows if r["kernel"] == kernel and "us" in r),
                            key=lambda r: r["us"])
                print(f"sweep {sh} {kernel} best 3: {ok[:3]}", flush=True)
        with open(os.path.join(args.out, "kernels.json"), "w") as f:
            json.dump(result, f, indent=1)
    md = markdown(result)
    print(md)
    with open(os.path.join(args.out, "kernels.md"), "w") as f:
        f.write(md)
    plot(result, os.path.join(args.out, "roofline.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""H200 benchmark of the weight-only fp8 matmul (issue 47): the Mosaic GPU kernel against the
XLA path and a bf16 matmul of the same shape.

Shapes: MiniMax-M3's per-rank linears at TP4 (``LAYERS``: q/k/v fused N=2304 K=6144, o_proj
N=6144 K=2048, dense MLP gate_up N=6144 K=6144, down N=6144 K=3072), T decode tokens in
1/16/64/128/256, both checkpoint formats (MXFP8 E8M0 per 32 inputs, fp8 128x128 blocks);
random weights quantized on the device, random bf16 x. Per (layer, format, T):
  * ours: ``fp8_matmul_mgpu`` with its default launch (or ``--tile-n`` etc.);
  * xla: ``fp8_matmul_xla`` inside jit (XLA dequantizes the weight to bf16, then one dot);
  * bf16: ``x @ w_bf16.T`` with the weight already in bf16 (f32 accumulation, cuBLAS).
Times are microseconds per call (``_common.time_jax``; default cold L2: a 512 MiB flush before
every call, the GPU's timer read inside the executable). ``pct_copy``: bytes moved (fp8 weight
+ scales + x + y; bf16: the bf16 weight + x + y) per second, as a percentage of the copy
bandwidth measured in the same process. Each row also records the relative L2 error of ours
and of xla against the f32 reference (``fp8_matmul_reference``).

Usage (GPU machine):  python3 bench/fp8_matmul.py --out DIR [--tokens 1,64] [--layers qkv]
CPU check of the script (interpret mode, tiny shapes, warm L2):  --smoke
Writes DIR/fp8_matmul.json and DIR/fp8_matmul.md.
"""
from __future__ import annotations

import _common  # noqa: E402  (first: repo root on sys.path, known warnings)
import argparse  # noqa: E402
import itertools  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _common import rel_l2, time_jax, timer_description, write_json  # noqa: E402
from pallas_kernels.fp8_matmul import (FORMATS, dequantize, fp8_matmul_reference,  # noqa: E402
                                       quantize_block128, quantize_mxfp8)
from pallas_kernels.fp8_matmul_default import fp8_matmul_xla  # noqa: E402
from pallas_kernels.fp8_matmul_mgpu import (K_SPLITS, STAGES, TILE_KS, TILE_NS,  # noqa: E402
                                            fp8_matmul_mgpu, make_config)

LAYERS = {"qkv": (2304, 6144), "o_proj": (6144, 2048), "gate_up": (6144, 6144),
          "down": (6144, 3072)}  # (N, K) per rank at TP4
TOKENS = (1, 16, 64, 128, 256)
SMOKE_LAYERS = {"tiny": (200, 384)}
SMOKE_TOKENS = (3,)
SWEEP_TILES = dict(tile_n=TILE_NS, tile_k=(128, 256), k_splits=K_SPLITS[:4], num_stages=(3, 4))


def _int_list(text: str, flag: str, parser) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(","))
    except ValueError:
        parser.error(f"{flag}: expected comma-separated integers, got {text!r}")
    if any(v < 1 for v in vals):
        parser.error(f"{flag}: every value must be >= 1, got {text!r}")
    return vals


def make_weight(key, n: int, k: int, fmt: str):
    """A random ``[n, k]`` weight (row magnitudes spread over 2^-4..2^4) quantized on the
    device, and its bf16 dequantization."""
    k1, k2 = jax.random.split(key)
    wf = jax.random.normal(k1, (n, k), jnp.float32) * 0.02
    wf = wf * jnp.exp2(jax.random.randint(k2, (n, 1), -4, 5).astype(jnp.float32))
    w = jax.jit(quantize_mxfp8 if fmt == "mxfp8" else quantize_block128)(wf)
    return w, jax.jit(lambda w: dequantize(w, jnp.bfloat16))(w)


def bf16_matmul(x, wb):
    """The bf16 baseline: ``x @ wb.T``, f32 accumulation, bf16 out."""
    return jax.lax.dot_general(x, wb, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def bench_case(layer: str, n: int, k: int, fmt: str, t: int, *, key, copy_bps: float,
               timing: dict, interpret: bool, tunables: dict) -> dict:
    kw, kx = jax.random.split(key)
    w, wb = make_weight(kw, n, k, fmt)
    x = jax.random.normal(kx, (t, k), jnp.float32).astype(jnp.bfloat16)
    cfg = make_config(t, n, k, fmt, **tunables)
    ours = jax.jit(lambda x, w: fp8_matmul_mgpu(x, w, interpret=interpret, **tunables))
    xla = jax.jit(fp8_matmul_xla)
    ref = fp8_matmul_reference(x, w, out_dtype=jnp.float32)
    y_ours, y_xla = ours(x, w), xla(x, w)
    row = {"layer": layer, "n": n, "k": k, "format": fmt, "tokens": t,
           "config": {f: getattr(cfg, f) for f in ("tile_t", "tile_n", "tile_k", "num_stages",
                                                   "k_splits")},
           "rel_l2": {"ours": rel_l2(y_ours.astype(jnp.float32), ref),
                      "xla": rel_l2(y_xla.astype(jnp.float32), ref)}}
    io = x.nbytes + t * n * 2
    fp8_bytes = w.values.nbytes + w.scales.nbytes + io
    cases = {"ours": (ours, (x, w), fp8_bytes), "xla": (xla, (x, w), fp8_bytes),
             "bf16": (bf16_matmul, (x, wb), wb.nbytes + io)}
    row["bytes"] = {"fp8": fp8_bytes, "bf16": wb.nbytes + io}
    for name, (fn, args, nbytes) in cases.items():
        tm = time_jax(fn, args, **timing)
        row[name] = {**tm.as_dict(), "pct_copy": round(100 * nbytes / (tm.us * 1e-6)
                                                       / copy_bps, 1)}
    row["speedup_vs_xla"] = round(row["xla"]["us"] / row["ours"]["us"], 3)
    row["speedup_vs_bf16"] = round(row["bf16"]["us"] / row["ours"]["us"], 3)
    return row


def sweep_case(layer: str, n: int, k: int, fmt: str, t: int, *, key, timing: dict) -> list:
    """``ours`` over :data:`SWEEP_TILES` (valid launches only), fastest first."""
    w, _ = make_weight(key, n, k, fmt)
    x = jnp.ones((t, k), jnp.bfloat16)
    rows = []
    for combo in itertools.product(*SWEEP_TILES.values()):
        tun = dict(zip(SWEEP_TILES, combo))
        try:
            make_config(t, n, k, fmt, **tun)
        except ValueError:
            continue
        fn = jax.jit(lambda x, w, tun=tun: fp8_matmul_mgpu(x, w, **tun))
        rows.append({**tun, "us": round(time_jax(fn, (x, w), **timing).us, 2)})
    return sorted(rows, key=lambda r: r["us"])


def markdown(result: dict) -> str:
    lines = [f"fp8 weight-only matmul, {result['meta']['device']}, {result['timing']}; copy "
             f"bandwidth {result['copy']['copy_Bps'] / 1e12:.2f} TB/s", "",
             "| layer | N | K | format | T | ours us (% copy) | xla us (% copy) | "
             "bf16 us (% copy) | vs xla | vs bf16 | launch (t, n, k, stages, splits) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        c = r["config"]
        lines.append(
            f"| {r['layer']} | {r['n']} | {r['k']} | {r['format']} | {r['tokens']} | "
            + " | ".join(f"{r[s]['us']:.1f} ({r[s]['pct_copy']:.0f}%)"
                         for s in ("ours", "xla", "bf16"))
            + f" | {r['speedup_vs_xla']:.2f}x | {r['speedup_vs_bf16']:.2f}x | "
              f"{c['tile_t']}, {c['tile_n']}, {c['tile_k']}, {c['num_stages']}, "
              f"{c['k_splits']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_common_args(p, reps=100, trials=3)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                   help="comma list of token counts T (default 1,16,64,128,256)")
    p.add_argument("--layers", default=",".join(LAYERS),
                   help=f"comma list of layers among {', '.join(LAYERS)} (default all)")
    p.add_argument("--formats", default=",".join(FORMATS),
                   help=f"comma list among {', '.join(FORMATS)} (default both)")
    p.add_argument("--l2", choices=_common.L2_MODES, default="cold",
                   help="cold (flush before every call, default) or warm L2")
    for name, allowed in (("tile-n", TILE_NS), ("tile-k", TILE_KS), ("num-stages", STAGES),
                          ("k-splits", K_SPLITS)):
        p.add_argument(f"--{name}", type=int, choices=allowed, default=None,
                       help=f"our kernel's {name.replace('-', '_')} (default: its rule)")
    p.add_argument("--a-in-smem", action="store_true",
                   help="our kernel's dequantized tile through shared memory (default: registers)")
    p.add_argument("--sweep", action="store_true",
                   help="also time our kernel over a grid of tunables per case")
    p.add_argument("--smoke", action="store_true",
                   help="off the GPU: tiny shapes, our kernel in interpret mode, warm L2 "
                        "(exercises the script)")
    args = p.parse_args(argv)
    args.tokens = _int_list(args.tokens, "--tokens", p)
    args.layers = tuple(args.layers.split(","))
    args.formats = tuple(args.formats.split(","))
    if set(args.layers) - set(LAYERS):
        p.error(f"--layers: {sorted(set(args.layers) - set(LAYERS))} not among "
                f"{', '.join(LAYERS)}")
    if set(args.formats) - set(FORMATS):
        p.error(f"--formats: {sorted(set(args.formats) - set(FORMATS))} not among "
                f"{', '.join(FORMATS)}")
    if not _common.ON_GPU and not args.smoke:
        p.error("no GPU backend: run on the GPU machine, or pass --smoke")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    interpret = args.smoke and not _common.ON_GPU
    if args.smoke:
        layers, tokens = SMOKE_LAYERS, SMOKE_TOKENS
        timing = dict(n=1, trials=1, l2="warm")
    else:
        layers, tokens = {k: LAYERS[k] for k in args.layers}, args.tokens
        timing = dict(n=args.reps, trials=args.trials, l2=args.l2)
    tunables = {f: getattr(args, f) for f in ("tile_n", "tile_k", "num_stages", "k_splits")
                if getattr(args, f) is not None}
    if args.a_in_smem:
        tunables["a_in_smem"] = True
    copy = _common.copy_bandwidth(8 << 20 if args.smoke else 2 << 30)
    print(f"copy bandwidth {copy['copy_Bps'] / 1e12:.3f} TB/s", flush=True)
    result = {"meta": _common.run_meta(), "copy": copy,
              "timing": timer_description(timing["l2"], timing["n"])
              + f"; median of {timing['trials']} samples",
              "tunables": tunables or "defaults", "interpret": interpret, "rows": []}
    key = jax.random.key(args.seed)
    json_path = os.path.join(args.out, "fp8_matmul.json")
    formats = args.formats
    for (layer, (n, k)), fmt, t in itertools.product(layers.items(), formats, tokens):
        key, sub = jax.random.split(key)
        row = bench_case(layer, n, k, fmt, t, key=sub, copy_bps=copy["copy_Bps"],
                         timing=timing, interpret=interpret, tunables=tunables)
        if args.sweep and not args.smoke:
            row["sweep"] = sweep_case(layer, n, k, fmt, t, key=sub, timing=timing)[:5]
        result["rows"].append(row)
        print(f"{layer} N={n} K={k} {fmt} T={t}: ours {row['ours']['us']:.1f} us "
              f"({row['ours']['pct_copy']}%), xla {row['xla']['us']:.1f}, bf16 "
              f"{row['bf16']['us']:.1f}; rel_l2 {row['rel_l2']['ours']:.2e}; "
              f"{row['config']}" + (f"; sweep best {row['sweep'][:2]}" if "sweep" in row
                                    else ""), flush=True)
        write_json(json_path, result)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    write_json(json_path, result)
    md = markdown(result)
    with open(os.path.join(args.out, "fp8_matmul.md"), "w") as f:
        f.write(md)
    print(md)
    bad = [r for r in result["rows"] if not r["rel_l2"]["ours"] < 1e-2]
    if bad:
        print(f"ours differs from the reference: {[(r['layer'], r['format'], r['tokens'], r['rel_l2']) for r in bad]}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

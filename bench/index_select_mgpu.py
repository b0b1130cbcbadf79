"""H200 benchmark: the Mosaic GPU indexer + select (two launches with PDL) against the Triton
fused one (``msa_index_select``), bf16 (or e4m3 with ``--fp8``), at the 16 shapes of
``bench/kernels.py``.

For each shape: whether the selections agree (as sets per row; they are computed from the
same f32 scores, so they should be identical), the XLA kernel count of each op, and the
cold-L2 time of each (``_common.time_jax``: ``--reps`` calls of (512 MiB flush; op), ten
looped in each executable, minus as many flushes, median of ``--trials``). ``--grid`` adds
Mosaic variants of the scores kernel's launch (grid size, ring depth). ``--parts`` times
the two halves on their own instead (the DCP path's calls): the scores (``msa_index_scores``
against ``msa_index_scores_mgpu``, their largest difference) and the select over the same f32
scores (``sparse_topk_select`` against ``sparse_topk_select_mgpu``, agreement).

Usage (GPU machine): python3 bench/index_select_mgpu.py --out FILE.json [--shapes 0,1,8]
  [--grid 'ctas=0,528;ns=2,3|ns=4'] [--fp8] [--parts] [--heads 1] [--reps 100] [--trials 3]
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import time

import numpy as np

import _common  # noqa: F401  (preamble: repository on sys.path, one warning filter)
import jax  # noqa: E402
from _common import hlo_kernel_count, positive_int, time_jax  # noqa: E402
from _shapes_inputs import all_shapes, make_inputs  # noqa: E402
from pallas_kernels.index_scores import msa_index_scores  # noqa: E402
from pallas_kernels.index_select import msa_index_select, num_valid_pages_of  # noqa: E402
from pallas_kernels.index_select_mgpu import (msa_index_scores_mgpu,  # noqa: E402
                                              msa_index_select_mgpu, sparse_topk_select_mgpu)
from pallas_kernels.topk_select import sparse_topk_select  # noqa: E402

ARGS = ("index_q", "index_k", "block_table", "req_indices", "positions")
FP8 = jax.numpy.float8_e4m3fn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="", help="indices into bench/kernels.py's 16 shapes")
    ap.add_argument("--reps", type=positive_int, default=100)
    ap.add_argument("--trials", type=positive_int, default=3)
    ap.add_argument("--grid", default="",
                    help="more Mosaic variants: every combination of 'ctas=0,528;ns=2,3' (the "
                         "scores kernel's CTAs, 0 for the default; its ring depth), parts "
                         "joined by |")
    ap.add_argument("--fp8", action="store_true",
                    help="e4m3 index queries over an e4m3 index-K cache on both kernels")
    ap.add_argument("--parts", action="store_true",
                    help="time the scores and the select on their own (each backend)")
    ap.add_argument("--heads", type=positive_int, default=None,
                    help="keep only the first HEADS index heads of every shape's queries")
    a = ap.parse_args(argv)
    shapes = all_shapes()
    if a.shapes:
        shapes = [shapes[int(i)] for i in a.shapes.split(",")]
    result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M:%S"),
                  method=_common.timer_description("cold", a.reps),
                  index_dtype="float8_e4m3fn" if a.fp8 else "bfloat16", rows=[])
    variants = {"triton": msa_index_select, "mgpu": msa_index_select_mgpu}
    variants.update(grid_variants(a.grid))
    for shape in shapes:
        x = make_inputs(shape, 0)
        if a.fp8:
            x = dict(x, index_q=x["index_q"].astype(FP8), index_k=x["index_k"].astype(FP8))
        if a.heads is not None:
            x = dict(x, index_q=x["index_q"][:, :a.heads])
        args = tuple(x[k] for k in ARGS)
        row = dict(shape=shape.name, index_heads=int(x["index_q"].shape[1]))
        if a.parts:
            row.update(time_parts(args, a.reps, a.trials))
        else:
            row.update(time_variants(variants, args, a.reps, a.trials))
        result["rows"].append(row)
        print(summary(row), flush=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def grid_variants(spec: str) -> dict:
    """``msa_index_select_mgpu`` variants: every combination within each ``|``-separated part
    of a ``--grid`` spec (``ctas`` the scores kernel's grid, 0 for its default; ``ns`` its ring
    depth)."""
    keys = dict(ctas="num_ctas", ns="num_stages")
    variants = {}
    for part in (p for p in spec.split("|") if p):
        axes = [(k, [int(v) for v in vals.split(",")])
                for k, vals in (kv.split("=") for kv in part.split(";") if kv)]
        for combo in itertools.product(*(vals for _, vals in axes)):
            kw = {keys[k]: v for (k, _), v in zip(axes, combo) if not (k == "ctas" and v == 0)}
            name = "mgpu_" + "_".join(f"{k}{v}" for (k, _), v in zip(axes, combo))
            variants[name] = functools.partial(msa_index_select_mgpu, **kw)
    return variants


def summary(row: dict) -> str:
    """One line per shape: each op's median us, agreements and errors (no kernel counts)."""
    return f"{row['shape']} " + str({k: (v["us"] if isinstance(v, dict) else v)
                                     for k, v in row.items()
                                     if k != "shape" and not k.endswith("_kernels")})


def time_variants(variants: dict, args: tuple, reps: int, trials: int) -> dict:
    """The indexer + select of each variant: kernel count, time, and each Mosaic variant's
    agreement with the Triton one (share of identical rows)."""
    row, outs = {}, {}
    for name, fn in variants.items():
        try:
            outs[name] = np.sort(np.asarray(jax.jit(fn)(*args)), axis=-1)
            row[f"{name}_kernels"] = hlo_kernel_count(
                jax.jit(fn).lower(*args).compile().as_text())["total"]
            row[name] = time_jax(fn, args, n=reps, trials=trials, l2="cold").as_dict()
        except Exception as e:  # one failing variant must not hide the others
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:1500]}"
    for name in outs.keys() - {"triton"}:
        if "triton" in outs:
            row[f"{name}_agree"] = float(np.mean(np.all(outs["triton"] == outs[name], -1)))
    return row


def time_parts(args: tuple, reps: int, trials: int) -> dict:
    """The scores and the select on their own, each backend: times, kernel counts, and the
    scores' largest difference / the selections' agreement (share of identical rows)."""
    row, scores = {}, {}

    def run(name, fn, fn_args):
        row[f"{name}_kernels"] = hlo_kernel_count(
            jax.jit(fn).lower(*fn_args).compile().as_text())["total"]
        row[name] = time_jax(fn, fn_args, n=reps, trials=trials, l2="cold").as_dict()
        return np.asarray(jax.jit(fn)(*fn_args))

    for name, fn in (("triton_scores", msa_index_scores), ("mgpu_scores", msa_index_scores_mgpu)):
        scores[name] = run(name, fn, args)
    a, b = scores.values()
    row["scores_max_abs_diff"] = float(np.max(np.abs(np.where(np.isfinite(a), a - b, 0.0))))
    sel_args = (jax.numpy.asarray(scores["triton_scores"]), num_valid_pages_of(args[-1]))
    picks = {name: run(name, fn, sel_args) for name, fn in (
        ("triton_select", sparse_topk_select), ("mgpu_select", sparse_topk_select_mgpu))}
    row["select_agree"] = float(np.mean(np.all(picks["triton_select"] == picks["mgpu_select"], -1)))
    return row


if __name__ == "__main__":
    raise SystemExit(main())

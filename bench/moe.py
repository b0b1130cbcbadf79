"""H200 benchmark of the MoE routed experts (issue 49): ours (pallas_kernels.moe_experts_default)
against vLLM 0.33.0's pure-Triton fused MoE (``fused_moe_kernel``) and XLA's grouped matmuls
(pallas_kernels.moe_experts.moe_experts_xla, the runner's MoE before the kernels: two
ragged_dots), all timed as GPU work.

Shapes, per rank of EP8 (MiniMax-M3): 16 local experts (global ids 0..15 of 128: rank 0), hidden
H = 6144, intermediate I = 3072, top-4 routing; B tokens in 1/16/64/256 (decode) and
2048/4096 (prefill). Routing: k = 4 distinct experts per token drawn uniformly over all 128, so
about 1/8 of the copies are local (a routing with no local copy is drawn again: at B = 1 that
happens 58% of the time, and would time an empty call); weights uniform in [0.1, 1), every token
unmasked; random bf16 x; expert weights N(0, 1/fan_in). Weight formats:
  * bf16: both sides (and XLA);
  * MXFP8 (E8M0 scale per 32 inputs): ours (and XLA, which dequantizes to bf16 inside the
    call); vLLM has no MXFP8 path in its Triton fused MoE;
  * fp8 block128 (f32 scale per 128 x 128 block): ours is weight-only (bf16 activations,
    fp8 weights dequantized in registers); vLLM's is w8a8 (it quantizes the activations to
    e4m3 too, a scale per 128 inputs of a token; block_shape [128, 128]), so its output differs
    from ours by that rounding (a few %).
On the same device buffers (DLPack), in one process:
  * ours: ``moe_experts_default(x, weights, experts, token_mask, gate_up, down, alpha=1.702,
    limit=7.0, first_expert=0)`` (its decode kernel up to 64 copies T*k, its prefill grouped
    GEMMs above) -> f32 [T, H]; decode shapes also time the other kernel (``backend=``);
  * vLLM: bench/_vllm_moe.FusedMoe: its TritonExperts sequence (activation quantization (fp8),
    moe_align_block_size with the rank's expert_map, fused_moe_kernel, the MiniMax-M3
    activation, fused_moe_kernel with the routing weights, moe_sum) on its weight layout (w1
    [E, 2I, H], w2 [E, H, I]: for fp8 the same bytes as ours, for bf16 a transposed copy).
    vLLM's CUDA helpers are stand-ins of ours (tools/vllm_compare/vllm_ops.py: torch
    moe_align_block_size, Triton activation / moe_sum / fp8 quantization), so "vLLM" is also
    timed as its two fused_moe_kernel launches alone ("GEMMs"), a lower bound of its time;
  * XLA: ``moe_experts_xla`` jitted;
  * the copy bandwidth and the bf16 matmul rate (XLA's GEMM, [8192]^2) in the same process.
Before timing: ours against the jnp reference ``moe_experts_reference`` and vLLM against ours at
every shape (relative L2), vLLM against the reference at B = 16 per format first (a failure
skips vLLM's timing for that format).

Per shape: times (us), ratios (vLLM / ours, > 1: ours faster; against the whole sequence and
against its GEMMs alone), touched expert bytes (experts with >= 1 local copy x the bytes of
their weights in the format that side reads, scales included), % of the copy bandwidth over
those bytes, FLOPs (6 H I per local copy) and % of the measured bf16 matmul rate.

Timing (every figure GPU work after a 512 MiB L2 flush, medians over --rounds x --trials):
ours and XLA: (flush; optimization_barrier; op) looped inside ONE XLA executable, the GPU's
timer read inside it (bench/_common.time_jax, cold L2); vLLM: the faster of a replayed CUDA
graph of (flush; op) and eager (flush x k; op), each minus its flush-only twin
(bench/_vllm_timing.py).

Usage (GPU machine, carry .vllm_ops):  python3 bench/moe.py --out DIR [--kinds decode,prefill]
    [--batches 1,16] [--prefill-batches 2048] [--formats bf16,block128] [--budget-s S]
CPU check (tiny shapes, ours in interpret mode against the reference, vLLM's Triton kernels in
Triton's interpreter in the .venv-vllm, no timing claims):  --dry-run
Writes DIR/moe.json and DIR/moe.md.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import _common  # noqa: E402  (first: repo root on sys.path, known warnings)
import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _common import FLUSH_BYTES, geomean, rel_l2, time_jax, timer_description  # noqa: E402
from pallas_kernels.fp8_matmul import BLOCK, MX_GROUP, quantize_block128, quantize_mxfp8  # noqa: E402,E501
from pallas_kernels.moe_experts import (check_moe_inputs, moe_experts_reference,  # noqa: E402
                                        moe_experts_xla)
from pallas_kernels.moe_experts_default import (moe_experts_backend,  # noqa: E402
                                                moe_experts_default)
from pallas_kernels.moe_experts_mgpu import make_decode_config, make_prefill_config  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALPHA, LIMIT = 1.702, 7.0  # MiniMax-M3's swigluoai (config.swiglu_alpha / swiglu_limit)
KINDS = ("decode", "prefill")
FORMATS = ("bf16", "mxfp8", "block128")
VLLM_FORMATS = ("bf16", "block128")  # vLLM's Triton fused MoE: bf16 and w8a8 block [128, 128]
DECODE_BATCHES = (1, 16, 64, 256)
PREFILL_BATCHES = (2048, 4096)
CHECK_BATCH = 16  # vLLM against the reference per format, before its timing
# Agreement bounds (relative L2, f32): ours vs the reference and vLLM bf16 vs ours differ by
# bf16 roundings; vLLM w8a8 also rounds its activations to e4m3 (about 4% measured at tiny
# shapes in the interpreter).
AGREE = {"ours": 1e-2, "xla": 1e-2, "vllm_bf16": 2e-2, "vllm_w8a8": 8e-2}
NOMINAL_PEAK = 989e12  # H200 dense bf16 data-sheet figure, for context only
VLLM_PYTHON = os.environ.get("VLLM_PYTHON", os.path.join(REPO, ".venv-vllm", "bin", "python"))


@dataclasses.dataclass(frozen=True)
class Dims:
    """One rank's expert shape: h hidden, i intermediate, e local experts (global ids
    [first, first + e)) of g, k experts per token."""
    h: int = 6144
    i: int = 3072
    e: int = 16
    g: int = 128
    k: int = 4
    first: int = 0


SERVING = Dims()
DRY = Dims(h=256, i=128, e=4, g=16, k=2)  # --dry-run: the kernels' smallest tiles


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str
    batch: int
    fmt: str
    dims: Dims = SERVING

    @property
    def name(self) -> str:
        return f"{self.kind} {self.fmt} B={self.batch}"


def all_cases(kinds=KINDS, batches=DECODE_BATCHES, prefill_batches=PREFILL_BATCHES,
              formats=FORMATS, dims: Dims = SERVING) -> list[Case]:
    """Formats outer (one set of weights each), then decode and prefill batches."""
    out = []
    for fmt in formats:
        if "decode" in kinds:
            out += [Case("decode", b, fmt, dims) for b in batches]
        if "prefill" in kinds:
            out += [Case("prefill", b, fmt, dims) for b in prefill_batches]
    return out


# --dry-run: both kinds in bf16 (both sides), decode MXFP8 (ours only), prefill block128 (both
# sides; vLLM's grouped config): 8 tokens = 16 copies (our decode kernel), 40 = 80 (prefill)
DRY_CASES = (Case("decode", 8, "bf16", DRY), Case("prefill", 40, "bf16", DRY),
             Case("decode", 8, "mxfp8", DRY), Case("prefill", 40, "block128", DRY))


# --------------------------------------------------------------------------- figures

def expert_bytes(fmt: str, d: Dims) -> int:
    """Bytes of one expert's gate_up [2I, H] and down [H, I] in ``fmt``, scales included."""
    n = 3 * d.h * d.i
    if fmt == "bf16":
        return 2 * n
    if fmt == "mxfp8":
        return n + n // MX_GROUP
    blocks = (-(-2 * d.i // BLOCK) * -(-d.h // BLOCK)) + (-(-d.h // BLOCK) * -(-d.i // BLOCK))
    return n + 4 * blocks


def routing_figures(experts: np.ndarray, d: Dims) -> dict:
    """Local copies, touched local experts and FLOPs (6 H I per local copy: 2 per
    multiply-add of gate_up's 2 H I and down's H I) of a routing ``[T, k]``."""
    local = experts - d.first
    mine = (local >= 0) & (local < d.e)
    copies = int(mine.sum())
    return {"local_copies": copies, "touched_experts": int(np.unique(local[mine]).size),
            "flops": 6 * d.h * d.i * copies}


def side_bytes(row: dict, fmt: str, d: Dims) -> int:
    return row["touched_experts"] * expert_bytes(fmt, d)


def rates(us, nbytes: int, flops: int, copy_bps: float, peak_flops: float) -> dict:
    """% of the copy bandwidth over ``nbytes`` and TFLOP/s, % of the measured bf16 peak."""
    if not us:
        return {"pct_copy": None, "tflops": None, "pct_peak": None}
    s = us * 1e-6
    return {"pct_copy": 100 * nbytes / s / copy_bps, "tflops": flops / s / 1e12,
            "pct_peak": 100 * flops / s / peak_flops}


# --------------------------------------------------------------------------- inputs

def make_weights(fmt: str, d: Dims, seed: int):
    """(gate_up, down) of the e local experts: bf16 [E, H, 2I] / [E, I, H], or Fp8Weights of
    values [E, 2I, H] / [E, H, I] (MXFP8 or 128x128 blocks) quantized from the same f32 draw."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    gu = jax.random.normal(k1, (d.e, 2 * d.i, d.h), jnp.float32) / np.sqrt(d.h)
    dn = jax.random.normal(k2, (d.e, d.h, d.i), jnp.float32) / np.sqrt(d.i)
    if fmt == "bf16":
        out = (jnp.swapaxes(gu, 1, 2).astype(jnp.bfloat16),
               jnp.swapaxes(dn, 1, 2).astype(jnp.bfloat16))
    else:
        q = jax.jit(quantize_mxfp8 if fmt == "mxfp8" else quantize_block128)
        out = (q(gu), q(dn))
    del gu, dn
    return jax.block_until_ready(out)


def make_routing(batch: int, d: Dims, seed: int) -> tuple[dict, int]:
    """(inputs: x [B, H] bf16, weights [B, k] f32, experts [B, k] int32 (k distinct of g),
    mask [B] all true; draws): routings without a local copy are drawn again."""
    rng = np.random.default_rng(seed)
    for draws in range(1, 1001):
        experts = np.argsort(rng.random((batch, d.g)), axis=1)[:, :d.k].astype(np.int32)
        local = experts - d.first
        if ((local >= 0) & (local < d.e)).any():
            break
    weights = rng.uniform(0.1, 1.0, (batch, d.k)).astype(np.float32)
    x = jax.random.normal(jax.random.key(seed + 1), (batch, d.h), jnp.float32)
    return {"x": x.astype(jnp.bfloat16), "weights": jnp.asarray(weights),
            "experts": jnp.asarray(experts), "mask": jnp.ones((batch,), jnp.bool_)}, draws


# --------------------------------------------------------------------------- our sides

def our_moe(a: dict, w: tuple):
    """Ours: f32 [T, H]; the kernels compiled on a GPU, interpreted elsewhere."""
    return moe_experts_default(a["x"], a["weights"], a["experts"], a["mask"], *w, alpha=ALPHA,
                               limit=LIMIT, first_expert=0, **_common.PALLAS_KW)


def our_decode_kernel(a: dict, w: tuple):
    return moe_experts_default(a["x"], a["weights"], a["experts"], a["mask"], *w, alpha=ALPHA,
                               limit=LIMIT, first_expert=0, backend="decode", **_common.PALLAS_KW)


def our_prefill_kernel(a: dict, w: tuple):
    return moe_experts_default(a["x"], a["weights"], a["experts"], a["mask"], *w, alpha=ALPHA,
                               limit=LIMIT, first_expert=0, backend="prefill",
                               **_common.PALLAS_KW)


def xla_moe(a: dict, w: tuple):
    """XLA's grouped matmuls (moe_experts_xla: fp8 experts dequantized to bf16 in the call,
    argsort + two ragged_dots); f32 [T, H]."""
    return moe_experts_xla(a["x"], a["weights"], a["experts"], a["mask"], *w, alpha=ALPHA,
                           limit=LIMIT, first_expert=0)


def reference_moe(a: dict, w: tuple):
    return moe_experts_reference(a["x"], a["weights"], a["experts"], a["mask"], *w, alpha=ALPHA,
                                 limit=LIMIT, first_expert=0)


def backend_of(case: Case, a: dict, w: tuple) -> dict:
    """Our default's choice for the case and its launch configuration (one line)."""
    s = check_moe_inputs(a["x"], a["weights"], a["experts"], a["mask"], *w)
    b = moe_experts_backend(s, a["x"].dtype, interpreting=not _common.ON_GPU,
                            on_gpu=_common.ON_GPU)
    if b == "decode":
        c = make_decode_config(s)
        cfg = (f"tile_c {c.tile_c}, tile_i {c.tile_i}, tile_h {c.tile_h}, stages "
               f"{c.stages}/{c.down_stages}, {c.num_ctas} CTAs")
    elif b == "prefill":
        c = make_prefill_config(s)
        cfg = (f"tile_c {c.tile_c}, stages {c.stages}, down tile_k {c.down_tile_k}, stages "
               f"{c.down_stages}, {c.num_ctas}/{c.down_num_ctas} CTAs")
    else:
        cfg = "jnp reference"
    return {"backend": b, "config": cfg}


# --------------------------------------------------------------------------- vLLM side (GPU)

def vllm_layout(w: tuple, fmt: str) -> dict:
    """Our expert weights in vLLM's layout (jax arrays): w1 [E, 2I, H] (gate rows, then up
    rows), w2 [E, H, I]; bf16 transposed, fp8 block the same values and scales."""
    gu, dn = w
    if fmt == "bf16":
        return {"w1": jnp.swapaxes(gu, 1, 2), "w2": jnp.swapaxes(dn, 1, 2)}
    return {"w1": gu.values, "w2": dn.values, "w1_scale": gu.scales, "w2_scale": dn.scales}


def vllm_weights(vllm, w: tuple, fmt: str) -> dict:
    """:func:`vllm_layout` as torch tensors on the device (made once per format)."""
    return {k: vllm[0].to_torch(jax.block_until_ready(v)).contiguous()
            for k, v in vllm_layout(w, fmt).items()}


def vllm_moe(vllm, a: dict, lay: dict, fmt: str, d: Dims):
    """vLLM's FusedMoe (one call run) on our device buffers (DLPack) and the tensors it holds;
    ``lay``: :func:`vllm_weights`."""
    import torch

    vt, vm, mods, _ = vllm
    held = {k: vt.to_torch(a[k]) for k in ("x", "weights", "experts")}
    emap = vm.expert_map(d.g, d.first, d.e, held["x"].device)
    moe = vm.FusedMoe(mods, held["x"], lay["w1"], lay["w2"], held["weights"],
                      held["experts"], emap, fp8=fmt == "block128", alpha=ALPHA, limit=LIMIT,
                      w1_scale=lay.get("w1_scale"), w2_scale=lay.get("w2_scale"))
    moe.call()
    torch.cuda.synchronize()
    return moe, dict(held, emap=emap)


def vllm_bound(fmt: str) -> float:
    return AGREE["vllm_w8a8" if fmt == "block128" else "vllm_bf16"]


# --------------------------------------------------------------------------- one case

def bench_case(case: Case, w: tuple, vllm, vw: dict | None, *, reps: int, trials: int,
               rounds: int, seed: int, preroll: int, warmup: bool = True
               ) -> tuple[dict, np.ndarray]:
    """Checks and times one case (module docstring); ``vw``: vLLM's weights (None: vLLM not
    run); ``preroll``, ``warmup``: time_jax's (0, False in a dry run). Returns (row, our output f32
    [T, H])."""
    from kernels import ours_summary, vllm_prepare, vllm_summary, vllm_time

    d = case.dims
    a, draws = make_routing(case.batch, d, case_seed(case, seed))
    row = {"name": case.name, "kind": case.kind, "fmt": case.fmt, "batch": case.batch,
           "routing_draws": draws, **routing_figures(np.asarray(a["experts"]), d),
           **backend_of(case, a, w)}
    row["bytes"] = {"ours": side_bytes(row, case.fmt, d), "xla": side_bytes(row, case.fmt, d),
                    "vllm": side_bytes(row, case.fmt, d) if case.fmt in VLLM_FORMATS else None}
    ours = np.asarray(jax.block_until_ready(jax.jit(our_moe)(a, w)))
    ref = np.asarray(jax.jit(reference_moe)(a, w))
    xla = np.asarray(jax.jit(xla_moe)(a, w))
    row["finite"] = bool(np.isfinite(ours).all())
    row["rel_l2"] = {"ours_vs_reference": rel_l2(ours, ref), "xla_vs_reference": rel_l2(xla, ref)}
    del ref, xla
    fns = {"ours": our_moe, "xla": xla_moe}
    if case.kind == "decode":  # the other kernel of our default, for the crossover
        fns["ours_other"] = our_prefill_kernel if row["backend"] == "decode" else our_decode_kernel
        row["other_backend"] = "prefill" if row["backend"] == "decode" else "decode"

    state = moe = held = None
    acc: dict = {}
    if vw is not None:
        vt, _, _, timer = vllm
        try:
            moe, held = vllm_moe(vllm, a, vw, case.fmt, d)
            row["vllm_config"] = moe.grid_note()
            row["rel_l2"]["vllm_vs_ours"] = rel_l2(moe.out.float().cpu().numpy(), ours)
            state = vllm_prepare(vt, timer, {"moe": [("sequence", moe.call)],
                                             "gemms": [("fused_moe_kernel x2", moe.gemms)]})
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: the row records it
            row["vllm_err"] = f"{type(e).__name__}: {e}"[:400]
            state = None
    timings: dict = {k: [] for k in fns}
    timing = dict(n=reps, trials=trials, l2="cold", preroll=preroll, warmup=warmup)
    for _ in range(rounds):  # interleaved: each round times every side
        for k, f in fns.items():
            timings[k].append(time_jax(f, (a, w), **timing))
        if state is not None:
            vllm_time(vllm[3], state, n=reps, trials=trials, acc=acc)
    for k in fns:
        row[k] = ours_summary(timings[k])
    if state is not None:
        summ = vllm_summary(acc, state, vllm[3].flush_us)
        row["vllm"], row["vllm_gemms"] = summ["moe"], summ["gemms"]
    del state, moe, held
    gc.collect()
    if vllm is not None:
        import torch
        torch.cuda.empty_cache()
    return row, ours


def case_seed(case: Case, seed: int) -> int:
    return seed + case.batch


def add_rates(row: dict, copy_bps: float, peak: float, claims: bool) -> None:
    """Per side % copy / TFLOP/s / % peak, and the ratios (vLLM, its GEMMs, XLA over ours);
    all None without ``claims`` (a dry run)."""
    for side, bkey in (("ours", "ours"), ("xla", "xla"), ("vllm", "vllm"),
                       ("vllm_gemms", "vllm")):
        us = (row.get(side) or {}).get("us") if claims else None
        nbytes = row["bytes"][bkey] or 0
        row.setdefault("rates", {})[side] = rates(us, nbytes, row["flops"], copy_bps, peak)
    for key, side in (("ratio", "vllm"), ("ratio_gemms", "vllm_gemms"), ("ratio_xla", "xla")):
        us = (row.get(side) or {}).get("us")
        row[key] = us / row["ours"]["us"] if claims and us else None


# --------------------------------------------------------------------------- vLLM check

def vllm_reference_check(vllm, w: tuple, vw: dict, fmt: str, d: Dims, seed: int) -> dict:
    """vLLM against the jnp reference at B = CHECK_BATCH (GPU)."""
    a, _ = make_routing(CHECK_BATCH, d, seed)
    ref = np.asarray(jax.jit(reference_moe)(a, w))
    try:
        moe, _ = vllm_moe(vllm, a, vw, fmt, d)
        err = rel_l2(moe.out.float().cpu().numpy(), ref)
    except Exception as e:  # noqa: BLE001 - recorded; vLLM is then not timed
        return {"batch": CHECK_BATCH, "ok": False, "err": f"{type(e).__name__}: {e}"[:400]}
    return {"batch": CHECK_BATCH, "rel_l2": err, "bound": vllm_bound(fmt),
            "ok": bool(err < vllm_bound(fmt))}


def dry_vllm_inputs(cases, weights: dict, seed: int) -> dict:
    """The npz payload of bench/_vllm_moe.py's script for the vLLM formats' dry cases (the
    routings bench_case draws): bf16 as float32 (exact), e4m3 as its uint8 bits."""
    out = {}
    for c in cases:
        if c.fmt not in VLLM_FORMATS:
            continue
        key, d = c.name.replace(" ", "_"), c.dims
        a = make_routing(c.batch, d, case_seed(c, seed))[0]
        lay = vllm_layout(weights[c.fmt], c.fmt)
        for k, v in lay.items():
            if v.dtype == jnp.float8_e4m3fn:
                v = jax.lax.bitcast_convert_type(v, jnp.uint8)
            out[f"{key}/{k}"] = np.asarray(v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v)
        out[f"{key}/x"] = np.asarray(a["x"].astype(jnp.float32))
        out[f"{key}/topk_weights"] = np.asarray(a["weights"])
        out[f"{key}/topk_ids"] = np.asarray(a["experts"])
        emap = np.full((d.g,), -1, np.int32)
        emap[d.first:d.first + d.e] = np.arange(d.e, dtype=np.int32)
        out[f"{key}/emap"] = emap
        out[f"{key}/meta"] = np.asarray(json.dumps({"fp8": c.fmt == "block128", "alpha": ALPHA,
                                                    "limit": LIMIT}))
    return out


def start_dry_vllm(payload: dict, ops_dir: str, python: str) -> dict:
    """Starts bench/_vllm_moe.py in ``python`` (the .venv-vllm) under Triton's interpreter on
    the payload's cases (it runs beside ours); :func:`finish_dry_vllm` collects it."""
    if not os.path.exists(python):
        return {"err": f"{python}: no comparison Python (make compare-env, or set VLLM_PYTHON)"}
    tmp = tempfile.mkdtemp(prefix="moe_dry_")
    inp, outp = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.npz")
    np.savez(inp, **payload)
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.Popen([python, os.path.join(REPO, "bench", "_vllm_moe.py"), "--ops-dir",
                             ops_dir, "--inputs", inp, "--out", outp], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    return {"proc": proc, "tmp": tmp, "out": outp}


def finish_dry_vllm(job: dict, timeout_s: int = 240) -> dict:
    """{"outputs": {case key: f32 [T, H]}, "cases": {key: config, alignment}, "versions"},
    or {"err": why}."""
    import shutil

    if "err" in job:
        return job
    try:
        out, err = job["proc"].communicate(timeout=timeout_s)
        if job["proc"].returncode != 0:
            return {"err": f"_vllm_moe.py rc={job['proc'].returncode}: {err[-1500:]}"}
        doc = json.loads(out.strip().splitlines()[-1])
        data = np.load(job["out"])
        doc["outputs"] = {k.split("/")[0]: data[k] for k in data.files}
        return doc
    except subprocess.TimeoutExpired:
        job["proc"].kill()
        job["proc"].communicate()
        return {"err": f"_vllm_moe.py: over {timeout_s} s"}
    finally:
        shutil.rmtree(job["tmp"], ignore_errors=True)


# --------------------------------------------------------------------------- output

def _f(v, spec=".1f", unit="", none="n/a") -> str:
    return none if v is None else format(v, spec) + unit


def markdown(result: dict) -> str:
    meta, bw, peak = result["meta"], result["copy"]["copy_Bps"], result["peak"]["flops_per_s"]
    vs = result.get("vllm_versions") or {}
    lines = [
        f"Date {meta['date']}; device {meta['device']}; jax {meta['jax']}"
        + (f", torch {vs['torch']}, triton {vs['triton']}, vLLM 0.33.0 fused_moe_kernel"
           if vs else "")
        + f"; copy bandwidth {bw / 1e12:.2f} TB/s (read + write), bf16 matmul "
          f"{peak / 1e12:.0f} TFLOP/s (XLA GEMM), both measured in this run"
        + ("; DRY RUN (CPU: interpret mode, no timing claims)" if result["dry_run"] else "")
        + ".", "",
        f"- Shapes: {result['shapes']}.",
        f"- Ours / XLA: {result['timing']['ours']}. vLLM: {result['timing']['vllm']}.",
        "- Ratio = vLLM time / our time (> 1: ours faster): against vLLM's whole sequence (its "
        "CUDA helpers are our stand-ins: torch moe_align_block_size, Triton activation / "
        "moe_sum / fp8 quantization) and against its two fused_moe_kernel launches alone "
        "(GEMMs: a lower bound of vLLM's time, the conservative ratio). XLA/ours likewise.",
        "- MXFP8: ours and XLA only (vLLM's Triton fused MoE has no MXFP8 path). block128: "
        "ours weight-only fp8 (bf16 activations), vLLM w8a8 (activations quantized to e4m3, a "
        "scale per 128 inputs of a token).",
        "- MiB: touched expert bytes (experts with >= 1 local copy x their weight bytes in the "
        "format, scales included; the same for both sides in bf16 and block128). % copy: "
        "those bytes / time / copy bandwidth. % peak: 6 H I FLOPs per local copy / time / the "
        "measured bf16 matmul rate "
        f"(nominal H200: {NOMINAL_PEAK / 1e12:.0f} TFLOP/s).",
        "- rel-L2: ours vs the jnp reference; vLLM vs ours.", ""]
    for fmt in FORMATS:
        rows = [r for r in result["rows"] if r["fmt"] == fmt]
        if not rows:
            continue
        lines += [f"{fmt}:", "",
                  "| kind | B | local copies | experts | ours us | vLLM us | vLLM GEMMs us "
                  "| XLA us | other kernel us | ratio | ratio GEMMs | XLA/ours | MiB | % copy "
                  "ours | % copy vLLM GEMMs | TFLOP/s ours | % peak ours | % peak vLLM GEMMs "
                  "| ours kernel | rel-L2 ref / vLLM |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
                  "---|---|"]
        for r in rows:
            o, g = r["rates"]["ours"], r["rates"]["vllm_gemms"]
            lines.append(
                f"| {r['kind']} | {r['batch']} | {r['local_copies']} | {r['touched_experts']} "
                f"| {_f(r['ours']['us'])} | {_f((r.get('vllm') or {}).get('us'))} "
                f"| {_f((r.get('vllm_gemms') or {}).get('us'))} | {_f(r['xla']['us'])} "
                f"| {_f((r.get('ours_other') or {}).get('us'))}"
                f"{' (' + r['other_backend'] + ')' if 'other_backend' in r else ''} "
                f"| {_f(r.get('ratio'), '.2f', 'x')} | {_f(r.get('ratio_gemms'), '.2f', 'x')} "
                f"| {_f(r.get('ratio_xla'), '.2f', 'x')} | {r['bytes']['ours'] / 2**20:.0f} "
                f"| {_f(o['pct_copy'], '.0f', '%')} | {_f(g['pct_copy'], '.0f', '%')} "
                f"| {_f(o['tflops'], '.0f')} | {_f(o['pct_peak'], '.0f', '%')} "
                f"| {_f(g['pct_peak'], '.0f', '%')} | {r['backend']} "
                f"| {_f(r['rel_l2']['ours_vs_reference'], '.1e')} / "
                f"{_f(r['rel_l2'].get('vllm_vs_ours'), '.1e')} |")
        lines.append("")
    if not result["dry_run"]:
        lines += targets(result["rows"]) + [""]
    checks = result.get("vllm_checks") or {}
    if checks:
        lines.append("vLLM against the reference before timing: " + "; ".join(
            f"{f} B={c['batch']}: " + (f"rel-L2 {c['rel_l2']:.1e} (bound {c['bound']})"
                                       if "rel_l2" in c else c.get("err", "?"))
            for f, c in checks.items()) + ".")
    cfgs = sorted({(r["fmt"], r["kind"], r["batch"], r.get("vllm_config"))
                   for r in result["rows"] if r.get("vllm_config")})
    if cfgs:
        lines.append("vLLM kernel configs: " + "; ".join(f"{f} B={b}: {c}"
                                                        for f, _, b, c in cfgs) + ".")
    if result.get("skipped"):
        lines.append("Skipped: " + "; ".join(f"{s['case']} ({s['why']})"
                                             for s in result["skipped"]) + ".")
    return "\n".join(lines) + "\n"


def targets(rows: list) -> list[str]:
    """The issue's speed targets against the rows (ours)."""
    dec = [r["rates"]["ours"]["pct_copy"] for r in rows if r["kind"] == "decode"]
    pre = [r["rates"]["ours"]["pct_peak"] for r in rows
           if r["kind"] == "prefill" and r["batch"] >= 2048]
    rat = [r.get("ratio_gemms") for r in rows if r["fmt"] in VLLM_FORMATS]
    out = ["Targets (issue 49):"]
    if dec:
        out.append(f"- decode >= 70% of copy bandwidth over touched bytes: min {min(dec):.0f}%, "
                   f"{sum(v >= 70 for v in dec)}/{len(dec)} shapes")
    if pre:
        out.append(f"- prefill B >= 2048 >= 50% of the bf16 peak (measured): min {min(pre):.0f}%, "
                   f"{sum(v >= 50 for v in pre)}/{len(pre)} shapes")
    got = [v for v in rat if v]
    if rat:
        out.append(f"- >= 1.0x vLLM (its GEMMs alone): {sum(v >= 1 for v in got)}/{len(rat)} "
                   f"shapes" + (f", geometric mean {geomean(got):.2f}x, min {min(got):.2f}x"
                                if got else "") + (f" ({len(rat) - len(got)} untimed)"
                                                   if len(got) < len(rat) else ""))
    return out


def print_row(r: dict, claims: bool) -> None:
    s = (f"{r['name']}: {r['local_copies']} local copies, {r['touched_experts']} experts; ours "
         f"{r['ours']['us']:.1f} us ({r['backend']}), XLA {r['xla']['us']:.1f} us")
    if "ours_other" in r:
        s += f", {r['other_backend']} kernel {r['ours_other']['us']:.1f} us"
    if claims:
        o = r["rates"]["ours"]
        s += f" [{o['pct_copy']:.0f}% copy, {o['pct_peak']:.0f}% peak]"
    if (r.get("vllm") or {}).get("us"):
        s += (f"; vLLM {r['vllm']['us']:.1f} us (GEMMs {_f(r['vllm_gemms'].get('us'))}) "
              f"ratio {_f(r.get('ratio'), '.2f')}x / {_f(r.get('ratio_gemms'), '.2f')}x")
    elif "vllm_err" in r:
        s += f"; vLLM: {r['vllm_err']}"
    s += f"; rel-L2 {json.dumps({k: float(f'{v:.2e}') for k, v in r['rel_l2'].items()})}"
    print(s, flush=True)


# --------------------------------------------------------------------------- main

def _names(text: str, flag: str, allowed, parser) -> tuple[str, ...]:
    vals = tuple(text.split(","))
    bad = sorted(set(vals) - set(allowed))
    if bad:
        parser.error(f"{flag}: {bad} not among {', '.join(allowed)}")
    return vals


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_common_args(p, reps=50, trials=3)
    p.add_argument("--rounds", type=_common.positive_int, default=2,
                   help="interleaved rounds of every side (default 2)")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma list among decode, prefill")
    p.add_argument("--batches", type=_common.int_list(), default=DECODE_BATCHES,
                   help="decode: comma list of B (default 1,16,64,256)")
    p.add_argument("--prefill-batches", type=_common.int_list(), default=PREFILL_BATCHES,
                   help="prefill: comma list of B (default 2048,4096)")
    p.add_argument("--formats", default=",".join(FORMATS),
                   help="comma list among bf16, mxfp8, block128 (default all)")
    p.add_argument("--vllm-ops", default=".vllm_ops",
                   help="the op folder of `make compare-env` ('' = no vLLM)")
    p.add_argument("--require-vllm", action="store_true",
                   help="fail when vLLM's fused MoE cannot be loaded (default: noted, skipped)")
    p.add_argument("--vllm-python", default=VLLM_PYTHON,
                   help="--dry-run: the Python with torch + triton for vLLM's side (default "
                        "$VLLM_PYTHON or .venv-vllm/bin/python)")
    p.add_argument("--budget-s", type=_common.positive_int, default=None,
                   help="start no new shape after this many seconds (outputs still written)")
    p.add_argument("--dry-run", action="store_true",
                   help="off the GPU: tiny shapes, ours in interpret mode against the reference, "
                        "vLLM in Triton's interpreter (.venv-vllm), json + md (no timing claims)")
    args = p.parse_args(argv)
    args.kinds = _names(args.kinds, "--kinds", KINDS, p)
    args.formats = _names(args.formats, "--formats", FORMATS, p)
    if not _common.ON_GPU and not args.dry_run:
        p.error("no GPU backend: run on the GPU machine, or pass --dry-run")
    return args


def load_vllm(ops_dir: str):
    """(_vllm_timing, _vllm_moe, vLLM's modules, OpTimer) on the GPU."""
    import _vllm_moe as vm
    import _vllm_timing as vt
    return vt, vm, vm.load(ops_dir), vt.OpTimer()


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    dry = args.dry_run
    if dry:
        cases = [c for c in DRY_CASES if c.fmt in args.formats and c.kind in args.kinds]
        reps, trials, rounds = 1, 1, 1
    else:
        cases = all_cases(args.kinds, args.batches, args.prefill_batches, args.formats)
        reps, trials, rounds = args.reps, args.trials, args.rounds
    vllm, vllm_note = None, "not requested"
    if args.vllm_ops and not dry:
        try:
            vllm = load_vllm(args.vllm_ops)
            vllm_note = "loaded"
        except Exception as e:  # noqa: BLE001 - ours are still timed, the JSON says why
            if args.require_vllm:
                raise
            vllm_note = f"not loaded: {type(e).__name__}: {e}"[:400]
    elif args.vllm_ops and dry:
        vllm_note = "Triton interpreter subprocess"
    print(f"vLLM fused MoE: {vllm_note}", flush=True)
    copy = _common.copy_bandwidth(8 << 20 if dry else 2 << 30)
    peak = _common.matmul_peak(256 if dry else 8192, reps=2 if dry else 10,
                               trials=1 if dry else 3)
    print(f"copy bandwidth {copy['copy_Bps'] / 1e12:.3f} TB/s; bf16 matmul "
          f"{peak['flops_per_s'] / 1e12:.1f} TFLOP/s", flush=True)
    d0 = DRY if dry else SERVING
    result = {
        "meta": _common.run_meta(), "copy": copy, "peak": peak, "vllm_ops": vllm_note,
        "dry_run": dry, "nominal_peak_flops": NOMINAL_PEAK, "dims": dataclasses.asdict(d0),
        "shapes": (f"{d0.e} local experts (global ids {d0.first}..{d0.first + d0.e - 1} of "
                   f"{d0.g}), H={d0.h}, I={d0.i}, top-{d0.k}; routing uniform over all {d0.g} "
                   f"experts (~{d0.e / d0.g:.3g} of the copies local; redrawn while none is)"),
        "timing": {"ours": (timer_description("cold", reps) if not dry else
                            "cold L2, wall clock, no pre-roll (dry run)")
                   + f"; median of {rounds} x {trials} samples; XLA command buffers off",
                   "vllm": f"faster of graph (CUDA graph of ({FLUSH_BYTES >> 20} MiB flush; op) "
                           f"replayed {reps} x minus a flush-only graph) and eager ({reps} x "
                           f"(flush x k; op) minus {reps} x flush x k, only where GPU-bound); "
                           f"median of {rounds} x {trials} samples"},
        "agree": AGREE, "reps": reps, "trials": trials, "rounds": rounds, "rows": [],
        "skipped": [], "vllm_checks": {}}
    if vllm is not None:
        result["vllm_versions"] = vllm[0].versions()
    json_path = os.path.join(args.out, "moe.json")
    weights, vw, job = {}, None, None
    if dry and args.vllm_ops:  # vLLM in the interpreter, beside our cases
        weights = {f: make_weights(f, DRY, args.seed) for f in {c.fmt for c in cases}}
        job = start_dry_vllm(dry_vllm_inputs(cases, weights, args.seed),
                             os.path.abspath(args.vllm_ops), args.vllm_python)
    for case in cases:
        if args.budget_s and time.perf_counter() - t_start > args.budget_s:
            result["skipped"].append({"case": case.name, "why": "over --budget-s"})
            print(f"over --budget-s {args.budget_s}: skipped {case.name}", flush=True)
            continue
        if case.fmt not in weights:
            if not dry:
                weights.clear()  # one format's weights on the device at a time
            vw = None
            gc.collect()
            weights[case.fmt] = make_weights(case.fmt, case.dims, args.seed)
            if vllm is not None and case.fmt in VLLM_FORMATS:
                vw = vllm_weights(vllm, weights[case.fmt], case.fmt)
                chk = vllm_reference_check(vllm, weights[case.fmt], vw, case.fmt, case.dims,
                                           args.seed + 7)
                result["vllm_checks"][case.fmt] = chk
                print(f"vLLM {case.fmt} vs the reference at B={CHECK_BATCH}: {chk}", flush=True)
                if not chk["ok"]:
                    vw = None  # not timed
        t0 = time.perf_counter()
        row, ours = bench_case(case, weights[case.fmt], vllm,
                               vw if case.fmt in VLLM_FORMATS else None, reps=reps,
                               trials=trials, rounds=rounds, seed=args.seed,
                               preroll=0 if dry else _common.PREROLL_FLUSHES, warmup=not dry)
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        add_rates(row, copy["copy_Bps"], peak["flops_per_s"], not dry)
        if job is not None:
            row["_ours"] = ours
        result["rows"].append(row)
        print_row(row, claims=not dry)
        _common.write_json(json_path, {**result, "rows": [_public(r) for r in result["rows"]]})
    if job is not None:
        dry_vllm(result, finish_dry_vllm(job))
    result["rows"] = [_public(r) for r in result["rows"]]
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    _common.write_json(json_path, result)
    md = markdown(result)
    print(md)
    with open(os.path.join(args.out, "moe.md"), "w") as f:
        f.write(md)
    bad = disagreements(result)
    if bad:
        print(f"outputs disagree or are not finite: {bad}", file=sys.stderr)
        return 1
    return 0


def _public(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("_")}


def dry_vllm(result: dict, doc: dict) -> None:
    """--dry-run: vLLM's outputs of the interpreter subprocess compared with ours per case."""
    if "err" in doc:
        result["vllm_dry"] = {"err": doc["err"]}
        print(f"vLLM dry run: {doc['err']}", flush=True)
        return
    result["vllm_versions"] = doc["versions"]
    result["vllm_dry"] = {"cases": doc["cases"]}
    for row in result["rows"]:
        key = row["name"].replace(" ", "_")
        if key in doc["outputs"]:
            row["rel_l2"]["vllm_vs_ours"] = rel_l2(doc["outputs"][key], row["_ours"])
            row["vllm_config"] = doc["cases"][key]["config"]
            row["vllm_alignment"] = doc["cases"][key]["alignment"]
    print(f"vLLM dry run: {json.dumps(doc['cases'])}", flush=True)


def disagreements(result: dict) -> list:
    """Rows whose outputs are not finite or miss an agreement bound, vLLM checks that failed,
    and (dry run) a vLLM side that did not run or whose alignment checks failed."""
    bad = []
    for r in result["rows"]:
        e = r["rel_l2"]
        if not r["finite"] or not e["ours_vs_reference"] < AGREE["ours"] \
                or not e["xla_vs_reference"] < AGREE["xla"]:
            bad.append((r["name"], e))
        if "vllm_vs_ours" in e and not e["vllm_vs_ours"] < vllm_bound(r["fmt"]):
            bad.append((r["name"], "vLLM", e["vllm_vs_ours"]))
        if not all((r.get("vllm_alignment") or {}).values()):
            bad.append((r["name"], "vLLM alignment", r["vllm_alignment"]))
    bad += [(f, c) for f, c in result.get("vllm_checks", {}).items() if not c.get("ok")]
    if result["dry_run"] and "err" in (result.get("vllm_dry") or {}):
        bad.append(("vLLM dry run", result["vllm_dry"]["err"][:300]))
    return bad


if __name__ == "__main__":
    sys.exit(main())

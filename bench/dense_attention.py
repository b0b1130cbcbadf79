"""H200 benchmark of dense paged attention (MiniMax-M3's dense layers) against vLLM 0.33.0's
pure-Triton ``unified_attention`` (its TRITON_ATTN backend), both timed as GPU work.

Shapes, per rank: GQA Hq/Hkv 16/1 and 64/4, head dim 128, bf16, pages of 128 keys:
  * decode: B tokens (one per request, B in 1/16/64/256), every request at context L in
    4096/32768/131072 (the token sees all L keys); shapes whose KV cache exceeds
    ``MAX_CACHE_GIB`` are skipped (64/4 B=256 L=131072: 64 GiB);
  * prefill chunk: 2048 tokens of one request after a context C of 0, 30720 and 32768 keys
    (causal: chunk token i sees C + i + 1 keys).
Random bf16 queries and cache, a random page permutation (page 0 the null page). On the same
device buffers (DLPack) in one process:
  * ours: ``pallas_kernels.paged_attention_default.paged_attention_default(q, kv_cache,
    block_table, req_indices, kv_lens, scale=D**-0.5)`` -> (out [T, Hq, D], lse [T, Hq]);
    kv_cache [N, Hkv, 128, 2D] (K then V in the last axis);
  * vLLM: ``unified_attention`` (vllm/v1/attention/ops/triton_unified_attention.py, taken
    from the wheel into .vllm_ops by tools/vllm_compare/vllm_ops.py) called as its
    TRITON_ATTN backend calls it: the backend's KV cache is [N, Hkv, 128, 2D] as ours, and
    key_cache / value_cache [N, 128, Hkv, D] are the views ``kv.transpose(1, 2).split(D, -1)``
    (no copy); cu_seqlens_q, seqused_k, the same block table, causal, no window/softcap; the
    split-K scratch of the backend's builder (16 segments, 128 // Hkv rows: its 3D decode path
    runs for B <= 128 // Hkv, the 2D kernel above and for the chunk).
  * the copy bandwidth (the roofline) in the same process.
Before timing, both outputs are compared (relative L2 of vLLM's against ours; --check-reference
also compares ours with the jnp reference ``paged_attention_reference``).

Per shape: our time, vLLM's, ratio (vLLM / ours, > 1: ours faster), bytes = K + V of the
visible keys per KV head (decode: B*L*Hkv*2D*2; chunk: (C + 2048)*Hkv*2D*2) and % of the copy
bandwidth, FLOPs = 4*T*Hq*D*visible keys (the chunk: summed over its causal rows) and % of the
nominal H200 dense bf16 peak (989 TFLOP/s, not measured), and our XLA kernel count.

Timing (every figure GPU work after a 512 MiB L2 flush, medians over --rounds x --trials):
  * ours: (flush; optimization_barrier; op) looped 10 x inside ONE XLA executable, the GPU's
    global timer read inside it (bench/_common.time_jax, cold L2);
  * vLLM: the faster of a replayed CUDA graph of (flush; op) and eager (flush x k; op), each
    minus its flush-only twin, valid only where GPU-bound (bench/_vllm_timing.py, as
    bench/kernels.py).

Usage (GPU machine, carry .vllm_ops):  python3 bench/dense_attention.py --out DIR
    [--kinds decode,prefill] [--heads 16/1] [--batches 1,16] [--contexts 4096]
    [--chunk-contexts 0,30720]
CPU check of the JAX side (interpret mode, tiny shapes, no vLLM, no timing claims):  --dry-run
Writes DIR/dense_attention.json and DIR/dense_attention.md.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import _common  # noqa: E402  (first: repo root on sys.path, known warnings)
import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _common import (FLUSH_BYTES, KERNEL_COUNT_DOC, compile_op, geomean,  # noqa: E402
                     hlo_kernel_count, rel_l2, time_jax, timer_description)
from kernels import ours_summary, vllm_prepare, vllm_summary, vllm_time  # noqa: E402
from pallas_kernels import PAGE_SIZE  # noqa: E402
from pallas_kernels.paged_attention import paged_attention_reference  # noqa: E402
from pallas_kernels.paged_attention_default import paged_attention_default  # noqa: E402

HEAD_DIM = 128
HEAD_CONFIGS = ((16, 1), (64, 4))
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (4096, 32768, 131072)
CHUNK = 2048
CHUNK_CONTEXTS = (0, 30720, 32768)
KINDS = ("decode", "prefill")
MAX_CACHE_GIB = 60  # skip shapes whose KV cache is larger (the device holds ~78-139 GiB)
PEAK_BF16_FLOPS = 989e12  # nominal H200 (and H100 SXM) dense bf16 tensor-core peak
PEAK_DOC = "nominal H200 dense bf16 peak 989 TFLOP/s (a data-sheet figure, not measured)"
AGREE_REL_L2 = 1e-2  # both sides' outputs (and ours vs the reference) must agree this well
# vLLM TRITON_ATTN backend constants (vllm/v1/attention/backends/triton_attn.py, 0.33.0): the
# builder's split-K threshold MIN_LAUNCH_GRID_SIZE_2D // Hkv (a default CUDA-graph capture
# size already, so unchanged by its capture-size rounding) and NUM_PAR_SOFTMAX_SEGMENTS.
VLLM_MIN_LAUNCH_GRID_SIZE_2D = 128
VLLM_SEGMENTS = 16
VLLM_MAX_3D_QUERY_LEN = 8  # triton_unified_attention.MAX_3D_QUERY_LEN


@dataclasses.dataclass(frozen=True)
class Case:
    """decode: ``batch`` requests of one token each, every request at ``context`` keys (the
    token sees all). prefill: ``tokens`` chunk tokens of one request after ``context`` keys."""
    kind: str
    hq: int
    hkv: int
    context: int
    batch: int = 1
    tokens: int = 1

    @property
    def name(self) -> str:
        if self.kind == "decode":
            return f"decode {self.hq}/{self.hkv} B={self.batch} L={self.context}"
        return f"prefill {self.hq}/{self.hkv} chunk={self.tokens} C={self.context}"

    @property
    def num_tokens(self) -> int:
        return self.batch if self.kind == "decode" else self.tokens

    @property
    def seq_len(self) -> int:
        """Keys per request in the cache (vLLM's seqused_k)."""
        return self.context if self.kind == "decode" else self.context + self.tokens

    @property
    def pages_per_request(self) -> int:
        return -(-self.seq_len // PAGE_SIZE)

    @property
    def num_pages(self) -> int:
        return self.batch * self.pages_per_request + 1  # + the null page 0

    @property
    def cache_bytes(self) -> int:
        return self.num_pages * self.hkv * PAGE_SIZE * 2 * HEAD_DIM * 2

    def kv_lens(self) -> np.ndarray:
        """Visible keys per token ``[T]``."""
        if self.kind == "decode":
            return np.full((self.batch,), self.context, np.int32)
        return (self.context + np.arange(1, self.tokens + 1)).astype(np.int32)

    @property
    def bytes(self) -> int:
        """K and V of the visible keys per KV head, bf16, each read once."""
        return self.batch * self.seq_len * self.hkv * 2 * HEAD_DIM * 2

    @property
    def flops(self) -> int:
        """4 * Hq * D per (token, visible key): QK^T and PV, 2 FLOPs per multiply-add."""
        return 4 * self.hq * HEAD_DIM * int(self.kv_lens().astype(np.int64).sum())


# --dry-run: two tiny cases: decode (M3's GQA group of 16, a partial last page) and a chunk after a
# context (4 query heads over 2 KV heads: the interpreted prefill kernel runs a CTA per head)
DRY_CASES = (Case("decode", 16, 1, 300, batch=2), Case("prefill", 4, 2, 200, tokens=48))


def all_cases(kinds=KINDS, heads=HEAD_CONFIGS, batches=DECODE_BATCHES,
              contexts=DECODE_CONTEXTS, chunk_contexts=CHUNK_CONTEXTS,
              chunk: int = CHUNK) -> list[Case]:
    cases = []
    if "decode" in kinds:
        cases += [Case("decode", hq, hkv, l, batch=b) for hq, hkv in heads for b in batches
                  for l in contexts]
    if "prefill" in kinds:
        cases += [Case("prefill", hq, hkv, c, tokens=chunk) for hq, hkv in heads
                  for c in chunk_contexts]
    return cases


def make_inputs(case: Case, seed: int) -> dict:
    """Random bf16 queries and cache of ``case``; block_table ``[R, P]`` a random permutation
    of pages 1..N-1 (page 0 the null page); req_indices, kv_lens ``[T]``."""
    ks = jax.random.split(jax.random.key(seed), 3)
    perm = jax.random.permutation(ks[0], case.num_pages - 1) + 1
    block_table = perm.reshape(case.batch, case.pages_per_request).astype(jnp.int32)
    kv = jax.random.normal(ks[1], (case.num_pages, case.hkv, PAGE_SIZE, 2 * HEAD_DIM),
                           jnp.bfloat16)
    q = jax.random.normal(ks[2], (case.num_tokens, case.hq, HEAD_DIM), jnp.bfloat16)
    req = (np.arange(case.batch) if case.kind == "decode"
           else np.zeros((case.tokens,))).astype(np.int32)
    return dict(q=q, kv=kv, block_table=block_table, req_indices=jnp.asarray(req),
                kv_lens=jnp.asarray(case.kv_lens()))


def our_attention(x: dict):
    """Ours: (out [T, Hq, D] bf16, lse [T, Hq] f32); compiled on a GPU, the kernels in
    interpret mode elsewhere (``interpret=True``: the default would pick the jnp reference)."""
    return paged_attention_default(x["q"], x["kv"], x["block_table"], x["req_indices"],
                                   x["kv_lens"], scale=HEAD_DIM ** -0.5, **_common.PALLAS_KW)


def reference_attention(x: dict):
    return paged_attention_reference(x["q"], x["kv"], x["block_table"], x["req_indices"],
                                     x["kv_lens"], scale=HEAD_DIM ** -0.5)


# --------------------------------------------------------------------------- vLLM side

def load_unified_attention(ops_dir: str):
    """vLLM's ``unified_attention`` from the ``.vllm_ops`` folder (tools/vllm_compare)."""
    import importlib
    import torch
    from tools.vllm_compare.vllm_ops import DENSE_OPS_PACKAGE, put_on_path
    put_on_path(ops_dir, f"{DENSE_OPS_PACKAGE}/triton_unified_attention.py")
    torch.set_grad_enabled(False)
    return importlib.import_module("vllm.v1.attention.ops.triton_unified_attention"
                                   ).unified_attention


def vllm_path(case: Case) -> str:
    """The kernel vLLM's wrapper launches for ``case`` (its use_3d rule, the backend's scratch
    of ``128 // Hkv`` rows)."""
    threshold = VLLM_MIN_LAUNCH_GRID_SIZE_2D // case.hkv
    q_len = 1 if case.kind == "decode" else case.tokens
    block_q = 16 // (case.hq // case.hkv) if case.hq // case.hkv <= 16 else 1
    use_3d = (q_len <= VLLM_MAX_3D_QUERY_LEN and case.batch * -(-q_len // block_q) <= threshold
              and case.num_tokens <= threshold)
    return (f"3D split-K ({VLLM_SEGMENTS} segments, tile 16) + reduce_segments" if use_3d
            else "2D (tile 32)")


def vllm_args(ua, q, kv, block_table, seq_lens, query_lens, out, *, scale: float):
    """A zero-argument call of vLLM's ``unified_attention`` on torch tensors of our layout, as
    its TRITON_ATTN backend makes it: q ``[T, Hq, D]``, kv ``[N, Hkv, 128, 2D]``, block_table
    ``[R, P]`` int32, seq_lens / query_lens ``[R]`` (python ints), out ``[T, Hq, D]``.
    Returns (call, the tensors it holds)."""
    import torch

    dev, d = q.device, q.shape[-1]
    hq, hkv = q.shape[1], kv.shape[1]
    key_cache, value_cache = kv.transpose(1, 2).split(d, dim=-1)  # [N, 128, Hkv, D] views
    cu = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32,
                      device=dev)
    seqused_k = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    descale = torch.ones((), dtype=torch.float32, device=dev).expand(len(seq_lens), hkv)
    rows = VLLM_MIN_LAUNCH_GRID_SIZE_2D // hkv  # the builder's 3D scratch: threshold x 1 token
    segm_out = torch.empty((rows, hq, VLLM_SEGMENTS, 1 << (d - 1).bit_length()),
                           dtype=torch.float32, device=dev)
    segm_max = torch.empty((rows, hq, VLLM_SEGMENTS), dtype=torch.float32, device=dev)
    segm_sum = torch.empty_like(segm_max)
    held = dict(key_cache=key_cache, value_cache=value_cache, cu=cu, seqused_k=seqused_k,
                descale=descale, segm_out=segm_out, segm_max=segm_max, segm_sum=segm_sum)
    max_q, max_k = int(max(query_lens)), int(max(seq_lens))

    def call():
        ua(q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=cu, max_seqlen_q=max_q,
           seqused_k=seqused_k, max_seqlen_k=max_k, softmax_scale=scale, causal=True,
           window_size=(-1, -1), block_table=block_table, softcap=0, q_descale=None,
           k_descale=descale, v_descale=descale, seq_threshold_3D=rows,
           num_par_softmax_segments=VLLM_SEGMENTS, softmax_segm_output=segm_out,
           softmax_segm_max=segm_max, softmax_segm_expsum=segm_sum)
        return out
    return call, held


def vllm_call(vt, ua, x: dict, case: Case):
    """vLLM's call on our device buffers (DLPack) and the tensors it holds."""
    import torch

    q, kv, bt = vt.to_torch(x["q"]), vt.to_torch(x["kv"]), vt.to_torch(x["block_table"])
    out = torch.empty_like(q)
    query_lens = [1] * case.batch if case.kind == "decode" else [case.tokens]
    call, held = vllm_args(ua, q, kv, bt, [case.seq_len] * case.batch, query_lens, out,
                           scale=HEAD_DIM ** -0.5)
    return call, dict(held, q=q, kv=kv, block_table=bt, out=out)


# --------------------------------------------------------------------------- one case

def bench_case(case: Case, vllm, *, reps: int, trials: int, rounds: int, seed: int,
               check_reference: bool, timing: dict) -> dict:
    """Both sides on the same inputs, outputs compared, then timed interleaved over
    ``rounds``. ``timing``: extra ``time_jax`` keywords (l2, preroll, warmup)."""
    x = make_inputs(case, seed)
    row = {"kind": case.kind, "hq": case.hq, "hkv": case.hkv, "context": case.context,
           "batch": case.batch, "tokens": case.num_tokens, "seq_len": case.seq_len,
           "cache_bytes": case.cache_bytes, "bytes": case.bytes, "flops": case.flops}
    compiled = compile_op(our_attention, x)
    row["kernels"] = hlo_kernel_count(compiled.as_text())
    out, lse = jax.block_until_ready(compiled(x))
    del compiled
    ours_out = np.asarray(out.astype(jnp.float32))
    row["ours_finite"] = bool(np.isfinite(ours_out).all() and np.isfinite(np.asarray(lse)).all())
    if check_reference:
        ref_out, ref_lse = jax.jit(reference_attention)(x)
        row["reference_check"] = {
            "out_rel_l2": rel_l2(ours_out, np.asarray(ref_out.astype(jnp.float32))),
            "lse_rel_l2": rel_l2(np.asarray(lse), np.asarray(ref_lse))}
        del ref_out, ref_lse
    del out, lse

    state = tensors = None
    acc: dict = {}
    if vllm is not None:
        vt, ua, timer = vllm
        row["vllm_kernel"] = vllm_path(case)
        try:
            call, tensors = vllm_call(vt, ua, x, case)
            state = vllm_prepare(vt, timer, {"attention": [("bf16", call)]})
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: the row records it
            row["vllm_err"] = f"{type(e).__name__}: {e}"[:400]
            state = None
        if state is not None and "result" in state["attention"]:
            theirs = tensors["out"].float().cpu().numpy()
            row["rel_l2_vs_vllm"] = rel_l2(theirs, ours_out)
    timings = []
    for _ in range(rounds):  # interleaved: each round times both sides
        timings.append(time_jax(our_attention, (x,), n=reps, trials=trials, **timing))
        if state is not None and "err" not in state["attention"]:
            vllm_time(timer, state, n=reps, trials=trials, acc=acc)
    row["ours"] = ours_summary(timings)
    if state is not None:
        row["vllm"] = vllm_summary(acc, state, timer.flush_us)["attention"]
        if row["vllm"].get("us"):
            row["ratio"] = row["vllm"]["us"] / row["ours"]["us"]
    del state, tensors, x, ours_out
    gc.collect()
    if vllm is not None:
        import torch
        torch.cuda.empty_cache()
    return row


def pct(row: dict, side: str, copy_bps: float, claims: bool = True) -> dict:
    """% of the copy bandwidth (bytes) and of the bf16 peak (FLOPs) of one side's time; all
    None without a time, or without ``claims`` (a dry run)."""
    us = (row.get(side) or {}).get("us")
    if not us or not claims:
        return {"pct_copy": None, "tflops": None, "pct_peak": None}
    s = us * 1e-6
    return {"pct_copy": 100 * row["bytes"] / s / copy_bps,
            "tflops": row["flops"] / s / 1e12,
            "pct_peak": 100 * row["flops"] / s / PEAK_BF16_FLOPS}


# --------------------------------------------------------------------------- output

def _f(v, spec=".1f", unit="", none="n/a") -> str:
    return none if v is None else format(v, spec) + unit


def markdown(result: dict) -> str:
    meta, bw = result["meta"], result["copy"]["copy_Bps"]
    vs, claims = result.get("vllm_versions", {}), not result.get("dry_run")
    lines = [
        f"Date {meta['date']}; device {meta['device']}; jax {meta['jax']}"
        + (f", torch {vs['torch']}, triton {vs['triton']}, vLLM 0.33.0 unified_attention"
           if vs else "")
        + f"; copy bandwidth {bw / 1e12:.2f} TB/s (read + write, same run)"
        + ("; DRY RUN (CPU interpret mode: no timing claims)" if result.get("dry_run") else "")
        + ".", "",
        f"- Ours: {result['timing']['ours']}.",
        f"- vLLM: {result['timing']['vllm']}.",
        f"- Ratio = vLLM time / our time (> 1: ours faster). {KERNEL_COUNT_DOC}; the "
        f"branches of a run-time choice (conditional) all count.",
        f"- Bytes: K + V of the visible keys per KV head (bf16). FLOPs: 4 * T * Hq * D * "
        f"visible keys (causal rows summed for the chunk); % peak of the {PEAK_DOC}.",
        f"- rel-L2: vLLM's output against ours"
        + ("; ref: ours against the jnp reference" if result.get("check_reference") else "")
        + ".", ""]
    decode = [r for r in result["rows"] if r["kind"] == "decode"]
    prefill = [r for r in result["rows"] if r["kind"] == "prefill"]
    ref = lambda r: (f" / {r['reference_check']['out_rel_l2']:.1e}"  # noqa: E731
                     if "reference_check" in r else "")
    if decode:
        lines += ["Decode (one token per request, every request at L keys):", "",
                  "| Hq/Hkv | B | L | ours us | vLLM us | ratio | MiB read | % copy ours | "
                  "% copy vLLM | XLA kernels | vLLM kernel | rel-L2" +
                  (" / ref" if result.get("check_reference") else "") + " |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in decode:
            o, v = pct(r, "ours", bw, claims), pct(r, "vllm", bw, claims)
            lines.append(
                f"| {r['hq']}/{r['hkv']} | {r['batch']} | {r['context']} "
                f"| {_f(r['ours']['us'])} | {_f((r.get('vllm') or {}).get('us'))} "
                f"| {_f(r.get('ratio'), '.2f', 'x')} "
                f"| {r['bytes'] / 2**20:.1f} | {_f(o['pct_copy'], '.0f', '%')} "
                f"| {_f(v['pct_copy'], '.0f', '%')} | {r['kernels']['total']} "
                f"| {r.get('vllm_kernel', '-')} "
                f"| {_f(r.get('rel_l2_vs_vllm'), '.1e')}{ref(r)} |")
    if prefill:
        lines += ["", "Prefill chunk (one request, causal, after a context of C keys):", "",
                  "| Hq/Hkv | chunk | C | ours us | vLLM us | ratio | TFLOP/s ours | % peak ours "
                  "| % peak vLLM | % copy ours | XLA kernels | vLLM kernel | rel-L2" +
                  (" / ref" if result.get("check_reference") else "") + " |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in prefill:
            o, v = pct(r, "ours", bw, claims), pct(r, "vllm", bw, claims)
            lines.append(
                f"| {r['hq']}/{r['hkv']} | {r['tokens']} | {r['context']} "
                f"| {_f(r['ours']['us'])} | {_f((r.get('vllm') or {}).get('us'))} "
                f"| {_f(r.get('ratio'), '.2f', 'x')} "
                f"| {_f(o['tflops'], '.1f')} | {_f(o['pct_peak'], '.1f', '%')} "
                f"| {_f(v['pct_peak'], '.1f', '%')} | {_f(o['pct_copy'], '.0f', '%')} "
                f"| {r['kernels']['total']} | {r.get('vllm_kernel', '-')} "
                f"| {_f(r.get('rel_l2_vs_vllm'), '.1e')}{ref(r)} |")
    for kind, rows in (("decode", decode), ("prefill", prefill)):
        ratios = [r["ratio"] for r in rows if r.get("ratio")]
        if ratios:
            lines.append(f"\n{kind}: geometric-mean ratio {geomean(ratios):.2f}x, min "
                         f"{min(ratios):.2f}x, {sum(x >= 1 for x in ratios)}/{len(ratios)} "
                         f"shapes >= 1.0x.")
    if result.get("skipped"):
        lines.append("\nSkipped: " + "; ".join(f"{s['case']} ({s['why']})"
                                              for s in result["skipped"]) + ".")
    vrows = [r for r in result["rows"] if "vllm" in r or "vllm_err" in r]
    if vrows:
        lines += ["", "vLLM timing per shape: graph and eager medians (us); eager is valid only "
                  "where its host time per iteration < its flush time (GPU-bound).", "",
                  "| shape | graph us | graph host us/replay | eager us | eager host us/iter "
                  "| flush us (x k) | eager GPU-bound | used |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in vrows:
            d = r.get("vllm") or {"err": r.get("vllm_err", "?")}
            if "err" in d:
                lines.append(f"| {r['name']} | error: {d['err'][:80]} | | | | | | |")
                continue
            g, e = d["graph"], d["eager"]
            lines.append(
                f"| {r['name']} | {_f(g.get('us'))} | {g.get('host_us_per_replay', 'n/a')} "
                f"| {_f(e['us'])} | {e['host_us_per_iter']:.1f} "
                f"| {e['flush_us']:.1f} (x{e['flush_repeats']}) "
                f"| {'yes' if e['gpu_bound'] else 'NO'} | {d['method']} |")
    return "\n".join(lines) + "\n"


def print_row(r: dict, copy_bps: float, claims: bool = True) -> None:
    o = r["ours"]
    s = (f"{r['name']}: ours {o['us']:.1f} us [{r['kernels']['total']} XLA kernels"
         f"{'' if o['gpu_bound'] else ': HOST-BOUND'}]")
    p = pct(r, "ours", copy_bps, claims)
    if claims:
        s += (f" {p['pct_copy']:.0f}% copy" if r["kind"] == "decode"
              else f" {p['tflops']:.1f} TFLOP/s ({p['pct_peak']:.1f}% peak)")
    v = r.get("vllm")
    if v and v.get("us"):
        s += (f"; vLLM {v['us']:.1f} us ({v['method']}, {r['vllm_kernel']}) ratio "
              f"{r['ratio']:.2f}x; rel-L2 {r['rel_l2_vs_vllm']:.1e}")
    elif v or "vllm_err" in r:
        s += f"; vLLM: {(v or {}).get('err') or (v or {}).get('method') or r.get('vllm_err')}"
    if "reference_check" in r:
        s += f"; vs the jnp reference {r['reference_check']}"
    print(s, flush=True)


# --------------------------------------------------------------------------- main

def _int_list(text: str, flag: str, parser, minimum: int = 1) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(","))
    except ValueError:
        parser.error(f"{flag}: expected comma-separated integers, got {text!r}")
    if any(v < minimum for v in vals):
        parser.error(f"{flag}: every value must be >= {minimum}, got {text!r}")
    return vals


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_common_args(p, reps=100, trials=3)
    p.add_argument("--rounds", type=_common.positive_int, default=2,
                   help="interleaved rounds of both sides (default 2)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help="comma list among decode, prefill (default both)")
    p.add_argument("--heads", default=",".join(f"{a}/{b}" for a, b in HEAD_CONFIGS),
                   help="comma list of Hq/Hkv (default 16/1,64/4)")
    p.add_argument("--batches", default=",".join(map(str, DECODE_BATCHES)),
                   help="decode: comma list of B (default 1,16,64,256)")
    p.add_argument("--contexts", default=",".join(map(str, DECODE_CONTEXTS)),
                   help="decode: comma list of L (default 4096,32768,131072)")
    p.add_argument("--chunk", type=_common.positive_int, default=CHUNK,
                   help=f"prefill: chunk tokens (default {CHUNK})")
    p.add_argument("--chunk-contexts", default=",".join(map(str, CHUNK_CONTEXTS)),
                   help="prefill: comma list of contexts before the chunk (default 0,30720,32768)")
    p.add_argument("--max-cache-gib", type=_common.positive_int, default=MAX_CACHE_GIB,
                   help=f"skip shapes whose KV cache exceeds this (default {MAX_CACHE_GIB})")
    p.add_argument("--vllm-ops", default=".vllm_ops",
                   help="the op folder of `make compare-env` ('' = ours only)")
    p.add_argument("--require-vllm", action="store_true",
                   help="fail when vLLM's op cannot be loaded (default: ours only, noted)")
    p.add_argument("--check-reference", action="store_true",
                   help="also compare ours with the jnp reference (always on with --dry-run)")
    p.add_argument("--budget-s", type=_common.positive_int, default=None,
                   help="start no new shape after this many seconds (outputs still written)")
    p.add_argument("--dry-run", action="store_true",
                   help="off the GPU: two tiny cases in interpret mode, no vLLM, ours checked "
                        "against the jnp reference, json + md written (no timing claims)")
    args = p.parse_args(argv)
    args.kinds = tuple(args.kinds.split(","))
    if set(args.kinds) - set(KINDS):
        p.error(f"--kinds: {sorted(set(args.kinds) - set(KINDS))} not among {', '.join(KINDS)}")
    heads = []
    for h in args.heads.split(","):
        try:
            hq, hkv = (int(v) for v in h.split("/"))
        except ValueError:
            p.error(f"--heads: expected Hq/Hkv pairs such as 16/1, got {args.heads!r}")
        if hkv < 1 or hq < hkv or hq % hkv:
            p.error(f"--heads: Hq must be a positive multiple of Hkv >= 1, got {h!r}")
        heads.append((hq, hkv))
    args.heads = tuple(heads)
    args.batches = _int_list(args.batches, "--batches", p)
    args.contexts = _int_list(args.contexts, "--contexts", p)
    args.chunk_contexts = _int_list(args.chunk_contexts, "--chunk-contexts", p, minimum=0)
    if not _common.ON_GPU and not args.dry_run:
        p.error("no GPU backend: run on the GPU machine, or pass --dry-run")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    if args.dry_run:
        cases, reps, trials, rounds = list(DRY_CASES), 1, 1, 1
        timing = dict(l2="cold", warmup=False)  # no timing claims: no untimed warm-up call
        check_reference = True
    else:
        cases = all_cases(args.kinds, args.heads, args.batches, args.contexts,
                          args.chunk_contexts, args.chunk)
        reps, trials, rounds = args.reps, args.trials, args.rounds
        timing = dict(l2="cold")
        check_reference = args.check_reference
    vllm, vllm_note = None, "not requested"
    if args.vllm_ops and not args.dry_run:
        try:
            import _vllm_timing as vt
            vllm = (vt, load_unified_attention(args.vllm_ops), vt.OpTimer())
            vllm_note = "loaded"
        except Exception as e:  # noqa: BLE001 - ours are still timed, the JSON says why
            if args.require_vllm:
                raise
            vllm_note = f"not loaded: {type(e).__name__}: {e}"[:400]
    print(f"vLLM unified_attention: {vllm_note}", flush=True)
    copy = _common.copy_bandwidth(8 << 20 if args.dry_run else 2 << 30)
    print(f"copy bandwidth {copy['copy_Bps'] / 1e12:.3f} TB/s ({copy['method']})", flush=True)
    result = {
        "meta": _common.run_meta(), "copy": copy, "vllm_ops": vllm_note,
        "dry_run": args.dry_run, "check_reference": check_reference,
        "peak_bf16_flops": PEAK_BF16_FLOPS, "peak_doc": PEAK_DOC,
        "timing": {
            "ours": timer_description("cold", reps) + f"; median of {rounds} x {trials} samples"
                    + "; XLA command buffers off",
            "vllm": (f"faster of graph (CUDA graph of ({FLUSH_BYTES >> 20} MiB flush; op) "
                     f"replayed {reps} x minus a flush-only graph) and eager ({reps} x "
                     f"(flush x k; op) issued asynchronously minus {reps} x flush x k, used "
                     f"only where host time per iteration < flush time); median of {rounds} x "
                     f"{trials} samples; key/value caches as views of our KV cache, as vLLM's "
                     f"TRITON_ATTN backend makes them"),
            "kernel_count": KERNEL_COUNT_DOC},
        "reps": reps, "trials": trials, "rounds": rounds, "rows": [], "skipped": []}
    if vllm is not None:
        result["vllm_versions"] = vllm[0].versions()
        result["vllm_flush_us"] = vllm[2].flush_us
    json_path = os.path.join(args.out, "dense_attention.json")
    for case in cases:
        if case.cache_bytes > args.max_cache_gib << 30:
            result["skipped"].append({"case": case.name, "why": f"KV cache "
                                      f"{case.cache_bytes / 2**30:.1f} GiB > "
                                      f"{args.max_cache_gib} GiB"})
            print(f"skipped {case.name}: {result['skipped'][-1]['why']}", flush=True)
            continue
        if args.budget_s and time.perf_counter() - t_start > args.budget_s:
            result["skipped"].append({"case": case.name, "why": "over --budget-s"})
            print(f"over --budget-s {args.budget_s}: skipped {case.name}", flush=True)
            continue
        t0 = time.perf_counter()
        row = bench_case(case, vllm, reps=reps, trials=trials, rounds=rounds, seed=args.seed,
                         check_reference=check_reference, timing=timing)
        row = {"name": case.name, **row, "wall_s": round(time.perf_counter() - t0, 1)}
        row["rates"] = {side: pct(row, side, copy["copy_Bps"], not args.dry_run)
                        for side in ("ours", "vllm")}
        result["rows"].append(row)
        print_row(row, copy["copy_Bps"], claims=not args.dry_run)
        _common.write_json(json_path, result)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    _common.write_json(json_path, result)
    md = markdown(result)
    print(md)
    with open(os.path.join(args.out, "dense_attention.md"), "w") as f:
        f.write(md)
    bad = [(r["name"], r.get("rel_l2_vs_vllm"), r.get("reference_check"))
           for r in result["rows"]
           if not r["ours_finite"]
           or not r.get("rel_l2_vs_vllm", 0.0) < AGREE_REL_L2
           or not (r.get("reference_check") or {}).get("out_rel_l2", 0.0) < AGREE_REL_L2]
    if bad:
        print(f"outputs disagree (rel L2 >= {AGREE_REL_L2}) or are not finite: {bad}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

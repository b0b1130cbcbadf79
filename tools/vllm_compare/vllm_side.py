"""The vLLM side of the comparison: vLLM 0.33.0's MiniMax-M3 Triton ops on given inputs.

Imports only numpy, torch and the op folder built by ``tools/vllm_compare/vllm_ops.py`` (no
jax), so it runs in the comparison venv (Python 3.11, CPU torch, Triton interpreter) or
in any Python that has torch + triton (the GPU machine). Run by path, as a subprocess of
``tools.vllm_compare.compare``:

    python tools/vllm_compare/vllm_side.py --ops-dir .vllm_ops --cases DIR [--device cuda]
        [--names a,b] [--time-iters N]

For each ``DIR/<name>.in.npz`` it writes ``DIR/<name>.vllm.npz`` (selection, output, times)
or, when the ops raise, ``DIR/<name>.vllm.json`` with the error; it never stops at a
failing case. On CPU set ``TRITON_INTERPRET=1`` and ``CUDA_VISIBLE_DEVICES=""`` first.

Case input arrays (bf16 travel as their uint16 bit patterns, float8_e4m3fn as uint8):
  mode            'decode' (uniform query length per request) or 'prefill'
  index_dtype     'bf16' (u16 index arrays) or 'fp8_e4m3' (u8: vLLM's fp8 indexer path,
                  an e4m3 x e4m3 dot); absent = 'bf16'
  index_q  u16|u8 [T, Hkv, Di]      index queries (one index head per KV head)
  index_k  u16|u8 [N, 128, Di]      index-K cache
  q        u16    [T, Hq, D]        queries, Hq = 16 * Hkv
  kv       u16    [N, Hkv, 128, 2D] KV cache (K then V in the last axis)
  block_table i32 [R, P];  seq_lens i32 [R];  query_lens i32 [R];  scale f32 []
Outputs: selected i32 [T, Hkv, 16] (vLLM's [Hkv, T, 16] transposed, -1 padded),
out u16 [T, Hq, D] (bf16 bits), times_us {indexer, attention} medians (GPU only).

``load_vllm_ops(ops_dir)`` is importable (torch-only) for in-process timing elsewhere.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import sys
import time
import traceback
from typing import Callable, NamedTuple

import numpy as np
import torch

_REPO = str(pathlib.Path(__file__).resolve().parents[2])
if _REPO not in sys.path:  # run as a script from the .venv-vllm
    sys.path.insert(0, _REPO)
from tools.vllm_compare.vllm_ops import OPS_PACKAGE, put_on_path  # noqa: E402

TOPK = 16
INIT_BLOCKS = 0
LOCAL_BLOCKS = 1


class VllmOps(NamedTuple):
    """vLLM 0.33.0's MiniMax-M3 op entry points (signatures as in the wheel)."""

    index_decode: Callable  # (idx_q, index_k, block_table, seq_lens, max_seq_len, topk, init, local, Hkv, q_len, max_q_len)
    index_score: Callable  # (idx_q, index_k, block_table, cu_seqlens_q, seq_lens, prefix_lens, max_q, max_seq, Hkv)
    index_topk: Callable  # (score, cu_seqlens_q, prefix_lens, max_q, topk, init, local)
    sparse_attn_decode: Callable  # (q, kv, topk_idx, block_table, seq_lens, Hkv, scale, out, q_len)
    sparse_attn: Callable  # (q, kv, topk_idx, block_table, cu_q, seq_lens, prefix_lens, max_q, Hkv, scale, out)


def load_vllm_ops(ops_dir: str | os.PathLike) -> VllmOps:
    """Import the two vLLM op modules from ``ops_dir`` (built by vllm_ops.py)."""
    put_on_path(ops_dir, f"{OPS_PACKAGE}/index_topk.py")
    it = importlib.import_module("vllm.models.minimax_m3.common.ops.index_topk")
    sa = importlib.import_module("vllm.models.minimax_m3.common.ops.sparse_attn")
    return VllmOps(it.minimax_m3_index_decode, it.minimax_m3_index_score, it.minimax_m3_index_topk,
                   sa.minimax_m3_sparse_attn_decode, sa.minimax_m3_sparse_attn)


def bf16_from_bits(bits: np.ndarray, device: str) -> torch.Tensor:
    """uint16 bit patterns -> a bf16 torch tensor on ``device``."""
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16).to(device)


def fp8_from_bits(bits: np.ndarray, device: str) -> torch.Tensor:
    """uint8 bit patterns -> a float8_e4m3fn torch tensor on ``device``."""
    return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.float8_e4m3fn).to(device)


def index_from_bits(bits: np.ndarray, index_dtype: str, device: str) -> torch.Tensor:
    """Index-K / index-query bits -> a torch tensor in ``index_dtype`` ('bf16' | 'fp8_e4m3')."""
    want = {"bf16": np.uint16, "fp8_e4m3": np.uint8}.get(index_dtype)
    if want is None or bits.dtype != want:
        raise ValueError(f"index arrays must be {want} bits for index_dtype {index_dtype!r}, "
                         f"got {bits.dtype}")
    return bf16_from_bits(bits, device) if index_dtype == "bf16" else fp8_from_bits(bits, device)


def bits_from_bf16(x: torch.Tensor) -> np.ndarray:
    """A bf16 torch tensor -> its uint16 bit patterns (numpy, host)."""
    return x.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def _median_us(fn: Callable[[], None], device: str, iters: int, warmup: int = 3) -> float:
    """Median wall time of one call (synchronised), microseconds."""
    for _ in range(warmup):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6)
    return float(np.median(samples))


def run_case(ops: VllmOps, case: dict, device: str = "cpu", time_iters: int = 0) -> dict:
    """Run vLLM's indexer + sparse attention on one case; see the module docstring."""
    mode = str(case["mode"])
    hkv = int(case["index_q"].shape[1])
    scale = float(case["scale"])
    index_dtype = str(case["index_dtype"]) if "index_dtype" in case else "bf16"
    iq = index_from_bits(case["index_q"], index_dtype, device)
    ik = index_from_bits(case["index_k"], index_dtype, device)
    q = bf16_from_bits(case["q"], device)
    kv = bf16_from_bits(case["kv"], device)
    bt = torch.from_numpy(case["block_table"].astype(np.int32)).to(device)
    seq_lens_np = case["seq_lens"].astype(np.int32)
    q_lens_np = case["query_lens"].astype(np.int32)
    seq_lens = torch.from_numpy(seq_lens_np).to(device)
    max_seq = int(seq_lens_np.max())
    out = torch.empty_like(q)

    if mode == "decode":
        q_len = int(q_lens_np[0])
        if not (q_lens_np == q_len).all():
            raise ValueError(f"decode needs one query length for all requests, got {q_lens_np}")

        def indexer():
            return ops.index_decode(iq, ik, bt, seq_lens, max_seq, TOPK, INIT_BLOCKS, LOCAL_BLOCKS,
                                    hkv, q_len, q_len)

        def attention(sel):
            ops.sparse_attn_decode(q, kv, sel, bt, seq_lens, hkv, scale, out, q_len)
    elif mode == "prefill":
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens_np)]).astype(np.int32)).to(device)
        prefix = torch.from_numpy((seq_lens_np - q_lens_np).astype(np.int32)).to(device)
        max_q = int(q_lens_np.max())

        def indexer():
            score = ops.index_score(iq, ik, bt, cu, seq_lens, prefix, max_q, max_seq, hkv)
            return ops.index_topk(score, cu, prefix, max_q, TOPK, INIT_BLOCKS, LOCAL_BLOCKS)

        def attention(sel):
            ops.sparse_attn(q, kv, sel, bt, cu, seq_lens, prefix, max_q, hkv, scale, out)
    else:
        raise ValueError(f"mode must be 'decode' or 'prefill', got {mode!r}")

    t0 = time.perf_counter()
    sel = indexer()
    attention(sel)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    result = {
        "selected": sel.permute(1, 0, 2).contiguous().cpu().numpy().astype(np.int32),
        "out": bits_from_bf16(out),
        "wall_s": np.float64(time.perf_counter() - t0),
    }
    if time_iters > 0:
        result["indexer_us"] = np.float64(_median_us(indexer, device, time_iters))
        result["attention_us"] = np.float64(_median_us(lambda: attention(sel), device, time_iters))
    return result


class _OneLineErrorParser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = _OneLineErrorParser(description="Run vLLM 0.33.0's MiniMax-M3 ops on comparison cases.")
    ap.add_argument("--ops-dir", required=True)
    ap.add_argument("--cases", required=True, help="folder of <name>.in.npz files")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--time-iters", type=_non_negative_int, default=0,
                    help="timed calls per op (GPU), >= 0; 0 = no timing")
    ap.add_argument("--names", default=None, help="comma-separated case names to run (default: all)")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("CPU runs need TRITON_INTERPRET=1 (Triton's interpreter)")
    folder = pathlib.Path(args.cases)
    try:
        ops, load_error = load_vllm_ops(args.ops_dir), None
    except Exception as exc:  # every case then reports it
        ops, load_error = None, exc
    wanted = None if args.names is None else set(args.names.split(","))
    for path in sorted(folder.glob("*.in.npz")):
        name = path.name[: -len(".in.npz")]
        if wanted is not None and name not in wanted:
            continue
        try:
            if load_error is not None:
                raise load_error
            with np.load(path, allow_pickle=False) as z:
                case = {k: z[k] for k in z.files}
            result = run_case(ops, case, args.device, args.time_iters)
            np.savez(folder / f"{name}.vllm.npz", **result)
            print(f"vllm-side {name}: ok ({float(result['wall_s']):.1f} s)", flush=True)
        except Exception as exc:  # reported per case; the caller fails the case
            (folder / f"{name}.vllm.json").write_text(json.dumps(
                {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}))
            print(f"vllm-side {name}: ERROR {type(exc).__name__}: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

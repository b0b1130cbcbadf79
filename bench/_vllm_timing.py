"""Timing of vLLM 0.33.0's MiniMax-M3 ops as GPU work (torch; imported only for the vLLM side).

vLLM serves these ops inside CUDA graphs, so its Python launch time is not part of a serving
step. Two timings of an op, both against the same flush as ours (``FLUSH_BYTES``,
``buf.add_(1)``: read + write):

- graph: a CUDA graph holding (flush; op), replayed ``n`` times, minus a flush-only graph
  replayed ``n`` times; CUDA events around each replay loop.
- eager: ``n`` x (flush x k; op) issued asynchronously, minus ``n`` x (flush x k); CUDA events
  around each loop. k (the flush repeats) is chosen so that the flush outlasts the op's host
  launch time; the samples are valid only where the measured host time per iteration stayed
  below the GPU time of its flush (``gpu_bound``), so the queue never drained.

The op's figure is the faster of the valid ones (kernels.best_valid).
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from _common import FLUSH_BYTES, no_gc

_FP8 = {jnp.dtype(jnp.float8_e4m3fn): torch.float8_e4m3fn}


def load_ops(ops_dir: str):
    """vLLM's op entry points from the carried ``.vllm_ops`` folder (tools.vllm_compare)."""
    from tools.vllm_compare.vllm_side import load_vllm_ops
    torch.set_grad_enabled(False)
    return load_vllm_ops(ops_dir)


def versions() -> dict:
    import triton
    return {"torch": torch.__version__, "triton": triton.__version__}


def to_torch(a: jax.Array) -> torch.Tensor:
    """The same device buffer as a torch tensor (DLPack); fp8 travels as its uint8 bits (a
    bit-exact copy), since DLPack does not carry float8."""
    a = jax.block_until_ready(a)
    if a.dtype in _FP8:
        bits = jax.block_until_ready(jax.lax.bitcast_convert_type(a, jnp.uint8))
        return torch.from_dlpack(bits).view(_FP8[a.dtype])
    return torch.from_dlpack(a)


class OpTimer:
    """Graph and eager GPU-bound timing of torch ops on the current CUDA device."""

    def __init__(self):
        self.buf = torch.zeros(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
        self.flush_us = self._flush_gpu_us()

    def flush(self, times: int = 1) -> None:
        for _ in range(times):
            self.buf.add_(1.0)

    def _events(self):
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def _flush_gpu_us(self) -> float:
        self.flush(3)
        start, end = self._events()
        start.record()
        self.flush(20)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / 20

    def host_us(self, op: Callable[[], object], n: int = 20) -> float:
        """Host time per eager call of ``op`` while the GPU is kept busy (a long flush first,
        so the launches never wait for a full queue)."""
        torch.cuda.synchronize()
        self.flush(max(1, n // 2))
        t0 = time.perf_counter()
        for _ in range(n):
            op()
        host = (time.perf_counter() - t0) / n
        torch.cuda.synchronize()
        return host * 1e6

    def capture(self, op: Callable[[], object]) -> dict:
        """Warm-up (compiles, autotunes) on a side stream, then the two graphs."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.flush()
                op()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g_op, g_flush = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_op):
            self.flush()
            op()
        with torch.cuda.graph(g_flush):
            self.flush()
        torch.cuda.synchronize()
        return {"op": g_op, "flush": g_flush}

    def _loop(self, step: Callable[[], None], n: int) -> tuple[float, float]:
        """(GPU seconds, host seconds) of n async steps between two CUDA events."""
        start, end = self._events()
        torch.cuda.synchronize()
        with no_gc():
            start.record()
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            host = time.perf_counter() - t0
            end.record()
            end.synchronize()
        return start.elapsed_time(end) * 1e-3, host

    def time_graph(self, graphs: dict, *, n: int, trials: int) -> dict:
        samples, host = [], []
        for _ in range(trials):
            t_op, h_op = self._loop(graphs["op"].replay, n)
            t_fl, _ = self._loop(graphs["flush"].replay, n)
            samples.append(max((t_op - t_fl) / n, 1e-9))
            host.append(h_op / n)
        host_us = statistics.median(host) * 1e6
        return {"samples_s": samples, "host_us_per_replay": host_us,
                "gpu_bound": host_us < self.flush_us}

    def time_eager(self, op: Callable[[], object], *, n: int, trials: int,
                   host_us: float) -> dict:
        """n x (flush x k; op) minus n x (flush x k), k so the flush outlasts 1.5x the host
        time per call; gpu_bound: the host issued each iteration faster than its flush ran."""
        k = max(1, math.ceil(1.5 * host_us / self.flush_us))

        def with_op():
            self.flush(k)
            op()

        samples, host = [], []
        for _ in range(trials):
            t_op, h_op = self._loop(with_op, n)
            t_fl, _ = self._loop(lambda: self.flush(k), n)
            samples.append(max((t_op - t_fl) / n, 1e-9))
            host.append(h_op / n)
        host_iter_us = statistics.median(host) * 1e6
        return {"samples_s": samples, "flush_repeats": k, "flush_us": k * self.flush_us,
                "host_us_per_iter": host_iter_us, "op_host_us": host_us,
                "gpu_bound": host_iter_us < k * self.flush_us}


def transpose_selection(sel: torch.Tensor) -> np.ndarray:
    """vLLM's [Hkv, B, 16] selection as numpy [B, Hkv, 16]."""
    return sel.permute(1, 0, 2).contiguous().cpu().numpy().astype(np.int32)

"""vLLM 0.33.0's pure-Triton fused MoE on one expert-parallel rank, as its ``TritonExperts``
(vllm/model_executor/layers/fused_moe/experts/triton_moe.py, no LoRA) runs MiniMax-M3's routed
experts; torch only (no jax), so it also runs in the ``.venv-vllm`` under Triton's interpreter.

The sequence of one call (vLLM's functions from ``.vllm_ops``, built by
tools/vllm_compare/vllm_ops.py; the CUDA ops are stand-ins of ours, see there):

  1. ``moe_kernel_quantize_input``: fp8 w8a8 only, x -> e4m3 with one f32 scale per 128
     inputs of a token (``per_token_group_quant_fp8``; stand-in Triton kernel);
  2. ``_prepare_expert_assignment`` -> ``moe_align_block_size`` with the rank's
     ``expert_map`` and ``ignore_invalid_experts`` (other ranks' copies dropped; the CUDA op's
     stand-in is torch);
  3. ``invoke_fused_moe_triton_kernel`` (``fused_moe_kernel``): x @ w1^T -> cache1
     [M, top_k, 2I] bf16;
  4. ``apply_moe_activation(SWIGLUOAI_UNINTERLEAVE)`` (gate | up halves, clamp 7, alpha
     1.702, up + 1; ``torch.ops._C.silu_and_mul_with_clamp``, stand-in Triton kernel) ->
     cache2 [M * top_k, I] bf16, then (fp8) quantized as in 1;
  5. ``fused_moe_kernel`` again: cache2 @ w2^T times the routing weight -> cache3
     [M, top_k, H] bf16;
  6. ``moe_sum`` skipping the slots of other ranks' experts (stand-in Triton kernel) -> out
     [M, H] bf16.

The kernel configuration is vLLM's (``try_get_optimal_moe_config``: a tuned JSON of the wheel
for (E, N, device, dtype) when there is one, else ``get_default_config``). Buffers are
allocated once (vLLM's workspaces), so a call launches kernels only.

Script use (bench/moe.py --dry-run): ``python bench/_vllm_moe.py --ops-dir D --inputs IN.npz
--out OUT.npz`` runs every case of IN.npz on the CPU (TRITON_INTERPRET=1 set by the caller)
and writes each case's output and alignment checks.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import numpy as np
import torch

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # run as a script from the .venv-vllm
    sys.path.insert(0, _REPO)
from tools.vllm_compare.vllm_ops import MOE_PACKAGE, put_on_path  # noqa: E402

MOE_MEMBER = f"{MOE_PACKAGE}/fused_moe.py"
BLOCK_SHAPE = [128, 128]  # vLLM's w8a8 block quantization of the fp8 checkpoints
SWIGLU_BETA = 1.0  # MiniMax-M3's swigluoai: (clamp(up) + 1) * ...


def load(ops_dir: str) -> dict:
    """vLLM's fused-MoE modules from the ``.vllm_ops`` folder: {"fused_moe", "activation",
    "utils", "ops", "tl"}."""
    put_on_path(ops_dir, MOE_MEMBER)
    torch.set_grad_enabled(False)
    pkg = "vllm.model_executor.layers.fused_moe"
    return {"fused_moe": importlib.import_module(f"{pkg}.fused_moe"),
            "activation": importlib.import_module(f"{pkg}.activation"),
            "utils": importlib.import_module(f"{pkg}.utils"),
            "ops": importlib.import_module("vllm._custom_ops"),
            "tl": importlib.import_module("vllm.triton_utils").tl}


def expert_map(num_global: int, first: int, num_local: int, device) -> torch.Tensor:
    """int32 [num_global]: global id -> local id on this rank, -1 elsewhere (vLLM's)."""
    m = torch.full((num_global,), -1, dtype=torch.int32, device=device)
    m[first:first + num_local] = torch.arange(num_local, dtype=torch.int32, device=device)
    return m


class FusedMoe:
    """One rank's routed experts on vLLM's fused MoE, for fixed inputs (module docstring).

    x [M, H] bf16; w1 [E, 2I, H] (gate rows then up rows; bf16, or e4m3 with w1_scale f32
    [E, 2I/128, H/128]); w2 [E, H, I] (bf16, or e4m3 with w2_scale [E, H/128, I/128]);
    topk_weights [M, k] f32; topk_ids [M, k] int32 (global ids); emap [G] int32 (see
    :func:`expert_map`). ``fp8``: vLLM's w8a8 block path (activations quantized too).
    ``call()`` runs the whole sequence into ``self.out`` [M, H] bf16; ``gemms()`` only its two
    ``fused_moe_kernel`` launches on the buffers of the last ``call()``.
    """

    def __init__(self, mods: dict, x, w1, w2, topk_weights, topk_ids, emap, *, fp8: bool,
                 alpha: float, limit: float, w1_scale=None, w2_scale=None):
        fm, act = mods["fused_moe"], mods["activation"]
        self.mods, self.fp8 = mods, fp8
        self.x, self.w1, self.w2, self.w1_scale, self.w2_scale = x, w1, w2, w1_scale, w2_scale
        self.topk_weights, self.topk_ids, self.emap = topk_weights, topk_ids, emap
        m, top_k = topk_ids.shape
        e, n, _ = w1.shape
        h = w2.shape[1]
        self.top_k, self.n = top_k, n
        self.block_shape = BLOCK_SHAPE if fp8 else None
        self.quant_dtype = torch.float8_e4m3fn if fp8 else None
        self.config = fm.try_get_optimal_moe_config(
            tuple(w1.shape), tuple(w2.shape), top_k, "fp8_w8a8" if fp8 else None, m,
            block_shape=self.block_shape)
        self.activation = act.MoEActivation.SWIGLUOAI_UNINTERLEAVE
        self.activation_config = act.ApplyMoEActivationConfig(
            clamp_limit=float(limit), alpha=float(alpha), beta=SWIGLU_BETA)
        dev, dt = x.device, x.dtype
        self.cache1 = torch.empty((m, top_k, n), dtype=dt, device=dev)
        self.cache2 = torch.empty((m * top_k, n // 2), dtype=dt, device=dev)
        self.cache3 = torch.empty((m, top_k, h), dtype=dt, device=dev)
        self.out = torch.empty((m, h), dtype=dt, device=dev)
        self.num_global = emap.shape[0]
        self.assignment = self.qx = self.q2 = None
        self._gemm_inputs = None

    def _gemm(self, a, a_scale, w, w_scale, c, weights, top_k: int, assignment=None) -> None:
        sorted_ids, expert_ids, ntpp = assignment or self.assignment
        self.mods["fused_moe"].invoke_fused_moe_triton_kernel(
            a, w, c, a_scale, w_scale, weights, sorted_ids, expert_ids, ntpp,
            weights is not None, top_k, self.config, compute_type=self.mods["tl"].bfloat16,
            use_fp8_w8a8=self.fp8, use_int8_w8a8=False, use_int8_w8a16=False,
            use_int4_w4a16=False, per_channel_quant=False, block_shape=self.block_shape,
            B_bias=None)

    def _quantize(self, a):
        return self.mods["utils"].moe_kernel_quantize_input(a, None, self.quant_dtype, False,
                                                            self.block_shape)

    def call(self) -> torch.Tensor:
        fm, act = self.mods["fused_moe"], self.mods["activation"]
        m = self.x.shape[0]
        self.qx = self._quantize(self.x)
        self.assignment = fm._prepare_expert_assignment(
            self.topk_ids, self.config, m, self.top_k, self.num_global, self.emap,
            block_shape=self.block_shape, ignore_invalid_experts=True)
        self._gemm(*self.qx, self.w1, self.w1_scale, self.cache1, None, self.top_k)
        act.apply_moe_activation(self.activation, self.cache2, self.cache1.view(-1, self.n),
                                 activation_config=self.activation_config)
        self.q2 = self._quantize(self.cache2)
        self._gemm(*self.q2, self.w2, self.w2_scale, self.cache3, self.topk_weights, 1)
        self.mods["ops"].moe_sum(self.cache3, self.out, self.topk_ids, self.emap)
        return self.out

    def gemms(self) -> torch.Tensor:
        """The two ``fused_moe_kernel`` launches alone, on copies (taken at the first call,
        owned here, so a captured graph of this never reads freed memory) of the quantized
        inputs and the assignment of the last :meth:`call`."""
        if self._gemm_inputs is None:
            if self.assignment is None:
                raise RuntimeError("FusedMoe.gemms: call() first")
            keep = lambda ts: tuple(None if t is None else t.clone() for t in ts)  # noqa: E731
            self._gemm_inputs = (keep(self.qx), keep(self.q2), keep(self.assignment))
        qx, q2, assignment = self._gemm_inputs
        self._gemm(*qx, self.w1, self.w1_scale, self.cache1, None, self.top_k, assignment)
        self._gemm(*q2, self.w2, self.w2_scale, self.cache3, self.topk_weights, 1, assignment)
        return self.cache3

    def grid_note(self) -> str:
        """The kernel configuration, one line (for the outputs)."""
        c = self.config
        return (f"BLOCK_M/N/K {c['BLOCK_SIZE_M']}/{c['BLOCK_SIZE_N']}/{c['BLOCK_SIZE_K']}, "
                f"GROUP_M {c['GROUP_SIZE_M']}, warps {c.get('num_warps')}, stages "
                f"{c.get('num_stages')}")


def alignment_checks(sorted_ids: np.ndarray, expert_ids: np.ndarray, ntpp: int,
                     topk_ids: np.ndarray, emap: np.ndarray, block: int) -> dict:
    """vLLM's moe_align_block_size contract on the stand-in's outputs: every local copy
    exactly once, in a block of its own (local) expert; the rest padding (= numel); ntpp a
    multiple of ``block``, each expert's blocks contiguous, no block for an untouched expert."""
    flat = topk_ids.reshape(-1)
    n = flat.size
    local = emap[flat]
    want = {int(i) for i in np.flatnonzero(local >= 0)}
    used = sorted_ids[:ntpp]
    copies = used[used < n]
    ok_once = sorted(copies.tolist()) == sorted(want)
    blocks = expert_ids[:ntpp // block]
    ok_expert = all(int(blocks[p // block]) == int(local[int(c)])
                    for p, c in enumerate(used) if c < n)
    ok_tail = bool((sorted_ids[ntpp:] == n).all())
    touched = sorted({int(v) for v in local[local >= 0]})
    runs = [int(b) for i, b in enumerate(blocks) if i == 0 or b != blocks[i - 1]]
    return {"copies_once": ok_once, "right_expert": ok_expert, "tail_is_padding": ok_tail,
            "ntpp_multiple": ntpp % block == 0, "blocks_by_expert": runs == touched}


# --------------------------------------------------------------------------- script (dry run)

def _tensor(a: np.ndarray, kind: str) -> torch.Tensor:
    """npz arrays: bf16 travels as float32 (exact), e4m3 as its uint8 bits."""
    if kind == "bf16":
        return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(torch.bfloat16)
    if kind == "fp8":
        return torch.from_numpy(np.ascontiguousarray(a, np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(np.ascontiguousarray(a))


def run_cases(ops_dir: str, inputs: str, out: str) -> dict:
    """Each case ``c`` of IN.npz (keys ``c/x``, ``c/w1``, ...; ``c/meta`` a JSON string) on
    the CPU; OUT.npz gets ``c/out`` f32, and the returned dict per case the config and the
    alignment checks."""
    mods = load(ops_dir)
    data = np.load(inputs)
    names = sorted({k.split("/")[0] for k in data.files})
    outputs, report = {}, {}
    for c in names:
        meta = json.loads(str(data[f"{c}/meta"]))
        fp8 = meta["fp8"]
        wk = "fp8" if fp8 else "bf16"
        sc = (lambda k: _tensor(data[f"{c}/{k}"], "raw")) if fp8 else (lambda k: None)
        emap = _tensor(data[f"{c}/emap"], "raw")
        moe = FusedMoe(mods, _tensor(data[f"{c}/x"], "bf16"), _tensor(data[f"{c}/w1"], wk),
                       _tensor(data[f"{c}/w2"], wk), _tensor(data[f"{c}/topk_weights"], "raw"),
                       _tensor(data[f"{c}/topk_ids"], "raw"), emap, fp8=fp8,
                       alpha=meta["alpha"], limit=meta["limit"], w1_scale=sc("w1_scale"),
                       w2_scale=sc("w2_scale"))
        outputs[f"{c}/out"] = moe.call().float().numpy()
        sorted_ids, expert_ids, ntpp = (t.numpy() for t in moe.assignment)
        report[c] = {"config": moe.grid_note(), "alignment": alignment_checks(
            sorted_ids, expert_ids, int(ntpp[0]), data[f"{c}/topk_ids"], emap.numpy(),
            moe.config["BLOCK_SIZE_M"])}
    np.savez(out, **outputs)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="vLLM's fused MoE on the cases of an npz (CPU)")
    p.add_argument("--ops-dir", required=True)
    p.add_argument("--inputs", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    report = run_cases(args.ops_dir, args.inputs, args.out)
    print(json.dumps({"versions": {"torch": torch.__version__,
                                   "triton": importlib.import_module("triton").__version__},
                      "cases": report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Our decode's time at one shape as the process takes on vLLM's side, stage by stage (GPU).

The run of record times our 16/1 B=128 decode 0.4-0.5 us slower than a process without
vLLM's ops does. This script times the same compiled op in one process after each step that
`bench/kernels.py` takes on the torch side, and once more on inputs allocated after them:

  jax          inputs, selection and the compiled decode, nothing of torch;
  torch_init   torch imported and its CUDA context made;
  torch_flush  vLLM timing's 512 MiB torch flush buffer allocated and timed;
  vllm_ops     vLLM's ops loaded;
  vllm_graph   our inputs shared with torch (DLPack), vLLM's decode run and its graphs captured;
  vllm_timed   one round of vLLM's graph and eager timing;
  new_inputs   fresh inputs and selection allocated now (other device addresses);
  torch_freed  vLLM's graphs and torch's tensors dropped, torch's cache emptied;
  idle         after --idle-s seconds idle.

With --sequence stress, no vLLM, only load: jax, then after --stress-s of back-to-back
JAX copies (stress_jax), after --idle-s idle (idle), after as long a torch add_ loop
(stress_torch), and idle again (idle_again): whether the device's state, not vLLM, costs the
time. Every stage also measures the copy bandwidth (bench/_common.copy_bandwidth).

With --torch-first, torch's context, its flush buffer and vLLM's ops come before our inputs
(as in `bench/kernels.py`), and the first stage is named torch_first.

Each stage: --trials samples of --reps calls (bench/_common.time_jax, cold L2), the flush-only
loop's time, and the GPU clocks nvidia-smi reads. Usage (GPU, carry .vllm_ops):
  python3 bench/process_state.py --out DIR [--shape 6] [--repeat 2] [--torch-first]
  [--sequence vllm|stress]
Writes DIR/process_state.json.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import _common  # noqa: E402  (first: repo root on sys.path, known warnings)
import argparse  # noqa: E402
import gc  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from _shapes_inputs import all_shapes, make_inputs, our_decode, our_indexer  # noqa: E402


def gpu_clocks() -> str:
    """nvidia-smi's SM and memory clocks, temperature and power, or why they are missing."""
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable: {type(e).__name__}"


def busy(step, seconds: float, sync) -> int:
    """Calls ``step`` back to back for ``seconds`` (synchronising every 20 calls); the count."""
    t_end, calls = time.perf_counter() + seconds, 0
    while time.perf_counter() < t_end:
        for _ in range(20):
            step()
        sync()
        calls += 20
    return calls


def inputs_and_selection(shape, seed: int) -> tuple[dict, jax.Array]:
    x = make_inputs(shape, seed)
    return x, jax.block_until_ready(jax.jit(our_indexer)(x))


def main(argv=None) -> int:
    p = _common.add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]),
                                reps=200, trials=3)
    p.add_argument("--shape", type=_common.non_negative_int, default=6,
                   help="index into bench/_shapes_inputs.all_shapes() (default 6: 16/1 B=128 L=8K)")
    p.add_argument("--repeat", type=_common.positive_int, default=2,
                   help="timings per stage (default 2)")
    p.add_argument("--vllm-ops", default=".vllm_ops")
    p.add_argument("--torch-first", action="store_true",
                   help="torch, its flush buffer and vLLM's ops before our inputs")
    p.add_argument("--sequence", choices=("vllm", "stress"), default="vllm")
    p.add_argument("--stress-s", type=_common.positive_int, default=10)
    p.add_argument("--idle-s", type=_common.positive_int, default=20)
    args = p.parse_args(argv)
    if not _common.ON_GPU:
        p.error("no GPU backend: run on the GPU machine")
    shape = all_shapes()[args.shape]
    result = {"shape": shape.name, "bytes": shape.decode_bytes, "reps": args.reps,
              "trials": args.trials, "torch_first": args.torch_first,
              "sequence": args.sequence, "stages": []}
    path = os.path.join(args.out, "process_state.json")

    def measure(stage: str) -> None:
        runs = [_common.time_jax(our_decode, (x, selected), n=args.reps, trials=args.trials,
                                 l2="cold") for _ in range(args.repeat)]
        samples = [s for r in runs for s in r.samples_s]
        us = [round(s * 1e6, 3) for s in samples]
        row = {"stage": stage, "us": _common.median_us(samples), "samples_us": us,
               "flush_us": [round(r.flush_us, 2) for r in runs],
               "copy_TBps": round(_common.copy_bandwidth()["copy_Bps"] / 1e12, 3),
               "clocks": gpu_clocks()}
        result["stages"].append(row)
        _common.write_json(path, result)
        print(f"{stage:12s} {row['us']:7.2f} us  samples {us}  flush {row['flush_us']}  "
              f"copy {row['copy_TBps']} TB/s  {row['clocks']}", flush=True)

    if args.sequence == "stress":
        x, selected = inputs_and_selection(shape, args.seed)
        measure("jax")
        a = _common.same_traffic_copy_input(2 << 30)
        copy = jax.jit(_common.scale_copy)
        n = busy(lambda: copy(a), args.stress_s, lambda: jax.block_until_ready(copy(a)))
        result["stress_jax_copies"] = n
        measure("stress_jax")
        time.sleep(args.idle_s)
        measure("idle")
        import torch
        buf = torch.zeros(1 << 29, dtype=torch.float32, device="cuda")
        result["stress_torch_adds"] = busy(lambda: buf.add_(1.0), args.stress_s,
                                           torch.cuda.synchronize)
        measure("stress_torch")
        del buf
        torch.cuda.empty_cache()
        time.sleep(args.idle_s)
        measure("idle_again")
        return 0

    if not args.torch_first:
        x, selected = inputs_and_selection(shape, args.seed)
        measure("jax")
    import torch
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    if not args.torch_first:
        measure("torch_init")
    import _vllm_timing as vt
    timer = vt.OpTimer()
    if not args.torch_first:
        measure("torch_flush")
    ops = vt.load_ops(args.vllm_ops)
    if args.torch_first:
        x, selected = inputs_and_selection(shape, args.seed)
        measure("torch_first")
    else:
        measure("vllm_ops")
    from kernels import vllm_calls, vllm_prepare, vllm_time
    calls, tensors = vllm_calls(vt, ops, x, None, selected, shape)
    calls = {"decode": calls["decode"]}
    state = vllm_prepare(vt, timer, calls)
    measure("vllm_graph")
    acc: dict = {}
    vllm_time(timer, state, n=args.reps, trials=args.trials, acc=acc)
    result["vllm_graph_us"] = [round(v * 1e6, 2) for v in acc["decode"]["graph"]]
    measure("vllm_timed")
    x, selected = inputs_and_selection(shape, args.seed + 1)
    measure("new_inputs")
    del calls, state, tensors, timer, acc
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    measure("torch_freed")
    time.sleep(args.idle_s)
    measure("idle")
    return 0


if __name__ == "__main__":
    sys.exit(main())

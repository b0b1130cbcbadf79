"""`jax-msa-runner logits`: the full-prompt logits of a checkpoint, through the serving path.

``--checkpoint DIR --token-ids FILE.npy --out OUT.npy`` loads the checkpoint, prefills the
prompt (a 1-D integer array) as one request through the scheduler and a ``ModelRunner``
built with ``all_token_logits`` (chunks of ``--max-num-batched-tokens`` tokens, MSA
attention), and writes the logits of every prompt token, float32 ``[T, vocab]``.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from jax_msa_runner.config import (RESERVED_PAGES, ConfigError, ModelConfig, RunnerConfig,
                                   SchedulerConfig)
from jax_msa_runner.cli.flags import FlagError, bounded_int
from jax_msa_runner.cli.mesh_flags import add_mesh_args, load_checkpoint_sharded


def add_logits_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the ``logits`` subcommand's flags on ``parser``."""
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="Hugging Face MiniMax-M3 checkpoint folder")
    parser.add_argument("--token-ids", required=True, metavar="FILE.npy",
                        help="the prompt: a 1-D integer array saved with numpy.save")
    parser.add_argument("--out", required=True, metavar="OUT.npy",
                        help="where to write the logits, float32 [T, vocab]")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="model dtype (the router stays float32)")
    parser.add_argument("--max-num-batched-tokens", type=bounded_int(1), default=512,
                        help="prefill chunk: tokens per step (the one bucket), >= 1")
    parser.add_argument("--attention-impl", choices=("pallas", "reference"), default=None,
                        help="default: pallas on a GPU, reference elsewhere")
    add_mesh_args(parser)
    return parser


def read_token_ids(path: str, vocab_size: int) -> np.ndarray:
    """The prompt in ``path`` as int32 [T]; FlagError naming the bound it breaks."""
    if not os.path.exists(path):
        raise FlagError("--token-ids", f"no such file {path!r}")
    try:
        ids = np.load(path, allow_pickle=False)
    except Exception as e:  # numpy raises ValueError / OSError / UnpicklingError
        raise FlagError("--token-ids", f"{path!r} is not a .npy array ({e})") from None
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise FlagError("--token-ids", f"needs a 1-D integer array, got {ids.dtype} of shape "
                                       f"{ids.shape}")
    if ids.size == 0:
        raise FlagError("--token-ids", "needs at least 1 token, got 0")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        raise FlagError("--token-ids", f"ids must be in [0, vocab_size={vocab_size}), got "
                                       f"{int(ids[bad[0]])} at index {int(bad[0])}")
    return ids.astype(np.int32)


def prompt_logits(params: dict, mconfig: ModelConfig, token_ids: np.ndarray, *,
                  max_num_batched_tokens: int = 512, attention_impl: str | None = None,
                  tp: int = 1, ep: int = 1) -> np.ndarray:
    """Logits f32 [T, vocab] of every token of ``token_ids`` [T] from one prefill served
    by the scheduler and a ModelRunner (chunked to ``max_num_batched_tokens`` per step;
    tp / ep: tensor / expert-parallel ranks)."""
    from jax_msa_runner.serving.kv_cache import pages_needed
    from jax_msa_runner.serving.runner import ModelRunner
    from jax_msa_runner.serving.scheduler import Request, Scheduler

    T = int(token_ids.shape[0])
    chunk = min(int(max_num_batched_tokens), T)
    rc = RunnerConfig(max_num_seqs=1, max_num_batched_tokens=chunk, max_model_len=T + 1,
                      bucket_sizes=(chunk,), tp_size=tp, ep_size=ep)
    num_pages = len(RESERVED_PAGES) + pages_needed(T + 1, 1)
    runner = ModelRunner(mconfig, rc, num_pages=num_pages, params=params,
                         attention_impl=attention_impl, all_token_logits=True)
    runner.warm_up()
    sched = Scheduler(SchedulerConfig.from_runner(rc, num_pages))
    sched.add_request(Request(0, tuple(int(t) for t in token_ids), max_new_tokens=1))
    rows = []
    while sched.has_unfinished():
        batch = sched.schedule()
        tokens = runner.execute(batch)
        rows.append(np.asarray(runner.last_logits[:batch.num_tokens], np.float32))
        sched.update(batch, tokens)
    logits = np.concatenate(rows)
    if logits.shape != (T, mconfig.vocab_size):
        raise RuntimeError(f"prefill produced logits of shape {logits.shape}, expected "
                           f"{(T, mconfig.vocab_size)}")
    return logits


def run_logits(args: argparse.Namespace) -> int:
    """Load, prefill, write ``args.out``; returns a process exit code. A bad checkpoint or
    prompt: one stderr line naming the flag and the bound, exit status 2."""
    from jax_msa_runner.checkpoint import CheckpointError
    from jax_msa_runner.cli.demo import request_host_devices

    request_host_devices(args.tp * args.ep)
    try:
        try:
            config, params = load_checkpoint_sharded(args.checkpoint, dtype=args.dtype,
                                                     num_layers=None, tp=args.tp, ep=args.ep)
        except (CheckpointError, ConfigError, OSError) as e:
            raise FlagError("--checkpoint", str(e)) from None
        ids = read_token_ids(args.token_ids, config.vocab_size)
    except FlagError as e:
        print(f"jax-msa-runner logits: error: {e}", file=sys.stderr)
        return 2
    logits = prompt_logits(params, config, ids, max_num_batched_tokens=args.max_num_batched_tokens,
                           attention_impl=args.attention_impl, tp=args.tp, ep=args.ep)
    np.save(args.out, logits)
    print(f"wrote {args.out}: logits float32 {logits.shape} ({config.num_layers} layers, "
          f"{sum(config.layer_is_moe)} MoE, {sum(config.layer_is_msa)} MSA)")
    return 0


__all__ = ["add_logits_args", "prompt_logits", "read_token_ids", "run_logits"]

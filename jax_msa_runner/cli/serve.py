"""`jax-msa-runner serve`: an OpenAI-compatible HTTP server on the jit-compiled engine.

Without ``--checkpoint`` it serves the built-in tiny model (random weights from ``--seed``)
with the byte tokenizer (``serving.tokenizer_io.ByteTokenizer``): text prompts, chat,
stop strings and streaming work end to end, and completions also take token-id prompts.
With ``--checkpoint DIR`` it serves that Hugging Face folder (``checkpoint.load``) with its
``tokenizer.json`` when there is one (else the byte tokenizer over the model's vocabulary).
Start-up: every flag is checked first (a bad one prints one line naming the flag and its
bound and exits with status 2), the port is bound (a port in use fails here, before any
compile), the runner compiles every bucket (warm-up), and only then does uvicorn accept
requests. Routes: ``jax_msa_runner.serving.server``. Prefix caching is on unless
``--no-prefix-caching``; ``--async-scheduling`` (off by default) lets the host schedule and
stage step N+1 while the device runs step N (``serving.engine``); ``--debug`` validates every
step's metadata and the KV pages' ref counts.
"""
from __future__ import annotations

import argparse
import os
import sys

from jax_msa_runner.config import COMMAND_BUFFERS, MAX_MODEL_LEN, RESERVED_PAGES
from jax_msa_runner.cli.mesh_flags import add_mesh_args
from jax_msa_runner.serving.kv_cache import pages_needed

DEFAULT_MODEL_NAME = "jax-msa-tiny"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the serve flags on ``parser`` (the CLI's ``serve`` subcommand)."""
    g = parser.add_argument_group("serve")
    g.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="serve this Hugging Face checkpoint folder instead of the tiny model")
    g.add_argument("--model-config", default=None, metavar="FILE",
                   help="serve random weights (from --seed) at the shapes of this config.json "
                        "(e.g. the real MiniMax-M3's, with --num-layers to keep the first few)")
    g.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="model dtype with --checkpoint or --model-config")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--model-name", default=DEFAULT_MODEL_NAME,
                   help="the model id clients send (and /v1/models lists)")
    g.add_argument("--max-model-len", type=int, default=2048, help="prompt + output tokens")
    g.add_argument("--max-num-seqs", type=int, default=16, help="requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=256, help="token budget per step")
    g.add_argument("--bucket-sizes", default=None, metavar="N,N,...",
                   help="compiled step sizes in tokens, the largest = --max-num-batched-tokens "
                        "(default: 16, 64, ... below the budget, then the budget)")
    g.add_argument("--num-pages", type=int, default=0,
                   help="KV pages (0: max-num-seqs requests of max-model-len tokens at once)")
    g.add_argument("--max-queue", type=int, default=256,
                   help="requests allowed to wait to run; more get 503")
    g.add_argument("--attention-impl", choices=("pallas", "reference"), default=None,
                   help="default: pallas on a GPU, reference elsewhere")
    g.add_argument("--command-buffers", choices=tuple(COMMAND_BUFFERS), default="xla",
                   help="XLA's CUDA graphs in the compiled step: xla (its defaults), off, "
                        "no-custom-calls (the Pallas kernels launched outside them), or "
                        "control-flow (lax.cond and while loops inside them too)")
    g.add_argument("--num-layers", type=int, default=None,
                   help="override the tiny model's layer count (layer 0 dense, others MSA)")
    g.add_argument("--seed", type=int, default=0, help="seed of the tiny model's random weights")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="uvicorn's log level")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="prefill every prompt in full (default: full KV pages of a repeated "
                        "prefix are reused)")
    g.add_argument("--async-scheduling", action="store_true",
                   help="schedule and launch step N+1 before reading step N's tokens (they "
                        "feed it on the device; a request with a grammar steps synchronously)")
    g.add_argument("--debug", action="store_true",
                   help="validate every step's metadata and the KV pages' ref counts")
    add_mesh_args(g)
    return parser


class FlagError(ValueError):
    """A bad flag: the message names the flag and its bound."""


def _bucket_sizes(args) -> tuple[int, ...]:
    budget = args.max_num_batched_tokens
    if args.bucket_sizes is None:
        return tuple(s for s in (16, 64, 256, 1024) if s < budget) + (budget,)
    try:
        sizes = tuple(sorted({int(s) for s in args.bucket_sizes.split(",") if s.strip()}))
    except ValueError:
        raise FlagError(f"--bucket-sizes: must be comma-separated integers, got "
                        f"{args.bucket_sizes!r}") from None
    if not sizes or sizes[0] < 1:
        raise FlagError(f"--bucket-sizes: every size must be >= 1, got {args.bucket_sizes!r}")
    if sizes[-1] != budget:
        raise FlagError(f"--bucket-sizes: the largest must equal --max-num-batched-tokens="
                        f"{budget}, got {sizes[-1]}")
    return sizes


def check_serve_args(args) -> tuple[tuple[int, ...], int]:
    """Checks every flag; returns (bucket sizes, KV pages). Raises FlagError."""
    def need(ok, flag, bound, value):
        if not ok:
            raise FlagError(f"{flag}: must be {bound}, got {value!r}")

    if args.checkpoint is not None:
        need(os.path.isfile(os.path.join(args.checkpoint, "config.json")), "--checkpoint",
             "a folder holding config.json", args.checkpoint)
        need(args.model_config is None, "--model-config", "left out with --checkpoint",
             args.model_config)
    if args.model_config is not None:
        need(os.path.isfile(args.model_config), "--model-config", "an existing config.json file",
             args.model_config)
    need(bool(args.host.strip()), "--host", "a non-empty host name or address", args.host)
    need(1 <= args.port <= 65535, "--port", "in [1, 65535]", args.port)
    need(bool(args.model_name.strip()), "--model-name", "non-empty", args.model_name)
    need(2 <= args.max_model_len <= MAX_MODEL_LEN, "--max-model-len",
         f"in [2, {MAX_MODEL_LEN}] (one prompt and one output token; the indexer's longest row)",
         args.max_model_len)
    need(args.max_num_seqs >= 1, "--max-num-seqs", ">= 1", args.max_num_seqs)
    need(args.max_num_batched_tokens >= 1, "--max-num-batched-tokens", ">= 1",
         args.max_num_batched_tokens)
    sizes = _bucket_sizes(args)
    full = len(RESERVED_PAGES) + pages_needed(args.max_model_len)
    need(args.num_pages == 0 or args.num_pages >= full, "--num-pages",
         f"0 (auto) or >= {full} (the reserved pages plus one request of --max-model-len="
         f"{args.max_model_len} tokens)", args.num_pages)
    need(args.max_queue >= 1, "--max-queue", ">= 1", args.max_queue)
    need(args.num_layers is None or args.num_layers >= 1, "--num-layers", ">= 1", args.num_layers)
    need(0 <= args.seed < 2**32, "--seed", "in [0, 2**32)", args.seed)
    pages = args.num_pages or len(RESERVED_PAGES) + args.max_num_seqs * pages_needed(
        args.max_model_len)
    _check_mesh(args)
    return sizes, pages


def build_model(args: argparse.Namespace):
    """(ModelConfig, params or None (random from --seed), tokenizer) the flags ask for.

    Raises FlagError naming --checkpoint when the folder cannot be loaded.
    """
    from jax_msa_runner.config import ModelConfig
    from jax_msa_runner.serving.tokenizer_io import ByteTokenizer

    if args.model_config is not None:
        from jax_msa_runner.config import ConfigError
        try:
            mc = ModelConfig.from_hf_config(args.model_config, num_layers=args.num_layers,
                                            dtype=args.dtype)
        except (ConfigError, ValueError, OSError) as e:
            raise FlagError(f"--model-config: cannot read {args.model_config!r}: {e}") from None
        return mc, None, ByteTokenizer(mc.vocab_size)
    if args.checkpoint is None:
        layers = {} if args.num_layers is None else dict(
            num_layers=args.num_layers,
            sparse_attention_freq=(0,) + (1,) * (args.num_layers - 1))
        mc = ModelConfig.tiny(**layers)
        return mc, None, ByteTokenizer(mc.vocab_size)
    from jax_msa_runner.checkpoint import CheckpointError, load
    from jax_msa_runner.config import ConfigError
    from jax_msa_runner.tokenizer import load_tokenizer
    try:
        mc, params = load(args.checkpoint, dtype=args.dtype, num_layers=args.num_layers)
        tok = load_tokenizer(args.checkpoint, vocab_size=mc.vocab_size)
    except (CheckpointError, ConfigError, ValueError, OSError) as e:
        raise FlagError(f"--checkpoint: cannot serve {args.checkpoint!r}: {e}") from None
    return mc, params, tok if tok is not None else ByteTokenizer(mc.vocab_size)


def served_config(args):
    """The ModelConfig the flags will serve, read without loading any weights."""
    from jax_msa_runner.config import ConfigError, ModelConfig

    if args.model_config is None and args.checkpoint is None:
        layers = {} if args.num_layers is None else dict(
            num_layers=args.num_layers, sparse_attention_freq=(0,) + (1,) * (args.num_layers - 1))
        return ModelConfig.tiny(**layers)
    flag, path = (("--model-config", args.model_config) if args.model_config is not None
                  else ("--checkpoint", args.checkpoint))
    try:
        return ModelConfig.from_hf_config(path, num_layers=args.num_layers, dtype=args.dtype)
    except (ConfigError, ValueError, OSError) as e:
        raise FlagError(f"{flag}: cannot read {path!r}: {e}") from None


def _check_mesh(args) -> None:
    """--tp / --ep against the served model and the devices (asks for host devices first)."""
    from jax_msa_runner.cli import flags, mesh_flags
    from jax_msa_runner.cli.demo import request_host_devices

    request_host_devices(args.tp * args.ep)
    try:
        mesh_flags.check_mesh_flags(served_config(args), args.tp, args.ep)
    except flags.FlagError as e:
        raise FlagError(str(e).removeprefix("argument ")) from None


def run_serve(args: argparse.Namespace) -> int:
    """Check the flags, build and warm up the runner, then serve until interrupted."""
    try:
        sizes, num_pages = check_serve_args(args)
    except FlagError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from jax_msa_runner.config import RunnerConfig, SchedulerConfig
    from jax_msa_runner.serving.engine import Engine
    from jax_msa_runner.serving.runner import ModelRunner
    from jax_msa_runner.serving.server import bind_socket, build_app

    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"error: --host/--port: cannot listen on {args.host}:{args.port}: {e}",
              file=sys.stderr)
        return 2
    try:
        mc, params, tokenizer = build_model(args)
    except FlagError as e:
        sock.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    rc = RunnerConfig(max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      max_model_len=args.max_model_len, bucket_sizes=sizes,
                      tp_size=args.tp, ep_size=args.ep, command_buffers=args.command_buffers)
    runner = ModelRunner(mc, rc, num_pages=num_pages, params=params, seed=args.seed,
                         attention_impl=args.attention_impl, debug=args.debug,
                         async_scheduling=args.async_scheduling)
    source = args.checkpoint or (f"{args.model_config} (random weights)" if args.model_config
                                 else "tiny (random weights)")
    print(f"model {args.model_name!r}: {source}, {mc.num_layers} layers, vocab {mc.vocab_size} "
          f"({type(tokenizer).__name__}); attention impl {runner.attention_impl}; buckets {list(sizes)}, "
          f"max_num_seqs {rc.max_num_seqs}, max_model_len {rc.max_model_len}, {num_pages} KV "
          f"pages, prefix caching {'on' if args.prefix_caching else 'off'}, async scheduling "
          f"{'on' if args.async_scheduling else 'off'}", flush=True)
    rep = runner.warm_up()
    print(f"warm-up: {len(rep.buckets)} buckets, {rep.compilations} XLA compilations in "
          f"{rep.compile_seconds:.1f}s", flush=True)
    for line in runner.memory_report(rep).lines():
        print(line, flush=True)
    sconfig = SchedulerConfig.from_runner(rc, num_pages,
                                          enable_prefix_caching=args.prefix_caching,
                                          async_scheduling=args.async_scheduling)
    engine = Engine(runner, sconfig, tokenizer, max_queue=args.max_queue,
                    model_tag=f"{source} seed={args.seed} dtype={args.dtype}").start()
    app = build_app(engine, model_name=args.model_name)
    print(f"serving on http://{args.host}:{sock.getsockname()[1]}/v1", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, lifespan="off"))
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
    return 0 if engine.error is None else 1


def main(argv: list[str] | None = None) -> int:
    parser = add_serve_args(argparse.ArgumentParser(prog="jax-msa-runner serve",
                                                    description=__doc__))
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

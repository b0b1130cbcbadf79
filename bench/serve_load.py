"""Load generator for `jax-msa-runner serve`: throughput, TTFT, inter-token latency, and the
host overhead per engine step, at several client concurrencies.

    python3 bench/serve_load.py --out DIR            (H200; JSON to DIR/serve_load.json)
    python3 bench/serve_load.py --out DIR --transport engine   (no HTTP stack needed)

``--transport http`` (default) starts the server as a subprocess
(``python -m jax_msa_runner.cli.serve``, the tiny model, its log in DIR/server.log), waits
for /health, and drives ``/v1/completions`` with streaming clients over httpx;
``--transport engine`` builds the same runner and engine in this process and submits to
``Engine.submit`` directly (no FastAPI / uvicorn / httpx: the engine's own latencies).

For every concurrency C in ``--concurrency`` (default 1,16,64): C clients each send
``--requests-per-client`` requests back to back (prompt of random token ids, length
uniform in ``--prompt-len LO,HI``; ``--output-len`` tokens, greedy unless ``--temperature``
> 0). Per level: requests/s, output tokens/s, TTFT and inter-token latency p50/p99 (the
inter-token latency is the gap between successive streamed chunks divided by the tokens
the later chunk carries), end-to-end latency p50/p99, and from the server's Prometheus
histograms (differences over the level): engine steps, mean step latency, and the host
overhead per step = the time the device waits between back-to-back steps (from one step's
output reaching the host to the next step's launch: mean, and p50/p99 interpolated in the
histogram buckets), also as a share of the level's wall time.

``--workload multi-turn``: every client holds one conversation of ``--turns`` turns; turn t
sends the whole history (turn 1's prompt: ``--turn-len`` random tokens; each later turn:
the previous prompt, its ``--output-len`` generated tokens and ``--turn-len`` new ones), so
its prompt grows by output-len + turn-len tokens a turn. It runs with the prefix cache on
and off (``--prefix-caching``: on, off or both; one server each over http, and over the
engine a fresh engine per level and setting, the settings of a level back to back, so
both see the same machine load) on the same conversations and reports per turn: the
prompt length, TTFT p50/p99 over the conversations and the cached prompt tokens (the
responses' ``usage.prompt_tokens_details.cached_tokens``).

    python3 bench/serve_load.py --out DIR --transport engine --workload multi-turn \
        --attention-impl reference --num-layers 2 --concurrency 1,4 --turns 8 --turn-len 100 \
        --output-len 16 --max-model-len 1024 --max-num-batched-tokens 256 --prompt-len 8,16 \
        --requests-per-client 1                                   (the CPU run of record)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

MODEL = "jax-msa-tiny"
HOST_GAP = "jax_msa_step_host_gap_seconds"
STEP = "jax_msa_step_latency_seconds"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for serve_load.json")
    p.add_argument("--transport", choices=("http", "engine"), default="http")
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated client counts")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--prompt-len", default="64,512", help="LO,HI prompt tokens (uniform)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8731)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--model-config", default=None, metavar="FILE",
                   help="serve random weights at this config.json's shapes (default: the tiny "
                        "model); with --num-layers to keep the first layers")
    p.add_argument("--attention-impl", choices=("pallas", "reference"), default=None)
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument("--workload", choices=("random", "multi-turn"), default="random",
                   help="random prompts, or conversations that resend their history each turn")
    p.add_argument("--turns", type=int, default=6, help="multi-turn: turns per conversation")
    p.add_argument("--turn-len", type=int, default=200,
                   help="multi-turn: new prompt tokens per turn")
    p.add_argument("--prefix-caching", choices=("on", "off", "both"), default=None,
                   help="the server's prefix cache (default: on; both for multi-turn)")
    p.add_argument("--bucket-sizes", default=None, metavar="N,N,...",
                   help="the server's --bucket-sizes (default: its own)")
    args = p.parse_args(argv)
    try:
        args.levels = [int(c) for c in args.concurrency.split(",")]
        lo, hi = (int(x) for x in args.prompt_len.split(","))
    except ValueError:
        p.error("--concurrency and --prompt-len take comma-separated integers")
    if not args.levels or min(args.levels) < 1:
        p.error(f"--concurrency: every level must be >= 1, got {args.concurrency}")
    if not 1 <= lo <= hi or hi + args.output_len > args.max_model_len:
        p.error(f"--prompt-len: need 1 <= LO <= HI and HI + --output-len <= --max-model-len "
                f"({args.max_model_len}), got {lo},{hi} + {args.output_len}")
    if args.requests_per_client < 1 or args.output_len < 1:
        p.error("--requests-per-client and --output-len must be >= 1")
    if args.turns < 1 or args.turn_len < 1:
        p.error(f"--turns and --turn-len must be >= 1, got {args.turns} and {args.turn_len}")
    longest = args.turns * (args.turn_len + args.output_len)
    if args.workload == "multi-turn" and longest > args.max_model_len:
        p.error(f"--turns * (--turn-len + --output-len) = {longest} must be <= "
                f"--max-model-len ({args.max_model_len})")
    if args.prefix_caching is None:
        args.prefix_caching = "both" if args.workload == "multi-turn" else "on"
    args.prompt_lo, args.prompt_hi = lo, hi
    return args


def cache_modes(args) -> list[bool]:
    """The prefix-cache settings to run, in order (True: on)."""
    return {"on": [True], "off": [False], "both": [True, False]}[args.prefix_caching]


def server_flags(args, caching: bool = True) -> list[str]:
    flags = ["--model-name", MODEL, "--max-model-len", str(args.max_model_len),
             "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--max-queue", str(max(args.levels) * 2 + 16), "--seed", str(args.seed)]
    if args.num_layers is not None:
        flags += ["--num-layers", str(args.num_layers)]
    if args.attention_impl is not None:
        flags += ["--attention-impl", args.attention_impl]
    if args.model_config is not None:
        flags += ["--model-config", args.model_config]
    if args.bucket_sizes is not None:
        flags += ["--bucket-sizes", args.bucket_sizes]
    if not caching:
        flags += ["--no-prefix-caching"]
    return flags


# ---- statistics -------------------------------------------------------------------------------

def percentile(values, q):
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def parse_prometheus(text: str) -> dict:
    """{'name{labels}': value} of every sample line."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def histogram(samples: dict, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative [(le, count)], sum, count) of a histogram from parsed samples."""
    buckets = []
    for key, v in samples.items():
        if key.startswith(name + "_bucket{le="):
            le = key.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), v))
    return sorted(buckets), samples.get(name + "_sum", 0.0), samples.get(name + "_count", 0.0)


def histogram_delta(before: dict, after: dict, name: str):
    b0, s0, c0 = histogram(before, name)
    b1, s1, c1 = histogram(after, name)
    prev = dict(b0)
    return [(le, n - prev.get(le, 0.0)) for le, n in b1], s1 - s0, c1 - c0


def histogram_quantile(buckets, q: float):
    """Linear interpolation inside the bucket holding the q-quantile (q in [0, 1])."""
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank, lo_le, lo_n = q * total, 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if le == float("inf"):
                return lo_le
            return lo_le + (le - lo_le) * ((rank - lo_n) / max(n - lo_n, 1e-12))
        lo_le, lo_n = le, n
    return lo_le


def ms(x):
    return None if x is None else round(x * 1e3, 4)


# ---- clients ----------------------------------------------------------------------------------

class Record:
    def __init__(self):
        self.start = time.perf_counter()
        self.chunks: list[tuple[float, int]] = []  # (arrival time, tokens in the chunk)
        self.token_ids: list[int] = []
        self.cached_tokens = 0
        self.end = None


async def http_request(hc, prompt, args) -> Record:
    rec = Record()
    rec.prompt_len = len(prompt)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": args.output_len,
            "temperature": args.temperature, "stream": True, "return_token_ids": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if args.temperature > 0:
        body["seed"] = random.randrange(2**31)
    async with hc.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                rec.cached_tokens = event["usage"]["prompt_tokens_details"]["cached_tokens"]
            if not event["choices"]:
                continue
            got = event["choices"][0].get("token_ids", [])
            if got:
                rec.chunks.append((time.perf_counter(), len(got)))
                rec.token_ids.extend(got)
    rec.end = time.perf_counter()
    return rec


async def engine_request(engine, prompt, args) -> Record:
    from jax_msa_runner.serving.engine import GenerationParams
    from jax_msa_runner.serving.sampling import SamplingParams

    rec = Record()
    rec.prompt_len = len(prompt)
    seed = random.randrange(2**31) if args.temperature > 0 else None
    stream = engine.submit(prompt, GenerationParams(
        max_tokens=args.output_len, sampling=SamplingParams(temperature=args.temperature),
        seed=seed, ignore_eos=True))
    async for ev in stream:
        rec.cached_tokens = ev.num_cached_tokens
        if ev.token_ids:
            rec.chunks.append((time.perf_counter(), len(ev.token_ids)))
            rec.token_ids.extend(ev.token_ids)
    rec.end = time.perf_counter()
    return rec


async def run_level(send, concurrency, args, rng) -> tuple[list[Record], float]:
    prompts = [[[rng.randrange(256) for _ in range(rng.randint(args.prompt_lo, args.prompt_hi))]
                for _ in range(args.requests_per_client)] for _ in range(concurrency)]

    async def client(mine):
        return [await send(p) for p in mine]

    t0 = time.perf_counter()
    per_client = await asyncio.gather(*(client(m) for m in prompts))
    return [r for recs in per_client for r in recs], time.perf_counter() - t0


async def run_conversations(send, concurrency, args, rng) -> list[list[Record]]:
    """``concurrency`` conversations of ``args.turns`` turns, each turn resending the
    history (its prompt, the output, ``args.turn_len`` new tokens); returns each
    conversation's records in turn order."""
    news = [[[rng.randrange(256) for _ in range(args.turn_len)] for _ in range(args.turns)]
            for _ in range(concurrency)]

    async def conversation(new):
        history, records = [], []
        for turn in new:
            prompt = history + turn
            rec = await send(prompt)
            records.append(rec)
            history = prompt + rec.token_ids
        return records

    return list(await asyncio.gather(*(conversation(n) for n in news)))


def summarize_turns(concurrency, caching, conversations) -> dict:
    """TTFT p50/p99, prompt length and cached tokens per turn, over the conversations."""
    turns = []
    for t in range(len(conversations[0])):
        recs = [c[t] for c in conversations]
        ttft = [r.chunks[0][0] - r.start for r in recs if r.chunks]
        turns.append({"turn": t + 1, "prompt_tokens": recs[0].prompt_len,
                      "ttft_ms": {"p50": ms(percentile(ttft, 50)),
                                  "p99": ms(percentile(ttft, 99))},
                      "cached_tokens_mean": sum(r.cached_tokens for r in recs) / len(recs)})
    return {"concurrency": concurrency, "prefix_caching": caching, "turns": turns}


def summarize(concurrency, records, wall, before, after) -> dict:
    ttft = [r.chunks[0][0] - r.start for r in records if r.chunks]
    itl = []
    for r in records:
        for (t0, _), (t1, n) in zip(r.chunks, r.chunks[1:]):
            itl.extend([(t1 - t0) / n] * n)
    e2e = [r.end - r.start for r in records]
    tokens = sum(n for r in records for _, n in r.chunks)
    gap_b, gap_sum, gap_n = histogram_delta(before, after, HOST_GAP)
    _, step_sum, step_n = histogram_delta(before, after, STEP)
    return {
        "concurrency": concurrency, "requests": len(records), "wall_s": round(wall, 4),
        "requests_per_s": len(records) / wall, "output_tokens_per_s": tokens / wall,
        "output_tokens": tokens,
        "ttft_ms": {"p50": ms(percentile(ttft, 50)), "p99": ms(percentile(ttft, 99))},
        "itl_ms": {"p50": ms(percentile(itl, 50)), "p99": ms(percentile(itl, 99))},
        "e2e_ms": {"p50": ms(percentile(e2e, 50)), "p99": ms(percentile(e2e, 99))},
        "engine_steps": int(step_n),
        "step_ms_mean": ms(step_sum / step_n) if step_n else None,
        "host_gap_ms": {"mean": ms(gap_sum / gap_n) if gap_n else None,
                        "p50": ms(histogram_quantile(gap_b, 0.5)),
                        "p99": ms(histogram_quantile(gap_b, 0.99)), "steps": int(gap_n)},
        "host_gap_share_of_wall": gap_sum / wall,
    }


# ---- the two transports -----------------------------------------------------------------------

async def drive(send, metrics, args, caching: bool, levels=None) -> list[dict]:
    """``levels`` (default: every --concurrency level) of the workload through ``send``
    (prompt -> Record); the conversations and prompts depend only on --seed and the level,
    so both cache settings see the same ones."""
    await run_level(send, 2, args, random.Random(args.seed))  # warm the path
    out = []
    for c in levels or args.levels:
        rng = random.Random(args.seed * 1000 + c)
        if args.workload == "multi-turn":
            out.append(summarize_turns(c, caching, await run_conversations(send, c, args,
                                                                           rng)))
        else:
            before = await metrics()
            recs, wall = await run_level(send, c, args, rng)
            out.append({**summarize(c, recs, wall, before, await metrics()),
                        "prefix_caching": caching})
        print(json.dumps(out[-1]), flush=True)
    return out


async def bench_http(args) -> list[dict]:
    levels = []
    for caching in cache_modes(args):
        levels += await _bench_http_server(args, caching)
    return levels


async def _bench_http_server(args, caching: bool) -> list[dict]:
    import httpx

    log = open(os.path.join(args.out, f"server_cache_{'on' if caching else 'off'}.log"), "w")
    cmd = [sys.executable, "-m", "jax_msa_runner.cli.serve", "--host", "127.0.0.1",
           "--port", str(args.port), "--log-level", "warning"] + server_flags(args, caching)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{args.port}"
    try:
        t0 = time.monotonic()
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0),
                                     limits=httpx.Limits(max_connections=max(args.levels) + 8,
                                                         max_keepalive_connections=max(args.levels) + 8)) as hc:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}; see {log.name}")
                try:
                    if (await hc.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() - t0 > args.startup_timeout:
                    raise RuntimeError(f"server did not become healthy; see {log.name}")
                await asyncio.sleep(0.5)
            print(f"server up after {time.monotonic() - t0:.1f}s: {' '.join(cmd)}", flush=True)

            async def metrics():
                return parse_prometheus((await hc.get("/metrics")).text)

            return await drive(lambda p: http_request(hc, p, args), metrics, args, caching)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


async def bench_engine(args) -> list[dict]:
    from jax_msa_runner.config import RunnerConfig, SchedulerConfig
    from jax_msa_runner.cli.serve import add_serve_args, build_model, check_serve_args
    from jax_msa_runner.serving.engine import Engine
    from jax_msa_runner.serving.runner import ModelRunner

    sargs = add_serve_args(argparse.ArgumentParser()).parse_args(server_flags(args))
    sizes, pages = check_serve_args(sargs)
    mc, _, tokenizer = build_model(sargs)
    rc = RunnerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                      max_model_len=args.max_model_len, bucket_sizes=sizes)
    runner = ModelRunner(mc, rc, num_pages=pages, seed=args.seed, attention_impl=args.attention_impl)
    rep = runner.warm_up()
    print(f"warm-up {rep.compile_seconds:.1f}s, {len(rep.buckets)} buckets", flush=True)
    levels = []
    for c in args.levels:  # each level with each setting back to back: the same machine load
        for caching in cache_modes(args):  # a fresh engine (an empty cache) on the one runner
            sconfig = SchedulerConfig.from_runner(rc, pages, enable_prefix_caching=caching)
            engine = Engine(runner, sconfig, tokenizer,
                            max_queue=max(args.levels) * 2 + 16).start()
            try:
                async def metrics():
                    return parse_prometheus(engine.metrics.render().decode())

                levels += await drive(lambda p: engine_request(engine, p, args), metrics,
                                      args, caching, [c])
            finally:
                engine.shutdown()
    return levels


def print_turns(levels) -> None:
    """One row per (concurrency, turn): prompt tokens, then TTFT p50 ms and cached tokens
    with the cache on and off."""
    by = {(lv["concurrency"], lv["prefix_caching"]): lv["turns"] for lv in levels}
    print(f"{'C':>4} {'turn':>4} {'prompt':>6} {'cache':>5} {'TTFT p50 ms':>11} "
          f"{'TTFT p99 ms':>11} {'cached':>7}")
    for (c, caching), turns in sorted(by.items(), key=lambda kv: (kv[0][0], not kv[0][1])):
        for t in turns:
            print(f"{c:>4} {t['turn']:>4} {t['prompt_tokens']:>6} {'on' if caching else 'off':>5} "
                  f"{t['ttft_ms']['p50']:>11.1f} {t['ttft_ms']['p99']:>11.1f} "
                  f"{t['cached_tokens_mean']:>7.0f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    random.seed(args.seed)
    run = bench_http if args.transport == "http" else bench_engine
    levels = asyncio.run(run(args))
    import jax

    result = {
        "bench": "serve_load", "transport": args.transport, "model": "tiny",
        "config": {k: getattr(args, k) for k in ("max_model_len", "max_num_seqs",
                                                 "max_num_batched_tokens", "num_layers",
                                                 "attention_impl", "requests_per_client",
                                                 "prompt_lo", "prompt_hi", "output_len",
                                                 "temperature", "seed", "workload", "turns",
                                                 "turn_len", "prefix_caching")},
        "server_flags": server_flags(args),
        "jax": jax.__version__, "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()], "python": platform.python_version(),
        "levels": levels,
    }
    path = os.path.join(args.out, "serve_load.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    if args.workload == "multi-turn":
        print_turns(levels)
        print(f"wrote {path}")
        return 0
    print(f"{'C':>4} {'req/s':>8} {'tok/s':>9} {'TTFT p50/p99 ms':>18} {'ITL p50/p99 ms':>16} "
          f"{'steps':>6} {'step ms':>8} {'host gap ms mean/p50/p99':>26} {'gap share':>9}")
    for lv in levels:
        g = lv["host_gap_ms"]
        print(f"{lv['concurrency']:>4} {lv['requests_per_s']:8.2f} {lv['output_tokens_per_s']:9.1f} "
              f"{lv['ttft_ms']['p50']:>8.2f}/{lv['ttft_ms']['p99']:<9.2f} "
              f"{lv['itl_ms']['p50']:>7.3f}/{lv['itl_ms']['p99']:<8.3f} {lv['engine_steps']:>6} "
              f"{lv['step_ms_mean'] or 0:8.3f} {g['mean'] or 0:>8.3f}/{g['p50'] or 0:.3f}/"
              f"{g['p99'] or 0:<8.3f} {lv['host_gap_share_of_wall']:9.3f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

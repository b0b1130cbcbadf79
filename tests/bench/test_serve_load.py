"""bench/serve_load.py's multi-turn workload: each turn resends the history, the per-turn
summary, its flag checks, and one tiny CPU run through the engine with the cache on and off
(same conversations, the same greedy outputs, cached tokens only with the cache on)."""
import asyncio
import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import serve_load  # noqa: E402


def test_conversations_resend_their_history_and_turns_are_summarized():
    args = serve_load.parse_args(["--out", "/tmp/x", "--workload", "multi-turn", "--turns", "3",
                                  "--turn-len", "5", "--output-len", "2"])
    assert args.prefix_caching == "both" and serve_load.cache_modes(args) == [True, False]
    sent = []

    async def send(prompt):
        sent.append(list(prompt))
        rec = serve_load.Record()
        rec.prompt_len = len(prompt)
        rec.token_ids = [1000 + len(prompt), 2000 + len(prompt)]
        rec.chunks = [(rec.start + 0.001 * len(prompt), 2)]
        rec.cached_tokens = 128 * (len(prompt) // 200)
        return rec

    import random
    convs = asyncio.run(serve_load.run_conversations(send, 1, args, random.Random(0)))
    assert [len(c) for c in convs] == [3]
    p1, p2, p3 = sent
    assert len(p1) == 5
    assert p2[:7] == p1 + [1005, 2005] and len(p2) == 12  # history, its output, 5 new
    assert p3[:14] == p2 + [1012, 2012] and len(p3) == 19
    assert p2[7:] != p3[14:]
    summary = serve_load.summarize_turns(1, True, convs)
    assert [t["prompt_tokens"] for t in summary["turns"]] == [5, 12, 19]
    assert [t["ttft_ms"]["p50"] for t in summary["turns"]] == [5.0, 12.0, 19.0]
    assert [t["cached_tokens_mean"] for t in summary["turns"]] == [0, 0, 0]
    assert summary["prefix_caching"] is True and summary["concurrency"] == 1


@pytest.mark.parametrize("argv, message", [
    (["--turns", "0"], "--turns and --turn-len must be >= 1, got 0 and 200"),
    (["--turn-len", "0"], "--turns and --turn-len must be >= 1, got 6 and 0"),
    (["--turns", "10", "--turn-len", "100", "--output-len", "128"],
     "--turns * (--turn-len + --output-len) = 2280 must be <= --max-model-len (2048)"),
])
def test_bad_multi_turn_flags_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        serve_load.parse_args(["--out", "/tmp/x", "--workload", "multi-turn", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_multi_turn_cpu_run_cache_on_and_off(tmp_path, capsys):
    rc = serve_load.main(["--out", str(tmp_path), "--transport", "engine", "--workload",
                          "multi-turn", "--turns", "2", "--turn-len", "140", "--output-len",
                          "4", "--concurrency", "1", "--num-layers", "2", "--max-model-len",
                          "320", "--max-num-seqs", "2", "--max-num-batched-tokens", "64",
                          "--bucket-sizes", "16,64", "--attention-impl", "reference",
                          "--prompt-len", "8,16", "--requests-per-client", "1"])
    assert rc == 0
    doc = json.loads((tmp_path / "serve_load.json").read_text())
    on, off = doc["levels"]
    assert (on["prefix_caching"], off["prefix_caching"]) == (True, False)
    assert [t["prompt_tokens"] for t in on["turns"]] == [140, 284]
    assert [t["prompt_tokens"] for t in off["turns"]] == [140, 284]
    assert [t["cached_tokens_mean"] for t in on["turns"]] == [0, 128]
    assert [t["cached_tokens_mean"] for t in off["turns"]] == [0, 0]
    assert "TTFT p50 ms" in capsys.readouterr().out

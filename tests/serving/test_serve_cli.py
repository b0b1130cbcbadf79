"""`jax-msa-runner serve` flags: each bad one is named with its bound on one line, exit 2,
before anything is built."""
import argparse

import pytest

from jax_msa_runner.cli import main as cli_main
from jax_msa_runner.serve_cli import add_serve_args, check_serve_args, run_serve


def parse(*argv):
    return add_serve_args(argparse.ArgumentParser()).parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    (("--port", "0"), "--port: must be in [1, 65535], got 0"),
    (("--port", "70000"), "--port: must be in [1, 65535], got 70000"),
    (("--host", " "), "--host: must be a non-empty host name or address"),
    (("--model-name", ""), "--model-name: must be non-empty"),
    (("--max-model-len", "1"), "--max-model-len: must be >= 2"),
    (("--max-num-seqs", "0"), "--max-num-seqs: must be >= 1, got 0"),
    (("--max-num-batched-tokens", "0"), "--max-num-batched-tokens: must be >= 1, got 0"),
    (("--bucket-sizes", "8,x"), "--bucket-sizes: must be comma-separated integers"),
    (("--bucket-sizes", "0,256"), "--bucket-sizes: every size must be >= 1"),
    (("--bucket-sizes", "8,64"), "--bucket-sizes: the largest must equal --max-num-batched-tokens=256"),
    (("--num-pages", "5"), "--num-pages: must be 0 (auto) or >= 18"),
    (("--max-queue", "0"), "--max-queue: must be >= 1, got 0"),
    (("--num-layers", "0"), "--num-layers: must be >= 1, got 0"),
    (("--seed", "-1"), "--seed: must be in [0, 2**32), got -1"),
    (("--checkpoint", "/nonexistent"), "--checkpoint: checkpoint loading is not available"),
])
def test_bad_flag_exits_2_naming_flag_and_bound(argv, message, capsys):
    assert run_serve(parse(*argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {message}"), err
    assert cli_main(["serve", *argv]) == 2  # the CLI's subcommand: the same checks


def test_defaults_and_derived_sizes():
    sizes, pages = check_serve_args(parse())
    assert sizes == (16, 64, 256) and pages == 2 + 16 * 16
    sizes, pages = check_serve_args(parse("--max-num-batched-tokens", "100", "--num-pages", "40",
                                          "--max-model-len", "512"))
    assert sizes == (16, 64, 100) and pages == 40

"""`jax-msa-runner serve` flags: each bad one is named with its bound on one line, exit 2,
before anything is built."""
import argparse
import os

import pytest

from jax_msa_runner.cli.main import main as cli_main
from jax_msa_runner.cli.serve import add_serve_args, check_serve_args, run_serve


def parse(*argv):
    return add_serve_args(argparse.ArgumentParser()).parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    (("--port", "0"), "--port: must be in [1, 65535], got 0"),
    (("--port", "70000"), "--port: must be in [1, 65535], got 70000"),
    (("--host", " "), "--host: must be a non-empty host name or address"),
    (("--model-name", ""), "--model-name: must be non-empty"),
    (("--max-model-len", "1"), "--max-model-len: must be in [2, 8388608]"),
    (("--max-model-len", "8388609"), "--max-model-len: must be in [2, 8388608]"),
    (("--max-num-seqs", "0"), "--max-num-seqs: must be >= 1, got 0"),
    (("--max-num-batched-tokens", "0"), "--max-num-batched-tokens: must be >= 1, got 0"),
    (("--bucket-sizes", "8,x"), "--bucket-sizes: must be comma-separated integers"),
    (("--bucket-sizes", "0,256"), "--bucket-sizes: every size must be >= 1"),
    (("--bucket-sizes", "8,64"), "--bucket-sizes: the largest must equal --max-num-batched-tokens=256"),
    (("--num-pages", "5"), "--num-pages: must be 0 (auto) or >= 18"),
    (("--max-queue", "0"), "--max-queue: must be >= 1, got 0"),
    (("--num-layers", "0"), "--num-layers: must be >= 1, got 0"),
    (("--seed", "-1"), "--seed: must be in [0, 2**32), got -1"),
    (("--checkpoint", "/nonexistent"), "--checkpoint: must be a folder holding config.json"),
])
def test_bad_flag_exits_2_naming_flag_and_bound(argv, message, capsys):
    assert run_serve(parse(*argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {message}"), err
    assert cli_main(["serve", *argv]) == 2  # the CLI's subcommand: the same checks


def test_command_buffers_flag():
    assert parse().command_buffers == "xla"
    assert parse("--command-buffers", "no-custom-calls").command_buffers == "no-custom-calls"
    with pytest.raises(SystemExit) as e:
        parse("--command-buffers", "graphs")
    assert e.value.code == 2


def test_prefix_caching_and_debug_flags():
    assert parse().prefix_caching is True and parse().debug is False
    assert parse("--no-prefix-caching").prefix_caching is False
    assert parse().async_scheduling is False and parse("--async-scheduling").async_scheduling
    assert parse("--debug").debug is True


def test_defaults_and_derived_sizes():
    sizes, pages = check_serve_args(parse())
    assert sizes == (16, 64, 256) and pages == 2 + 16 * 16
    sizes, pages = check_serve_args(parse("--max-num-batched-tokens", "100", "--num-pages", "40",
                                          "--max-model-len", "512"))
    assert sizes == (16, 64, 100) and pages == 40


def test_checkpoint_model_is_what_the_loader_gives(tmp_path):
    """--checkpoint serves the folder's config and weights (byte tokenizer without a
    tokenizer.json); a folder whose weights do not match its config is refused, naming
    --checkpoint."""
    import chex
    import jax

    from _checkpoint_writer import write_checkpoint
    from jax_msa_runner.config import ModelConfig
    from jax_msa_runner.model import init_params
    from jax_msa_runner.cli.serve import FlagError, build_model
    from jax_msa_runner.serving.tokenizer_io import ByteTokenizer

    cfg = ModelConfig.tiny(num_layers=2, sparse_attention_freq=(0, 1), hidden_size=64,
                           vocab_size=300, intermediate_size=96, moe_intermediate_size=32,
                           shared_intermediate_size=32)
    params = init_params(cfg, seed=3)
    write_checkpoint(tmp_path, params, cfg, scheme="transformers")
    mc, loaded, tok = build_model(parse("--checkpoint", str(tmp_path), "--dtype", "float32"))
    assert (mc.num_layers, mc.hidden_size, mc.vocab_size) == (2, 64, 300)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 300
    chex.assert_trees_all_close(jax.tree.map(lambda x: x.astype("float32"), loaded),
                                jax.tree.map(lambda x: x.astype("float32"), params))
    bad = tmp_path / "bad"
    write_checkpoint(bad, init_params(ModelConfig.tiny(num_layers=2, sparse_attention_freq=(0, 1),
                                                        hidden_size=32), seed=0),
                     ModelConfig.tiny(num_layers=2, sparse_attention_freq=(0, 1), hidden_size=32))
    (bad / "config.json").write_text((tmp_path / "config.json").read_text())
    with pytest.raises(FlagError, match="^--checkpoint: cannot serve"):
        build_model(parse("--checkpoint", str(bad)))


def test_model_config_serves_random_weights_at_its_shapes(tmp_path):
    """--model-config: the config.json's shapes (truncated by --num-layers), random weights;
    an unreadable file or one together with --checkpoint exits 2 naming the flag."""
    import json

    from jax_msa_runner.cli.serve import FlagError, build_model

    m3 = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "configs", "minimax_m3.json")
    mc, params, tok = build_model(parse("--model-config", m3, "--num-layers", "4"))
    assert params is None and tok.vocab_size == mc.vocab_size == 200064
    assert (mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads) == (4, 6144, 64, 4)
    assert mc.layer_is_msa == (False, False, False, True) and mc.num_experts == 128
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(FlagError, match="^--model-config: cannot read"):
        build_model(parse("--model-config", str(bad)))
    assert run_serve(parse("--model-config", str(tmp_path / "missing.json"))) == 2
    assert run_serve(parse("--model-config", m3, "--checkpoint", str(tmp_path))) == 2

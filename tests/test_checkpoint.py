"""checkpoint.load: both key schemes, text and VL, shards, dtypes, sharding, and its errors."""
import json
import logging
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file, save_file

from _checkpoint_writer import BF16, write_checkpoint
from jax_msa_runner.checkpoint import CheckpointError, load
from jax_msa_runner.config import ModelConfig
from jax_msa_runner.model import init_params

CFG = ModelConfig.tiny(num_layers=3, sparse_attention_freq=(0, 1, 1), moe_layer_freq=(0, 1, 1),
                       vocab_size=97, hidden_size=40, num_heads=4, num_kv_heads=2,
                       num_index_heads=2, head_dim=16, rotary_dim=8, index_dim=16,
                       intermediate_size=24, num_experts=5, num_experts_per_tok=2,
                       moe_intermediate_size=12, shared_intermediate_size=20)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=7)


@pytest.mark.parametrize("scheme, vl, shards", [("transformers", False, 1), ("released", False, 3),
                                                ("released", True, 2), ("transformers", True, 1)])
def test_round_trip(tmp_path, params, caplog, scheme, vl, shards):
    write_checkpoint(tmp_path, params, CFG, scheme=scheme, num_shards=shards, vl=vl)
    with caplog.at_level(logging.INFO, logger="jax_msa_runner.checkpoint"):
        config, loaded = load(tmp_path, dtype="float32")
    assert config == CFG
    chex.assert_trees_all_equal_structs(loaded, params)
    chex.assert_trees_all_equal(loaded, params)
    lines = [r.getMessage() for r in caplog.records]
    if vl:  # one line for everything skipped
        assert len(lines) == 1 and "skipped 3 weights (vision: 2, MTP: 1)" in lines[0], lines
    else:
        assert lines == []


def test_bf16_storage_and_dtypes(tmp_path, params):
    written = write_checkpoint(tmp_path, params, CFG, scheme="released", store_dtype=BF16)
    config, loaded = load(tmp_path, dtype="bfloat16")
    assert config.dtype == "bfloat16"
    layer = loaded["layers"][1]
    assert layer["router"].dtype == jnp.float32 and layer["router_bias"].dtype == jnp.float32
    assert layer["experts_gate_up"].dtype == jnp.bfloat16 and loaded["embed"].dtype == jnp.bfloat16
    w1 = written["model.layers.1.block_sparse_moe.experts.3.w1.weight"]  # [I, H] bf16
    np.testing.assert_array_equal(np.asarray(layer["experts_gate_up"][3, :, :12]), w1.T)
    _, as_f32 = load(tmp_path, dtype="float32")  # bf16 values widened exactly
    np.testing.assert_array_equal(np.asarray(as_f32["layers"][1]["experts_gate_up"][3, :, :12]),
                                  w1.T.astype(np.float32))


def test_sharding_callback_places_each_param(tmp_path, params):
    write_checkpoint(tmp_path, params, CFG, scheme="transformers", num_shards=2)
    devs = jax.devices()
    assert len(devs) >= 2, "tests/conftest.py provides several host devices"
    mesh = Mesh(np.array(devs[:2]), ("x",))
    split_h = NamedSharding(mesh, P(None, "x"))  # experts split over hidden (40 / 2)
    calls = []

    def sharding(path, shape):
        calls.append((path, shape))
        if path.endswith("experts_gate_up"):
            return split_h
        return jax.sharding.SingleDeviceSharding(devs[1]) if path == "embed" else None

    _, loaded = load(tmp_path, dtype="float32", sharding=sharding)
    assert ("layers.1.experts_gate_up", (5, 40, 24)) in calls
    assert len(calls) == len(jax.tree.leaves(params))
    gu = loaded["layers"][2]["experts_gate_up"]
    assert gu.sharding == split_h and len(gu.addressable_shards) == 2
    assert {s.data.shape for s in gu.addressable_shards} == {(5, 20, 24)}
    assert loaded["embed"].devices() == {devs[1]}
    assert loaded["layers"][2]["experts_down"].devices() == {devs[0]}
    chex.assert_trees_all_equal(jax.device_get(loaded), jax.device_get(params))


def test_num_layers_truncation_skips_later_layers(tmp_path, params, caplog):
    write_checkpoint(tmp_path, params, CFG, scheme="released")
    with caplog.at_level(logging.INFO, logger="jax_msa_runner.checkpoint"):
        config, loaded = load(tmp_path, dtype="float32", num_layers=2)
    assert config.num_layers == 2 and len(loaded["layers"]) == 2
    chex.assert_trees_all_equal(loaded["layers"][1], params["layers"][1])
    assert "layers past num_layers" in caplog.records[0].getMessage()


# ---- errors ----------------------------------------------------------------------------------

def _rewrite(folder, fn):
    path = os.path.join(folder, "model.safetensors")
    tensors = fn(load_file(path))
    save_file(tensors, path)


@pytest.mark.parametrize("scheme,vl,key,rest", [
    ("released", False, "model.layers.2.block_sparse_moe.experts.4.w3.weight",
     r" \(expected shape \(12, 40\)\) for param 'layers.2.experts_gate_up'"),
    ("released", True, "language_model.model.layers.0.mlp.up_proj.weight",   # split projection
     r" \(expected shape \(24, 40\)\) for param 'layers.0.gate_up_proj'"),
    ("transformers", False, "model.layers.1.mlp.gate.e_score_correction_bias",
     r" \(expected shape \(5,\)\)"),
])
def test_missing_key(tmp_path, params, scheme, vl, key, rest):
    write_checkpoint(tmp_path, params, CFG, scheme=scheme, vl=vl)
    _rewrite(tmp_path, lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(CheckpointError, match=rf"^missing key '{key}'" + rest):
        load(tmp_path, dtype="float32")


def test_unexpected_key(tmp_path, params):
    write_checkpoint(tmp_path, params, CFG, scheme="transformers")
    key = "model.layers.0.self_attn.sinks"
    _rewrite(tmp_path, lambda t: {**t, key: np.zeros(4, np.float32)})
    with pytest.raises(CheckpointError, match=rf"^unexpected key '{key}': not a weight of this "
                                              r"3-layer model"):
        load(tmp_path, dtype="float32")
    # an expert past num_local_experts is unexpected too
    write_checkpoint(tmp_path / "r", params, CFG, scheme="released")
    key = "model.layers.1.block_sparse_moe.experts.5.w2.weight"
    _rewrite(tmp_path / "r", lambda t: {**t, key: np.zeros((40, 12), np.float32)})
    with pytest.raises(CheckpointError, match=rf"^unexpected key '{key}'"):
        load(tmp_path / "r", dtype="float32")


def test_wrong_shape(tmp_path, params):
    write_checkpoint(tmp_path, params, CFG, scheme="transformers")
    key = "model.layers.1.mlp.experts.down_proj"
    _rewrite(tmp_path, lambda t: {**t, key: np.zeros((5, 40, 13), np.float32)})
    with pytest.raises(CheckpointError, match=rf"^wrong shape for '{key}': checkpoint has "
                                              r"\(5, 40, 13\), the config expects \(5, 40, 12\)"):
        load(tmp_path, dtype="float32")


@pytest.mark.parametrize("keep", [0.999, 0.5, 0.001])
def test_truncated_file(tmp_path, params, keep):
    write_checkpoint(tmp_path, params, CFG, scheme="transformers", num_shards=2)
    path = os.path.join(tmp_path, "model-00002-of-00002.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:max(1, int(len(data) * keep))])
    with pytest.raises(CheckpointError, match=rf"^{path}: not a complete safetensors file, "
                                              r"truncated or corrupt"):
        load(tmp_path, dtype="float32")


def test_folder_errors(tmp_path, params):
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        load(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no config.json"):
        load(tmp_path)
    write_checkpoint(tmp_path, params, CFG, scheme="transformers", num_shards=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-00003-of-00003.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="lists shard 'model-00003-of-00003.safetensors', "
                                              "which is not in"):
        load(tmp_path)


# ---- tokenizer, `logits` and `demo --checkpoint` -------------------------------------------

TEXT_CFG = ModelConfig.tiny(num_layers=2, sparse_attention_freq=(0, 1), vocab_size=320,
                            hidden_size=48, num_heads=4, num_kv_heads=1, head_dim=16,
                            rotary_dim=8, index_dim=16, intermediate_size=32, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=16,
                            shared_intermediate_size=16)
CORPUS = ["the quick brown fox jumps over the lazy dog", "sparse attention reads sixteen pages",
          "a mixture of experts routes every token", "hello world, hello tokens"] * 8


def _train_tokenizer(folder):
    """A byte-level BPE tokenizer trained here (nothing downloaded), saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return tok


def test_tokenizer_round_trip(tmp_path):
    from jax_msa_runner.tokenizer import load_tokenizer
    assert load_tokenizer(tmp_path) is None  # no tokenizer files
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(ValueError, match=r"has tokenizer files \['vocab.json'\] but no tokenizer.json"):
        load_tokenizer(tmp_path)
    os.remove(tmp_path / "vocab.json")
    trained = _train_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == trained.get_vocab_size() <= TEXT_CFG.vocab_size
    assert tok.eos_token_ids == (trained.token_to_id("<eos>"),)
    for text in ("hello world", "the lazy fox routes sixteen tokens!", "ünïcödé bytes ✓"):
        ids = tok.encode(text)
        assert ids == trained.encode(text).ids and tok.decode(ids) == text
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")  # merges learnt
    assert tok.token_str(trained.token_to_id("<eos>")) == "<eos>"
    pieces = [tok.token_str(i) for i in range(tok.vocab_size)]
    assert len(set(pieces)) == tok.vocab_size  # distinct per id
    with pytest.raises(ValueError, match=r"token id 300: must be in \[0, vocab_size=300\)"):
        tok.decode([1, 300])
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
                "{{ raise_exception('no tools') }}{% endif %}[{{ m['role'] }}]{{ m['content'] }}"
                "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eos>", "bos_token": {"content": "<s>"}, "chat_template": template}))
    chat = load_tokenizer(tmp_path)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat.apply_chat_template(msgs) == "<s>[system]be brief<eos>[user]hi<eos>[assistant]"
    with pytest.raises(ValueError, match="refused the messages: no tools"):
        chat.apply_chat_template([{"role": "tool", "content": "x"}])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}|")
    assert load_tokenizer(tmp_path).apply_chat_template(msgs) == "be brief|"
    os.remove(tmp_path / "chat_template.jinja")
    padded = load_tokenizer(tmp_path, vocab_size=TEXT_CFG.vocab_size)  # model vocab 320
    assert padded.vocab_size == 320 and padded.encode("hello") == tok.encode("hello")
    hello = tok.encode("hello")
    assert padded.decode(hello + [305] + hello) == "hello<|305|>hello"
    assert padded.token_str(319) == "<|319|>" and padded.token_str(hello[0]) == tok.token_str(hello[0])
    with pytest.raises(ValueError, match=r"300 tokens, more than the model's vocab_size=299"):
        load_tokenizer(tmp_path, vocab_size=299)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert load_tokenizer(tmp_path).eos_token_ids == (5, 7)


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text_ckpt")
    params = init_params(TEXT_CFG, seed=21)
    write_checkpoint(folder, params, TEXT_CFG, scheme="released", num_shards=2)
    _train_tokenizer(folder)
    return folder, params


def test_logits_cli_matches_one_shot_forward(text_checkpoint, tmp_path, capsys):
    """`jax-msa-runner logits`: 300 prompt tokens prefilled in chunks of 128 by the serving
    path give the logits of a single unchunked forward pass (f32, atol 1e-4)."""
    from jax_msa_runner.attention.parallel import init_caches
    from jax_msa_runner.batch.staging import stage_batch
    from jax_msa_runner.cli.main import main
    from jax_msa_runner.config import RunnerConfig
    from jax_msa_runner.model import compute_logits, forward
    folder, params = text_checkpoint
    ids = np.random.default_rng(4).integers(0, TEXT_CFG.vocab_size, 300)
    np.save(tmp_path / "ids.npy", ids)
    rc = main(["logits", "--checkpoint", str(folder), "--token-ids", str(tmp_path / "ids.npy"),
               "--out", str(tmp_path / "out.npy"), "--max-num-batched-tokens", "128"])
    assert rc == 0
    got = np.load(tmp_path / "out.npy")
    assert got.dtype == np.float32 and got.shape == (300, TEXT_CFG.vocab_size)
    rconf = RunnerConfig(max_num_seqs=1, max_num_batched_tokens=384, max_model_len=384,
                         bucket_sizes=(384,))
    md = stage_batch(np.array([300]), np.array([0]), [[2, 3, 4]], rconf)
    toks = np.pad(ids, (0, 84)).astype(np.int32)
    hidden, _ = jax.jit(lambda p, c, t, m: forward(p, c, t, m, config=TEXT_CFG))(
        params, init_caches(TEXT_CFG, 5, None), jnp.asarray(toks), md)
    want = np.asarray(compute_logits(params, hidden, TEXT_CFG))[:300]
    chex.assert_trees_all_close(got, want, atol=1e-4, rtol=0)
    assert np.abs(want).max() > 1.0  # not a degenerate comparison


@pytest.mark.parametrize("arr, match", [
    (np.array([[1, 2]]), r"--token-ids: needs a 1-D integer array, got int64 of shape \(1, 2\)"),
    (np.array([1.0, 2.0]), r"--token-ids: needs a 1-D integer array, got float64"),
    (np.array([], np.int64), r"--token-ids: needs at least 1 token, got 0"),
    (np.array([3, 320, 1]), r"--token-ids: ids must be in \[0, vocab_size=320\), got 320 at index 1"),
    (np.array([-1]), r"--token-ids: ids must be in \[0, vocab_size=320\), got -1 at index 0"),
])
def test_logits_cli_rejects_bad_token_ids(text_checkpoint, tmp_path, capsys, arr, match):
    from jax_msa_runner.cli.main import main
    folder, _ = text_checkpoint
    np.save(tmp_path / "ids.npy", arr)
    rc = main(["logits", "--checkpoint", str(folder), "--token-ids", str(tmp_path / "ids.npy"),
               "--out", str(tmp_path / "out.npy")])
    assert rc == 2 and not (tmp_path / "out.npy").exists()
    import re
    assert re.search(match, capsys.readouterr().err)


def test_demo_serves_text_from_a_checkpoint(text_checkpoint, capsys):
    from jax_msa_runner.cli.demo import main
    folder, _ = text_checkpoint
    rc = main(["--checkpoint", str(folder), "--prompt", "hello world", "--prompt",
               "the lazy fox", "--output-len", "5", "--max-model-len", "256",
               "--max-num-batched-tokens", "32", "--max-num-seqs", "4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "model: 2 layers (1 MSA, 1 dense)" in out and "compilations after warm-up: 0" in out
    assert "'hello world' -> '" in out and "'the lazy fox' -> '" in out
    with pytest.raises(SystemExit) as exit_:  # text prompts need a checkpoint's tokenizer
        main(["--prompt", "hello"])
    assert exit_.value.code == 2
    assert ("error: argument --prompt: needs --checkpoint DIR with a tokenizer.json"
            in capsys.readouterr().err)
    with pytest.raises(SystemExit) as exit_:
        main(["--checkpoint", str(folder / "nope")])
    assert exit_.value.code == 2
    assert "error: argument --checkpoint: " in capsys.readouterr().err

"""Config validation: invalid combinations fail at construction, naming the field."""
import pytest

from jax_msa_runner.config import (MAX_MODEL_LEN, ConfigError, ModelConfig, RunnerConfig,
                                   SchedulerConfig)
from pallas_kernels import PAGE_SIZE
from pallas_kernels.topk_select_chunked import max_chunked_pages


def test_defaults_are_valid_and_hashable():
    cfg = RunnerConfig()
    assert hash(cfg) == hash(RunnerConfig())
    assert cfg.max_pages == 64 and cfg.uniform_decode_len == 1 and cfg.dcp_dummy_context_len == 0
    assert RunnerConfig(bucket_sizes=(8, 2, 8)).bucket_sizes == (2, 8)
    assert RunnerConfig(dcp_world_size=4).dcp_dummy_context_len == 512
    tiny = ModelConfig.tiny()
    assert hash(tiny) == hash(ModelConfig.tiny()) and tiny.group_size == 16
    sc = SchedulerConfig.from_runner(RunnerConfig(dcp_world_size=2), num_pages=10)
    assert (sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_model_len, sc.num_pages,
            sc.dcp_world_size) == (8, 64, 8192, 10, 2)


def test_longest_context_is_the_mosaic_selects():
    assert MAX_MODEL_LEN == max_chunked_pages() * PAGE_SIZE
    assert RunnerConfig(max_model_len=MAX_MODEL_LEN).max_pages == max_chunked_pages()


@pytest.mark.parametrize("kwargs, match", [
    (dict(page_size=64), r"^page_size: MSA needs page_size == 128"),
    (dict(dcp_interleave=64), r"^dcp_interleave: MSA needs dcp_interleave == 128"),
    (dict(bucket_sizes=(8, 128)), r"^bucket_sizes: bucket 128 is larger than max_num_batched_tokens=64"),
    (dict(bucket_sizes=()), r"^bucket_sizes: must not be empty"),
    (dict(bucket_sizes=(0, 8)), r"^bucket_sizes: every bucket must be >= 1, got 0"),
    (dict(max_num_seqs=0), r"^max_num_seqs: must be >= 1, got 0"),
    (dict(max_num_batched_tokens=0, bucket_sizes=(1,)), r"^max_num_batched_tokens: must be >= 1"),
    (dict(max_model_len=0), r"^max_model_len: must be >= 1, got 0"),
    (dict(max_model_len=2 ** 23 + 1),
     r"^max_model_len: must be <= 8388608 \(the indexer's Mosaic GPU select holds 65536 pages"),
    (dict(num_spec_tokens=-1), r"^num_spec_tokens: must be >= 0, got -1"),
    (dict(num_spec_tokens=64), r"^num_spec_tokens: decode length 1 \+ 64 exceeds"),
    (dict(dcp_world_size=0), r"^dcp_world_size: must be >= 1, got 0"),
    (dict(dcp_world_size=4, max_model_len=512),
     r"^max_model_len: must exceed the DCP dummy context .* = 512"),
    (dict(command_buffers="graphs"),
     r"^command_buffers: must be one of \('xla', 'off', 'no-custom-calls', 'control-flow'\), "
     r"got 'graphs'"),
])
def test_runner_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        RunnerConfig(**kwargs)
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=256), r"^block_size: must be 128"),
    (dict(topk_blocks=8), r"^topk_blocks: must be 16, got 8"),
    (dict(num_heads=0), r"^num_heads: must be >= 1"),
    (dict(num_heads=10, num_kv_heads=4, num_index_heads=4), r"^num_heads: must be a multiple"),
    (dict(num_index_heads=2), r"^num_index_heads: must equal num_kv_heads=1"),
    (dict(local_blocks=2), r"^local_blocks: must be 1"),
    (dict(init_blocks=16), r"^init_blocks: must be in \[0, 16\)"),
])
def test_model_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.tiny(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_pages=2), r"^num_pages: need the reserved pages"),
    (dict(max_num_seqs=0), r"^max_num_seqs: must be >= 1, got 0"),
    (dict(dcp_world_size=0), r"^dcp_world_size: must be >= 1, got 0"),
])
def test_scheduler_config_errors_name_the_field(kwargs, match):
    base = dict(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64, num_pages=8)
    with pytest.raises(ConfigError, match=match):
        SchedulerConfig(**{**base, **kwargs})


def test_xla_compile_options_are_fresh_dicts_of_read_only_choices():
    from jax_msa_runner.config import COMMAND_BUFFERS, xla_compile_options
    assert xla_compile_options("xla") is None
    off = xla_compile_options("off")
    assert off == {"xla_gpu_enable_command_buffer": ""} and type(off) is dict
    off["xla_gpu_enable_command_buffer"] = "FUSION"  # the caller's copy, not the table
    assert xla_compile_options("off") == {"xla_gpu_enable_command_buffer": ""}
    assert xla_compile_options("no-custom-calls") == {
        "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUDNN,DYNAMIC_SLICE_FUSION"}
    assert xla_compile_options("control-flow") == {  # XLA's default kinds + control flow
        "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
                                         "DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE"}
    with pytest.raises(TypeError):
        COMMAND_BUFFERS["off"]["xla_gpu_enable_command_buffer"] = "FUSION"
    with pytest.raises(KeyError):
        xla_compile_options("graphs")

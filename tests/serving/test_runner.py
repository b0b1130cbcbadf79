"""Runner pieces: host buffer layout, compile counter, start-up errors, serving with an fp8
index-K cache (the sampler itself: test_sampling.py).

The compiled end-to-end behaviour (warm-up, serving, zero compiles) is in test_serving_e2e.py,
which shares one warmed-up runner across its tests to keep CI cheap.
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import numpy.testing as npt
import pytest

from jax_msa_runner.batch.buckets import Bucket
from jax_msa_runner.serving.compile_count import CompileCounter
from jax_msa_runner.config import ModelConfig, RunnerConfig
from jax_msa_runner.attention.dcp import DCPError
from jax_msa_runner.serving.runner import ModelRunner, host_buffer_size, pack_step_inputs, serve
from jax_msa_runner.serving.sampling import SamplingRows, unpack_rows
from jax_msa_runner.serving.scheduler import Request, Scheduler, SchedulerConfig
from jax_msa_runner.batch.staging import pack_host_batch, packed_size, stage_packed


def test_host_buffer_layout_roundtrip():
    rc = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=256, bucket_sizes=(8,))
    b = Bucket(8, 4, 2)
    packed = pack_host_batch(np.array([3, 1]), np.array([0, 130]), [[2], [3, 4]], b, rc)
    rows = SamplingRows.neutral(2)._replace(
        seed=np.array([11, -12], np.int32), sample_index=np.array([0, 4], np.int32),
        top_k=np.array([0, 7], np.int32), slot=np.array([3, 0], np.int32),
        prompt_len=np.array([3, 100], np.int32), temperature=np.array([0.0, 0.7], np.float32),
        top_p=np.array([1.0, 0.25], np.float32), min_p=np.array([0.0, 0.1], np.float32),
        presence_penalty=np.array([0.5, -1.5], np.float32),
        frequency_penalty=np.array([-2.0, 1.0], np.float32),
        repetition_penalty=np.array([1.0, 1.3], np.float32))
    buf = pack_step_inputs(packed, np.array([5, 6, 7, 8]), rows, b)
    assert buf.dtype == np.int32 and buf.shape == (host_buffer_size(b),)
    o = packed_size(b)
    npt.assert_array_equal(buf[:o], packed)
    npt.assert_array_equal(buf[o:o + 8], [5, 6, 7, 8, 0, 0, 0, 0])
    back = unpack_rows(jnp.asarray(buf[o + 8:]), 4)
    for f in SamplingRows._fields:
        want = np.concatenate([getattr(rows, f), getattr(SamplingRows.neutral(2), f)])
        npt.assert_array_equal(np.asarray(getattr(back, f)), want, err_msg=f)
    assert np.asarray(back.slot)[2:].tolist() == [-1, -1]  # padded rows: no slot
    md = stage_packed(jnp.asarray(buf[:o]), b, rc)
    npt.assert_array_equal(np.asarray(md.positions)[:4], [0, 1, 2, 130])


def test_compile_counter_sees_compiles_and_cache_hits():
    """A fresh jit compiles exactly once, named after its function; a cache hit compiles
    nothing; a new shape compiles again. (numpy inputs: no jnp op compiles inside a block.)"""
    def counted_affine(x):
        return x * 3 + 1

    f = jax.jit(counted_affine)
    x3, x5 = np.ones(3, np.float32), np.ones(5, np.float32)
    with CompileCounter() as cc:
        f(x3).block_until_ready()
        assert cc.so_far == 1
    assert cc.names == ["jit(counted_affine)"] and cc.count == 1
    with CompileCounter() as cc:
        f(x3).block_until_ready()
    assert cc.names == [] and cc.count == 0
    with CompileCounter() as cc:
        f(x5).block_until_ready()  # new shape: a cache miss
    assert cc.names == ["jit(counted_affine)"] and cc.count == 1


def test_runner_rejects_bad_setup():
    mc = ModelConfig.tiny(num_layers=2, sparse_attention_freq=(0, 1))
    n = len(jax.devices())  # DCP runs over the available devices; one rank more is an error
    with pytest.raises(DCPError, match=f"dcp_world_size: {n + 1} ranks need {n + 1} devices"):
        ModelRunner(mc, RunnerConfig(dcp_world_size=n + 1, max_model_len=1024), num_pages=8)
    with pytest.raises(ValueError, match="attention_impl"):
        ModelRunner(mc, RunnerConfig(), num_pages=8, attention_impl="cuda")
    r = ModelRunner(mc, RunnerConfig(), num_pages=8)
    assert r.attention_impl == ("pallas" if jax.default_backend() == "gpu" else "reference")
    with pytest.raises(RuntimeError, match="before warm_up"):
        r.execute(None)


def test_fp8_index_cache_serves():
    """A runner with a float8_e4m3fn index-K cache (f32 model) warms up, serves a mixed
    workload (prompts ending mid-page, chunked prefill + decode) without compiling, and keeps
    its index pages fp8 and finite through the donated steps (numerics: test_model.py)."""
    mc = ModelConfig.tiny(num_layers=1, sparse_attention_freq=(1,), num_heads=4, head_dim=32,
                          rotary_dim=16, index_dim=32, index_cache_dtype="float8_e4m3fn")
    rc = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=320,
                      bucket_sizes=(32,))
    runner = ModelRunner(mc, rc, num_pages=12, seed=23, attention_impl="reference", debug=True)
    assert runner.caches.index_k[0].dtype == jnp.float8_e4m3fn
    runner.warm_up()
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                      max_model_len=320, num_pages=12))
    rng = np.random.default_rng(23)
    for i, n in enumerate((200, 37, 129)):
        sched.add_request(Request(i, tuple(int(t) for t in rng.integers(0, mc.vocab_size, n)), 6))
    stats = serve(runner, sched)
    assert stats.compilations == 0 and len(sched.finished) == 3
    assert all(len(r.output) == 6 for r in sched.finished.values())
    ik = runner.caches.index_k[0]
    assert ik.dtype == jnp.float8_e4m3fn and runner.caches.kv[0].dtype == jnp.float32
    chex.assert_shape(ik, (12, 128, 32))
    chex.assert_tree_all_finite(ik.astype(jnp.float32))
    assert float(jnp.abs(ik[2:].astype(jnp.float32)).max()) > 0  # request pages were written


def test_all_token_logits_rows_and_sampling_agree():
    """all_token_logits: last_logits holds every token's logits [T_bucket, V]; each row's
    last-token logits are what it samples from (greedy = their argmax), as without it."""
    mc = ModelConfig.tiny(num_layers=1, sparse_attention_freq=(1,), num_heads=4, head_dim=32,
                          rotary_dim=16, index_dim=32)
    rc = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
                      bucket_sizes=(32,))
    outs = {}
    for flag in (False, True):
        runner = ModelRunner(mc, rc, num_pages=8, seed=5, attention_impl="reference",
                             all_token_logits=flag)
        runner.warm_up()
        sched = Scheduler(SchedulerConfig.from_runner(rc, 8))
        for i, n in enumerate((13, 7)):
            sched.add_request(Request(i, tuple(range(3 * i, 3 * i + n)), 3))
        batch = sched.schedule()
        tokens = runner.execute(batch)
        logits = np.asarray(runner.last_logits)
        last = np.cumsum(batch.num_scheduled) - 1
        rows = logits[last] if flag else logits[:2]
        chex.assert_shape(logits, (32, mc.vocab_size) if flag else (4, mc.vocab_size))
        npt.assert_array_equal(tokens, rows.argmax(-1))
        outs[flag] = (tokens, rows)
    npt.assert_array_equal(outs[False][0], outs[True][0])
    npt.assert_allclose(outs[False][1], outs[True][1], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_step_compiles_with_the_configured_command_buffers(monkeypatch):
    """RunnerConfig.command_buffers reaches XLA: every bucket's step (its forward and its
    sampling executable) is compiled with the options of ``COMMAND_BUFFERS[name]`` (None for
    XLA's defaults), and a runner compiled without custom calls in command buffers serves the
    same greedy tokens as one with XLA's defaults; ``compile_bucket`` compiles a bucket's
    pair again under other options, with the same outputs' shapes."""
    want = {"xla": None, "no-custom-calls": {"xla_gpu_enable_command_buffer":
                                             "FUSION,CUBLAS,CUBLASLT,CUDNN,DYNAMIC_SLICE_FUSION"}}
    seen = []
    compile_ = jax.stages.Lowered.compile

    def spy(self, compiler_options=None, **kw):
        seen.append(compiler_options)
        return compile_(self, compiler_options=compiler_options, **kw)

    monkeypatch.setattr(jax.stages.Lowered, "compile", spy)
    mc = ModelConfig.tiny(num_layers=2, sparse_attention_freq=(0, 1), num_heads=4, head_dim=32,
                          rotary_dim=16, index_dim=32)
    outputs = {}
    for name in ("xla", "no-custom-calls"):
        rc = RunnerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=256,
                          bucket_sizes=(8, 16), command_buffers=name)
        seen.clear()
        runner = ModelRunner(mc, rc, num_pages=8, seed=5, attention_impl="reference")
        runner.warm_up()
        assert seen == [want[name]] * 4, seen  # 2 buckets x (forward, sampling)
        sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16,
                                          max_model_len=256, num_pages=8))
        for i, n in enumerate((21, 5)):
            sched.add_request(Request(i, tuple(range(3, 3 + n)), 4))
        stats = serve(runner, sched)
        assert stats.compilations == 0
        outputs[name] = {i: list(r.output) for i, r in sched.finished.items()}
    assert outputs["xla"] == outputs["no-custom-calls"] and len(outputs["xla"]) == 2
    # compile_bucket: the same step again under other options (a profiler's "off"), runs nothing
    seen.clear()
    bucket = runner.buckets[0]
    off = runner.compile_bucket(bucket, "off")
    assert seen == [{"xla_gpu_enable_command_buffer": ""}] * 2, seen
    for mine, served in zip(off, runner._compiled[bucket]):
        chex.assert_trees_all_equal_shapes_and_dtypes(mine.out_info, served.out_info)

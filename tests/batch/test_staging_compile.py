"""Staging compiles once per bucket at warm-up, never afterwards (the counter itself:
tests/serving/test_runner.py)."""
import jax
import numpy as np

from jax_msa_runner.batch.buckets import make_buckets
from jax_msa_runner.serving.compile_count import CompileCounter
from jax_msa_runner.config import RunnerConfig
from jax_msa_runner.batch.staging import DUMMY_KINDS, stage_batch, stage_dummy_batch


def test_one_compile_per_bucket_then_none():
    # A config no other test uses, so the jit cache starts empty for it.
    cfg = RunnerConfig(max_num_seqs=3, max_num_batched_tokens=24, bucket_sizes=(1, 3, 10, 24),
                       max_model_len=777, num_spec_tokens=1)
    buckets = make_buckets(cfg)
    with CompileCounter() as warmup:
        for b in buckets:
            jax.block_until_ready(stage_dummy_batch(b.num_tokens, cfg))
    # one compilation of the staging function per bucket, and nothing else
    assert warmup.names == ["jit(stage_packed)"] * len(buckets), warmup.names
    assert warmup.count == len(buckets)
    with CompileCounter() as again:
        for b in buckets:
            for kind in DUMMY_KINDS:
                for L in (None, 1, 500):
                    jax.block_until_ready(stage_dummy_batch(b.num_tokens, cfg, kind=kind,
                                                            profile_seq_len=L))
        # real batches of every size reuse the warm buckets too
        for n_tokens in range(1, 25):
            q = [n_tokens // 3 + (n_tokens % 3 > i) for i in range(min(3, n_tokens))]
            jax.block_until_ready(stage_batch(q, [5] * len(q), [[2]] * len(q), cfg))
    np.testing.assert_array_equal(again.count, 0, err_msg=str(again.names))

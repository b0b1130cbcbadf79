"""Buckets: one static shape per configured size; the smallest fitting bucket is selected."""
import pytest

from jax_msa_runner.batch.buckets import Bucket, BucketError, make_buckets, select_bucket
from jax_msa_runner.config import RunnerConfig

CFG = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=32, bucket_sizes=(16, 1, 4, 32),
                   max_model_len=1000)


def test_make_buckets():
    assert make_buckets(CFG) == (Bucket(1, 1, 8), Bucket(4, 4, 8), Bucket(16, 4, 8),
                                 Bucket(32, 4, 8))
    assert all(b.max_pages == CFG.max_pages == 8 for b in make_buckets(CFG))
    assert make_buckets(RunnerConfig())[-1] == Bucket(num_tokens=64, num_reqs=8, max_pages=64)


@pytest.mark.parametrize("tokens, reqs, expected", [
    (0, 0, Bucket(1, 1, 8)), (1, 1, Bucket(1, 1, 8)), (2, 1, Bucket(4, 4, 8)),
    (4, 4, Bucket(4, 4, 8)), (5, 2, Bucket(16, 4, 8)), (17, 4, Bucket(32, 4, 8)),
    (32, 4, Bucket(32, 4, 8)), (3, 2, Bucket(4, 4, 8)),
])
def test_select_smallest_fitting(tokens, reqs, expected):
    assert select_bucket(tokens, reqs, CFG) == expected


def test_requests_also_bound_the_bucket():
    cfg = RunnerConfig(max_num_seqs=8, max_num_batched_tokens=64, bucket_sizes=(2, 8, 64))
    assert select_bucket(2, 2, cfg) == Bucket(2, 2, 64)
    assert select_bucket(2, 3, cfg) == Bucket(8, 8, 64)


@pytest.mark.parametrize("tokens, reqs, match", [
    (33, 1, r"no bucket fits num_tokens=33, num_reqs=1: largest bucket holds 32 tokens and 4 "
            r"requests \(max_num_seqs=4\); buckets: \(tokens=1, reqs=1\), \(tokens=4, reqs=4\)"),
    (8, 5, r"no bucket fits num_tokens=8, num_reqs=5"),
    (-1, 0, r"num_tokens: must be >= 0, got -1"),
    (1, -2, r"num_reqs: must be >= 0, got -2"),
])
def test_no_bucket_fits(tokens, reqs, match):
    with pytest.raises(BucketError, match=match):
        select_bucket(tokens, reqs, CFG)
    assert issubclass(BucketError, ValueError)

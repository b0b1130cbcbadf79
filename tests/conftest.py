"""Shared test settings: host devices for the DCP tests, hypothesis profiles sized for CI.

Only known warnings are filtered, each narrowly, in pyproject.toml's ``filterwarnings``.
"""
import os
import sys

# Several host CPU devices for the DCP (shard_map) tests; must be set before jax initialises.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))  # tests/_helpers.py for every test package

settings.register_profile(
    "ci", max_examples=300, deadline=None, derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def no_work(monkeypatch):
    """Any model building, serving or staging fails the test: flags must be refused first
    (XLA_FLAGS, which ``--dcp`` / ``--tp`` may extend, is restored afterwards)."""
    import jax_msa_runner.batch.staging as staging
    import jax_msa_runner.cli.demo as demo

    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the flags were checked")

    monkeypatch.setattr(demo, "ModelRunner", forbidden)
    monkeypatch.setattr(demo, "serve", forbidden)
    monkeypatch.setattr(staging, "stage_dummy_batch", forbidden)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))

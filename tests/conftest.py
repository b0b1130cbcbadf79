"""Shared test settings: host devices for the DCP tests, hypothesis profiles sized for CI.

Only known warnings are filtered, each narrowly, in pyproject.toml's ``filterwarnings``.
"""
import atexit
import os
import shutil
import sys
import tempfile

# Several host CPU devices for the DCP (shard_map) tests; must be set before jax initialises.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

# XLA:CPU keeps its default LLVM level: at -O0 the interpret-mode kernel tests take about 8%
# less time, but the serving and HF tests, which run the model, take about twice as long.

# One persistent compilation cache for the whole run, shared by the xdist workers and the tests'
# subprocesses (which inherit the variables): many tests compile the same programs (the tiny
# model's steps per bucket, the kernels' references) in fresh runners or processes. A cache hit
# still records jax's backend-compile event, so CompileCounter counts it as before. Removed when
# the process that made it exits; CPU only.
if not os.path.exists("/dev/nvidiactl") and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax-msa-runner-tests-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

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


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: a long test (tens of CPU seconds: serving over host-device meshes, "
        "subprocesses); collected first, so pytest-xdist starts it early, not at the tail")


@pytest.hookimpl(trylast=True)  # after xdist's own hook
def pytest_collection_modifyitems(config, items):
    """``slow`` tests first, otherwise collection order (a stable sort). With ``--dist
    loadgroup`` xdist hands out its groups (largest first), then single tests in this order.

    Also makes ``xdist_group`` work under pytest 9.2: pytest-xdist 3.8 tags a grouped test by
    assigning ``item._nodeid += "@group"``, which pytest 9.2 (node ids in ``item._id``) ignores,
    so every group was silently spread over the workers. Where xdist's tag did not land, it is
    set here, the same way xdist names it (group names sorted, joined by "_")."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        tag = "@" + "_".join(names)
        if names and not item.nodeid.endswith(tag):
            from _pytest.nodeid import coerce_node_id
            item._id = coerce_node_id(item.nodeid + tag)
            assert item.nodeid.endswith(tag), item.nodeid

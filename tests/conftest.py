"""Shared test settings: interpret mode off the GPU, hypothesis profiles sized for CI."""
import os
import warnings

# Several host CPU devices for the DCP (shard_map) tests; must be set before jax initialises.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402
from hypothesis import HealthCheck, settings

warnings.filterwarnings("ignore", category=DeprecationWarning)

# Pallas kernels run compiled on a GPU and in interpret mode everywhere else (CI is CPU-only).
INTERPRET = jax.default_backend() != "gpu"

settings.register_profile(
    "ci", max_examples=300, deadline=None, derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

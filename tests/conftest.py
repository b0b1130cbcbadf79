"""Shared test settings: interpret mode off the GPU, hypothesis profiles sized for CI."""
import os
import warnings

import jax
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

"""What several test packages share: the Pallas mode of this backend, fresh random seeds, the
environment of a quicker-compiling dry-run subprocess."""
import jax
import numpy as np

# Pallas kernels run compiled on a GPU and in interpret mode everywhere else (CI is CPU-only).
INTERPRET = jax.default_backend() != "gpu"


def fresh_seed() -> int:
    """A new random seed each call, printed (pytest shows it when the test fails)."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}")
    return seed


# LLVM's optimisation level of XLA's CPU backend for a dry-run subprocess: 0, not the default 2.
# XLA's HLO passes (fusion, layout, scheduling) do not read it (the optimised HLO of a test
# function and of sparse_decode_reference came out the same); only the machine code of the
# CPU executables is less optimised, and compiling it takes about a quarter less time.
QUICK_CPU_COMPILE_FLAG = "--xla_backend_optimization_level=0"


def quick_compile_env(env=None) -> dict:
    """``env`` (default ``os.environ``) for a subprocess whose work is compiling small CPU
    executables (the benches' ``--dry-run``): XLA_FLAGS gets :data:`QUICK_CPU_COMPILE_FLAG`
    on a CPU backend; on a GPU the environment is returned unchanged (copied)."""
    import os

    env = dict(os.environ if env is None else env)
    if jax.default_backend() == "cpu":
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {QUICK_CPU_COMPILE_FLAG}".strip()
    return env

"""What several test packages share: the Pallas mode of this backend, fresh random seeds."""
import jax
import numpy as np

# Pallas kernels run compiled on a GPU and in interpret mode everywhere else (CI is CPU-only).
INTERPRET = jax.default_backend() != "gpu"


def fresh_seed() -> int:
    """A new random seed each call, printed (pytest shows it when the test fails)."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}")
    return seed

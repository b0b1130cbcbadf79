"""What several test packages share: the Pallas mode of this backend."""
import jax

# Pallas kernels run compiled on a GPU and in interpret mode everywhere else (CI is CPU-only).
INTERPRET = jax.default_backend() != "gpu"

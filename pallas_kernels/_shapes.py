"""Small shape helpers shared by the kernels (Triton needs power-of-two block sizes)."""
from jax.experimental import pallas as pl

NUM_SMS_H200 = 132  # streaming multiprocessors of an H200: grids are sized to fill them


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (int(x) - 1).bit_length())


def is_pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def whole_block(shape: tuple[int, ...]) -> pl.BlockSpec:
    """BlockSpec of the whole array, the same block for every program (the kernel indexes it:
    caches, block tables, per-token metadata)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

"""The kernels' shared constants and small shape helpers (Triton needs power-of-two blocks)."""
from jax.experimental import pallas as pl

PAGE_SIZE = 128  # tokens per KV page == MSA sparse block == index-K page
TOPK = 16  # pages selected per (token, KV head)
MIN_DOT = 16  # Triton dots need M, N, K >= 16
SMEM_BYTES = 227 * 1024  # shared memory one block (CTA) may use on an H200 (Hopper) SM

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

"""Small shape helpers shared by the kernels (Triton needs power-of-two block sizes)."""

NUM_SMS_H200 = 132  # streaming multiprocessors of an H200: grids are sized to fill them


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (int(x) - 1).bit_length())


def is_pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0

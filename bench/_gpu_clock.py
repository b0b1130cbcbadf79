"""The GPU's global nanosecond timer, read by a kernel between other kernels of one executable.

``read_clock(*deps)`` launches a one-warpgroup Mosaic GPU kernel that takes ``deps`` as
inputs (never reads them: they only order it after the kernels that produce them) and
returns ``%globaltimer`` as int32 ``[2]`` (low word, high word). :func:`clock_ns` joins the
two words on the host. The bench timer (``_common.time_jax``) brackets a loop of calls with
two reads, so a sample is device time between two points of the GPU's stream, as CUDA events
are on the torch side. Compiled only (no interpreter rule for the timer).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, memref
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
def _store_clock(_ctx, out_ref):
    """Every thread stores its read of the timer (they differ by nanoseconds)."""
    i32 = ir.IntegerType.get_signless(32)
    i64 = ir.IntegerType.get_signless(64)
    now = mgpu_utils.globaltimer()
    low = arith.trunci(i32, now)
    high = arith.trunci(i32, arith.shrui(now, arith.constant(i64, 32)))
    index = ir.IndexType.get()
    memref.store(low, out_ref, [arith.constant(index, 0)])
    memref.store(high, out_ref, [arith.constant(index, 1)])


def _clock_body(*refs):
    _store_clock(refs[-1])  # refs: the dependencies (unread), then the output


def read_clock(*deps) -> jax.Array:
    """int32 ``[2]``: the GPU's ``%globaltimer`` (ns; low, high word) once every array of
    ``deps`` (pytrees allowed) is written."""
    leaves = jax.tree.leaves(deps)
    return plgpu.kernel(_clock_body, out_type=jax.ShapeDtypeStruct((2,), jnp.int32),
                        kernel_name="bench_read_clock")(*leaves)


def clock_ns(words) -> int:
    """The timer value of :func:`read_clock`'s ``[2]`` int32 words."""
    low, high = (int(v) & 0xFFFFFFFF for v in np.asarray(words))
    return (high << 32) | low

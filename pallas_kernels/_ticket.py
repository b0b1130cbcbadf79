"""The last-program ticket: how the programs of one Triton launch hand a reduction to the
program that finishes last, without any program waiting for another.

Each program stores its share (partials, scores) to a scratch output, then calls
:func:`last_to_arrive` on its row's counter: a CTA barrier (every thread's stores come
first), then an acquire-release atomic add at GPU scope. The program that draws ticket
``count - 1`` sees every other program's stores and does the row's reduction; it must read
the scratch with volatile loads (not from L1, which may hold a neighbour row's line read
earlier). The counter is an int32 array of zeros that the wrapper passes in and aliases to an
output (``input_output_aliases``): :func:`with_ticket` adds it and the scratch outputs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

from pallas_kernels._shapes import whole_block


def last_to_arrive(ticket_ref, row, count: int, *, interpreting: bool) -> jax.Array:
    """Inside a kernel: takes a ticket from ``ticket_ref[row]`` (whole ``[rows]`` int32 ref)
    and returns a bool scalar, true for the program that draws the last of ``count``.
    ``interpreting``: programs run one after another, so the CTA barrier (which has no
    interpreter rule) is left out."""
    if not interpreting:
        plt.debug_barrier()  # every thread's stores precede the release of the ticket
    return plt.atomic_add(ticket_ref, (row,), jnp.int32(1)) == count - 1


def with_ticket(in_specs, args, out_specs, out_shape, *, num_rows: int, scratch):
    """The wrapper side of a ticketed ``pallas_call``: its operand lists extended with the
    ``scratch`` outputs (``[(shape, dtype)]``, whole blocks) and the ``[num_rows]`` int32
    counter, passed in as zeros after the other inputs and aliased to the last output.
    Returns ``(in_specs, args, out_specs, out_shape, input_output_aliases)``; the kernel gets
    the counter's input ref after its other inputs and the scratch refs, then the counter's
    output ref, after its other outputs."""
    outs = [*scratch, ((num_rows,), jnp.int32)]
    in_specs = [*in_specs, whole_block((num_rows,))]
    args = [*args, jnp.zeros((num_rows,), jnp.int32)]
    out_specs = [*out_specs, *(whole_block(shape) for shape, _ in outs)]
    out_shape = [*out_shape, *(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in outs)]
    return in_specs, args, out_specs, out_shape, {len(args) - 1: len(out_shape) - 1}


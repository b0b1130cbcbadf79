"""The default dense paged attention: which kernel runs a call.

Contract (arguments, results, safety boundary, reference): :mod:`pallas_kernels.paged_attention`.
Two Mosaic GPU kernels compute it:

- ``"decode"`` (:mod:`pallas_kernels.paged_decode_mgpu`): one CTA per (token, KV head, run of
  pages); made for one or a few tokens per request.
- ``"prefill"`` (:mod:`pallas_kernels.paged_prefill_mgpu`): the tokens cut into tiles of up
  to ``block_q`` consecutive tokens of one request (:func:`pallas_kernels.paged_attention.
  prefill_tiles`), one CTA per (tile, query head), so a tile's tokens share each page load.
  A batch that mixes decode rows and prefill chunks runs in this one launch (a decode row is a
  tile of one token).

:func:`attention_backend` picks per static shape: batches of at most
:data:`DECODE_MAX_TOKENS` tokens compile both kernels and choose at run time (``"auto"``): the
decode kernel while no request has more than :data:`DECODE_MAX_RUN` tokens in the batch, the
prefill kernel otherwise; larger batches run the prefill kernel. Off a GPU (``interpret``
None on a CPU backend) the default is the jnp reference (``"reference"``); interpreted
kernels are for tests. Calls the kernels do not take (:func:`kernels_support`: f32 or mixed
dtypes, head dims other than 64 and 128, GQA groups over 64) run the reference too.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._interpret import resolve_interpret
from pallas_kernels.paged_attention import (max_tiles, paged_attention_reference,
                                            prefill_tiles, tiles_to_tokens, validate_inputs)
from pallas_kernels.paged_decode_mgpu import DTYPES, HEAD_DIMS, MAX_GROUP, paged_decode_mgpu
from pallas_kernels.paged_prefill_mgpu import paged_prefill_mgpu

DEFAULT_BLOCK_Q = 128  # tokens per prefill tile: two compute warpgroups share each page load
DECODE_MAX_TOKENS = 256  # batches up to this size may run the decode kernel
DECODE_MAX_RUN = 8  # tokens of one request in a batch up to which the decode kernel runs it
BACKENDS = ("auto", "decode", "prefill", "reference")


def attention_backend(num_tokens: int, *, interpreting: bool, explicit_interpret: bool) -> str:
    """One of :data:`BACKENDS` for a call of ``num_tokens`` tokens (see the module docstring).
    ``explicit_interpret``: the caller asked for interpreted kernels (``interpret=True``)."""
    if interpreting and not explicit_interpret:
        return "reference"
    return "auto" if num_tokens <= DECODE_MAX_TOKENS else "prefill"


def kernels_support(q_dtype, kv_dtype, head_dim: int, group: int) -> bool:
    """Whether both Mosaic GPU kernels take a call: q and cache of one dtype in the decode
    kernel's ``DTYPES`` (wgmma operands), ``head_dim`` in ``HEAD_DIMS``, a GQA ``group``
    (Hq / Hkv) of at most ``MAX_GROUP`` rows (the prefill kernel's limits are the same or
    looser)."""
    return (jnp.dtype(q_dtype) in DTYPES and jnp.dtype(kv_dtype) == jnp.dtype(q_dtype)
            and head_dim in HEAD_DIMS and group <= MAX_GROUP)


def longest_run(req_indices: jax.Array) -> jax.Array:
    """The most consecutive tokens of one request in the batch (int32 scalar)."""
    t = req_indices.shape[0]
    new_run = jnp.concatenate([jnp.ones((1,), bool), req_indices[1:] != req_indices[:-1]])
    run = jnp.cumsum(new_run.astype(jnp.int32)) - 1
    return jnp.max(jnp.zeros((t,), jnp.int32).at[run].add(1))


def paged_prefill_tiled(q, kv_cache, block_table, req_indices, kv_lens, *, scale,
                        interpret=None, block_q=DEFAULT_BLOCK_Q):
    """The prefill kernel on a batch of tokens: tile, gather q, run, scatter back.

    Arguments and results as :func:`paged_attention_default`; ``block_q`` (static): tokens
    per tile.
    """
    t, hq, d = q.shape
    num_tiles = max_tiles(t, block_q, block_table.shape[0])
    tiles = prefill_tiles(req_indices, kv_lens, block_q=block_q, num_tiles=num_tiles)
    q_tiles = jnp.where((tiles.token >= 0)[..., None, None],
                        q[jnp.maximum(tiles.token, 0)], jnp.zeros((), q.dtype))
    out_tiles, lse_tiles = paged_prefill_mgpu(q_tiles, kv_cache, block_table, tiles.req,
                                              tiles.kv_lens, scale=scale, interpret=interpret)
    return tiles_to_tokens(tiles, out_tiles, lse_tiles, t)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "backend"))
def paged_attention_default(q, kv_cache, block_table, req_indices, kv_lens, *, scale,
                            interpret=None, backend=None):
    """Dense paged causal attention on the kernel :func:`attention_backend` picks.

    q ``[T, Hq, D]``; kv_cache ``[N, Hkv, 128, 2D]``; block_table ``[R, P]`` int32;
    req_indices, kv_lens ``[T]`` int32 (0 = padded token); scale static. Returns
    ``(out [T, Hq, D] q.dtype, lse [T, Hq] f32)``; a token with kv_len 0 gives zeros and -inf.
    ``backend``: None (the rule) or one of :data:`BACKENDS` (static).
    """
    t = validate_inputs(q, kv_cache, block_table, req_indices, kv_lens,
                        name="paged_attention_default")[0]
    if backend is None:
        _, hq, d = q.shape
        backend = (attention_backend(t, interpreting=resolve_interpret(interpret),
                                     explicit_interpret=interpret is not None)
                   if kernels_support(q.dtype, kv_cache.dtype, d, hq // kv_cache.shape[1])
                   else "reference")
    if backend not in BACKENDS:
        raise ValueError(f"paged_attention_default: backend must be one of {BACKENDS} or None, "
                         f"got {backend!r}")
    args = (q, kv_cache, block_table, req_indices, kv_lens)
    if backend == "reference":
        return paged_attention_reference(*args, scale=scale)
    decode = functools.partial(paged_decode_mgpu, scale=scale, interpret=interpret)
    prefill = functools.partial(paged_prefill_tiled, scale=scale, interpret=interpret)
    if backend == "decode":
        return decode(*args)
    if backend == "prefill":
        return prefill(*args)
    return jax.lax.cond(longest_run(req_indices) <= DECODE_MAX_RUN,
                        lambda a: decode(*a), lambda a: prefill(*a), args)


__all__ = ["paged_attention_default", "paged_prefill_tiled", "attention_backend",
           "kernels_support", "longest_run", "BACKENDS", "DECODE_MAX_TOKENS", "DECODE_MAX_RUN"]

"""Decode-context-parallel (DCP) metadata helpers, pure jnp.

W ranks, interleave I (128 for MSA: one page per unit). Token position p lives on rank
``(p // I) % W`` at rank-local position ``(p // (I*W)) * I + p % I``; global page g is local
page ``g // W`` of rank ``g % W``.

Block-table convention under DCP (as in vLLM's virtual blocks): ``block_table[r, j]`` is the
physical page of the request's rank-local page j, the same id on every rank (each rank owns
its own cache). With W == 1 every formula here reduces to the single-device one.
``rank`` may be a Python int or a traced int32 scalar (e.g. ``jax.lax.axis_index``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_msa_runner.config import DCP_INTERLEAVE, PAGE_SIZE
from jax_msa_runner.batch.metadata import BatchMetadata


def dcp_owner(positions: jax.Array, world_size: int, interleave: int = DCP_INTERLEAVE) -> jax.Array:
    """Owning rank of each position: int32 [T] = (positions // I) % W."""
    positions = jnp.asarray(positions, jnp.int32)
    return (positions // interleave) % world_size


def dcp_local_positions(positions: jax.Array, world_size: int,
                        interleave: int = DCP_INTERLEAVE) -> jax.Array:
    """Rank-local position of each token on its owner: int32 [T]."""
    positions = jnp.asarray(positions, jnp.int32)
    return (positions // (interleave * world_size)) * interleave + positions % interleave


def dcp_local_seq_lens(seq_lens: jax.Array, world_size: int, rank,
                       interleave: int = DCP_INTERLEAVE) -> jax.Array:
    """Tokens of each global length stored on ``rank``: int32 [R].

    base = (L // (I*W)) * I, rem = L - base*W, local = base + clamp(rem - rank*I, 0, I).
    """
    seq_lens = jnp.asarray(seq_lens, jnp.int32)
    base = (seq_lens // (interleave * world_size)) * interleave
    rem = seq_lens - base * world_size
    return base + jnp.clip(rem - jnp.asarray(rank, jnp.int32) * interleave, 0, interleave)


def dcp_owner_slots(positions: jax.Array, req_indices: jax.Array, token_mask: jax.Array,
                    block_table: jax.Array, world_size: int,
                    interleave: int = DCP_INTERLEAVE, page_size: int = PAGE_SIZE) -> jax.Array:
    """Physical slot of each token in its owning rank's cache (rank-agnostic): int32 [T].

    slot = block_table[req, local_pos // page] * page + local_pos % page; -1 on masked tokens.
    This is ``BatchMetadata.slot_mapping``; with W == 1 it is the plain slot mapping.
    """
    local = dcp_local_positions(positions, world_size, interleave)
    page_ids = block_table[req_indices, local // page_size]
    return jnp.where(token_mask, page_ids * page_size + local % page_size, -1).astype(jnp.int32)


def dcp_slot_mapping(positions: jax.Array, req_indices: jax.Array, token_mask: jax.Array,
                     block_table: jax.Array, world_size: int, rank,
                     interleave: int = DCP_INTERLEAVE, page_size: int = PAGE_SIZE) -> jax.Array:
    """Slot mapping of ``rank``: the owner slot where the rank owns the token, else -1. int32 [T]."""
    slots = dcp_owner_slots(positions, req_indices, token_mask, block_table, world_size,
                            interleave, page_size)
    owned = dcp_owner(positions, world_size, interleave) == jnp.asarray(rank, jnp.int32)
    return jnp.where(owned, slots, -1)


def rank_slot_mapping(md: BatchMetadata, world_size: int, rank,
                      interleave: int = DCP_INTERLEAVE) -> jax.Array:
    """Slot mapping of ``rank`` from staged metadata: int32 [T].

    Consumes the staged ``positions`` and ``slot_mapping`` (no second position formula):
    keeps ``md.slot_mapping`` on tokens the rank owns and writes -1 elsewhere.
    """
    owned = (dcp_owner(md.positions, world_size, interleave) == jnp.asarray(rank, jnp.int32))
    return jnp.where(owned & md.token_mask, md.slot_mapping, -1)


def dcp_local_pages(seq_lens: jax.Array, world_size: int,
                    page_size: int = PAGE_SIZE) -> jax.Array:
    """Block-table entries a row needs on the fullest rank (rank 0): ceil(L / (page*W)). int32 [R]."""
    seq_lens = jnp.asarray(seq_lens, jnp.int32)
    unit = page_size * world_size
    return (seq_lens + unit - 1) // unit

"""Where a serving step's arrays live: one device, or a decode-context-parallel mesh.

``step_mesh(rconfig)`` is None on one device and the 1-D ``"dcp"`` mesh of
``rconfig.dcp_world_size`` devices otherwise. The other functions take that value and
place params, caches and host buffers accordingly, and wrap a per-device step body so it
runs once per rank (``jax.shard_map``: params and host buffer replicated, every cache leaf a
per-rank stack ``[W, N_local, ...]`` sharded over ``"dcp"``).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_msa_runner.attention.dcp import DCP_AXIS, check_config_mesh, mesh_for_config
from jax_msa_runner.attention.paged_cache import KVCaches, init_kv_caches
from jax_msa_runner.config import ModelConfig, RunnerConfig


def step_mesh(rconfig: RunnerConfig) -> Mesh | None:
    """None without DCP, else the "dcp" mesh (DCPError when there are too few devices)."""
    return mesh_for_config(rconfig) if rconfig.dcp_world_size > 1 else None


def _init_caches(mconfig: ModelConfig, num_pages: int) -> KVCaches:
    return init_kv_caches(num_pages, mconfig.num_kv_heads, mconfig.head_dim, mconfig.index_dim,
                          mconfig.layer_is_msa, dtype=mconfig.jnp_dtype,
                          index_dtype=mconfig.index_cache_jnp_dtype)


def init_caches(mconfig: ModelConfig, num_pages: int, mesh: Mesh | None) -> KVCaches:
    """Zero caches of every layer: leaves [num_pages, ...], or [W, num_pages, ...] sharded
    over "dcp" (each rank allocates its own shard; num_pages per rank)."""
    if mesh is None:
        return _init_caches(mconfig, num_pages)
    w = int(mesh.shape[DCP_AXIS])

    def stacked():
        return jax.tree.map(lambda x: jnp.broadcast_to(x[None], (w,) + x.shape),
                            _init_caches(mconfig, num_pages))

    return jax.jit(stacked, out_shardings=NamedSharding(mesh, P(DCP_AXIS)))()


def replicate(tree, mesh: Mesh | None):
    """``tree`` on the default device, or replicated on every device of ``mesh``."""
    return jax.device_put(tree, None if mesh is None else NamedSharding(mesh, P()))


def per_rank_step(body: Callable, rconfig: RunnerConfig, mesh: Mesh | None) -> Callable:
    """``body(params, caches, host_buf) -> (tokens, logits, caches, md)`` run once per rank.

    Without DCP, ``body`` itself. With DCP, a shard_map over "dcp" whose cache leaves are the
    per-rank stacks; the other outputs are replicated (they come from collectives only).
    """
    if rconfig.dcp_world_size == 1:
        return body
    if mesh is None:
        raise ValueError(f"mesh: dcp_world_size={rconfig.dcp_world_size} needs the 'dcp' mesh")
    check_config_mesh(rconfig, mesh)

    def one_rank(params, caches, host_buf):
        nxt, logits, local, md = body(params, jax.tree.map(lambda x: x[0], caches), host_buf)
        return nxt, logits, jax.tree.map(lambda x: x[None], local), md

    # check_vma=False: the Pallas calls / fori_loops carry no varying-axis types; the
    # replicated outputs derive from all_gather / pmax / psum results only.
    return jax.shard_map(one_rank, mesh=mesh, in_specs=(P(), P(DCP_AXIS), P()),
                         out_specs=(P(), P(), P(DCP_AXIS), P()), check_vma=False)

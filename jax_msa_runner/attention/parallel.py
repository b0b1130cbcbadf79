"""Where a serving step's arrays live: one device, a DCP mesh, or a DCP x TP x EP mesh.

``step_mesh(rconfig)`` is None on one device; the 1-D ``"dcp"`` mesh of
``rconfig.dcp_world_size`` devices with DCP only; and the 3-D mesh
``("dcp", "tensor", "expert")`` of shape ``(W, TP, EP)`` as soon as ``rconfig.tp_size`` or
``rconfig.ep_size`` exceeds 1. The other functions take that value and place params,
caches and host buffers accordingly, and wrap a per-device step body so it runs once per
rank (``jax.shard_map`` over every mesh axis; explicit collectives inside the model).

Layout on the 3-D mesh (``param_specs`` / ``cache_specs``):
  * tensor parallelism ("tensor", TP ranks): q/k/v and index-q projections split by
    columns (rank r holds query heads [r*Hq/TP, (r+1)*Hq/TP), KV and index heads likewise),
    o_proj by rows (partial sums, psum over "tensor"); the dense MLP and the shared expert
    by intermediate size (gate_up columns in the *TP layout*: rank r's contiguous chunk is
    ``[gate_r | up_r]``, see ``tp_layout``; down_proj rows; psum); the routed experts'
    intermediate size the same way; the embedding and the LM head by vocabulary (masked
    local lookup + psum; local logits + all_gather). The KV cache leaves split over KV heads;
    the index-K cache has no head axis (one shared index key) and is replicated over
    "tensor" (every rank computes and writes the same index keys).
  * expert parallelism ("expert", EP ranks): experts [E, ...] split by expert. Dispatch is
    the simplest correct one: every rank already holds every token (tokens are replicated
    over the mesh), computes its E/EP local experts on the copies routed to them
    (``ragged_dot``, other copies sorted behind every group) and the combined partial
    outputs are summed with one psum over ("tensor", "expert"). No all-to-all yet.
    Attention, router and norms are replicated over "expert".
  * fp8 linears (``Fp8Weight(values [..., out, in], scales)``, ``checkpoint.load``): values
    and scales split like the dense weight with its last two axes swapped; gate|up rows in
    the TP layout. A split must fall on a scale block (MXFP8: 32 inputs; block format: 128
    rows and 128 inputs): ``put_param`` raises ConfigError naming the param where it does not.
  * caches are per-rank stacks ``[W, N, ...]`` sharded over "dcp" (W may be 1), KV leaves
    also over "tensor" on their head axis.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import numpy as np
from jax import lax

from jax_msa_runner.attention.dcp import DCP_AXIS, check_config_mesh, mesh_for_config
from jax_msa_runner.attention.paged_cache import KVCaches, init_kv_caches
from jax_msa_runner.config import ConfigError, ModelConfig, RunnerConfig
from pallas_kernels.fp8_matmul import BLOCK, MX_GROUP, Fp8Weight, fp8_format

TENSOR_AXIS = "tensor"
EXPERT_AXIS = "expert"
MESH_AXES = (DCP_AXIS, TENSOR_AXIS, EXPERT_AXIS)
# params whose last axis is a gate|up pair (split by intermediate size under TP)
GATE_UP_PARAMS = ("gate_up_proj", "shared_gate_up", "experts_gate_up")
FP8_FIELDS = ("values", "scales")  # an Fp8Weight's leaves: param paths "{param}.values" etc.


def uses_model_mesh(rconfig: RunnerConfig) -> bool:
    """True when the step runs on the 3-D ("dcp", "tensor", "expert") mesh."""
    return rconfig.tp_size > 1 or rconfig.ep_size > 1


def check_parallel(mconfig: ModelConfig, rconfig: RunnerConfig,
                   num_devices: int | None = None) -> None:
    """ConfigError naming the field and bound unless TP/EP divide the model's shapes and
    dcp_world_size * tp_size * ep_size ranks fit on the devices."""
    check_mesh_shape(mconfig, rconfig.dcp_world_size, rconfig.tp_size, rconfig.ep_size,
                     num_devices)


def check_mesh_shape(mconfig: ModelConfig, dcp: int, tp: int, ep: int,
                     num_devices: int | None = None) -> None:
    """``check_parallel`` on plain sizes (num_devices None: ``len(jax.devices())``)."""
    c = mconfig
    for name in ("num_heads", "num_kv_heads", "vocab_size"):
        if getattr(c, name) % tp:
            raise ConfigError(f"tp_size: {tp} must divide {name}={getattr(c, name)}")
    if any(c.layer_is_msa) and c.num_index_heads % tp:
        raise ConfigError(f"tp_size: {tp} must divide num_index_heads={c.num_index_heads}")
    if not all(c.layer_is_moe) and c.intermediate_size % tp:
        raise ConfigError(f"tp_size: {tp} must divide intermediate_size={c.intermediate_size}")
    if any(c.layer_is_moe):
        for name in ("moe_intermediate_size", "shared_intermediate_size"):
            if getattr(c, name) % tp:
                raise ConfigError(f"tp_size: {tp} must divide {name}={getattr(c, name)}")
        if c.num_experts % ep:
            raise ConfigError(f"ep_size: {ep} must divide num_experts={c.num_experts}")
    n = len(jax.devices()) if num_devices is None else num_devices
    ranks = dcp * tp * ep
    if ranks > n:
        raise ConfigError(f"tp_size: dcp_world_size * tp_size * ep_size = {dcp} * {tp} * {ep} = "
                          f"{ranks} ranks need {ranks} devices, only {n} available")


def model_mesh(dcp: int, tp: int, ep: int, devices=None) -> Mesh:
    """The ("dcp", "tensor", "expert") mesh of shape (dcp, tp, ep) over the first dcp*tp*ep
    devices (ConfigError when there are fewer)."""
    devices = list(jax.devices() if devices is None else devices)
    n = dcp * tp * ep
    if n > len(devices):
        raise ConfigError(f"tp_size: dcp_world_size * tp_size * ep_size = {dcp} * {tp} * {ep} = "
                          f"{n} ranks need {n} devices, only {len(devices)} available")
    return Mesh(np.asarray(devices[:n]).reshape(dcp, tp, ep), MESH_AXES)


def make_model_mesh(rconfig: RunnerConfig, devices=None) -> Mesh:
    """``model_mesh`` of the config's (dcp_world_size, tp_size, ep_size)."""
    return model_mesh(rconfig.dcp_world_size, rconfig.tp_size, rconfig.ep_size, devices)


def step_mesh(rconfig: RunnerConfig, mconfig: ModelConfig | None = None) -> Mesh | None:
    """None on one device, the "dcp" mesh with DCP only (DCPError when there are too few
    devices), else the 3-D mesh (``check_parallel`` first when mconfig is given)."""
    if uses_model_mesh(rconfig):
        if mconfig is not None:
            check_parallel(mconfig, rconfig)
        return make_model_mesh(rconfig)
    return mesh_for_config(rconfig) if rconfig.dcp_world_size > 1 else None


def mesh_size(mesh: Mesh | None, axis: str) -> int:
    """Ranks of ``axis`` in ``mesh`` (1 without a mesh or without that axis)."""
    return 1 if mesh is None or axis not in mesh.shape else int(mesh.shape[axis])


# ---- collectives the model uses (no-ops at size 1) ---------------------------------------------

def tensor_psum(x: jax.Array, tp: int) -> jax.Array:
    """Sum of per-rank partial results over "tensor" (inside the step's shard_map)."""
    return lax.psum(x, TENSOR_AXIS) if tp > 1 else x


def moe_psum(x: jax.Array, tp: int, ep: int) -> jax.Array:
    """Sum of per-rank routed-expert partial outputs over "tensor" and "expert"."""
    axes = tuple(a for a, n in ((TENSOR_AXIS, tp), (EXPERT_AXIS, ep)) if n > 1)
    return lax.psum(x, axes) if axes else x


def expert_offset(num_local_experts: int, ep: int):
    """Global id of this rank's first expert (0 without EP)."""
    return lax.axis_index(EXPERT_AXIS) * num_local_experts if ep > 1 else 0


def vocab_embed(embed: jax.Array, token_ids: jax.Array, tp: int) -> jax.Array:
    """Embedding lookup; under TP ``embed`` is this rank's vocab rows [V/TP, H] (masked
    local lookup, psum over "tensor": exact, one nonzero term per token)."""
    if tp == 1:
        return embed[token_ids]
    vl = embed.shape[0]
    local = token_ids - lax.axis_index(TENSOR_AXIS) * vl
    mine = (local >= 0) & (local < vl)
    x = jnp.where(mine[:, None], embed[jnp.clip(local, 0, vl - 1)], 0)
    return lax.psum(x, TENSOR_AXIS)


def gather_vocab(logits: jax.Array, tp: int) -> jax.Array:
    """Local logits [..., V/TP] -> all of them [..., V] (all_gather over "tensor")."""
    return lax.all_gather(logits, TENSOR_AXIS, axis=logits.ndim - 1, tiled=True) if tp > 1 \
        else logits


# ---- params ------------------------------------------------------------------------------------

def param_spec(name: str, ndim: int, fp8: bool = False) -> P:
    """PartitionSpec of one param on the 3-D mesh, by its name (the last path component).
    fp8: a leaf of the param's ``Fp8Weight`` (``[..., out, in]``: the dense spec with its
    last two axes swapped)."""
    if fp8:
        dense = tuple(param_spec(name, ndim)) + (None,) * ndim
        return P(*dense[:ndim - 2], dense[ndim - 1], dense[ndim - 2])
    if name in ("q_proj", "k_proj", "v_proj", "index_q_proj", "gate_up_proj", "shared_gate_up",
                "lm_head"):
        return P(None, TENSOR_AXIS)
    if name in ("o_proj", "down_proj", "shared_down", "embed"):
        return P(TENSOR_AXIS, None)
    if name == "experts_gate_up":
        return P(EXPERT_AXIS, None, TENSOR_AXIS)
    if name == "experts_down":
        return P(EXPERT_AXIS, TENSOR_AXIS, None)
    return P()  # norms, router, router_bias, index_k_proj


def _param_name(path: str) -> tuple[str, str | None]:
    """``"layers.3.q_proj"`` -> ("q_proj", None); ``"layers.3.q_proj.scales"`` -> ("q_proj",
    "scales")."""
    parts = path.split(".")
    if parts[-1] in FP8_FIELDS and len(parts) > 1:
        return parts[-2], parts[-1]
    return parts[-1], None


def _path_name(path) -> tuple[str, str | None]:
    """``_param_name`` of a pytree key path (an Fp8Weight's field is a GetAttrKey)."""
    return _param_name(".".join(_key_name(k) for k in path))


def param_specs(params: dict) -> dict:
    """The PartitionSpec tree of ``params`` (same structure)."""
    def spec(path, x):
        name, field = _path_name(path)
        return param_spec(name, x.ndim, fp8=field is not None)
    return jax.tree_util.tree_map_with_path(spec, params)


def _key_name(k) -> str:
    return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))


def tp_layout(name: str, host: np.ndarray, tp: int, axis: int = -1) -> np.ndarray:
    """A param's host array in the TP layout: gate|up params get their gate|up ``axis`` (the
    last; -2 for fp8 values and scales) reordered to ``[gate_0 | up_0 | gate_1 | up_1 | ...]``
    (TP chunks), every other param unchanged."""
    if tp == 1 or name not in GATE_UP_PARAMS:
        return host
    x = np.moveaxis(np.asarray(host), axis, -1)
    *lead, two_i = x.shape
    i = two_i // 2
    x = np.moveaxis(x.reshape(*lead, 2, tp, i // tp), -3, -2).reshape(*lead, two_i)
    return np.moveaxis(x, -1, axis)


def check_fp8_split(name: str, w: Fp8Weight, tp: int) -> None:
    """ConfigError naming the param unless the TP split of its fp8 weight ``w`` (values
    ``[..., out, in]``; uint8 scales: MXFP8, 32 inputs per scale; float32: 128 x 128 blocks)
    falls on scale blocks."""
    shape = tuple(w.values.shape)
    mx = fp8_format(w) == "mxfp8"
    param = _param_name(name)[0]
    spec = tuple(param_spec(param, len(shape), fp8=True)) + (None,) * len(shape)
    for axis, label in ((len(shape) - 2, "output"), (len(shape) - 1, "input")):
        if spec[axis] != TENSOR_AXIS:
            continue
        group = (1 if mx else BLOCK) if label == "output" else (MX_GROUP if mx else BLOCK)
        halves = 2 if param in GATE_UP_PARAMS and label == "output" else 1
        part = shape[axis] // halves // tp
        if part % group:
            fmt = "MXFP8 (32 inputs per scale)" if mx else f"fp8 block ({BLOCK}x{BLOCK})"
            raise ConfigError(f"{name}: tp_size={tp} splits its {label} dim "
                              f"{shape[axis] // halves} into {part}-wide shards, not on the "
                              f"{group}-element scale blocks of {fmt}")


def put_param(path: str, host, mesh: Mesh):
    """One param (host array in the checkpoint/``init_params`` layout, or an ``Fp8Weight`` of
    host arrays as on disk) onto its shards of the 3-D mesh: each device receives only its
    slice (``jax.make_array_from_callback``). ConfigError where the TP split of an fp8
    weight misses its scale blocks."""
    name, _ = _param_name(path)
    tp = mesh_size(mesh, TENSOR_AXIS)
    if isinstance(host, Fp8Weight):
        if tp > 1:
            check_fp8_split(path, host, tp)
        return Fp8Weight(*(_put_leaf(name, np.asarray(x), mesh, tp, fp8=True) for x in host))
    return _put_leaf(name, np.asarray(host), mesh, tp, fp8=False)


def _put_leaf(name: str, host: np.ndarray, mesh: Mesh, tp: int, fp8: bool) -> jax.Array:
    laid = tp_layout(name, host, tp, axis=-2 if fp8 else -1)
    sharding = NamedSharding(mesh, param_spec(name, host.ndim, fp8=fp8))
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: laid[idx])


def param_putter(mesh: Mesh) -> Callable[[str, np.ndarray], jax.Array]:
    """``put_param`` bound to ``mesh``: the ``put`` hook of ``checkpoint.load``."""
    return lambda path, host: put_param(path, host, mesh)


def place_params(params: dict, mesh: Mesh | None) -> dict:
    """Params on the default device, replicated over a DCP-only mesh, or sharded over the
    3-D mesh (``put_param`` per param; names from the dict keys). On the 3-D mesh a param
    whose leaves already have exactly their ``param_spec`` sharding on ``mesh`` is taken to
    be in the TP layout already (``checkpoint.load(put=param_putter(mesh))``) and kept."""
    if mesh is None or TENSOR_AXIS not in mesh.shape:
        return replicate(params, mesh)

    def placed(path, x) -> bool:
        name, fp8 = _key_name(path[-1]), isinstance(x, Fp8Weight)
        return all(isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(
            NamedSharding(mesh, param_spec(name, leaf.ndim, fp8=fp8)), leaf.ndim)
            for leaf in (x if fp8 else (x,)))

    def place(path, x):
        if placed(path, x):
            return x
        return put_param(_key_name(path[-1]), jax.device_get(x), mesh)

    return jax.tree_util.tree_map_with_path(place, params,
                                            is_leaf=lambda x: isinstance(x, Fp8Weight))


def bytes_by_device(tree) -> dict:
    """{device: {dtype name: bytes}} of every leaf's addressable shards."""
    out: dict = {}
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            per = out.setdefault(s.device, {})
            name = str(s.data.dtype)
            per[name] = per.get(name, 0) + s.data.size * s.data.dtype.itemsize
    return out


def param_bytes_per_device(params: dict) -> dict:
    """Bytes of the params held by each device: {device: bytes} (from addressable shards)."""
    return {d: sum(per.values()) for d, per in bytes_by_device(params).items()}


def _init_caches(mconfig: ModelConfig, num_pages: int) -> KVCaches:
    return init_kv_caches(num_pages, mconfig.num_kv_heads, mconfig.head_dim, mconfig.index_dim,
                          mconfig.layer_is_msa, dtype=mconfig.jnp_dtype,
                          index_dtype=mconfig.index_cache_jnp_dtype)


def cache_specs(caches: KVCaches, mesh: Mesh) -> KVCaches:
    """PartitionSpecs of per-rank cache stacks: P("dcp"), KV leaves also P(..., "tensor") on
    their head axis on the 3-D mesh."""
    kv = P(DCP_AXIS, None, TENSOR_AXIS) if TENSOR_AXIS in mesh.shape else P(DCP_AXIS)
    return KVCaches(kv=tuple(kv for _ in caches.kv),
                    index_k=tuple(None if x is None else P(DCP_AXIS) for x in caches.index_k))


def init_caches(mconfig: ModelConfig, num_pages: int, mesh: Mesh | None) -> KVCaches:
    """Zero caches of every layer: leaves [num_pages, ...], or [W, num_pages, ...] sharded
    over "dcp" (each rank allocates its own shard; num_pages per rank); on the 3-D mesh KV
    leaves [W, num_pages, Hkv, ...] are also split over "tensor" by KV head."""
    if mesh is None:
        return _init_caches(mconfig, num_pages)
    w = int(mesh.shape[DCP_AXIS])
    if TENSOR_AXIS in mesh.shape:
        shape = jax.eval_shape(lambda: _init_caches(mconfig, num_pages))
        specs = cache_specs(shape, mesh)
        shardings = jax.tree.map(lambda p: NamedSharding(mesh, p), specs)

        def stacked3():
            return jax.tree.map(lambda x: jnp.zeros((w,) + x.shape, x.dtype), shape)

        return jax.jit(stacked3, out_shardings=shardings)()

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
    if uses_model_mesh(rconfig):
        return _model_mesh_step(body, rconfig, mesh)
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


def _model_mesh_step(body: Callable, rconfig: RunnerConfig, mesh: Mesh | None) -> Callable:
    """``body`` in one shard_map over ("dcp", "tensor", "expert"): params by
    ``param_specs``, caches by ``cache_specs``, the host buffer and every other output
    replicated (logits come from all_gather, hidden states from psums)."""
    if mesh is None or tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"mesh: tp_size={rconfig.tp_size}, ep_size={rconfig.ep_size} need the "
                         f"{MESH_AXES} mesh, got {None if mesh is None else mesh.axis_names}")
    want = (rconfig.dcp_world_size, rconfig.tp_size, rconfig.ep_size)
    got = tuple(int(mesh.shape[a]) for a in MESH_AXES)
    if got != want:
        raise ValueError(f"mesh: shape {got} over {MESH_AXES}, the config needs {want}")

    def one_rank(params, caches, host_buf):
        nxt, logits, local, md = body(params, jax.tree.map(lambda x: x[0], caches), host_buf)
        return nxt, logits, jax.tree.map(lambda x: x[None], local), md

    def step(params, caches, host_buf):
        cspec = cache_specs(caches, mesh)
        # check_vma=False as for DCP: Pallas calls / fori_loops carry no varying-axis types
        return jax.shard_map(one_rank, mesh=mesh, in_specs=(param_specs(params), cspec, P()),
                             out_specs=(P(), P(), cspec, P()), check_vma=False
                             )(params, caches, host_buf)

    return step

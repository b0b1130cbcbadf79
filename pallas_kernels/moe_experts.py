"""MoE routed experts: the contract, its input checks, the jax.numpy reference and the routing
step the kernels share (the token copies grouped by local expert).

Contract (``moe_experts_reference``, ``moe_experts_xla``,
:func:`pallas_kernels.moe_experts_default.moe_experts_default` and the Mosaic GPU kernels of
:mod:`pallas_kernels.moe_experts_mgpu` all compute it): the
partial sum of one rank's routed experts, ``routed_experts_partial`` of the runner's model,

    out[t] = sum_j [mine(t, j)] weights[t, j] * expert_{e(t, j)}(x[t])      (f32 [T, H])

    expert_e(x) = swigluoai(x @ gate_up_e, alpha, limit).astype(x.dtype) @ down_e   (f32 accum.)
    swigluoai(h) = (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g),  g = min(gate, limit)

where ``e(t, j) = experts[t, j] - first_expert`` is the copy's local expert and ``mine(t, j)`` is
``token_mask[t] and 0 <= e(t, j) < E`` (copies of padding tokens and copies routed to other
ranks' experts contribute nothing, whatever their weight or x row holds). gate|up: the first I
outputs of gate_up are the gate, the next I the up projection.

Shapes / dtypes:
  x            [T, H]   bfloat16 | float16 | float32 (the kernels: bfloat16)
  weights      [T, k]   float (the routing weights; f32 in the model)
  experts      [T, k]   int32, global expert ids (any values: those outside the local range
                        are other ranks' copies)
  token_mask   [T]      bool
  gate_up      [E, H, 2I] in x.dtype ([in, out]), or an :class:`Fp8Weight` with values e4m3
               [E, 2I, H] ([out, in]) and MXFP8 (uint8 [E, 2I, H/32]) or 128x128-block (f32
               [E, ceil(2I/128), ceil(H/128)]) scales
  down         [E, I, H] in x.dtype, or an :class:`Fp8Weight` with values [E, H, I]
  first_expert static int or traced int32 scalar: the global id of local expert 0
  alpha, limit static floats
  result       float32 [T, H]

Routing (:func:`group_copies`): the ``T*k`` copies are sorted by local expert (stable; others'
and masked copies last), so local expert ``e`` owns sorted rows ``[offset_e, offset_e +
count_e)``; each expert's rows are cut into *slots* of at most ``tile`` rows, the kernels' unit
of work along the copies. At most :func:`slot_bound` slots exist (``min(E, T*k) + T*k //
tile``: one partial slot per touched expert plus the full ones); the table lists the used ones
first (by expert, then row), the rest with count 0. Rows are numbered twice: the sorted rows
``[0, T*k)`` (outputs) and the *aligned* rows, where each expert's group starts at a multiple
of 8 (inputs: a TMA load into swizzled shared memory needs its row offset a multiple of the
8-row tile), :func:`aligned_rows` of them. :func:`combine_copies` maps per-row expert outputs
back to tokens with their weights.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.fp8_matmul import Fp8Weight, check_fp8_weight, dequantize

FORMATS = ("dense", "mxfp8", "block128")  # a weight: an array, or an Fp8Weight of either format
X_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


class MoeShapes(NamedTuple):
    """The static sizes of one call and the format of each expert weight."""
    t: int  # tokens
    k: int  # experts per token
    h: int  # hidden size
    i: int  # intermediate size (per expert, this rank's)
    e: int  # local experts
    gate_up_fmt: str  # one of FORMATS
    down_fmt: str

    @property
    def copies(self) -> int:
        return self.t * self.k


def _shape(a) -> tuple[int, ...]:
    return tuple(getattr(a, "shape", ()))


def weight_format(w, name: str) -> str:
    """``"dense"`` for an array, else the :class:`Fp8Weight`'s format (checked)."""
    if isinstance(w, Fp8Weight):
        return check_fp8_weight(w, name)
    if not hasattr(w, "shape") or not hasattr(w, "dtype"):
        raise ValueError(f"{name}: expected an array or an Fp8Weight, got {type(w).__name__}")
    return "dense"


def check_moe_inputs(x, weights, experts, token_mask, gate_up, down, first_expert=0,
                     name: str = "moe_experts") -> MoeShapes:
    """Checks the contract's shapes and dtypes (static); ValueError naming the argument,
    its field and the expected shape / dtype otherwise. Returns the sizes."""
    xs = _shape(x)
    if len(xs) != 2:
        raise ValueError(f"{name}: x must be [T, H], got shape {xs}")
    if jnp.dtype(x.dtype) not in X_DTYPES:
        raise ValueError(f"{name}: x dtype must be bfloat16, float16 or float32, got {x.dtype}")
    t, h = xs
    es = _shape(experts)
    if len(es) != 2 or es[0] != t:
        raise ValueError(f"{name}: experts must be [T, k] with T = {t} (x [T, H]), got shape "
                         f"{es}")
    if not jnp.issubdtype(experts.dtype, jnp.integer):
        raise ValueError(f"{name}: experts dtype must be int32, got {experts.dtype}")
    k = es[1]
    if k < 1:
        raise ValueError(f"{name}: experts must be [T, k] with k >= 1, got shape {es}")
    if _shape(weights) != (t, k):
        raise ValueError(f"{name}: weights must be [T, k] = {(t, k)} (experts [T, k]), got "
                         f"shape {_shape(weights)}")
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise ValueError(f"{name}: weights dtype must be floating (f32), got {weights.dtype}")
    if _shape(token_mask) != (t,):
        raise ValueError(f"{name}: token_mask must be [T] = {(t,)}, got shape "
                         f"{_shape(token_mask)}")
    if jnp.dtype(token_mask.dtype) != jnp.dtype(jnp.bool_):
        raise ValueError(f"{name}: token_mask dtype must be bool, got {token_mask.dtype}")
    if not isinstance(first_expert, int):
        fs = _shape(first_expert)
        if fs != () or not jnp.issubdtype(first_expert.dtype, jnp.integer):
            raise ValueError(f"{name}: first_expert must be a Python int or an int32 scalar, "
                             f"got shape {fs} dtype {getattr(first_expert, 'dtype', None)}")

    gfmt = weight_format(gate_up, f"{name}: gate_up")
    dfmt = weight_format(down, f"{name}: down")
    if gfmt == "dense":
        gs = _shape(gate_up)
        if len(gs) != 3 or gs[1] != h or gs[2] % 2 or gs[2] == 0:
            raise ValueError(f"{name}: gate_up must be [E, H, 2I] with H = {h} (x [T, H]), "
                             f"got shape {gs}")
        if jnp.dtype(gate_up.dtype) != jnp.dtype(x.dtype):
            raise ValueError(f"{name}: gate_up dtype must be x's ({x.dtype}), got "
                             f"{gate_up.dtype}")
        e, i = gs[0], gs[2] // 2
    else:
        gs = _shape(gate_up.values)
        if len(gs) != 3 or gs[2] != h or gs[1] % 2 or gs[1] == 0:
            raise ValueError(f"{name}: gate_up.values must be [E, 2I, H] with H = {h} "
                             f"(x [T, H]), got shape {gs}")
        e, i = gs[0], gs[1] // 2
    if dfmt == "dense":
        ds = _shape(down)
        if ds != (e, i, h):
            raise ValueError(f"{name}: down must be [E, I, H] = {(e, i, h)} (gate_up and x), "
                             f"got shape {ds}")
        if jnp.dtype(down.dtype) != jnp.dtype(x.dtype):
            raise ValueError(f"{name}: down dtype must be x's ({x.dtype}), got {down.dtype}")
    else:
        ds = _shape(down.values)
        if ds != (e, h, i):
            raise ValueError(f"{name}: down.values must be [E, H, I] = {(e, h, i)} (gate_up "
                             f"and x), got shape {ds}")
    if e < 1:
        raise ValueError(f"{name}: gate_up must hold at least one expert, got E = {e}")
    return MoeShapes(t, k, h, i, e, gfmt, dfmt)


def swigluoai(gate_up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``;
    gate|up the two halves of the last axis (the model's activation)."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1.0) * gate * jax.nn.sigmoid(alpha * gate)


def dense_expert_weights(w, dtype) -> jax.Array:
    """``[E, in, out]`` in ``dtype``: an array as is, an :class:`Fp8Weight` (values ``[E, out,
    in]``) dequantized (f32 products rounded once to ``dtype``) and transposed."""
    if isinstance(w, Fp8Weight):
        return jnp.swapaxes(dequantize(w, dtype), -1, -2)
    return w


def local_copies(experts, token_mask, num_experts: int, first_expert=0):
    """(local expert ids ``experts - first_expert`` [T, k] int32, mine [T, k] bool)."""
    local = experts.astype(jnp.int32) - jnp.asarray(first_expert, jnp.int32)
    mine = token_mask[:, None] & (local >= 0) & (local < num_experts)
    return local, mine


@functools.partial(jax.jit, static_argnames=("alpha", "limit"))
def moe_experts_reference(x, weights, experts, token_mask, gate_up, down, *, alpha: float,
                          limit: float, first_expert=0) -> jax.Array:
    """The contract in jax.numpy, expert by expert (a scan over the E local experts, each a
    dense MLP over all T tokens, kept for the tokens with a copy routed to it): the products
    ``x @ gate_up_e`` and ``act @ down_e`` with f32 accumulation, the activation rounded to
    x.dtype in between (fp8 weights dequantized to x.dtype first). Returns f32 [T, H]."""
    s = check_moe_inputs(x, weights, experts, token_mask, gate_up, down, first_expert,
                         "moe_experts_reference")
    gu = dense_expert_weights(gate_up, x.dtype)
    dn = dense_expert_weights(down, x.dtype)
    local, mine = local_copies(experts, token_mask, s.e, first_expert)
    w = jnp.where(mine, weights.astype(jnp.float32), 0.0)

    def expert(acc, e):
        routed = mine & (local == e)
        scale = jnp.sum(jnp.where(routed, w, 0.0), axis=1)  # [T] (duplicates add up)
        hid = jnp.dot(x, gu[e], preferred_element_type=jnp.float32)
        act = swigluoai(hid, alpha, limit).astype(x.dtype)
        y = jnp.dot(act, dn[e], preferred_element_type=jnp.float32)
        contrib = jnp.where(jnp.any(routed, axis=1)[:, None], scale[:, None] * y, 0.0)
        return acc + contrib, None

    out, _ = lax.scan(expert, jnp.zeros((s.t, s.h), jnp.float32), jnp.arange(s.e))
    return out


@functools.partial(jax.jit, static_argnames=("alpha", "limit"))
def moe_experts_xla(x, weights, experts, token_mask, gate_up, down, *, alpha: float,
                    limit: float, first_expert=0) -> jax.Array:
    """The contract as two XLA grouped matmuls (``lax.ragged_dot``): the copies sorted by
    local expert (others' and masked copies behind every group, outside ``group_sizes``: no
    weights read, zeros out), fp8 weights dequantized to x.dtype first. The fallback where
    the kernels do not run (a CPU backend, f16/f32 x, unsupported sizes). Returns f32 [T, H]."""
    s = check_moe_inputs(x, weights, experts, token_mask, gate_up, down, first_expert,
                         "moe_experts_xla")
    gu = dense_expert_weights(gate_up, x.dtype)
    dn = dense_expert_weights(down, x.dtype)
    local, mine = local_copies(experts, token_mask, s.e, first_expert)
    flat = jnp.where(mine, local, s.e).reshape(s.copies)  # e: not a local copy
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=s.e + 1)[:s.e].astype(jnp.int32)
    xs = x[order // s.k]  # [T*k, H]
    hid = lax.ragged_dot(xs, gu, group_sizes, preferred_element_type=jnp.float32)
    act = swigluoai(hid, alpha, limit).astype(x.dtype)  # [T*k, I]
    y = lax.ragged_dot(act, dn, group_sizes, preferred_element_type=jnp.float32)
    unsorted = jnp.zeros_like(y).at[order].set(y).reshape(s.t, s.k, s.h)
    return jnp.einsum("tk,tkh->th", jnp.where(mine, weights.astype(jnp.float32), 0.0),
                      unsorted)


# --------------------------------------------------------------------------- routing

def slot_bound(copies: int, num_experts: int, tile: int) -> int:
    """Most slots ``copies`` copies over ``num_experts`` experts can need with slots of at
    most ``tile`` rows: one partial slot per touched expert plus the full ones."""
    return min(num_experts, copies) + copies // tile


def aligned_rows(copies: int, num_experts: int, align: int) -> int:
    """Most rows the copies take when each expert's group starts at a multiple of ``align``,
    rounded up to a multiple of ``align`` (Mosaic GPU tiles a buffer's rows by 8)."""
    rows = copies + (align - 1) * min(num_experts, copies)
    return -(-rows // align) * align


class CopyGroups(NamedTuple):
    """The copies sorted by local expert and cut into slots (module docstring).

    order       [n] int32: sorted row r holds copy ``order[r]`` (copy = token * k + j)
    num_local   int32 scalar: the local copies, sorted rows ``[0, num_local)``
    slots       [S, 4] int32: per slot (local expert, first aligned row, first sorted row,
                rows); rows = 0 past ``num_slots``
    num_slots   int32 scalar
    aligned_tokens  [A] int32: the token of each aligned row (each expert's group starts at
                a multiple of ``align``; rows of no copy: token 0), A = :func:`aligned_rows`
    mine        [T, k] bool
    """
    order: jax.Array
    num_local: jax.Array
    slots: jax.Array
    num_slots: jax.Array
    aligned_tokens: jax.Array
    mine: jax.Array


def group_copies(experts, token_mask, num_experts: int, tile: int, first_expert=0,
                 align: int = 8) -> CopyGroups:
    """Sorts the copies by local expert and cuts each expert's rows into slots of at most
    ``tile`` rows (a multiple of ``align``), in two numberings: the sorted rows (dense) and
    the aligned rows (each expert's group padded to a multiple of ``align``; what the
    kernels' TMA loads index). :class:`CopyGroups`, :func:`slot_bound` slots."""
    if tile % align:
        raise ValueError(f"group_copies: tile = {tile} must be a multiple of align = {align}")
    t, k = experts.shape
    n = t * k
    e = num_experts
    local, mine = local_copies(experts, token_mask, e, first_expert)
    flat = jnp.where(mine, local, e).reshape(n)  # e: not a local copy
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    counts = jnp.bincount(flat, length=e + 1)[:e].astype(jnp.int32)
    offsets = jnp.cumsum(counts) - counts
    padded = (counts + align - 1) // align * align
    aligned_offsets = jnp.cumsum(padded) - padded
    chunks = (counts + tile - 1) // tile
    ends = jnp.cumsum(chunks)  # slots of experts <= e
    num_slots = ends[-1]
    sb = slot_bound(n, e, tile)
    s = jnp.arange(sb, dtype=jnp.int32)
    used = s < num_slots
    ex = jnp.minimum(jnp.sum(ends[None, :] <= s[:, None], axis=1), e - 1).astype(jnp.int32)
    q = s - (ends[ex] - chunks[ex])  # slot index within its expert
    rows = jnp.where(used, jnp.clip(counts[ex] - q * tile, 0, tile), 0)
    in_start = jnp.where(used, aligned_offsets[ex] + q * tile, 0)
    out_start = jnp.where(used, offsets[ex] + q * tile, 0)
    slots = jnp.stack([ex, in_start, out_start, rows], axis=1).astype(jnp.int32)
    # aligned row of each sorted local row; the others dropped
    r = jnp.arange(n, dtype=jnp.int32)
    se = jnp.minimum(flat[order], e - 1)
    a = aligned_rows(n, e, align)
    pos = jnp.where(r < jnp.sum(counts), aligned_offsets[se] + r - offsets[se], a)
    aligned_tokens = jnp.zeros((a,), jnp.int32).at[pos].set(order // k, mode="drop")
    return CopyGroups(order=order, num_local=jnp.sum(counts), slots=slots,
                      num_slots=num_slots.astype(jnp.int32), aligned_tokens=aligned_tokens,
                      mine=mine)


def combine_copies(y_rows: jax.Array, groups: CopyGroups, weights: jax.Array) -> jax.Array:
    """Per sorted row expert outputs ``y_rows`` [n, H] f32 (rows past ``num_local`` may hold
    anything) -> f32 [T, H]: each token's sum of its local copies times their weights (exact
    f32 products and sums, no matmul)."""
    t, k = groups.mine.shape
    n, h = y_rows.shape
    row_of = jnp.zeros((n,), jnp.int32).at[groups.order].set(jnp.arange(n, dtype=jnp.int32))
    y = y_rows[row_of].reshape(t, k, h)  # each copy's row (a gather)
    w = weights.astype(jnp.float32)[:, :, None]
    return jnp.sum(jnp.where(groups.mine[:, :, None], w * y, 0.0), axis=1)


__all__ = ["moe_experts_reference", "moe_experts_xla", "check_moe_inputs", "MoeShapes", "weight_format",
           "swigluoai", "dense_expert_weights", "local_copies", "group_copies",
           "combine_copies", "CopyGroups", "slot_bound", "aligned_rows", "FORMATS"]

"""MSA page top-k selection: Pallas (Triton) kernel and jnp reference.

Per (token t, head h) row of block scores:
  1. n = clamp(num_valid_pages[t], 0, P).
  2. n <= topk: output [0, 1, ..., n-1, -1, ...] whatever the scores.
  3. else: the local blocks n-local_blocks .. n-1 and the init blocks 0 .. init_blocks-1
     get +inf; take the `topk` best by (score desc, block id asc); a pick >= n or with score
     -inf becomes -1.
  4. valid ids sorted ascending, -1 only at the tail.
NaN scores are treated as -inf (never selected unless forced) and -0.0 as +0.0, so equal
scores (IEEE ==) always tie-break by block id, in the kernel and in the lax.top_k reference.

Shapes / dtypes:
  scores           [T, H, P]     f32
  num_valid_pages  [T]           int32
  result           [T, H, topk]  int32

Kernel: one program per token (all H rows at once), the row padded to Pp = next_pow2(P)
with -inf. Triton has no sort/top_k, so `topk` rounds each take the row max and the smallest
id among the ties (then knock that entry out); the winners are put in ascending order by a
[topk, topk] rank compare (rank = number of smaller ids; -1 picks rank last).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._interpret import resolve_interpret
from pallas_kernels._shapes import TOPK, is_pow2, next_pow2


def validate_scores(scores, num_valid_pages, topk, local_blocks, init_blocks) -> None:
    """Raises ValueError / TypeError naming the offending argument and the bound."""
    if scores.ndim != 3 or min(scores.shape) < 1:
        raise ValueError(f"scores: expected shape [T >= 1, H >= 1, P >= 1], got {scores.shape}")
    if jnp.dtype(scores.dtype) != jnp.dtype(jnp.float32):
        raise TypeError(f"scores: dtype must be float32, got {scores.dtype}")
    validate_selection(scores.shape[0], num_valid_pages, topk, local_blocks, init_blocks)


def validate_selection(num_tokens: int, num_valid_pages, topk, local_blocks,
                       init_blocks) -> None:
    """The selector's own arguments (``num_valid_pages`` may be None: counted elsewhere);
    raises ValueError / TypeError naming the offending argument and the bound."""
    if num_valid_pages is not None:
        if num_valid_pages.shape != (num_tokens,):
            raise ValueError(f"num_valid_pages: expected shape [T]=({num_tokens},), "
                             f"got {num_valid_pages.shape}")
        if jnp.dtype(num_valid_pages.dtype) != jnp.dtype(jnp.int32):
            raise TypeError(f"num_valid_pages: dtype must be int32, "
                            f"got {num_valid_pages.dtype}")
    if not isinstance(topk, int) or not is_pow2(topk):
        raise ValueError(f"topk: must be a power of two >= 1, got {topk}")
    if not isinstance(local_blocks, int) or not 0 <= local_blocks <= topk:
        raise ValueError(f"local_blocks: must be in [0, topk={topk}], got {local_blocks}")
    if not isinstance(init_blocks, int) or not 0 <= init_blocks <= topk - local_blocks:
        raise ValueError(f"init_blocks: must be in [0, topk - local_blocks = "
                         f"{topk - local_blocks}], got {init_blocks}")


def prepare_scores(x, ids, nvp, *, max_pages: int, topk: int, local_blocks: int,
                   init_blocks: int):
    """The selector's input, in a kernel or a reference (jnp ops only): the scores with NaN as
    -inf and -0 as +0, -inf outside [0, n), +inf on forced blocks (every valid block when
    n <= topk: the +inf ties then resolve to ids 0..n-1 by the id tie-break)."""
    n = jnp.clip(nvp, 0, max_pages)
    valid = ids < n
    forced = valid & ((n <= topk) | (ids >= n - local_blocks) | (ids < init_blocks))
    x = jnp.where(jnp.isnan(x), -jnp.inf, jnp.where(x == 0, 0.0, x))  # NaN -> -inf, -0 -> +0
    return jnp.where(forced, jnp.inf, jnp.where(valid, x, -jnp.inf))


def select_rows(x, nvp, *, max_pages: int, topk: int, local_blocks: int, init_blocks: int):
    """The selection of one token inside a kernel: ``x [Hs, Pp]`` f32 block scores (columns
    ``>= max_pages`` may hold anything: they are masked), ``nvp`` int32 scalar -> ``[Hs, topk]``
    int32 block ids, ascending, -1 last (see the module docstring)."""
    hs, pp = x.shape
    ids = lax.broadcasted_iota(jnp.int32, (hs, pp), 1)
    x = prepare_scores(x, ids, nvp, max_pages=max_pages, topk=topk, local_blocks=local_blocks,
                       init_blocks=init_blocks)
    slot = lax.broadcasted_iota(jnp.int32, (hs, topk), 1)

    def pick(r, carry):
        x, win = carry
        m = jnp.max(x, axis=1, keepdims=True)  # [Hs, 1]
        i = jnp.min(jnp.where(x == m, ids, pp), axis=1, keepdims=True)  # smallest id of the max
        win = jnp.where(slot == r, jnp.where(m > -jnp.inf, i, -1), win)
        x = jnp.where(ids == i, -jnp.inf, x)
        return x, win

    win = jnp.full((hs, topk), -1, jnp.int32)
    _, win = lax.fori_loop(0, topk, pick, (x, win))

    # Ascending order, -1 last: rank[a] = #{b : key[b] < key[a] or (== and b < a)}.
    key = jnp.where(win < 0, pp, win)
    ka, kb = key[:, :, None], key[:, None, :]  # [Hs, a, b]
    a_idx = lax.broadcasted_iota(jnp.int32, (hs, topk, topk), 1)
    b_idx = lax.broadcasted_iota(jnp.int32, (hs, topk, topk), 2)
    before = (kb < ka) | ((kb == ka) & (b_idx < a_idx))
    rank = jnp.sum(before.astype(jnp.int32), axis=2)  # [Hs, topk]
    # out[r] = win[a] with rank[a] == r (ranks are a permutation).
    r_idx = lax.broadcasted_iota(jnp.int32, (hs, topk, topk), 2)
    hit = rank[:, :, None] == r_idx  # [Hs, a, r]
    return jnp.sum(jnp.where(hit, win[:, :, None], 0), axis=1)


def _topk_select_kernel(s_ref, cnt_ref, out_ref, *, max_pages: int, topk: int,
                        local_blocks: int, init_blocks: int):
    """One token: s_ref [Hs, Pp] (block), cnt_ref [T] (whole: num_valid_pages), out_ref
    [Hs, topk] (block)."""
    t = pl.program_id(0)
    nvp = cnt_ref[t]
    out_ref[...] = select_rows(s_ref[...], nvp, max_pages=max_pages, topk=topk,
                               local_blocks=local_blocks, init_blocks=init_blocks)


@functools.partial(jax.jit, static_argnames=("topk", "local_blocks", "init_blocks",
                                             "interpret", "num_warps"))
def sparse_topk_select(scores: jax.Array, num_valid_pages: jax.Array, *, topk: int = TOPK,
                       local_blocks: int = 1, init_blocks: int = 0,
                       interpret: bool | None = None, num_warps: int = 4) -> jax.Array:
    """Selected block ids [T, H, topk] int32 (see module docstring), Pallas Triton kernel.

    `interpret`: Pallas interpret mode; None (default) interprets on every backend but a GPU.
    Tunable (static): `num_warps`.
    """
    validate_scores(scores, num_valid_pages, topk, local_blocks, init_blocks)
    if num_warps < 1 or not is_pow2(num_warps):
        raise ValueError(f"num_warps: must be a power of two >= 1, got {num_warps}")
    t, h, p = scores.shape
    hs, pp = next_pow2(h), next_pow2(p)
    if (hs, pp) != (h, p):
        scores = jnp.pad(scores, ((0, 0), (0, hs - h), (0, pp - p)),
                         constant_values=-jnp.inf)
    kernel = functools.partial(_topk_select_kernel, max_pages=p, topk=topk,
                               local_blocks=local_blocks, init_blocks=init_blocks)
    out = pl.pallas_call(
        kernel,
        grid=(t,),
        in_specs=[pl.BlockSpec((None, hs, pp), lambda i: (i, 0, 0)),
                  pl.BlockSpec((t,), lambda i: (0,))],
        out_specs=pl.BlockSpec((None, hs, topk), lambda i: (i, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((t, hs, topk), jnp.int32),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=resolve_interpret(interpret),
        name="sparse_topk_select",
    )(scores, num_valid_pages)
    return out[:, :h] if hs != h else out


@functools.partial(jax.jit, static_argnames=("topk", "local_blocks", "init_blocks"))
def sparse_topk_select_reference(scores: jax.Array, num_valid_pages: jax.Array, *,
                                 topk: int = TOPK, local_blocks: int = 1,
                                 init_blocks: int = 0) -> jax.Array:
    """Pure jnp reference of `sparse_topk_select` (lax.top_k + sort)."""
    validate_scores(scores, num_valid_pages, topk, local_blocks, init_blocks)
    t, h, p = scores.shape
    ids = jnp.arange(p, dtype=jnp.int32)[None, None, :]
    x = prepare_scores(scores, ids, num_valid_pages[:, None, None], max_pages=p, topk=topk,
                       local_blocks=local_blocks, init_blocks=init_blocks)
    if p < topk:  # lax.top_k needs k <= P
        x = jnp.pad(x, ((0, 0), (0, 0), (0, topk - p)), constant_values=-jnp.inf)
    vals, idx = lax.top_k(x, topk)  # ties: smaller index first
    key = jnp.where(vals > -jnp.inf, idx, jnp.iinfo(jnp.int32).max)
    key = jnp.sort(key, axis=-1)
    return jnp.where(key == jnp.iinfo(jnp.int32).max, -1, key).astype(jnp.int32)

"""MSA indexer block scores: Pallas (Triton) kernel and jnp reference.

S[t, h, b] = max_{i < 128, b*128 + i <= positions[t]} <index_q[t, h], index_k[page, i]>
with page = block_table[req_indices[t], b], computed in fp32; -inf for blocks
b >= nvp_t = positions[t] // 128 + 1 (those pages are never loaded) and for a block whose
keys are all in the causal future.

Shapes / dtypes:
  index_q        [T, H, Di]   bf16 | f16 | f32 (H index heads, Di a power of two >= 16), or
                              float8_e4m3fn with an fp8 cache (an fp8 x fp8 dot: the queries
                              rounded to e4m3 by the caller, as vLLM's fp8 indexer does)
  index_k_cache  [N, 128, Di] index_q's dtype, or float8_e4m3fn (raw fp8 values, no scale,
                              half the bytes of the O(L) index-K scan vs bf16; upcast exactly
                              after each page load to the dot dtype of `dot_dtype`: f16 for
                              bf16 queries, since e4m3 -> f16 is one conversion and e4m3 ->
                              bf16 several)
  block_table    [R, P]       int32 physical page ids
  req_indices    [T]          int32 request row of each token
  positions      [T]          int32 absolute position of each token
  result         [T, H, P]    f32

Safety boundary: every page id is clamped to [0, N) and every request row to [0, R) before
an address is formed, and block-table reads stay inside columns [0, P) of that row, so a
wrong id (a -1 sentinel, a stale or garbage entry) can never cause an out-of-bounds read.
Such an id yields the scores of the clamped page, not an error: callers must keep the
block-table entries a token may read in [0, N) (padded rows point them at the null page 0). Index-K pages of blocks b >= nvp_t are never loaded (no memory traffic for them).

Kernel layout: grid (T, ceil(P / pages_per_program)); program (t, c) owns pages
[c * ppp, (c + 1) * ppp) of token t, loads the token's H query rows once and loops
(software-pipelined fori_loop) over its valid pages, one contiguous [128, Di] page per
iteration, scoring all H heads against it (shared index-key head: one read per page per
token); the program's page ids are loaded as one vector before the loop by default. The
dot needs M >= 16 rows: the H query rows are replicated 16 / H times (no padding rows to
mask) and the duplicate rows are folded back with a max at the end.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._interpret import resolve_interpret
from pallas_kernels._shapes import MIN_DOT, NUM_SMS_H200, PAGE_SIZE, is_pow2, next_pow2, whole_block

_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
FP8_INDEX_K_DTYPE = jnp.dtype(jnp.float8_e4m3fn)  # the one index-K dtype besides index_q's
_F16_MAX = float(jnp.finfo(jnp.float16).max)


def dot_dtype(q_dtype, k_dtype):
    """Operand dtype of the score dot: index_q's (e4m3 queries over the e4m3 cache: an fp8 x
    fp8 dot with f32 accumulation), except f16 for bf16 queries over an fp8 cache (every e4m3
    value and every bf16 query in f16's range [6e-5, 65504] is exact)."""
    if jnp.dtype(k_dtype) == FP8_INDEX_K_DTYPE and jnp.dtype(q_dtype) == jnp.bfloat16:
        return jnp.dtype(jnp.float16)
    return jnp.dtype(q_dtype)


def cast_query(q, dtype):
    """index_q in the dot dtype; narrowing bf16 -> f16 clips to +-65504 (no inf)."""
    if jnp.dtype(dtype) == jnp.float16 and q.dtype == jnp.bfloat16:
        q = jnp.clip(q.astype(jnp.float32), -_F16_MAX, _F16_MAX)
    return q.astype(dtype)


def validate_index_inputs(index_q, index_k_cache, block_table, req_indices, positions) -> None:
    """Raises ValueError / TypeError naming the offending argument and the bound."""
    if index_q.ndim != 3:
        raise ValueError(f"index_q: expected rank 3 [T, H, Di], got shape {index_q.shape}")
    t, h, di = index_q.shape
    if t < 1:
        raise ValueError(f"index_q: needs T >= 1 tokens, got shape {index_q.shape}")
    if index_k_cache.ndim != 3 or index_k_cache.shape[1] != PAGE_SIZE:
        raise ValueError(f"index_k_cache: expected shape [N, {PAGE_SIZE}, Di], "
                         f"got {index_k_cache.shape}")
    n = index_k_cache.shape[0]
    if n < 1:
        raise ValueError(f"index_k_cache: needs at least 1 page (N >= 1), got N={n}")
    if index_k_cache.shape[2] != di:
        raise ValueError(f"index_k_cache: last dim must equal index_q's Di={di}, "
                         f"got {index_k_cache.shape[2]}")
    if not is_pow2(di) or di < MIN_DOT:
        raise ValueError(f"index_q: Di must be a power of two >= {MIN_DOT}, got {di}")
    if h < 1:
        raise ValueError(f"index_q: needs H >= 1 index heads, got {h}")
    fp8_pair = (jnp.dtype(index_q.dtype) == FP8_INDEX_K_DTYPE
                and jnp.dtype(index_k_cache.dtype) == FP8_INDEX_K_DTYPE)
    if jnp.dtype(index_q.dtype) not in _SUPPORTED_DTYPES and not fp8_pair:
        raise TypeError(f"index_q: dtype must be one of bfloat16, float16, float32 (or "
                        f"float8_e4m3fn with a float8_e4m3fn index_k_cache), "
                        f"got {index_q.dtype}")
    if jnp.dtype(index_k_cache.dtype) not in (jnp.dtype(index_q.dtype), FP8_INDEX_K_DTYPE):
        raise TypeError(f"index_k_cache: dtype must be index_q's {index_q.dtype} or "
                        f"{FP8_INDEX_K_DTYPE}, got {index_k_cache.dtype}")
    if block_table.ndim != 2 or block_table.shape[0] < 1 or block_table.shape[1] < 1:
        raise ValueError(f"block_table: expected shape [R >= 1, P >= 1], got {block_table.shape}")
    for name, arr in (("block_table", block_table), ("req_indices", req_indices),
                      ("positions", positions)):
        if jnp.dtype(arr.dtype) != jnp.dtype(jnp.int32):
            raise TypeError(f"{name}: dtype must be int32, got {arr.dtype}")
    for name, arr in (("req_indices", req_indices), ("positions", positions)):
        if arr.shape != (t,):
            raise ValueError(f"{name}: expected shape [T]=({t},), got {arr.shape}")


FP8_MAX_PAGES_PER_PROGRAM = 8  # fp8 pages are half the bytes: more, shorter programs


def default_pages_per_program(num_tokens: int, max_pages: int, fp8: bool = False) -> int:
    """Pages per program: about 4-8 programs per SM of an H200, 1 <= ppp <= 64 (a power of
    two); at most 8 over an fp8 index-K cache."""
    target = max(1, (num_tokens * max_pages) // (4 * NUM_SMS_H200))
    ppp = 1 << (target.bit_length() - 1)
    cap = FP8_MAX_PAGES_PER_PROGRAM if fp8 else 64
    return max(1, min(ppp, cap, next_pow2(max_pages)))


def chunk_scores(q_ref, k_ref, bt_ref, req_ref, pos_ref, *, num_heads_pow2: int, rows: int,
                 pages_per_program: int, num_pages_cache: int, num_reqs: int, max_pages: int,
                 preload_block_table: bool):
    """Inside a kernel: the block scores ``[Hs, ppp]`` f32 of token t = program_id(0) over pages
    [c*ppp, (c+1)*ppp), c = program_id(1); -inf for pages past the token's last block.

    q_ref [Hs, Di] (block of token t), k_ref [N, 128, Di] (whole cache), bt_ref [R, P],
    req_ref [T], pos_ref [T] (whole arrays).
    """
    t = pl.program_id(0)
    c = pl.program_id(1)
    hs, ppp = num_heads_pow2, pages_per_program
    di = q_ref.shape[-1]

    q = cast_query(q_ref[...], dot_dtype(q_ref.dtype, k_ref.dtype))  # [Hs, Di]
    if rows != hs:  # replicate the heads to the dot's M rows: row r <-> head r % Hs
        q = jnp.broadcast_to(q[None, :, :], (rows // hs, hs, di)).reshape(rows, di)
    precision = (lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)

    req = jnp.clip(req_ref[t], 0, num_reqs - 1)
    pos = pos_ref[t]
    nvp = jnp.clip(jnp.floor_divide(pos, PAGE_SIZE) + 1, 0, max_pages)
    start = c * ppp
    end = jnp.minimum(start + ppp, nvp)

    key_off = lax.broadcasted_iota(jnp.int32, (PAGE_SIZE, 1), 0)
    col = lax.broadcasted_iota(jnp.int32, (rows, ppp), 1)

    if preload_block_table:
        # The chunk's page ids as one vector load before the loop: the page addresses in the
        # loop then depend on no load, which keeps the loop easy to software-pipeline.
        chunk = bt_ref.at[req, pl.ds(start, ppp)]
        if max_pages % ppp == 0:
            chunk_pages = chunk[...]
        else:  # the last chunk runs past column P - 1
            chunk_pages = plt.load(chunk, mask=start + lax.iota(jnp.int32, ppp) < max_pages,
                                   other=0)
        chunk_pages = jnp.clip(chunk_pages, 0, num_pages_cache - 1)
        lane = lax.iota(jnp.int32, ppp)

    def body(b, acc):
        if preload_block_table:
            page = jnp.sum(jnp.where(lane == b - start, chunk_pages, 0))
        else:
            page = jnp.clip(bt_ref[req, b], 0, num_pages_cache - 1)
        k = k_ref[page, :, :].astype(q.dtype)  # [128, Di], one contiguous page (fp8: upcast)
        s = lax.dot_general(k, q, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)  # [128, rows]
        s = jnp.where(b * PAGE_SIZE + key_off <= pos, s, -jnp.inf)
        m = jnp.max(s, axis=0)  # [rows]
        return jnp.where(col == b - start, m[:, None], acc)

    acc = jnp.full((rows, ppp), -jnp.inf, jnp.float32)
    acc = lax.fori_loop(start, end, body, acc)
    if rows != hs:
        acc = jnp.max(acc.reshape(rows // hs, hs, ppp), axis=0)
    return acc


def _index_scores_kernel(q_ref, k_ref, bt_ref, req_ref, pos_ref, out_ref, **kw):
    """One program: :func:`chunk_scores` into ``out_ref [Hs, ppp]`` (block)."""
    out_ref[...] = chunk_scores(q_ref, k_ref, bt_ref, req_ref, pos_ref, **kw)


def scores_launch(index_q, index_k_cache, block_table, req_indices, positions, *,
                  pages_per_program: int | None, num_warps: int, num_stages: int,
                  preload_block_table: bool):
    """Checks the inputs and tunables (ValueError / TypeError naming them) and returns
    ``(index_q padded to Hs = next_pow2(H) heads, the static keywords of chunk_scores)``."""
    validate_index_inputs(index_q, index_k_cache, block_table, req_indices, positions)
    t, h, _ = index_q.shape
    r, p = block_table.shape
    fp8 = jnp.dtype(index_k_cache.dtype) == FP8_INDEX_K_DTYPE
    ppp = (default_pages_per_program(t, p, fp8) if pages_per_program is None
           else pages_per_program)
    if not is_pow2(ppp):
        raise ValueError(f"pages_per_program: must be a power of two >= 1, got {ppp}")
    if num_warps < 1 or not is_pow2(num_warps):
        raise ValueError(f"num_warps: must be a power of two >= 1, got {num_warps}")
    if num_stages < 1:
        raise ValueError(f"num_stages: must be >= 1, got {num_stages}")
    hs = next_pow2(h)
    if hs != h:
        index_q = jnp.pad(index_q, ((0, 0), (0, hs - h), (0, 0)))
    return index_q, dict(num_heads_pow2=hs, rows=max(MIN_DOT, hs), pages_per_program=ppp,
                         num_pages_cache=index_k_cache.shape[0], num_reqs=r, max_pages=p,
                         preload_block_table=preload_block_table)


@functools.partial(jax.jit, static_argnames=("interpret", "pages_per_program", "num_warps",
                                             "num_stages", "preload_block_table"))
def msa_index_scores(index_q: jax.Array, index_k_cache: jax.Array, block_table: jax.Array,
                     req_indices: jax.Array, positions: jax.Array, *,
                     interpret: bool | None = None, pages_per_program: int | None = None, num_warps: int = 4,
                     num_stages: int = 3, preload_block_table: bool = True) -> jax.Array:
    """Block scores [T, H, P] f32 (see module docstring) with a Pallas Triton kernel.

    `interpret`: Pallas interpret mode; None (default) interprets on every backend but a GPU.
    Tunables (static): `pages_per_program` (power of two; default
    `default_pages_per_program(T, P, fp8 cache)`), `num_warps`, `num_stages` (software
    pipelining depth of the page loop), `preload_block_table` (load the program's ppp page
    ids as one vector before the loop, else one scalar load per page inside the loop).
    """
    padded_q, kw = scores_launch(index_q, index_k_cache, block_table, req_indices, positions,
                                 pages_per_program=pages_per_program, num_warps=num_warps,
                                 num_stages=num_stages, preload_block_table=preload_block_table)
    t, h, di = index_q.shape
    n = index_k_cache.shape[0]
    r, p = block_table.shape
    hs, ppp = kw["num_heads_pow2"], kw["pages_per_program"]
    num_chunks = pl.cdiv(p, ppp)
    kernel = functools.partial(_index_scores_kernel, **kw)
    out = pl.pallas_call(
        kernel,
        grid=(t, num_chunks),
        in_specs=[
            pl.BlockSpec((None, hs, di), lambda i, c: (i, 0, 0)),
            whole_block((n, PAGE_SIZE, di)),
            whole_block((r, p)),
            whole_block((t,)),
            whole_block((t,)),
        ],
        out_specs=pl.BlockSpec((None, hs, ppp), lambda i, c: (i, 0, c)),
        out_shape=jax.ShapeDtypeStruct((t, hs, num_chunks * ppp), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=resolve_interpret(interpret),
        name="msa_index_scores",
    )(padded_q, index_k_cache, block_table, req_indices, positions)
    if out.shape != (t, h, p):
        out = out[:, :h, :p]
    return out


@jax.jit
def msa_index_scores_reference(index_q: jax.Array, index_k_cache: jax.Array,
                               block_table: jax.Array, req_indices: jax.Array,
                               positions: jax.Array) -> jax.Array:
    """Pure jnp reference of `msa_index_scores` (same clamping of page and request ids; the
    operands are cast to `dot_dtype` like the kernel's, then to f32)."""
    validate_index_inputs(index_q, index_k_cache, block_table, req_indices, positions)
    n = index_k_cache.shape[0]
    r, p = block_table.shape
    req = jnp.clip(req_indices, 0, r - 1)
    pages = jnp.clip(block_table[req], 0, n - 1)  # [T, P]
    op_dtype = dot_dtype(index_q.dtype, index_k_cache.dtype)
    k = index_k_cache[pages].astype(op_dtype).astype(jnp.float32)  # [T, P, 128, Di]
    q = cast_query(index_q, op_dtype).astype(jnp.float32)
    s = jnp.einsum("thd,tpkd->thpk", q, k,
                   precision=lax.Precision.HIGHEST)
    key = jnp.arange(p)[:, None] * PAGE_SIZE + jnp.arange(PAGE_SIZE)[None, :]  # [P, 128]
    visible = key[None, :, :] <= positions[:, None, None]  # [T, P, 128]
    s = jnp.where(visible[:, None, :, :], s, -jnp.inf)
    return jnp.max(s, axis=-1)

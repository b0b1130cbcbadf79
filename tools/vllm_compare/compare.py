"""Comparison against vLLM 0.33.0's MiniMax-M3 operators on the same seeded inputs.

Each case (``CASES``) is generated from its seed: requests with their sequence and query
lengths, a block table over a random permutation of physical pages (page 0 = null page),
a bf16 KV cache and bf16 queries, and an index-K cache with index queries in bf16 or, for the
``index_dtype="fp8_e4m3"`` cases, in float8_e4m3fn (raw values, no scale: vLLM's fp8 indexer
path, an e4m3 x e4m3 dot; ours takes the e4m3 cache as is and the same e4m3 index queries
carried exactly in bf16, since ``msa_index_scores`` takes bf16/f16/f32 queries). Both sides get
the same inputs:

- ours: ``pallas_kernels`` (``--ours kernels``: the Pallas kernels, interpret mode on CPU;
  ``--ours reference``: their jnp references) — ``msa_index_scores`` -> ``sparse_topk_select``
  -> ``sparse_decode`` (decode cases) or ``sparse_prefill`` (prefill cases);
- vLLM: ``minimax_m3_index_decode`` + ``minimax_m3_sparse_attn_decode`` (decode) or
  ``minimax_m3_index_score`` + ``minimax_m3_index_topk`` + ``minimax_m3_sparse_attn``
  (prefill), run by ``tools/vllm_compare/vllm_side.py`` in a subprocess (``--vllm-python``;
  on CPU the ``.venv-vllm`` Python under Triton's interpreter, on a GPU compiled).

Per case it reports: selection agreement as sets per (token, KV head); exact score ties
(the 16th and 17th best block scores equal in exact float64 arithmetic, where any choice
is correct) counted separately and never hidden; attention output relative L2 error
(tokens whose selections agree on every head; and ours fed vLLM's selection, all tokens);
both sides' error against a float64 oracle; on a GPU both sides' median times.

CLI: ``jax-msa-runner compare [--device cpu|gpu] [--ours kernels|reference] ...``
(``python -m tools.vllm_compare.compare --help``). Exit status 0 iff every case passes; 2
with one error line naming the flag and its bound for a bad flag value.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

PAGE = 128
TOPK = 16
GROUP = 16  # query heads per KV head (MiniMax-M3)
INDEX_DTYPES = ("bf16", "fp8_e4m3")  # index-K cache and index queries: bits as uint16 / uint8
REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DEFAULT_OPS_DIR = REPO / ".vllm_ops"
VLLM_SIDE = pathlib.Path(__file__).resolve().with_name("vllm_side.py")


@dataclasses.dataclass(frozen=True)
class CaseSpec:
    """One seeded comparison case.

    mode: 'decode' (every request has the same query length, 1-4 = spec decode) or 'prefill'
    (a chunk of ``query_lens[r]`` tokens after a prefix of ``seq_lens[r] - query_lens[r]``).
    zero_index_q_reqs: requests whose index queries are zero (all block scores tie exactly).
    perturb_vllm_page: negative control — one index-K page is changed on vLLM's input only.
    index_dtype: "bf16" or "fp8_e4m3" (index-K cache and index queries in float8_e4m3fn).
    """

    name: str
    mode: str
    num_kv_heads: int
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    seed: int
    covers: str = ""
    zero_index_q_reqs: tuple[int, ...] = ()
    perturb_vllm_page: bool = False
    index_dtype: str = "bf16"


CASES: tuple[CaseSpec, ...] = (
    CaseSpec("dec_h1_below", "decode", 1, (1000, 300), (1, 1), 101, "< 16 pages, partial pages"),
    CaseSpec("dec_h1_at16", "decode", 1, (2048, 2047), (1, 1), 102, "exactly 16 pages / full last page"),
    CaseSpec("dec_h1_above", "decode", 1, (2049, 2500), (1, 1), 103, "17 and 20 pages"),
    CaseSpec("dec_h1_long", "decode", 1, (5000, 129, 3333), (1, 1, 1), 104, "40 pages, 3 requests"),
    CaseSpec("dec_h4_mixed", "decode", 4, (2500, 700), (1, 1), 105, "Hkv 4, above + below"),
    CaseSpec("dec_h4_long", "decode", 4, (5000,), (1,), 106, "Hkv 4, 40 pages"),
    CaseSpec("dec_h1_spec2", "decode", 1, (2049, 3000), (2, 2), 107, "q_len 2 across the 16-page edge"),
    CaseSpec("dec_h1_spec4", "decode", 1, (2050, 4097), (4, 4), 108,
             "q_len 4 (spec decode) across the 16- and the 32-page edge"),
    CaseSpec("dec_h4_spec3", "decode", 4, (2200,), (3,), 109, "Hkv 4, q_len 3, 18 pages"),
    CaseSpec("pre_h1_prefix", "prefill", 1, (2052, 5), (12, 5), 110, "chunk across 16 pages + fresh"),
    CaseSpec("pre_h1_long", "prefill", 1, (4906, 1003), (6, 3), 111, "prefix 4900 and 1000"),
    CaseSpec("pre_h4_prefix", "prefill", 4, (2304, 103), (4, 3), 112, "Hkv 4 prefill chunks"),
    CaseSpec("dec_h1_ties", "decode", 1, (3000, 2600), (1, 1), 113, "exact ties: zero index q (req 0)",
             zero_index_q_reqs=(0,)),
    CaseSpec("dec_h1_fp8", "decode", 1, (5000, 2049), (1, 1), 114,
             "fp8 e4m3 index q + index-K, 40 and 17 pages", index_dtype="fp8_e4m3"),
    CaseSpec("dec_h4_fp8", "decode", 4, (2200,), (1,), 115, "fp8 e4m3 index, Hkv 4, 18 pages",
             index_dtype="fp8_e4m3"),
    CaseSpec("pre_h1_fp8", "prefill", 1, (2100, 9), (7, 9), 116,
             "fp8 e4m3 index, chunk across 16 pages + fresh", index_dtype="fp8_e4m3"),
)

NEGATIVE_CONTROL = CaseSpec("neg_perturbed_page", "decode", 1, (3000, 2600), (1, 1), 201,
                            "one index-K page perturbed on vLLM's input only", perturb_vllm_page=True)


# ----------------------------------------------------------------------------- inputs
def _bf16_bits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normal values rounded to bf16, as uint16 bit patterns."""
    return rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def bf16_to_f64(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> float64 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _fp8_bits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normal values rounded to float8_e4m3fn, as uint8 bit patterns."""
    return rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def index_to_f64(bits: np.ndarray) -> np.ndarray:
    """Index-K / index-query bit patterns -> float64 (exact): uint16 = bf16, uint8 = e4m3."""
    if bits.dtype == np.uint8:
        return bits.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return bf16_to_f64(bits)


def make_inputs(spec: CaseSpec, index_dim: int = 128, head_dim: int = 128) -> dict[str, np.ndarray]:
    """Generate one case's inputs from its seed (numpy only; bf16 as uint16 bits).

    Returns: mode, index_dtype, index_q [T,Hkv,Di], index_k [N,128,Di] (u16 bf16 or u8 e4m3
    bits), q [T,16*Hkv,D], kv [N,Hkv,128,2D] (u16 bf16 bits); block_table [R,P], seq_lens
    [R], query_lens [R], req_indices [T], positions [T], kv_lens [T] (int32); scale (f32).
    """
    seq = np.asarray(spec.seq_lens, np.int32)
    qlen = np.asarray(spec.query_lens, np.int32)
    if seq.shape != qlen.shape or (qlen < 1).any() or (qlen > seq).any():
        raise ValueError(f"{spec.name}: need 1 <= query_lens <= seq_lens, got {seq}, {qlen}")
    if spec.mode == "decode" and len(set(qlen.tolist())) != 1:
        raise ValueError(f"{spec.name}: decode cases need one query length, got {qlen}")
    if spec.index_dtype not in INDEX_DTYPES:
        raise ValueError(f"{spec.name}: index_dtype must be one of {INDEX_DTYPES}, "
                         f"got {spec.index_dtype!r}")
    index_bits = _bf16_bits if spec.index_dtype == "bf16" else _fp8_bits
    rng = np.random.default_rng(spec.seed)
    hkv, r = spec.num_kv_heads, len(seq)
    pages = -(-seq // PAGE)
    p = int(pages.max())
    n = 1 + int(pages.sum()) + 3  # null page + used pages + a few spare
    perm = rng.permutation(np.arange(1, n, dtype=np.int32))
    bt = np.zeros((r, p), np.int32)
    start = 0
    for i, k in enumerate(pages):
        bt[i, :k] = perm[start:start + k]
        start += k
    req = np.repeat(np.arange(r, dtype=np.int32), qlen)
    qpos = np.concatenate([np.arange(k, dtype=np.int32) for k in qlen])
    positions = (seq - qlen)[req] + qpos
    t = len(req)
    index_q = index_bits(rng, (t, hkv, index_dim))
    for z in spec.zero_index_q_reqs:
        index_q[req == z] = 0
    return {
        "mode": np.asarray(spec.mode),
        "index_dtype": np.asarray(spec.index_dtype),
        "index_q": index_q,
        "index_k": index_bits(rng, (n, PAGE, index_dim)),
        "q": _bf16_bits(rng, (t, GROUP * hkv, head_dim)),
        "kv": _bf16_bits(rng, (n, hkv, PAGE, 2 * head_dim)),
        "block_table": bt,
        "seq_lens": seq,
        "query_lens": qlen,
        "req_indices": req,
        "positions": positions.astype(np.int32),
        "kv_lens": (positions + 1).astype(np.int32),
        "scale": np.float32(head_dim ** -0.5),
    }


def perturb_one_page(inputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict]:
    """Negative control: vLLM's copy of the index-K page of token 0's *worst* block gets
    ``8 * index_q[0, 0]`` in every row, so that block becomes the best of (token 0, head 0)
    on vLLM's side only. Returns (perturbed inputs, description)."""
    if inputs["index_k"].dtype != np.uint16:
        raise ValueError("negative control needs a bf16 index-K cache")
    scores = oracle_scores(inputs)
    nvp = inputs["positions"] // PAGE + 1
    n0 = int(nvp[0])
    if n0 <= TOPK + 1:
        raise ValueError("negative control needs token 0 to see more than 17 pages")
    blk = int(np.argmin(scores[0, 0, :n0 - 1]))
    page = int(inputs["block_table"][inputs["req_indices"][0], blk])
    out = dict(inputs)
    idx_k = inputs["index_k"].copy()
    boosted = (8.0 * bf16_to_f64(inputs["index_q"][0, 0])).astype(np.float32).astype(ml_dtypes.bfloat16)
    idx_k[page] = boosted.view(np.uint16)[None, :]
    out["index_k"] = idx_k
    return out, {"token": 0, "head": 0, "block": blk, "page": page}


# ----------------------------------------------------------------------------- float64 oracle
def oracle_scores(inputs: dict[str, np.ndarray]) -> np.ndarray:
    """Exact block scores [T, Hkv, P] float64; -inf where nothing is visible."""
    iq = index_to_f64(inputs["index_q"])
    ik = index_to_f64(inputs["index_k"])
    bt = inputs["block_table"]
    pages = bt[inputs["req_indices"]]  # [T, P]
    s = np.einsum("thd,tpkd->thpk", iq, ik[pages])  # [T, H, P, 128]
    key = np.arange(bt.shape[1])[:, None] * PAGE + np.arange(PAGE)[None, :]
    visible = key[None] <= inputs["positions"][:, None, None]
    return np.where(visible[:, None], s, -np.inf).max(axis=-1)


def oracle_attention(inputs: dict[str, np.ndarray], selected: np.ndarray) -> np.ndarray:
    """Sparse attention [T, Hq, D] float64 over the given selection [T, Hkv, 16] (ids < 0
    or >= ceil(kv_len / 128) contribute nothing), keys ``< kv_len``."""
    q = bf16_to_f64(inputs["q"])
    kv = bf16_to_f64(inputs["kv"])
    t, hq, d = q.shape
    hkv = kv.shape[1]
    out = np.zeros((t, hq, d))
    for i in range(t):
        kv_len = int(inputs["kv_lens"][i])
        row = inputs["block_table"][inputs["req_indices"][i]]
        for h in range(hkv):
            ids = [int(b) for b in selected[i, h] if 0 <= b < -(-kv_len // PAGE)]
            keys = np.concatenate([np.arange(b * PAGE, min(b * PAGE + PAGE, kv_len)) for b in ids])
            k = kv[row[keys // PAGE], h, keys % PAGE, :d]
            v = kv[row[keys // PAGE], h, keys % PAGE, d:]
            logits = q[i, h * GROUP:(h + 1) * GROUP] @ k.T * float(inputs["scale"])
            w = np.exp(logits - logits.max(axis=-1, keepdims=True))
            out[i, h * GROUP:(h + 1) * GROUP] = (w / w.sum(axis=-1, keepdims=True)) @ v
    return out


# ----------------------------------------------------------------------------- our side
@functools.lru_cache(maxsize=None)
def _our_functions(ours: str, interpret: bool):
    """(indexer, attention) callables of ours: kernels or their jnp references (jitted).

    Cached: every case of one process calls the same jitted functions, so cases of equal
    shapes (dec_h1_ties and the negative control) compile once."""
    import jax

    import pallas_kernels as pk

    if ours == "kernels":
        scores_fn = functools.partial(pk.msa_index_scores, interpret=interpret)
        select_fn = functools.partial(pk.sparse_topk_select, interpret=interpret)
        attn = {"decode": functools.partial(pk.sparse_decode, interpret=interpret),
                "prefill": functools.partial(pk.sparse_prefill, interpret=interpret)}
    elif ours == "reference":
        scores_fn = pk.msa_index_scores_reference
        select_fn = pk.sparse_topk_select_reference
        attn = {"decode": pk.sparse_decode_reference, "prefill": pk.sparse_prefill_reference}
    else:
        raise ValueError(f"ours must be 'kernels' or 'reference', got {ours!r}")

    @jax.jit
    def indexer(index_q, index_k, block_table, req_indices, positions):
        scores = scores_fn(index_q, index_k, block_table, req_indices, positions)
        return select_fn(scores, positions // PAGE + 1)

    attention = {mode: jax.jit(fn, static_argnames=("scale",)) for mode, fn in attn.items()}
    return indexer, attention.__getitem__


def _median_us(fn, iters: int, warmup: int = 3) -> float:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append((time.perf_counter() - t0) * 1e6)
    return float(np.median(samples))


def run_ours(inputs: dict[str, np.ndarray], ours: str, interpret: bool, time_iters: int = 0):
    """Our indexer + select + attention on one case.

    Returns (result dict: selected [T,Hkv,16] i32, out [T,Hq,D] f32, times), and
    ``attend(selected) -> out f32`` (our attention on another selection).
    """
    import jax.numpy as jnp

    indexer, attention = _our_functions(ours, interpret)
    bf = lambda k: jnp.asarray(inputs[k].view(ml_dtypes.bfloat16))  # noqa: E731
    i32 = lambda k: jnp.asarray(inputs[k], jnp.int32)  # noqa: E731
    q, kv = bf("q"), bf("kv")
    if str(inputs["index_dtype"]) == "fp8_e4m3":  # e4m3 cache as is; e4m3 queries exact in bf16
        e4m3 = lambda k: jnp.asarray(inputs[k].view(ml_dtypes.float8_e4m3fn))  # noqa: E731
        iq, ik = e4m3("index_q").astype(jnp.bfloat16), e4m3("index_k")
    else:
        iq, ik = bf("index_q"), bf("index_k")
    bt, req, pos, kv_lens = i32("block_table"), i32("req_indices"), i32("positions"), i32("kv_lens")
    scale = float(inputs["scale"])
    attn = attention(str(inputs["mode"]))

    def run_indexer():
        return indexer(iq, ik, bt, req, pos)

    def attend(sel):
        out, _ = attn(q, kv, jnp.asarray(sel, jnp.int32), bt, req, kv_lens, scale=scale)
        return out

    t0 = time.perf_counter()
    sel = run_indexer()
    out = attend(sel)
    result = {"selected": np.asarray(sel), "out": np.asarray(out.astype(jnp.float32)),
              "wall_s": time.perf_counter() - t0}
    if time_iters > 0:
        result["indexer_us"] = _median_us(run_indexer, time_iters)
        result["attention_us"] = _median_us(lambda: attend(sel), time_iters)
    return result, lambda s: np.asarray(attend(s).astype(jnp.float32))


# ----------------------------------------------------------------------------- comparison
def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b|| (0 for two empty arrays); NaN anywhere gives inf."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size == 0:
        return 0.0
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def compare_selections(ours: np.ndarray, theirs: np.ndarray, scores: np.ndarray,
                       positions: np.ndarray) -> dict:
    """Per (token, head) set comparison of two selections [T, H, 16] with tie accounting.

    A row with ``n = pos // 128 + 1 <= 16`` visible pages must select exactly ``0..n-1``.
    Otherwise the local page is forced and 15 more are chosen; the row is an exact tie when
    the 15th and 16th best non-local exact scores are equal (overall 16th == 17th), and then
    only the pages scoring strictly above the tie value must be in both sets.
    """
    t, h, _ = ours.shape
    stats = {"rows": t * h, "rows_le16": 0, "agree": 0, "ties": 0, "tie_disagree": 0,
             "tie_strict_violations": 0, "mismatch": 0, "invalid": 0, "mismatch_rows": []}
    for i in range(t):
        n = int(positions[i]) // PAGE + 1
        for j in range(h):
            a = {int(x) for x in ours[i, j] if x >= 0}
            b = {int(x) for x in theirs[i, j] if x >= 0}
            want_size = min(n, TOPK)
            if len(a) != want_size or len(b) != want_size or (n - 1) not in a or (n - 1) not in b:
                stats["invalid"] += 1
            tie = False
            if n <= TOPK:
                stats["rows_le16"] += 1
            else:
                s = np.sort(scores[i, j, :n - 1])[::-1]
                tie = bool(s[TOPK - 2] == s[TOPK - 1])
                if tie:
                    stats["ties"] += 1
                    strict = {int(k) for k in np.nonzero(scores[i, j, :n - 1] > s[TOPK - 1])[0]}
                    if not (strict <= a and strict <= b):
                        stats["tie_strict_violations"] += 1
            if a == b:
                stats["agree"] += 1
            elif tie:
                stats["tie_disagree"] += 1
            else:
                stats["mismatch"] += 1
                gap = None if n <= TOPK else float(s[TOPK - 2] - s[TOPK - 1])
                stats["mismatch_rows"].append({"token": i, "head": j, "n_pages": n, "gap": gap,
                                               "only_ours": sorted(a - b), "only_vllm": sorted(b - a)})
    return stats


def summarize_case(spec: CaseSpec, inputs: dict, ours: dict, theirs: dict, attend_ours,
                   tol: float) -> dict:
    """One report row: selection stats, output errors, times and a pass flag."""
    scores = oracle_scores(inputs)
    sel = compare_selections(ours["selected"], theirs["selected"], scores, inputs["positions"])
    vllm_out = bf16_to_f64(theirs["out"])
    agree_tok = np.array([{int(x) for x in ours["selected"][i, h] if x >= 0}
                          == {int(x) for x in theirs["selected"][i, h] if x >= 0}
                          for i in range(len(vllm_out)) for h in range(spec.num_kv_heads)])
    agree_tok = agree_tok.reshape(len(vllm_out), spec.num_kv_heads).all(axis=1)
    row = {
        "case": spec.name, "mode": spec.mode, "hkv": spec.num_kv_heads,
        "index_dtype": spec.index_dtype,
        "seq_lens": list(spec.seq_lens), "query_lens": list(spec.query_lens), "seed": spec.seed,
        "covers": spec.covers, **sel,
        "tokens_compared": int(agree_tok.sum()), "tokens": int(len(vllm_out)),
        "out_rel_err": rel_l2(ours["out"][agree_tok], vllm_out[agree_tok]),
        "out_rel_err_vllm_sel": rel_l2(attend_ours(theirs["selected"]), vllm_out),
        "ours_vs_oracle": rel_l2(ours["out"], oracle_attention(inputs, ours["selected"])),
        "vllm_vs_oracle": rel_l2(vllm_out, oracle_attention(inputs, theirs["selected"])),
        "ours_us": [ours.get("indexer_us"), ours.get("attention_us")],
        "vllm_us": [theirs.get("indexer_us"), theirs.get("attention_us")],
        "error": None,
    }
    row["passed"] = bool(sel["mismatch"] == 0 and sel["invalid"] == 0
                         and sel["tie_strict_violations"] == 0
                         and row["out_rel_err"] <= tol and row["out_rel_err_vllm_sel"] <= tol)
    return row


def _vllm_command(vllm_python: str, ops_dir: pathlib.Path, folder: pathlib.Path, device: str,
                  time_iters: int, names: list[str]) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if device == "cpu":
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    else:
        env.pop("TRITON_INTERPRET", None)
    cmd = [vllm_python, str(VLLM_SIDE), "--ops-dir", str(ops_dir), "--cases", str(folder),
           "--device", "cpu" if device == "cpu" else "cuda", "--time-iters", str(time_iters),
           "--names", ",".join(names)]
    return cmd, env


def _shards(specs: list[CaseSpec], n: int) -> list[list[str]]:
    """Case names split into n groups of about equal interpreter cost (greedy, by rows)."""
    cost = lambda c: 2 + sum(c.query_lens) * c.num_kv_heads * (3 if c.mode == "decode" else 1)  # noqa: E731
    groups = [[] for _ in range(max(1, min(n, len(specs))))]
    load = [0] * len(groups)
    for c in sorted(specs, key=cost, reverse=True):
        i = load.index(min(load))
        groups[i].append(c.name)
        load[i] += cost(c)
    return groups


def run_comparison(specs=CASES, *, ours: str = "kernels", device: str = "cpu",
                   vllm_python: str | None = None, ops_dir: str | os.PathLike = DEFAULT_OPS_DIR,
                   time_iters: int = 0, negative_control: bool = False, tol: float = 1e-2,
                   vllm_workers: int | None = None, log=print) -> list[dict]:
    """Run every case on both sides; returns one report row per case (see summarize_case).

    The vLLM side runs in ``vllm_workers`` subprocesses (default 2 on CPU, 1 on a GPU):
    concurrently with ours on CPU, before ours on a GPU (so timings do not overlap and JAX
    has not reserved GPU memory).
    Negative-control rows have ``passed`` True iff the perturbation was detected.
    Raises ValueError naming the argument and its bound for a bad ``time_iters`` (>= 0),
    ``tol`` (finite, > 0) or ``vllm_workers`` (>= 1).
    """
    if not (isinstance(time_iters, int) and time_iters >= 0):
        raise ValueError(f"time_iters must be an integer >= 0, got {time_iters!r}")
    if not (np.isfinite(tol) and tol > 0):
        raise ValueError(f"tol must be a finite number > 0, got {tol!r}")
    if vllm_workers is not None and not (isinstance(vllm_workers, int) and vllm_workers >= 1):
        raise ValueError(f"vllm_workers must be an integer >= 1, got {vllm_workers!r}")
    specs = list(specs) + ([NEGATIVE_CONTROL] if negative_control else [])
    vllm_python = vllm_python or (str(DEFAULT_VLLM_PYTHON) if device == "cpu" else sys.executable)
    ops_dir = pathlib.Path(ops_dir)
    if not pathlib.Path(vllm_python).exists() and "/" in vllm_python:
        raise FileNotFoundError(f"{vllm_python}: no comparison Python; run `make compare-env`")
    rows = []
    with tempfile.TemporaryDirectory(prefix="msa_compare_") as tmp:
        folder = pathlib.Path(tmp)
        inputs, perturbations = {}, {}
        for spec in specs:
            inputs[spec.name] = make_inputs(spec)
            theirs_in = inputs[spec.name]
            if spec.perturb_vllm_page:
                theirs_in, perturbations[spec.name] = perturb_one_page(inputs[spec.name])
            np.savez(folder / f"{spec.name}.in.npz", **theirs_in)
        t0 = time.perf_counter()
        procs = []
        for names in _shards(specs, vllm_workers or (2 if device == "cpu" else 1)):
            cmd, env = _vllm_command(vllm_python, ops_dir, folder, device, time_iters, names)
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        if device != "cpu":
            vllm_log = "".join(p.communicate()[0] for p in procs)
        ours_results = {}
        for spec in specs:
            try:
                ours_results[spec.name] = run_ours(inputs[spec.name], ours, device == "cpu", time_iters)
                log(f"ours {spec.name}: ok ({ours_results[spec.name][0]['wall_s']:.1f} s)")
            except Exception as exc:  # reported as a failed case
                ours_results[spec.name] = exc
                log(f"ours {spec.name}: ERROR {type(exc).__name__}: {exc}")
        if device == "cpu":
            vllm_log = "".join(p.communicate()[0] for p in procs)
        log(vllm_log.rstrip())
        log(f"both sides done in {time.perf_counter() - t0:.0f} s")
        for spec in specs:
            err_file = folder / f"{spec.name}.vllm.json"
            res_file = folder / f"{spec.name}.vllm.npz"
            base = {"case": spec.name, "mode": spec.mode, "hkv": spec.num_kv_heads,
                    "index_dtype": spec.index_dtype, "seq_lens": list(spec.seq_lens), "query_lens": list(spec.query_lens),
                    "seed": spec.seed, "covers": spec.covers, "passed": False}
            mine = ours_results[spec.name]
            if isinstance(mine, Exception):
                rows.append({**base, "error": f"ours: {type(mine).__name__}: {mine}"})
                continue
            if not res_file.exists():
                detail = json.loads(err_file.read_text())["error"] if err_file.exists() else \
                    f"no result (vLLM side exit status {[p.returncode for p in procs]})"
                rows.append({**base, "error": f"vllm: {detail}"})
                continue
            with np.load(res_file) as z:
                theirs = {k: z[k] for k in z.files}
            row = summarize_case(spec, inputs[spec.name], mine[0], theirs, mine[1], tol)
            if spec.perturb_vllm_page:
                p = perturbations[spec.name]
                hit = any(m["token"] == p["token"] and m["head"] == p["head"] for m in row["mismatch_rows"])
                row.update(negative_control=p, detected=hit, passed=bool(hit and row["mismatch"] > 0))
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------- report
def _fmt_us(pair) -> str:
    return " / ".join("-" if v is None else f"{float(v):.0f}" for v in pair)


def markdown_table(rows: list[dict], header: str = "") -> str:
    """The report as a markdown table (one line per case)."""
    lines = [header] if header else []
    lines += ["| case | mode | Hkv | index | seq_lens | q_lens | rows (<=16 pages) | sets agree "
              "| exact ties (disagree) | mismatch | out rel err (tokens) | rel err, vLLM sel "
              "| ours / vLLM vs f64 | ours us idx / attn | vLLM us idx / attn | pass |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['case']} | {r['mode']} | {r['hkv']} | {r['index_dtype']} "
                         f"| {r['seq_lens']} | {r['query_lens']} "
                         f"| ERROR: {r['error']} |  |  |  |  |  |  |  |  | FAIL |")
            continue
        verdict = "PASS" if r["passed"] else "FAIL"
        if "detected" in r:
            verdict = ("detected" if r["passed"] else "NOT DETECTED") + " (neg. control)"
        lines.append(
            f"| {r['case']} | {r['mode']} | {r['hkv']} | {r['index_dtype']} | {r['seq_lens']} "
            f"| {r['query_lens']} | {r['rows']} ({r['rows_le16']}) | {r['agree']} | {r['ties']} ({r['tie_disagree']}) "
            f"| {r['mismatch']} | {r['out_rel_err']:.1e} ({r['tokens_compared']}/{r['tokens']}) "
            f"| {r['out_rel_err_vllm_sel']:.1e} | {r['ours_vs_oracle']:.1e} / {r['vllm_vs_oracle']:.1e} "
            f"| {_fmt_us(r['ours_us'])} | {_fmt_us(r['vllm_us'])} | {verdict} |")
    return "\n".join(lines)


def _jsonable(rows: list[dict]) -> list[dict]:
    return json.loads(json.dumps(rows, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def int_at_least(low: int):
    """argparse type: an integer >= ``low`` (the error names the bound)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value
    return parse


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}") from None
    if not (np.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = OneLineErrorParser(prog="jax-msa-runner compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                    help="cpu: Pallas interpret mode + Triton interpreter; gpu: both compiled, timed")
    ap.add_argument("--ours", choices=["kernels", "reference"], default="kernels",
                    help="our Pallas kernels (default) or their jnp references")
    ap.add_argument("--vllm-python", default=None,
                    help="Python with torch + triton for vLLM's ops (default: .venv-vllm on cpu, "
                         "this Python on gpu)")
    ap.add_argument("--ops-dir", default=str(DEFAULT_OPS_DIR), help="folder built by vllm_ops.py")
    ap.add_argument("--cases", default="all", help="comma-separated case names, or 'all'")
    ap.add_argument("--negative-control", action="store_true", help="also run the perturbed-page control")
    ap.add_argument("--time-iters", type=int_at_least(0), default=None,
                    help="timed calls per op, >= 0 (default: 0 cpu, 30 gpu)")
    ap.add_argument("--tol", type=positive_float, default=1e-2,
                    help="max output relative L2 error, > 0 (default 1e-2)")
    ap.add_argument("--vllm-workers", type=int_at_least(1), default=None,
                    help="vLLM-side processes, >= 1 (default: 2 on cpu, 1 on gpu)")
    ap.add_argument("--out-dir", default=None, help="write compare.json and compare.md here")
    args = ap.parse_args(argv)
    if args.device == "gpu":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    names = [c.name for c in CASES]
    wanted = names if args.cases == "all" else args.cases.split(",")
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {names}")
    time_iters = args.time_iters if args.time_iters is not None else (30 if args.device == "gpu" else 0)
    rows = run_comparison([c for c in CASES if c.name in wanted], ours=args.ours, device=args.device,
                          vllm_python=args.vllm_python, ops_dir=args.ops_dir, time_iters=time_iters,
                          negative_control=args.negative_control, tol=args.tol,
                          vllm_workers=args.vllm_workers)
    import jax

    header = (f"Comparison vs vLLM 0.33.0 MiniMax-M3 ops — device {args.device} "
              f"({jax.devices()[0].device_kind}), ours = {args.ours}"
              f"{' (Pallas interpret mode)' if args.device == 'cpu' and args.ours == 'kernels' else ''}, "
              f"vLLM = {'Triton interpreter' if args.device == 'cpu' else 'compiled Triton'}; "
              f"times: median of {time_iters} synchronised calls (us)\n")
    table = markdown_table(rows, header)
    print(table)
    if args.out_dir:
        out = pathlib.Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"device": args.device, "device_kind": jax.devices()[0].device_kind, "ours": args.ours,
                "time_iters": time_iters, "tol": args.tol, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        (out / "compare.json").write_text(json.dumps({"meta": meta, "rows": _jsonable(rows)}, indent=1))
        (out / "compare.md").write_text(table + "\n")
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

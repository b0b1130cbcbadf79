"""TEMPORARY device script (not for commit): compiled correctness + timing of the MoE kernels."""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))
import _common  # noqa: E402,F401
from _common import time_jax  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_msa_runner.model import expert_weights, routed_experts_partial  # noqa: E402
from pallas_kernels.fp8_matmul import quantize_block128, quantize_mxfp8  # noqa: E402
from pallas_kernels.moe_experts import moe_experts_reference  # noqa: E402
from pallas_kernels.moe_experts_default import moe_experts_default  # noqa: E402
from pallas_kernels.moe_experts_mgpu import (make_decode_config, make_prefill_config,  # noqa: E402
                                             moe_decode_mgpu, moe_prefill_mgpu)
from pallas_kernels.moe_experts import check_moe_inputs  # noqa: E402

AL, LI = 1.702, 7.0
KW = dict(alpha=AL, limit=LI)
PART = sys.argv[1] if len(sys.argv) > 1 else "check"
FMTS = sys.argv[2].split(",") if len(sys.argv) > 2 else ["dense", "mxfp8", "block128"]


def weights_of(key, e, h, i, fmt):
    k1, k2 = jax.random.split(key)
    gu = jax.random.normal(k1, (e, 2 * i, h), jnp.float32) / np.sqrt(h)
    dn = jax.random.normal(k2, (e, h, i), jnp.float32) / np.sqrt(i)
    if fmt == "dense":
        return (jnp.swapaxes(gu, 1, 2).astype(jnp.bfloat16),
                jnp.swapaxes(dn, 1, 2).astype(jnp.bfloat16))
    q = jax.jit(quantize_mxfp8 if fmt == "mxfp8" else quantize_block128)
    return q(gu), q(dn)


def routing(key, t, k, e_global, e_local, first):
    k1, k2, k3 = jax.random.split(key, 3)
    experts = jnp.argsort(jax.random.uniform(k1, (t, e_global)), axis=1)[:, :k].astype(jnp.int32)
    w = jax.random.uniform(k2, (t, k), jnp.float32) + 0.1
    mask = jax.random.uniform(k3, (t,)) > 0.1
    return w, experts, mask


def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check():
    key = jax.random.key(1)
    rows = []
    for (t, k, h, i, e, eg, first), fmts in [((13, 3, 256, 192, 5, 20, 5), FMTS),
                                              ((16, 4, 6144, 3072, 16, 128, 16), [] if os.environ.get("SMALL") else ["mxfp8"])]:
        for fmt in fmts:
            key, kw_, kr, kx = jax.random.split(key, 4)
            gu, dn = weights_of(kw_, e, h, i, fmt)
            w, ex, m = routing(kr, t, k, eg, e, first)
            x = jax.random.normal(kx, (t, h), jnp.float32).astype(jnp.bfloat16)
            f = jnp.int32(first)
            ref = routed_experts_partial(x, w, ex, m, expert_weights(gu, x.dtype),
                                         expert_weights(dn, x.dtype), AL, LI, first_expert=f)
            ref2 = moe_experts_reference(x, w, ex, m, gu, dn, first_expert=f, **KW)
            outs = {}
            for a_smem in (False, True):
                outs[f"dec{'S' if a_smem else 'R'}"] = moe_decode_mgpu(
                    x, w, ex, m, gu, dn, f, a_in_smem=a_smem, **KW)
                outs[f"pre{'S' if a_smem else 'R'}"] = moe_prefill_mgpu(
                    x, w, ex, m, gu, dn, f, a_in_smem=a_smem, **KW)
            outs["default"] = moe_experts_default(x, w, ex, m, gu, dn, first_expert=f, **KW)
            res = {n: rel(o, ref) for n, o in outs.items()}
            res["ref2"] = rel(ref2, ref)
            fin = all(bool(jnp.isfinite(o).all()) for o in outs.values())
            line = (f"T={t} k={k} H={h} I={i} E={e} {fmt}: finite={fin} " +
                    " ".join(f"{n}={v:.2e}" for n, v in res.items()))
            print(line, flush=True)
            rows.append(line)


def bench():
    h, i, e, k, eg = 6144, 3072, 16, 4, 128
    fmts = [f for f in ("mxfp8", "dense", "block128") if f in FMTS]
    key = jax.random.key(7)
    print(f"{'fmt':9s} {'T':>5s} {'decode_us':>10s} {'prefill_us':>10s} {'xla_us':>10s} "
          f"{'dec_err':>8s} {'pre_err':>8s} cfg", flush=True)
    for fmt in fmts:
        key, kw_ = jax.random.split(key)
        gu, dn = weights_of(kw_, e, h, i, fmt)
        xla = jax.jit(lambda x, w, ex, m, gu, dn: routed_experts_partial(
            x, w, ex, m, expert_weights(gu, jnp.bfloat16), expert_weights(dn, jnp.bfloat16),
            AL, LI, first_expert=0))
        dec = jax.jit(lambda x, w, ex, m, gu, dn: moe_decode_mgpu(x, w, ex, m, gu, dn, 0, **KW))
        pre = jax.jit(lambda x, w, ex, m, gu, dn: moe_prefill_mgpu(x, w, ex, m, gu, dn, 0, **KW))
        for t in TS:
            if time.time() - T0 > BUDGET:
                print("budget: stop", flush=True)
                return
            key, kr, kx = jax.random.split(key, 3)
            w, ex, m = routing(kr, t, k, eg, e, 0)
            m = jnp.ones_like(m)
            x = jax.random.normal(kx, (t, h), jnp.float32).astype(jnp.bfloat16)
            args = (x, w, ex, m, gu, dn)
            ref = xla(*args)
            timing = dict(n=10, trials=3, l2="cold")
            res = {}
            errs = {}
            for name, fn in (("dec", dec), ("pre", pre), ("xla", xla)):
                if name == "dec" and t > 256:
                    res[name] = float("nan")
                    continue
                try:
                    res[name] = time_jax(fn, args, **timing).us
                    if name != "xla":
                        errs[name] = rel(fn(*args), ref)
                except Exception as exc:  # noqa: BLE001
                    print(f"  {name} T={t} failed: {str(exc)[:300]}", flush=True)
                    res[name] = float("nan")
            s = check_moe_inputs(x, w, ex, m, gu, dn)
            dc = make_decode_config(s) if t <= 256 else None
            pc = make_prefill_config(s)
            cfg = (f"dec(c={dc.tile_c},ti={dc.tile_i},th={dc.tile_h},st={dc.stages},"
                   f"G={dc.num_ctas}) " if dc else "") + \
                  f"pre(c={pc.tile_c},st={pc.stages},dk={pc.down_tile_k},ds={pc.down_stages}," \
                  f"G={pc.num_ctas}/{pc.down_num_ctas})"
            print(f"{fmt:9s} {t:5d} {res['dec']:10.1f} {res['pre']:10.1f} {res['xla']:10.1f} "
                  f"{errs.get('dec', float('nan')):8.1e} {errs.get('pre', float('nan')):8.1e} "
                  f"{cfg}", flush=True)


T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "480"))
TS = tuple(int(v) for v in os.environ.get("TS", "1,16,64,256").split(","))

if __name__ == "__main__":
    print(jax.devices(), flush=True)
    t0 = time.time()
    if PART in ("check", "all"):
        check()
    if PART in ("bench", "all"):
        bench()
    print(f"wall {time.time() - t0:.0f}s")

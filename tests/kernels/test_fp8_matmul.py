"""Weight-only fp8 matmul: the formats' quantize/dequantize against float64 numpy, the
reference, the Mosaic GPU kernel (``fp8_matmul_mgpu``), the default (``fp8_matmul_default``)
and the ValueErrors of bad inputs.

The kernel runs in Mosaic GPU interpret mode on a CPU backend and compiled on a GPU (the same
tests). Each case draws a fresh seed (in every assertion message): weights whose magnitude
changes by up to 2^12 between neighbouring 32-element groups (MXFP8) or 128x128 blocks, so a
scale applied to the wrong group shows; shapes that are not multiples of the tiles (T = 3,
17; N = 200; K = 160, 700), zero rows in x. The float64 reference rounds the dequantized
weight to bf16 as the kernel does (exact for MXFP8). The CUDA lowering for an abstract H200
runs on the CPU too.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from _helpers import INTERPRET, fresh_seed
from pallas_kernels._lowering import custom_call_counts, lower_for_cuda
from pallas_kernels.fp8_matmul import (BLOCK, E4M3_MAX, MX_GROUP, Fp8Weight, check_fp8_weight,
                                       dequantize, e8m0_to_f32, fp8_matmul_reference,
                                       quantize_block128, quantize_mxfp8)
from pallas_kernels.fp8_matmul_default import (MAX_KERNEL_TOKENS, fp8_matmul_backend,
                                               fp8_matmul_default, fp8_matmul_xla)
from pallas_kernels.fp8_matmul_mgpu import (MAX_K, fp8_matmul_mgpu, make_config, smem_bytes,
                                            supported, unsupported_reason)
from pallas_kernels._shapes import SMEM_BYTES

ON_GPU = jax.default_backend() == "gpu"
FORMATS = ("mxfp8", "block128")
QUANTIZE = {"mxfp8": quantize_mxfp8, "block128": quantize_block128}


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    """A kernel that raised inside the Mosaic GPU interpreter leaves its state behind."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    interpret_pallas_call.reset_gpu_interpret_mode_state()
    yield


# --------------------------------------------------------------------------- data, numpy

def random_weight(rng, n: int, k: int, fmt: str, spread: int = 12) -> np.ndarray:
    """f32 ``[n, k]``: normal values times 2^u per scale group (MXFP8: 1 x 32; blocks: 128 x
    128), u uniform in [-spread/2, spread/2]."""
    gn, gk = (1, MX_GROUP) if fmt == "mxfp8" else (BLOCK, BLOCK)
    u = rng.integers(-spread // 2, spread // 2 + 1, size=(-(-n // gn), -(-k // gk)))
    mag = np.repeat(np.repeat(2.0 ** u, gn, 0), gk, 1)[:n, :k]
    return (rng.standard_normal((n, k)) * mag * 0.05).astype(np.float32)


def scales_f64(w: Fp8Weight) -> np.ndarray:
    """Each element's scale, float64 ``[N, K]``, decoded in numpy."""
    n, k = w.values.shape
    s = np.asarray(w.scales)
    if s.dtype == np.uint8:
        return np.repeat(np.ldexp(1.0, s.astype(np.int64) - 127), MX_GROUP, axis=1)
    return np.repeat(np.repeat(s.astype(np.float64), BLOCK, 0), BLOCK, 1)[:n, :k]


def dequant_f64(w: Fp8Weight, bf16: bool = False) -> np.ndarray:
    """fp8 x scale in float64 (block scales: rounded to f32 as dequantize does); ``bf16``: then
    rounded to bf16, the kernel's wgmma operand."""
    v = np.asarray(w.values).astype(np.float64) * scales_f64(w)
    if np.asarray(w.scales).dtype == np.float32:
        v = v.astype(np.float32).astype(np.float64)
    if bf16:
        v = v.astype(ml_dtypes.bfloat16).astype(np.float64)
    return v


def check_matmul(y, x, w, out_dtype, msg):
    """``y`` against float64 ``x @ bf16(dequantize(w)).T``: f32 accumulation error (1e-5 of
    ``|x| @ |w|.T``) plus the output's rounding; and against ``fp8_matmul_reference``."""
    x64 = np.asarray(x.astype(jnp.float32), np.float64).reshape(-1, x.shape[-1])
    wq = dequant_f64(w, bf16=True)
    ref = x64 @ wq.T
    mag = np.abs(x64) @ np.abs(wq).T
    out_eps = {jnp.dtype(jnp.float32): 0.0, jnp.dtype(jnp.bfloat16): 2.0 ** -8,
               jnp.dtype(jnp.float16): 2.0 ** -11}[jnp.dtype(out_dtype)]
    got = np.asarray(y.astype(jnp.float32), np.float64).reshape(ref.shape)
    err = np.abs(got - ref)
    bound = 1e-5 * mag + out_eps * np.abs(ref) + 1e-30
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert np.isfinite(got).all() and (err <= bound).all(), (
        f"{msg}: |y - ref| = {err[worst]:.3e} > bound {bound[worst]:.3e} at {worst}")
    # the API's reference (f32 weights, not rounded to bf16): within the bf16 rounding
    y_ref = np.asarray(fp8_matmul_reference(x, w, out_dtype=jnp.float32), np.float64)
    chex.assert_trees_all_close(got, y_ref.reshape(got.shape), atol=float(3e-3 * mag.max()),
                                custom_message=msg)


# --------------------------------------------------------------------------- formats

def test_e8m0_decoding_is_exact():
    e = jnp.asarray([0, 1, 2, 100, 126, 127, 128, 200, 253, 254], jnp.uint8)
    got = np.asarray(e8m0_to_f32(e))
    want = np.ldexp(1.0, np.asarray(e, np.int64) - 127).astype(np.float32)
    chex.assert_trees_all_equal(got.view(np.uint32), want.view(np.uint32))
    assert got[0].view(np.uint32) == 1 << 22  # e = 0: the f32 subnormal 2^-127
    assert got[-1] == np.float32(2.0 ** 127)  # e = 254: the largest finite scale
    assert np.isinf(np.asarray(e8m0_to_f32(jnp.asarray([255], jnp.uint8))))[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_is_exact_against_float64(fmt):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    w = QUANTIZE[fmt](random_weight(rng, 200, 320, fmt))
    assert check_fp8_weight(w) == fmt
    got = np.asarray(dequantize(w, jnp.float32), np.float64)
    chex.assert_trees_all_equal(got, dequant_f64(w), custom_message=f"seed {seed}")
    got16 = np.asarray(dequantize(w, jnp.bfloat16).astype(jnp.float32), np.float64)
    chex.assert_trees_all_equal(got16, dequant_f64(w, bf16=True), custom_message=f"seed {seed}")
    if fmt == "mxfp8":  # fp8 x 2^k is exact in bf16
        chex.assert_trees_all_equal(got16, got, custom_message=f"seed {seed}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_round_trip_error_bounds(fmt):
    """|w - dequantize(quantize(w))| <= 2^-4 |w| (e4m3 rounding) + 2^-10 s (half the smallest
    subnormal step, times the element's scale s); no group saturates; MXFP8 takes the
    smallest exponent keeping the group's amax within 448."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    wf = random_weight(rng, 192, 256, fmt, spread=40)
    wf[5, :] = 0.0  # all-zero groups
    w = QUANTIZE[fmt](wf)
    s = scales_f64(w)
    err = np.abs(dequant_f64(w) - wf.astype(np.float64))
    bound = 2.0 ** -4 * np.abs(wf) * (1 + 1e-6) + 2.0 ** -10 * s
    assert (err <= bound).all(), f"seed {seed}: max excess {np.max(err - bound):.3e}"
    q = np.abs(np.asarray(w.values).astype(np.float64))
    assert q.max() <= E4M3_MAX, f"seed {seed}"
    if fmt == "mxfp8":
        amax = np.abs(wf).reshape(192, -1, MX_GROUP).max(-1)
        e = np.asarray(w.scales).astype(np.int64)
        ratio = amax / np.ldexp(1.0, e - 127)
        nz = amax > 0
        assert ((ratio[nz] > E4M3_MAX / 2) & (ratio[nz] <= E4M3_MAX)).all(), f"seed {seed}"
        assert (e[~nz] == 127).all(), f"seed {seed}"
    else:
        assert (np.asarray(w.scales)[0, :] > 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_against_float64(fmt):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    w = QUANTIZE[fmt](random_weight(rng, 136, 224, fmt))
    x = rng.standard_normal((2, 5, 224)).astype(np.float32)
    y = fp8_matmul_reference(jnp.asarray(x), w)
    chex.assert_shape(y, (2, 5, 136))
    assert y.dtype == jnp.float32
    ref = x.astype(np.float64) @ dequant_f64(w).T
    mag = np.abs(x.astype(np.float64)) @ np.abs(dequant_f64(w)).T
    chex.assert_trees_all_close(np.asarray(y, np.float64), ref, atol=float(1e-6 * mag.max()),
                                custom_message=f"seed {seed}")


# --------------------------------------------------------------------------- the kernel

# (fmt, T, N, K, tunables): tile-unaligned T/N/K, both tile_n, every tile_k, K splits,
# ring depths, an explicit tile_t over several token tiles.
KERNEL_CASES = [
    ("mxfp8", 3, 200, 160, {}),
    ("block128", 3, 200, 160, {}),
    ("mxfp8", 17, 384, 384, dict(tile_k=64, num_stages=3)),
    ("block128", 17, 384, 384, dict(tile_k=256, num_stages=2)),
    ("mxfp8", 17, 256, 1024, dict(k_splits=2, tile_k=256)),
    ("block128", 40, 256, 700, dict(tile_n=128, k_splits=2, tile_k=64)),
    ("mxfp8", 40, 256, 512, dict(tile_n=128, num_stages=4)),
    ("block128", 20, 136, 384, dict(tile_t=8)),  # three token tiles
]


@pytest.mark.parametrize("fmt,t,n,k,kw", KERNEL_CASES)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_reference(fmt, t, n, k, kw, out_dtype):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    w = QUANTIZE[fmt](random_weight(rng, n, k, fmt))
    x = rng.standard_normal((t, k)).astype(np.float32)
    x[t // 2] = 0.0  # a zero row gives a zero row
    x = jnp.asarray(x, jnp.bfloat16)
    y = fp8_matmul_mgpu(x, w, out_dtype=out_dtype, interpret=INTERPRET, **kw)
    chex.assert_shape(y, (t, n))
    assert y.dtype == jnp.dtype(out_dtype)
    msg = f"seed {seed}, {fmt}, T={t} N={n} K={k} {kw} out {jnp.dtype(out_dtype)}"
    check_matmul(y, x, w, out_dtype, msg)
    assert not np.asarray(y[t // 2]).any(), msg


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_leading_dims_f16_out_and_single_token(fmt):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    w = QUANTIZE[fmt](random_weight(rng, 128, 256, fmt))
    x = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.bfloat16)
    y = fp8_matmul_mgpu(x, w, out_dtype=jnp.float16, interpret=INTERPRET)
    chex.assert_shape(y, (2, 3, 128))
    check_matmul(y, x, w, jnp.float16, f"seed {seed}, {fmt}")
    y1 = fp8_matmul_mgpu(x[0, :1], w, interpret=INTERPRET)
    chex.assert_shape(y1, (1, 128))
    chex.assert_trees_all_equal(y1, fp8_matmul_mgpu(x, w, interpret=INTERPRET)[0, :1],
                                custom_message=f"seed {seed}")


def test_kernel_nan_and_empty():
    """A NaN in x reaches its row only; T = 0 gives an empty result."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    w = quantize_mxfp8(random_weight(rng, 64, 128, "mxfp8"))
    x = np.asarray(rng.standard_normal((4, 128)), np.float32)
    x[1, 7] = np.nan
    y = np.asarray(fp8_matmul_mgpu(jnp.asarray(x, jnp.bfloat16), w, interpret=INTERPRET)
                   .astype(jnp.float32))
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2, 3]]).all(), f"seed {seed}"
    empty = fp8_matmul_mgpu(jnp.zeros((0, 128), jnp.bfloat16), w, interpret=INTERPRET)
    chex.assert_shape(empty, (0, 64))


@pytest.mark.skipif(not ON_GPU, reason="A from registers needs the compiled kernel")
@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_a_from_registers_equals_a_through_smem(fmt):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    w = QUANTIZE[fmt](random_weight(rng, 2304, 6144, fmt))
    x = jnp.asarray(rng.standard_normal((24, 6144)), jnp.bfloat16)
    y_reg = fp8_matmul_mgpu(x, w, out_dtype=jnp.float32, a_in_smem=False)
    y_smem = fp8_matmul_mgpu(x, w, out_dtype=jnp.float32, a_in_smem=True)
    chex.assert_trees_all_close(y_reg, y_smem, rtol=1e-6, atol=1e-6,
                                custom_message=f"seed {seed}")
    check_matmul(fp8_matmul_mgpu(x, w), x, w, jnp.bfloat16, f"seed {seed}, {fmt}")


# --------------------------------------------------------------------------- the default

@pytest.mark.parametrize("fmt", FORMATS)
def test_default_on_either_backend_matches_reference(fmt):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    w = QUANTIZE[fmt](random_weight(rng, 200, 320, fmt))
    x = jnp.asarray(rng.standard_normal((2, 3, 320)), jnp.bfloat16)
    msg = f"seed {seed}, {fmt}"
    y = fp8_matmul_default(x, w)  # CPU: XLA; GPU: the compiled kernel
    chex.assert_shape(y, (2, 3, 200))
    assert y.dtype == jnp.bfloat16
    check_matmul(y, x, w, jnp.bfloat16, msg)
    y_xla = fp8_matmul_default(x, w, backend="xla", out_dtype=jnp.float32)
    chex.assert_trees_all_equal(y_xla, fp8_matmul_xla(x, w, out_dtype=jnp.float32))
    check_matmul(y_xla, x, w, jnp.float32, msg)
    y_k = fp8_matmul_default(x, w, interpret=INTERPRET, backend="mosaic")
    check_matmul(y_k, x, w, jnp.bfloat16, msg)
    if INTERPRET:  # interpret=True asks for the kernel (interpreted)
        chex.assert_trees_all_equal(fp8_matmul_default(x, w, interpret=True), y_k)
    for dt in (jnp.float32, jnp.float16):  # other activations: XLA, x.dtype out
        xd = x.astype(dt)
        yd = fp8_matmul_default(xd, w, interpret=INTERPRET)
        assert yd.dtype == jnp.dtype(dt)
        chex.assert_trees_all_close(yd.astype(jnp.float32),
                                    fp8_matmul_reference(xd, w, out_dtype=jnp.float32),
                                    rtol=2e-3, atol=2e-3, custom_message=msg)


def test_default_backend_rule():
    w = quantize_mxfp8(jnp.ones((128, 256), jnp.float32))
    rule = lambda shape, dt=jnp.bfloat16, **kw: fp8_matmul_backend(shape, dt, w, **kw)  # noqa: E731
    assert rule((8, 256), interpreting=False, on_gpu=True) == "mosaic"
    assert rule((2, 128, 256), interpreting=False, on_gpu=True) == "mosaic"  # 256 tokens
    assert rule((MAX_KERNEL_TOKENS + 1, 256), interpreting=False, on_gpu=True) == "xla"
    assert rule((8, 256), interpreting=False, on_gpu=False) == "xla"  # a CPU backend
    assert rule((8, 256), interpreting=True, on_gpu=False) == "mosaic"
    assert rule((1024, 256), interpreting=True, on_gpu=False) == "mosaic"
    assert rule((8, 256), jnp.float16, interpreting=True, on_gpu=True) == "xla"
    assert rule((8, 256), jnp.float32, interpreting=False, on_gpu=True) == "xla"
    assert supported((8, 256), w) and not supported((8, 256), w, jnp.float16)
    w3 = Fp8Weight(w.values[None], w.scales[None])
    assert "2-D" in unsupported_reason((8, 256), w3)
    assert fp8_matmul_backend((8, 256), jnp.bfloat16, w3, interpreting=True, on_gpu=True) == "xla"
    big = Fp8Weight(jax.ShapeDtypeStruct((64, MAX_K + 32), jnp.float8_e4m3fn),
                    jax.ShapeDtypeStruct((64, (MAX_K + 32) // 32), jnp.uint8))
    assert "exceeds" in unsupported_reason((8, MAX_K + 32), big)


# --------------------------------------------------------------------------- bad inputs

def _mx(n=64, k=128):
    return quantize_mxfp8(jnp.ones((n, k), jnp.float32))


@pytest.mark.parametrize("fn", [fp8_matmul_mgpu, fp8_matmul_default, fp8_matmul_reference,
                                fp8_matmul_xla])
def test_bad_weights_and_activations_name_the_field(fn):
    x = jnp.ones((4, 128), jnp.bfloat16)
    w = _mx()
    kw = dict(interpret=INTERPRET) if fn is fp8_matmul_mgpu else {}
    cases = [
        (Fp8Weight(w.values, w.scales.astype(jnp.int32)), x, r"scales: dtype must be uint8"),
        (Fp8Weight(w.values, w.scales[:, :3]), x, r"scales: shape must be \[\.\.\., N, K // 32\]"),
        (Fp8Weight(w.values, jnp.ones((1, 2), jnp.float32)), x,
         r"scales: shape must be \[\.\.\., ceil\(N / 128\), ceil\(K / 128\)\] = \(1, 1\)"),
        (Fp8Weight(w.values.astype(jnp.bfloat16), w.scales), x, r"values: dtype must be "
                                                                 r"float8_e4m3fn"),
        (Fp8Weight(jnp.zeros((64, 100), jnp.float8_e4m3fn), jnp.zeros((64, 3), jnp.uint8)),
         jnp.ones((4, 100), jnp.bfloat16), r"K = 100 must be a multiple of 32"),
        (w, jnp.ones((4, 96), jnp.bfloat16), r"x must be \[\.\.\., K\] with K = 128"),
        (w, jnp.ones((4, 128), jnp.int8), r"x dtype must be bf16, f16 or f32"),
        (Fp8Weight(w.values[None], w.scales[None]), x, r"w.values must be 2-D"),
    ]
    for weight, act, match in cases:
        with pytest.raises(ValueError, match=match):
            fn(act, weight, **kw)


@pytest.mark.parametrize("kw,match", [
    (dict(tile_n=96), r"tile_n must be one of \(64, 128\)"),
    (dict(tile_k=32), r"tile_k must be one of \(64, 128, 256\)"),
    (dict(num_stages=1), r"num_stages must be one of \(2, 3, 4, 5, 6\)"),
    (dict(num_stages=7), r"num_stages must be one of"),
    (dict(k_splits=3), r"k_splits must be one of \(1, 2, 4, 8, 16\)"),
    (dict(tile_t=12, tile_n=64), r"tile_t must be a multiple of 8 in \[8, 256\]"),
    (dict(tile_t=256, tile_n=128), r"tile_t must be a multiple of 8 in \[8, 128\] for "
                                   r"tile_n = 128"),
    (dict(k_splits=2), r"k_splits = 2 with MXFP8 needs K and K / k_splits multiples of 512"),
    (dict(out_dtype=jnp.int8), r"out_dtype must be one of"),
    (dict(tile_n=128, tile_k=256, tile_t=128, num_stages=6),
     r"num_stages = 6 .* needs \d+ bytes of shared memory, more than"),
])
def test_bad_tunables_name_the_argument_and_bound(kw, match):
    with pytest.raises(ValueError, match=match):
        fp8_matmul_mgpu(jnp.ones((128, 512), jnp.bfloat16), _mx(128, 512),
                        interpret=INTERPRET, **kw)


def test_bad_activation_dtype_mode_and_backend():
    w = _mx()
    with pytest.raises(ValueError, match=r"x dtype must be bfloat16, got float16"):
        fp8_matmul_mgpu(jnp.ones((4, 128), jnp.float16), w, interpret=INTERPRET)
    if INTERPRET:
        with pytest.raises(ValueError, match=r"a_in_smem=False \(A from registers\) needs the "
                                             r"compiled kernel"):
            fp8_matmul_mgpu(jnp.ones((4, 128), jnp.bfloat16), w, interpret=True,
                            a_in_smem=False)
    with pytest.raises(ValueError, match=r"backend must be one of \('mosaic', 'xla'\)"):
        fp8_matmul_default(jnp.ones((4, 128), jnp.bfloat16), w, backend="triton")


# --------------------------------------------------------------------------- CUDA lowering

LAYERS = [(2304, 6144), (6144, 2048), (6144, 6144), (6144, 3072)]  # MiniMax-M3 per rank, TP4


def _specs(t, n, k, fmt):
    sd = jax.ShapeDtypeStruct
    scales = (sd((n, k // MX_GROUP), jnp.uint8) if fmt == "mxfp8"
              else sd((-(-n // BLOCK), -(-k // BLOCK)), jnp.float32))
    return sd((t, k), jnp.bfloat16), Fp8Weight(sd((n, k), jnp.float8_e4m3fn), scales)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("t,layer", [(1, 0), (16, 1), (64, 2), (256, 3), (128, 0)])
def test_lowers_for_h200_at_serving_shapes(fmt, t, layer):
    """The default launch of each serving shape fits shared memory and lowers for CUDA on the
    CPU (abstract H200) as one Mosaic GPU call; the default routes it there too."""
    n, k = LAYERS[layer]
    cfg = make_config(t, n, k, fmt)
    assert (cfg.n_pad, cfg.k_pad) == (n, k)  # no weight padding at the serving shapes
    assert smem_bytes(fmt, cfg.tile_t, cfg.tile_n, cfg.tile_k, cfg.num_stages, cfg.k_splits,
                      cfg.k_pad) <= SMEM_BYTES
    text = lower_for_cuda(fp8_matmul_mgpu, *_specs(t, n, k, fmt), interpret=False)
    assert custom_call_counts(text) == dict(mosaic=1, triton=0, other=0)
    text = lower_for_cuda(fp8_matmul_default, *_specs(t, n, k, fmt))
    assert custom_call_counts(text)["mosaic"] == 1
    assert "fp8_weight_matmul_mgpu" in text


@pytest.mark.parametrize("fmt,t,n,k,kw", KERNEL_CASES + [("mxfp8", 6, 128, 256, {}),
                                                         ("mxfp8", 4, 64, 128, {})])
def test_kernel_cases_lower_for_h200(fmt, t, n, k, kw):
    """The interpreted cases above also pass the CUDA lowering (TMA alignment: 16-byte global
    rows, which the interpreter does not check), A from registers and through smem."""
    for out_dtype in (jnp.bfloat16, jnp.float32):
        for a_in_smem in (False, True):
            text = lower_for_cuda(fp8_matmul_mgpu, *_specs(t, n, k, fmt), interpret=False,
                                  out_dtype=out_dtype, a_in_smem=a_in_smem, **kw)
            assert custom_call_counts(text)["mosaic"] == 1


@pytest.mark.parametrize("kw", [dict(tile_n=128, tile_k=256, k_splits=4), dict(a_in_smem=True),
                                dict(tile_k=64, num_stages=6, out_dtype=jnp.float32)])
def test_tunables_lower_for_h200(kw):
    text = lower_for_cuda(fp8_matmul_mgpu, *_specs(64, 2304, 6144, "mxfp8"), interpret=False,
                          **kw)
    assert custom_call_counts(text)["mosaic"] == 1


def test_default_lowers_large_batches_to_xla():
    text = lower_for_cuda(fp8_matmul_default, *_specs(MAX_KERNEL_TOKENS + 8, 2304, 6144,
                                                      "block128"))
    assert custom_call_counts(text)["mosaic"] == 0

"""MoE routed experts: the reference, the Mosaic GPU decode and prefill kernels and the
default against XLA's grouped matmuls (``moe_experts_xla``, the model's former MoE and the
fallback off the GPU), the routing step, the model's MoE on the default,
the CUDA lowering for an abstract H200 at the serving shapes, and the errors of bad inputs.

The kernels run in Mosaic GPU interpret mode on a CPU backend and compiled on a GPU (the same
tests). Each case draws a fresh seed (in every message): routings with masked tokens, copies
of other ranks' experts (``first_expert > 0``, ids on both sides of the local range), a local
expert with no copies, one holding a copy of every token (more than one slot of copies), T
not a multiple of 8; bf16 weights and fp8 weights of both formats whose magnitude changes by
up to 2^8 between neighbouring scale groups (MXFP8: 32 inputs; blocks: 128 x 128), so a scale
applied to the wrong group shows. The model rounds the activation to bf16 between the two
matmuls, as the kernels do; both are f32 accumulations of the same products in other orders,
so they agree to a few bf16 roundings of the activation.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _helpers import INTERPRET, fresh_seed
from jax_msa_runner.model import routed_experts_partial, swigluoai
from pallas_kernels._lowering import custom_call_counts, lower_for_cuda
from pallas_kernels._shapes import SMEM_BYTES
from pallas_kernels.fp8_matmul import (BLOCK, MX_GROUP, Fp8Weight, quantize_block128,
                                       quantize_mxfp8)
from pallas_kernels.moe_experts import (aligned_rows, check_moe_inputs, group_copies,
                                        moe_experts_reference, moe_experts_xla, slot_bound)
from pallas_kernels.moe_experts import swigluoai as our_swigluoai
from pallas_kernels.moe_experts_default import (DECODE_MAX_COPIES, moe_experts_backend,
                                                moe_experts_default)
from pallas_kernels.moe_experts_mgpu import (decode_smem_bytes, make_decode_config,
                                             make_prefill_config, moe_decode_mgpu,
                                             moe_prefill_mgpu, prefill_down_smem_bytes,
                                             prefill_smem_bytes)

ON_GPU = jax.default_backend() == "gpu"
ALPHA, LIMIT = 1.702, 7.0
KW = dict(alpha=ALPHA, limit=LIMIT)
FORMATS = ("dense", "mxfp8", "block128")
QUANTIZE = {"mxfp8": quantize_mxfp8, "block128": quantize_block128}


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    """A kernel that raised inside the Mosaic GPU interpreter leaves its state behind."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    interpret_pallas_call.reset_gpu_interpret_mode_state()
    yield


# --------------------------------------------------------------------------- data

def _spread(rng, lead, n, k, fmt, spread=8):
    """2^u per scale group of ``[*lead, n, k]`` (MXFP8 1 x 32, blocks 128 x 128; dense:
    blocks too), u uniform in [-spread/2, spread/2]."""
    gn, gk = (1, MX_GROUP) if fmt == "mxfp8" else (BLOCK, BLOCK)
    u = rng.integers(-spread // 2, spread // 2 + 1, size=(*lead, -(-n // gn), -(-k // gk)))
    mag = np.repeat(np.repeat(2.0 ** u, gn, -2), gk, -1)[..., :n, :k]
    return mag


def make_experts(rng, e, h, i, fmt):
    """(gate_up, down) of ``e`` experts: bf16 ``[E, H, 2I]`` / ``[E, I, H]`` or Fp8Weights of
    values ``[E, 2I, H]`` / ``[E, H, I]``; entries ~ N(0, 1/fan_in) times the group spread."""
    gu = rng.standard_normal((e, 2 * i, h)) / np.sqrt(h) * _spread(rng, (e,), 2 * i, h, fmt)
    dn = rng.standard_normal((e, h, i)) / np.sqrt(i) * _spread(rng, (e,), h, i, fmt)
    gu, dn = gu.astype(np.float32), dn.astype(np.float32)
    if fmt == "dense":
        return (jnp.asarray(np.swapaxes(gu, 1, 2), jnp.bfloat16),
                jnp.asarray(np.swapaxes(dn, 1, 2), jnp.bfloat16))
    return QUANTIZE[fmt](gu), QUANTIZE[fmt](dn)


def make_routing(rng, t, k, e, first, num_global, *, empty=None, full=None, masked=3):
    """(weights [T, k] f32, experts [T, k] int32, token_mask [T] bool): k distinct global ids
    per token out of ``num_global``; local expert ``empty`` gets no copy (its copies move to
    an id past the local range), local expert ``full`` a copy of every token (slot 0);
    ``masked`` tokens are padding."""
    experts = np.stack([rng.permutation(num_global)[:k] for _ in range(t)]).astype(np.int32)
    if full is not None:
        g = first + full
        for r in range(t):
            row = [x for x in experts[r] if x != g][:k - 1]
            experts[r] = [g, *row]
    if empty is not None:
        g = first + empty
        other = first + e  # another rank's expert
        experts[experts == g] = other
        if full is not None:  # keep ids distinct per token
            experts[:, 0] = first + full
    weights = (rng.random((t, k)) + 0.1).astype(np.float32)
    mask = np.ones(t, bool)
    mask[rng.choice(t, size=min(masked, t), replace=False)] = False
    return jnp.asarray(weights), jnp.asarray(experts), jnp.asarray(mask)


@jax.jit
def xla_partial(x, weights, experts, mask, gu, dn, first):
    """XLA's grouped matmuls: the check every kernel and the reference are held to."""
    return moe_experts_xla(x, weights, experts, mask, gu, dn, first_expert=first, **KW)


def check_out(out, ref, msg):
    """``out`` against XLA's grouped matmuls (f32 [T, H]): a few bf16 roundings of the activation."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape and np.isfinite(out).all(), msg
    scale = float(np.abs(ref).max()) + 1e-30
    chex.assert_trees_all_close(out, ref, atol=2e-2 * scale, rtol=2e-2, custom_message=msg)
    err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err < 1e-2, f"{msg}: relative L2 error {err:.2e}"


# (T, k, H, I, E local, first expert, global experts, empty local expert, full local expert,
#  masked tokens)
SCENARIOS = {
    "mixed": (13, 3, 256, 128, 5, 5, 20, 2, None, 3),  # others' ids on both sides, an empty one
    "all": (11, 2, 256, 192, 4, 0, 8, 3, 1, 1),  # expert 1: all 10 real tokens (slots 8 + 2)
}
# tunables per scenario: "mixed" decode in one 128-column tile (two 64-column sub-tiles);
# "all" in slots of 8 copies (expert 1's ten in two) and 64-column tiles (I = 192: three)
TUNABLES = {("decode", "mixed"): dict(tile_i=128), ("decode", "all"): dict(tile_c=8),
            ("prefill", "mixed"): {}, ("prefill", "all"): dict(tile_c=8)}


def _case(name, fmt, seed):
    t, k, h, i, e, first, ng, empty, full, masked = SCENARIOS[name]
    rng = np.random.default_rng(seed)
    gu, dn = make_experts(rng, e, h, i, fmt)
    weights, experts, mask = make_routing(rng, t, k, e, first, ng, empty=empty, full=full,
                                          masked=masked)
    x = rng.standard_normal((t, h)).astype(np.float32)
    x[~np.asarray(mask)] = np.nan  # padding rows: whatever they hold stays out
    return jnp.asarray(x, jnp.bfloat16), weights, experts, mask, gu, dn, first


def _no_local_copy(experts, mask, first, e):
    local = np.asarray(experts) - first
    mine = np.asarray(mask)[:, None] & (local >= 0) & (local < e)
    return ~mine.any(axis=1)


# --------------------------------------------------------------------------- the reference
# (the reference against XLA's at each scenario and format: in the kernel tests below)

def test_swigluoai_is_the_models():
    seed = fresh_seed()
    h = jnp.asarray(np.random.default_rng(seed).standard_normal((5, 64)) * 6, jnp.float32)
    chex.assert_trees_all_equal(our_swigluoai(h, ALPHA, LIMIT), swigluoai(h, ALPHA, LIMIT))


def test_reference_f32_and_traced_first_expert():
    """f32 activations and weights (the model's default dtype) and a traced first_expert."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    t, k, h, i, e = 7, 2, 64, 32, 3
    gu = jnp.asarray(rng.standard_normal((e, h, 2 * i)) / 8, jnp.float32)
    dn = jnp.asarray(rng.standard_normal((e, i, h)) / 6, jnp.float32)
    weights, experts, mask = make_routing(rng, t, k, e, 3, 9)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    ref = moe_experts_xla(x, weights, experts, mask, gu, dn, first_expert=3, **KW)
    fn = jax.jit(lambda f: moe_experts_reference(x, weights, experts, mask, gu, dn,
                                                 first_expert=f, **KW))
    chex.assert_trees_all_close(fn(jnp.int32(3)), ref, atol=1e-5, rtol=1e-5,
                                custom_message=f"seed {seed}")


def test_group_copies_slots_and_aligned_rows():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    t, k, e, tile = 11, 2, 4, 8
    weights, experts, mask = make_routing(rng, t, k, e, 0, 8, empty=3, full=1, masked=1)
    g = group_copies(experts, mask, e, tile)
    n = t * k
    local = np.asarray(experts) - 0
    mine = np.asarray(mask)[:, None] & (local < e)
    counts = np.bincount(local[mine], minlength=e)
    assert int(g.num_local) == mine.sum() and counts[3] == 0
    slots = np.asarray(g.slots)
    used = int(g.num_slots)
    assert slots.shape == (slot_bound(n, e, tile), 4)
    assert used == sum(-(-c // tile) for c in counts)
    assert (slots[used:, 3] == 0).all() and (slots[:used, 3] > 0).all()
    assert (slots[:, 1] % 8 == 0).all(), "aligned rows start at multiples of 8"
    for ex in range(e):  # each expert's slots cover its rows exactly, in order
        mine_s = slots[:used][slots[:used, 0] == ex]
        assert mine_s[:, 3].sum() == counts[ex]
    assert counts[1] == 10 and (slots[:used, 0] == 1).sum() == 2  # the full expert: 8 + 2
    order = np.asarray(g.order)
    tokens = np.asarray(g.aligned_tokens)
    assert tokens.shape == (aligned_rows(n, e, 8),)
    for ex, a0, s0, rows in slots[:used]:  # aligned and sorted rows name the same copies
        copies = order[s0:s0 + rows]
        assert (local.reshape(-1)[copies] == ex).all()
        chex.assert_trees_all_equal(tokens[a0:a0 + rows], copies // k)


# --------------------------------------------------------------------------- the kernels

KERNELS = {"decode": moe_decode_mgpu, "prefill": moe_prefill_mgpu}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernel_matches_xla_and_reference(kernel, name, fmt):
    """The kernel (NaN in the padding tokens' x rows) against XLA's grouped matmuls and the
    reference (zeros there), and the reference against XLA's."""
    seed = fresh_seed()
    x, weights, experts, mask, gu, dn, first = _case(name, fmt, seed)
    msg = f"seed {seed}, {kernel}, {name}, {fmt}"
    first_arg = jnp.int32(first) if name == "mixed" else first  # traced, as under EP
    out = KERNELS[kernel](x, weights, experts, mask, gu, dn, first_arg, interpret=INTERPRET,
                          **TUNABLES[kernel, name], **KW)
    chex.assert_shape(out, x.shape)
    assert out.dtype == jnp.float32
    x0 = jnp.where(mask[:, None], x, 0)
    ref = xla_partial(x0, weights, experts, mask, gu, dn, first)
    ours = moe_experts_reference(x0, weights, experts, mask, gu, dn, first_expert=first, **KW)
    assert ours.dtype == jnp.float32
    # the same f32 products summed in other orders: an activation's bf16 rounding may flip
    chex.assert_trees_all_close(ours, ref, atol=1e-3 * float(jnp.abs(ref).max()), rtol=1e-3,
                                custom_message=msg + ": reference vs xla")
    # relative L2 over every token row but the one farthest off: a flipped activation moves
    # one row (seed 685961936, block128: 2.3e-4 over all rows, 1.5e-7 without that row)
    rows = np.argsort(np.asarray(jnp.linalg.norm(ours - ref, axis=1)))[:-1]
    err = float(jnp.linalg.norm((ours - ref)[rows]) / jnp.linalg.norm(ref[rows]))
    assert err < 1e-4, f"{msg}: reference vs xla, relative L2 error {err:.2e} (all rows but one)"
    check_out(out, ref, msg + " vs xla")
    check_out(out, ours, msg + " vs reference")
    none = _no_local_copy(experts, mask, first, gu[0].shape[0] if isinstance(gu, Fp8Weight)
                          else gu.shape[0])
    assert none.any() and not np.asarray(out)[none].any(), (
        f"{msg}: rows without a local copy must be exactly 0")


def test_default_picks_and_runs_the_kernels():
    """CPU: XLA's grouped matmuls unless asked (interpret=True runs the kernel the rule picks);
    the rule: decode up to DECODE_MAX_COPIES copies, prefill above, XLA off the GPU; the
    model's routed_experts_partial is the default."""
    seed = fresh_seed()
    x, weights, experts, mask, gu, dn, first = _case("mixed", "mxfp8", seed)
    x0 = jnp.where(mask[:, None], x, 0)
    ref = xla_partial(x0, weights, experts, mask, gu, dn, first)
    out = moe_experts_default(x0, weights, experts, mask, gu, dn, first_expert=first, **KW)
    check_out(out, ref, f"seed {seed}, default")
    model = jax.jit(lambda *a: routed_experts_partial(*a, ALPHA, LIMIT, first_expert=first))
    chex.assert_trees_all_equal(model(x0, weights, experts, mask, gu, dn), out)
    if INTERPRET:
        chex.assert_trees_all_equal(out, ref)
        y = moe_experts_default(x, weights, experts, mask, gu, dn, first_expert=first,
                                interpret=True, **KW)
        check_out(y, ref, f"seed {seed}, default interpreted")
    s = check_moe_inputs(x, weights, experts, mask, gu, dn)
    bf16 = jnp.bfloat16
    assert moe_experts_backend(s, bf16, interpreting=False, on_gpu=False) == "xla"
    assert moe_experts_backend(s, bf16, interpreting=True, on_gpu=False) == "decode"
    assert moe_experts_backend(s, jnp.float32, interpreting=True, on_gpu=True) == "xla"
    big = s._replace(t=DECODE_MAX_COPIES // s.k + 1)
    assert moe_experts_backend(big, bf16, interpreting=False, on_gpu=True) == "prefill"
    assert moe_experts_backend(s._replace(h=200), bf16, interpreting=False,
                               on_gpu=True) == "xla"


def test_empty_batch_and_no_local_copies():
    seed = fresh_seed()
    x, weights, experts, mask, gu, dn, _ = _case("all", "dense", seed)
    for kernel in KERNELS.values():  # every copy another rank's: zeros, no expert read
        out = kernel(x, weights, experts, mask, gu, dn, 100, interpret=INTERPRET, tile_c=8,
                     **KW)
        chex.assert_trees_all_equal(out, jnp.zeros(x.shape, jnp.float32))
        empty = kernel(x[:0], weights[:0], experts[:0], mask[:0], gu, dn,
                       interpret=INTERPRET, **KW)
        chex.assert_shape(empty, (0, x.shape[1]))


@pytest.mark.skipif(not ON_GPU, reason="A from registers needs the compiled kernel")
@pytest.mark.parametrize("fmt", ("mxfp8", "block128"))
def test_compiled_a_from_registers_equals_a_through_smem(fmt):
    seed = fresh_seed()
    x, weights, experts, mask, gu, dn, first = _case("mixed", fmt, seed)
    for kernel in KERNELS.values():
        a = kernel(x, weights, experts, mask, gu, dn, first, a_in_smem=False, **KW)
        b = kernel(x, weights, experts, mask, gu, dn, first, a_in_smem=True, **KW)
        chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-5, custom_message=f"seed {seed}")


# --------------------------------------------------------------------------- CUDA lowering

H, I, E, TOP_K = 6144, 3072, 16, 4  # MiniMax-M3 per rank: 16 of 128 experts, top-4


def _specs(t, fmt):
    sd = jax.ShapeDtypeStruct
    if fmt == "dense":
        gu, dn = sd((E, H, 2 * I), jnp.bfloat16), sd((E, I, H), jnp.bfloat16)
    elif fmt == "mxfp8":
        gu = Fp8Weight(sd((E, 2 * I, H), jnp.float8_e4m3fn), sd((E, 2 * I, H // 32), jnp.uint8))
        dn = Fp8Weight(sd((E, H, I), jnp.float8_e4m3fn), sd((E, H, I // 32), jnp.uint8))
    else:
        gu = Fp8Weight(sd((E, 2 * I, H), jnp.float8_e4m3fn),
                       sd((E, 2 * I // 128, H // 128), jnp.float32))
        dn = Fp8Weight(sd((E, H, I), jnp.float8_e4m3fn), sd((E, H // 128, I // 128), jnp.float32))
    return (sd((t, H), jnp.bfloat16), sd((t, TOP_K), jnp.float32), sd((t, TOP_K), jnp.int32),
            sd((t,), jnp.bool_), gu, dn)


TOKENS = (1, 16, 64, 256, 2048, 4096)


@pytest.mark.parametrize("t", TOKENS)
def test_default_lowers_for_h200_at_serving_shapes(t):
    """bf16 and an fp8 format (the two in turn) at each T: Mosaic GPU calls only (decode:
    one, prefill: two), no Triton, no XLA ragged_dot; with the traced first_expert of EP
    (``expert_offset``)."""
    kernel = "moe_decode_mgpu" if t * TOP_K <= DECODE_MAX_COPIES else "moe_prefill_gate_up_mgpu"
    for fmt in ("dense", ("mxfp8", "block128")[TOKENS.index(t) % 2]):
        first = jax.ShapeDtypeStruct((), jnp.int32)
        text = lower_for_cuda(lambda *a: moe_experts_default(*a[:6], first_expert=a[6], **KW),
                              *_specs(t, fmt), first)
        want = 1 if kernel == "moe_decode_mgpu" else 2
        assert custom_call_counts(text) == dict(mosaic=want, triton=0, other=0), (t, fmt)
        assert "ragged_dot" not in text and kernel in text, (t, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_both_kernels_lower_and_fit_at_serving_shapes(fmt):
    """The kernel the default does not pick at a T lowers there too (decode at 256 tokens,
    prefill at 1), and every default launch fits shared memory."""
    for kernel, t in ((moe_decode_mgpu, 256), (moe_prefill_mgpu, 1)):
        text = lower_for_cuda(kernel, *_specs(t, fmt), interpret=False, **KW)
        assert custom_call_counts(text)["triton"] == 0 and "ragged_dot" not in text
    for t in TOKENS:
        s = check_moe_inputs(*_specs(t, fmt))
        d = make_decode_config(s)
        assert decode_smem_bytes(s, d.tile_c, d.tile_i, d.tile_k, d.tile_h, d.stages,
                                 d.down_stages) <= SMEM_BYTES
        p = make_prefill_config(s)
        assert prefill_smem_bytes(s, p.tile_c, p.tile_k, p.stages) <= SMEM_BYTES
        assert prefill_down_smem_bytes(s, p.tile_c, p.tile_n, p.down_tile_k,
                                       p.down_stages) <= SMEM_BYTES


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernels_lower_at_copy_counts_not_multiples_of_8(kernel, name):
    """The compiled kernels lower at the interpret tests' sizes (22 and 39 copies; T = 5 at
    serving shapes: 20 copies over 16 experts): Mosaic GPU tiles the routed rows by 8, which
    the interpreter does not check."""
    x, weights, experts, mask, gu, dn, first = _case(name, "mxfp8", 0)
    text = lower_for_cuda(KERNELS[kernel], x, weights, experts, mask, gu, dn, first,
                          interpret=False, **TUNABLES[kernel, name], **KW)
    assert custom_call_counts(text)["mosaic"] >= 1, (kernel, name)
    text = lower_for_cuda(KERNELS[kernel], *_specs(5, "dense"), interpret=False, **KW)
    assert custom_call_counts(text)["mosaic"] >= 1, (kernel, 5)


# --------------------------------------------------------------------------- bad inputs

def _good(fmt="dense"):
    rng = np.random.default_rng(0)
    gu, dn = make_experts(rng, 2, 128, 64, fmt)
    weights, experts, mask = make_routing(rng, 4, 2, 2, 0, 4, masked=0)
    x = jnp.ones((4, 128), jnp.bfloat16)
    return dict(x=x, weights=weights, experts=experts, token_mask=mask, gate_up=gu, down=dn)


BAD = [
    (dict(x=jnp.ones((4, 2, 128), jnp.bfloat16)), r"x must be \[T, H\]"),
    (dict(x=jnp.ones((4, 128), jnp.int8)), r"x dtype must be bfloat16, float16 or float32"),
    (dict(experts=jnp.zeros((5, 2), jnp.int32)), r"experts must be \[T, k\] with T = 4"),
    (dict(experts=jnp.zeros((4, 2), jnp.float32)), r"experts dtype must be int32"),
    (dict(weights=jnp.ones((4, 3), jnp.float32)), r"weights must be \[T, k\] = \(4, 2\)"),
    (dict(token_mask=jnp.ones((4,), jnp.int32)), r"token_mask dtype must be bool"),
    (dict(token_mask=jnp.ones((3,), bool)), r"token_mask must be \[T\] = \(4,\)"),
    (dict(gate_up=jnp.ones((2, 96, 128), jnp.bfloat16)),
     r"gate_up must be \[E, H, 2I\] with H = 128"),
    (dict(gate_up=jnp.ones((2, 128, 128), jnp.float32)), r"gate_up dtype must be x's"),
    (dict(down=jnp.ones((2, 64, 96), jnp.bfloat16)), r"down must be \[E, I, H\] = \(2, 64, 128\)"),
    (dict(down=jnp.ones((3, 64, 128), jnp.bfloat16)), r"down must be \[E, I, H\]"),
    (dict(first_expert=jnp.zeros((2,), jnp.int32)), r"first_expert must be a Python int or an "
                                                    r"int32 scalar"),
]


@pytest.mark.parametrize("fn", [moe_experts_reference, moe_experts_default, moe_decode_mgpu,
                                moe_prefill_mgpu])
def test_bad_inputs_name_the_field(fn):
    for change, match in BAD:
        args = {**_good(), **change}
        first = args.pop("first_expert", 0)
        with pytest.raises(ValueError, match=match):
            fn(*args.values(), first_expert=first, **KW) if fn in (
                moe_experts_reference, moe_experts_default) else fn(
                *args.values(), first, interpret=INTERPRET, **KW)


def test_bad_fp8_weights_and_unsupported_sizes():
    good = _good("mxfp8")
    gu, dn = good["gate_up"], good["down"]
    cases = [
        (dict(gate_up=Fp8Weight(gu.values, gu.scales[..., :2])), r"gate_up\.scales: shape must be"),
        (dict(down=Fp8Weight(dn.values.astype(jnp.bfloat16), dn.scales)),
         r"down\.values: dtype must be float8_e4m3fn"),
        (dict(gate_up=Fp8Weight(gu.values[:, :, :64], gu.scales[:, :, :2])),
         r"gate_up\.values must be \[E, 2I, H\] with H = 128"),
        (dict(down=Fp8Weight(dn.values[:, :, :32], dn.scales[:, :, :1])),
         r"down\.values must be \[E, H, I\] = \(2, 128, 64\)"),
    ]
    for change, match in cases:
        args = {**good, **change}
        with pytest.raises(ValueError, match=match):
            moe_experts_reference(*args.values(), **KW)
    args = _good()
    for fn in KERNELS.values():  # H = 96 is no multiple of 128: the kernels refuse it
        rng = np.random.default_rng(1)
        gu, dn = make_experts(rng, 2, 96, 64, "dense")
        with pytest.raises(ValueError, match=r"H = 96 must be a multiple of 128"):
            fn(jnp.ones((4, 96), jnp.bfloat16), args["weights"], args["experts"],
               args["token_mask"], gu, dn, interpret=INTERPRET, **KW)
        with pytest.raises(ValueError, match=r"x dtype must be bfloat16"):
            fn(args["x"].astype(jnp.float32), args["weights"], args["experts"],
               args["token_mask"], args["gate_up"].astype(jnp.float32),
               args["down"].astype(jnp.float32), interpret=INTERPRET, **KW)
    with pytest.raises(ValueError, match=r"tile_c must be a multiple of 8"):
        moe_decode_mgpu(*args.values(), tile_c=12, interpret=INTERPRET, **KW)
    with pytest.raises(ValueError, match=r"tile_i must be one of \(64, 128\)"):
        moe_decode_mgpu(*args.values(), tile_i=96, interpret=INTERPRET, **KW)
    with pytest.raises(ValueError, match=r"backend must be one of"):
        moe_experts_default(*args.values(), backend="triton", **KW)

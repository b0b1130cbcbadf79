"""Every kernel entry runs without an ``interpret`` argument: interpreted on a CPU backend,
compiled on a GPU (``interpret=None`` means automatic), and equals its reference."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels import (PAGE_SIZE, TOPK, msa_index_scores, msa_index_scores_reference,
                            msa_index_select, msa_index_select_reference, sparse_decode,
                            sparse_decode_default, sparse_decode_reference, sparse_prefill,
                            sparse_prefill_reference,
                            sparse_topk_select, sparse_topk_select_reference)
from pallas_kernels._interpret import resolve_interpret
from pallas_kernels._lowering import H200

ON_GPU = jax.default_backend() == "gpu"


def test_resolve_interpret():
    assert resolve_interpret(None) is (not ON_GPU)
    assert resolve_interpret(True) is True and resolve_interpret(False) is False
    cuda = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(*H200, "cuda"))
    with jax.sharding.use_abstract_mesh(cuda):  # lowering for an abstract H200: compiled
        assert resolve_interpret(None) is False
        assert resolve_interpret(True) is True
    with jax.set_mesh(jax.make_mesh((1,), ("x",))):  # a mesh of this backend's devices
        assert resolve_interpret(None) is (not ON_GPU)


def _index_inputs(seed, t=3, h=2, di=32, pages=7, cols=5):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((t, h, di)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((pages, PAGE_SIZE, di)), jnp.float32)
    bt = jnp.asarray(rng.permutation(np.arange(1, pages))[:cols][None].repeat(2, 0), jnp.int32)
    req = jnp.asarray([0, 1, 1][:t], jnp.int32)
    pos = jnp.asarray([cols * PAGE_SIZE - 1, 300, 5][:t], jnp.int32)
    return q, k, bt, req, pos


def test_msa_index_scores_without_interpret_argument():
    args = _index_inputs(21)
    got = msa_index_scores(*args)
    chex.assert_shape(got, (3, 2, 5))
    chex.assert_trees_all_close(got, msa_index_scores_reference(*args), rtol=1e-4, atol=1e-3)


def test_sparse_topk_select_without_interpret_argument():
    scores = jnp.asarray(np.random.default_rng(22).standard_normal((3, 2, 40)), jnp.float32)
    nvp = jnp.asarray([40, 7, 23], jnp.int32)
    got = sparse_topk_select(scores, nvp)
    chex.assert_shape(got, (3, 2, TOPK))
    chex.assert_trees_all_equal(got, sparse_topk_select_reference(scores, nvp))


def test_msa_index_select_without_interpret_argument():
    args = _index_inputs(23)
    got = msa_index_select(*args)
    chex.assert_shape(got, (3, 2, TOPK))
    chex.assert_trees_all_equal(got, msa_index_select_reference(*args))


def _attention_inputs(seed, t=3, hq=16, hkv=1, d=32, pages=6):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((pages, hkv, PAGE_SIZE, 2 * d)), jnp.float32)
    sel = np.full((t, hkv, TOPK), -1, np.int32)
    sel[:, :, :3] = [0, 1, 2]
    bt = jnp.asarray([[4, 2, 5, 1], [3, 1, 2, 0]], jnp.int32)
    req = jnp.asarray([0, 1, 0][:t], jnp.int32)
    kv_lens = jnp.asarray([300, 257, 0][:t], jnp.int32)
    return q, kv, jnp.asarray(sel), bt, req, kv_lens


@pytest.mark.parametrize("kernel,reference,seed", [
    (sparse_decode, sparse_decode_reference, 24), (sparse_prefill, sparse_prefill_reference, 25),
    (sparse_decode_default, sparse_decode_reference, 26)])
def test_sparse_attention_without_interpret_argument(kernel, reference, seed):
    args = _attention_inputs(seed)
    out, lse = kernel(*args, scale=0.2)
    chex.assert_shape((out, lse), ((3, 16, 32), (3, 16)))
    chex.assert_trees_all_close((out, lse), reference(*args, scale=0.2),
                                rtol=1e-2 if ON_GPU else 2e-5, atol=1e-2 if ON_GPU else 2e-5)

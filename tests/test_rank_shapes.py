"""rank_shapes.rank_params: the bench's random rank weights."""
import chex
import jax.numpy as jnp
import numpy as np

from jax_msa_runner.config import ModelConfig
from jax_msa_runner.rank_shapes import rank_params


def test_router_over_every_expert_with_a_zero_correction_bias():
    """Each MoE layer routes over all E experts ~ N(0, 1/H) and holds the local ones only; its
    correction bias is zero (a random one sent most tokens to the few experts it favoured)."""
    cfg = ModelConfig.tiny(num_layers=2, sparse_attention_freq=(0, 1), moe_layer_freq=(0, 1),
                           num_experts=16, use_routing_bias=True)
    params = rank_params(cfg, num_local_experts=4, seed=3)
    moe = params["layers"][1]
    chex.assert_shape(moe["router"], (cfg.hidden_size, 16))
    chex.assert_shape(moe["experts_down"], (4, cfg.moe_intermediate_size, cfg.hidden_size))
    chex.assert_trees_all_equal(moe["router_bias"], jnp.zeros((16,), jnp.float32))
    std = float(np.std(np.asarray(moe["router"])))
    assert abs(std * np.sqrt(cfg.hidden_size) - 1) < 0.1, std

"""The GPT matches nanoGPT's architecture: causal, tied head, padded vocab that never wins, 6N FLOPs."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from conftest import tiny_config
from jaxpar.flops import matmul_params
from jaxpar.model import GPT, padded_vocab


def tiny_model(**overrides):
    cfg = tiny_config(**overrides)
    return cfg, GPT(cfg.model, 65, nnx.Rngs(0))


def test_vocab_is_padded_and_padding_never_wins():
    cfg, model = tiny_model()
    assert padded_vocab(65) == 128 and model.wte.shape == (128, cfg.model.n_embd)
    logits = model(jnp.zeros((2, 8), jnp.int32))
    assert logits.shape == (2, 8, 128)
    assert int(jnp.argmax(logits, -1).max()) < 65
    assert float(logits[..., 65:].max()) < -1e8


def test_attention_is_causal():
    _, model = tiny_model()
    tokens = jnp.arange(16, dtype=jnp.int32)[None] % 65
    changed = tokens.at[0, 10].set(3)
    a, b = model(tokens), model(changed)
    np.testing.assert_array_equal(a[0, :10], b[0, :10])
    assert not np.allclose(a[0, 10:], b[0, 10:])


def test_layers_are_stacked_on_a_leading_axis():
    cfg, model = tiny_model(**{"model.n_layer": 3})
    for leaf in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model.blocks))):
        assert leaf.shape[0] == 3


def test_init_follows_gpt2():
    cfg, model = tiny_model(**{"model.n_layer": 4, "model.n_embd": 128, "model.n_head": 4})
    assert abs(float(model.blocks.mlp_in.kernel[...].std()) - 0.02) < 2e-3
    resid = 0.02 / np.sqrt(2 * 4)
    assert abs(float(model.blocks.mlp_out.kernel[...].std()) - resid) < 1e-3
    assert float(jnp.abs(model.blocks.qkv.bias[...]).max()) == 0.0


def test_matmul_param_count_matches_the_model():
    cfg, model = tiny_model()
    blocks = nnx.to_pure_dict(nnx.state(model.blocks))
    kernels = sum(blocks[name]["kernel"].size for name in blocks if "kernel" in blocks[name])
    assert matmul_params(cfg.model, 65) == kernels + 65 * cfg.model.n_embd


def test_nanogpt_cpu_recipe_has_nanogpt_param_count():
    """The reference (../shared/bench/torch_ref.py, same recipe) reports 809,856 with wpe."""
    cfg, model = tiny_model(**{"model.n_layer": 4, "model.n_embd": 128, "model.n_head": 4,
                               "model.block_size": 64})
    params = nnx.to_pure_dict(nnx.state(model))
    total = sum(x.size for x in jax.tree.leaves(params))
    padding = (128 - 65) * 128
    assert total - padding == 809_856

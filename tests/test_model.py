"""The GPT matches nanoGPT's architecture: causal, tied head, padded vocab that never wins, 6N FLOPs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

from jaxpar.models.flops import matmul_params
from jaxpar.models.transformer import Transformer
from jaxpar.nn.layers import padded_vocab


def tiny_model(**overrides):
    """(cfg, the model's logits as a function of the tokens, its params, drawn from seed 0)."""
    cfg = tiny_config(**overrides)
    model = Transformer(cfg.model, 65)
    params = model.init(0)
    forward = jax.jit(model)
    return cfg, lambda tokens: forward(params, tokens), params


def test_vocab_is_padded_and_padding_never_wins():
    cfg, model, params = tiny_model()
    assert padded_vocab(65) == 128 and params["wte"].shape == (128, cfg.model.n_embd)
    logits = model(jnp.zeros((2, 8), jnp.int32))
    assert logits.shape == (2, 8, 128)
    assert int(jnp.argmax(logits, -1).max()) < 65
    assert float(logits[..., 65:].max()) < -1e8


def test_attention_is_causal():
    _, model, _ = tiny_model()
    tokens = jnp.arange(16, dtype=jnp.int32)[None] % 65
    changed = tokens.at[0, 10].set(3)
    a, b = model(tokens), model(changed)
    np.testing.assert_array_equal(a[0, :10], b[0, :10])
    assert not np.allclose(a[0, 10:], b[0, 10:])


def test_layers_are_stacked_on_a_leading_axis():
    cfg, _, params = tiny_model(**{"model.n_layer": 3})
    for leaf in jax.tree.leaves(params["blocks"]):
        assert leaf.shape[0] == 3


def test_init_follows_gpt2():
    cfg, _, params = tiny_model(**{"model.n_layer": 4, "model.n_embd": 128, "model.n_head": 4})
    blocks = params["blocks"]
    assert abs(float(blocks["mlp_in"]["kernel"].std()) - 0.02) < 2e-3
    resid = 0.02 / np.sqrt(2 * 4)
    assert abs(float(blocks["mlp_out"]["kernel"].std()) - resid) < 1e-3
    assert float(jnp.abs(blocks["qkv"]["bias"]).max()) == 0.0


@pytest.mark.parametrize("config", ["tiny", "tiny_llama"])
def test_matmul_param_count_matches_the_model(config):
    """N in 6N is every block kernel (for Llama: q, the smaller k/v, out, and SwiGLU's three) and
    the lm_head over the real vocabulary, tied or not."""
    cfg = tiny_config(config)
    blocks = Transformer(cfg.model, 65).shapes()["blocks"]
    kernels = sum(blocks[name]["kernel"].size for name in blocks if "kernel" in blocks[name])
    assert matmul_params(cfg.model, 65) == kernels + 65 * cfg.model.n_embd
    if config == "tiny_llama":  # 2 KV heads of 8 and an MLP of 64: by hand
        assert kernels == 2 * (32 * 32 + 2 * 32 * 2 * 8 + 32 * 32 + 3 * 32 * 64)


def test_nanogpt_cpu_recipe_has_nanogpt_param_count():
    """The reference (../shared/bench/torch_ref.py, same recipe) reports 809,856 with wpe."""
    cfg, _, params = tiny_model(**{"model.n_layer": 4, "model.n_embd": 128, "model.n_head": 4,
                                   "model.block_size": 64})
    total = sum(x.size for x in jax.tree.leaves(params))
    padding = (128 - 65) * 128
    assert total - padding == 809_856


def test_weight_decay_covers_every_2d_weight_as_nanogpt():
    """nanoGPT decays its 2-D params (matmul weights, wte = the tied head, wpe), not its 1-D ones
    (biases, LayerNorm scales). Our q/k/v bias is factored to (3, heads, head_dim) but is 1-D there."""
    from jaxpar.training.optimizers.registry import optimizer_for

    cfg, _, params = tiny_model()
    # Weight decay alone moves a decayed param (lr * wd * p) and leaves the others where they are.
    tx = optimizer_for(cfg.optimizer, Transformer(cfg.model, 65))
    updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    moved = jax.tree.map(lambda u: bool(jnp.any(u != 0)), updates)
    expected = jax.tree_util.tree_map_with_path(
        lambda path, _: path[-1].key not in ("bias", "scale"), params)
    assert moved == expected
    assert moved["wte"] and moved["wpe"]


@pytest.mark.parametrize("kv_heads", [3, 1], ids=["heads-3", "gqa-3-of-1"])
@pytest.mark.parametrize("blocks", [None, [(0, 4), (4, 12), (12, 16)]], ids=["one-block", "query-blocks"])
def test_attention_backward_equals_autodiff(blocks, kv_heads, monkeypatch):
    """The hand-written attention backward against autodiff of the plain formula, with dropout too,
    whole and with the queries in blocks that skip the masked keys; with grouped-query attention,
    against the plain formula on K and V repeated as Hugging Face's repeat_kv repeats them (query
    head h reads KV head h // group)."""
    import math

    from jaxpar.nn import attention
    from jaxpar.nn.attention import causal_attention
    monkeypatch.setattr(attention, "query_blocks", lambda T: blocks or [(0, T)])

    def plain(q, k, v, rate, key):
        group = q.shape[1] // k.shape[1]
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
        T, D = q.shape[2], q.shape[3]
        scores = jnp.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(D)
        probs = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf), -1)
        if key is not None:
            keep = jax.random.bernoulli(key, 1.0 - rate, probs.shape)
            probs = jnp.where(keep, probs / (1.0 - rate), 0.0)
        return jnp.einsum("bhts,bhsd->bthd", probs, v)

    q, k, v, w = (jax.random.normal(jax.random.key(i), (2, 3, 16, 8)) for i in range(4))
    k, v = k[:, :kv_heads], v[:, -kv_heads:]
    w = w.transpose(0, 2, 1, 3)  # a fixed cotangent in the output's (batch, seq, heads, dim) layout
    for rate, key in ((0.0, None), (0.25, jax.random.key(7))):
        grads = [jax.grad(lambda *qkv: jnp.sum(f(*qkv, rate, key) * w), argnums=(0, 1, 2))(q, k, v)
                 for f in (causal_attention, plain)]
        for ours, reference in zip(*grads):
            np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-6)  # float32 rounding


@pytest.mark.parametrize("for_cpu", [True, False], ids=["cpu form", "accelerator form"])
@pytest.mark.parametrize("spec, x_shape, w_shape", [
    ("nc,cf->nf", (64, 12), (12, 20)), ("nf,cf->nc", (64, 20), (12, 20)),
    ("nc,cshd->nshd", (64, 12), (12, 3, 2, 4)), ("nhd,hdc->nc", (64, 2, 4), (2, 4, 12)),
    ("btc,vc->btv", (2, 32, 12), (16, 12))])
def test_bf16_projections_have_float32s_gradients(spec, x_shape, w_shape, for_cpu):
    """The bf16 projections' own backward (bf16 dots, float32 accumulation; on CPUs the weight
    gradient's operand laid out) gives autodiff's float32 gradients to bf16 rounding: within 1e-2
    of each gradient's largest magnitude (a wrong transpose is off by order 1). Every dot of the
    backward takes bf16 operands (autodiff's would take the float32 output gradient)."""
    from jaxpar.nn.recipes.model_dtype import low_precision_project
    rng = np.random.default_rng(0)
    x, w = (jnp.asarray(rng.normal(size=s), jnp.bfloat16) for s in (x_shape, w_shape))
    out_shape = jax.eval_shape(lambda x, w: jnp.einsum(spec, x, w), x, w).shape
    g = jnp.asarray(rng.normal(size=out_shape), jnp.bfloat16).astype(jnp.float32)
    _, low = jax.vjp(lambda x, w: low_precision_project(spec, x, w, for_cpu), x, w)
    _, exact = jax.vjp(lambda x, w: jnp.einsum(spec, x, w), x.astype(jnp.float32), w.astype(jnp.float32))
    for got, want in zip(jax.jit(low)(g), exact(g)):  # jit: XLA:CPU runs the accelerator form's dots
        assert got.dtype == jnp.bfloat16
        error = jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want))
        assert error < 1e-2, (spec, float(error))
    dots = [e for e in jax.make_jaxpr(low)(g).eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 2 and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)


@pytest.mark.parametrize("config", ["tiny", "tiny_llama"])
def test_activations_are_recomputed_on_accelerators_alone(config, monkeypatch):
    """On an accelerator the GELU / SwiGLU keeps its input alone and runs again in the backward
    pass (jaxpar.nn.layers.recomputed): the same gradients to 1e-6 of each tensor's largest
    magnitude (float32). On the CPU the step is autodiff's, as before (the control)."""
    from jaxpar.core.execution import ExecutionPlan
    cfg = tiny_config(config)
    rows = jnp.asarray(np.random.default_rng(0).integers(0, 65, (2, cfg.model.block_size + 1)), jnp.int32)
    params = Transformer(cfg.model, 65).init(0)

    def gradient(platform: str):  # the execution plan of a mesh on that platform's devices
        model = Transformer(cfg.model, 65, plan=ExecutionPlan(platform=platform))
        return jax.grad(lambda p: model.loss(p, rows[:, :-1], rows[:, 1:])[0])

    on_cpu = jax.make_jaxpr(gradient("cpu"))(params)
    reference = jax.jit(gradient("cpu"))(params) if config == "tiny" else None
    assert "remat" not in str(on_cpu) and "remat" in str(jax.make_jaxpr(gradient("gpu"))(params))
    if config == "tiny":  # the numerics once: both families recompute through the same function
        recomputed = jax.jit(gradient("gpu"))(params)
        for a, b in zip(jax.tree.leaves(recomputed), jax.tree.leaves(reference)):
            assert float(jnp.max(jnp.abs(a - b))) <= 1e-6 * float(jnp.max(jnp.abs(b)))

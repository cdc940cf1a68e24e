"""Mixture of experts: the grouped-GEMM layer against a per-expert loop, dense layers between the
sparse ones against a loop over layers, the capacity rule, cached decoding on every mesh, resuming
on another layout, and the MoE config's one-line errors (the layouts against one device:
tests/test_layouts.py, tests/test_moe_layouts.py)."""

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_overrides, tiny_config
from helpers import LOSS_RTOL, error_at_scale, fails_with

from jaxpar.core.execution import ExecutionPlan
from jaxpar.core.model_config import model_config
from jaxpar.inference import sample
from jaxpar.models.llama import model as llama
from jaxpar.models.transformer import build_model
from jaxpar.nn import grouped_gemm, moe, routing
from jaxpar.train import run

MOE = "tiny_moe"
TRAINED = "tiny_moe_expert_parallel"  # the tiny MoE after 10 steps on dp=2,ep=2 (conftest.TRAINED_RUNS)


def per_expert_loop(h, p, k, renormalize):
    """Every expert on every token, weighted by the routing (zero where a token did not pick it)."""
    router, gate_up, out = p["router"]["kernel"], p["experts_gate_up"]["kernel"], p["experts_out"]["kernel"]
    x = h.reshape(-1, h.shape[-1])
    probs = jax.nn.softmax(x @ router, axis=-1)
    top, chosen = jax.lax.top_k(probs, k)
    if renormalize:
        top = top / top.sum(-1, keepdims=True)
    y = jnp.zeros_like(x)
    for e in range(router.shape[-1]):
        gu = jnp.einsum("nc,czf->nzf", x, gate_up[e])
        expert_out = (jax.nn.silu(gu[:, 0]) * gu[:, 1]) @ out[e]
        weight = jnp.sum(jnp.where(chosen == e, top, 0.0), axis=-1)
        y = y + weight[:, None] * expert_out
    return y.reshape(h.shape)


def moe_params(key, C=16, E=4, F=8):
    keys = jax.random.split(key, 3)
    return {"router": {"kernel": 0.5 * jax.random.normal(keys[0], (C, E))},
            "experts_gate_up": {"kernel": 0.3 * jax.random.normal(keys[1], (E, C, 2, F))},
            "experts_out": {"kernel": 0.3 * jax.random.normal(keys[2], (E, F, C))}}


@pytest.mark.parametrize("renormalize, gemm", [(True, "ragged_dot"), (False, "ragged_dot"), (True, "megablox"),
                                                (True, "blocks")])
def test_grouped_gemm_equals_a_loop_over_experts(renormalize, gemm):
    """ragged_dot, the Megablox kernels (interpreted here) and the blocked GEMM against every
    expert on every token."""
    cfg = model_config("llama", n_experts=4, experts_per_token=2, moe_renormalize=renormalize, moe_gemm=gemm)
    p, h = moe_params(jax.random.key(0)), jax.random.normal(jax.random.key(1), (3, 8, 16))
    plan = ExecutionPlan(moe_gemm=moe.gemm_of(cfg, "cpu")[0])
    grouped = jax.jit(lambda p, h: moe.moe_mlp(plan, h, p, cfg, jnp.float32)[0])
    loop = jax.jit(lambda p, h: per_expert_loop(h, p, 2, renormalize))
    assert_close_at_scale(grouped(p, h), loop(p, h))
    cotangent = jax.random.normal(jax.random.key(2), h.shape)
    grads = [jax.jit(jax.grad(lambda p, h: jnp.sum(f(p, h) * cotangent), argnums=(0, 1)))(p, h)
             for f in (grouped, loop)]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        assert_close_at_scale(a, b)


def assert_close_at_scale(actual, desired, tol=1e-5):
    """Each element within `tol` of the largest magnitude of `desired` (helpers.error_at_scale):
    the two sum the same products in other orders."""
    error = error_at_scale(actual, desired)
    assert error <= tol, f"differ by {error:.3g} of the largest magnitude, beyond {tol}"


@pytest.mark.parametrize("group_sizes", [(10, 0, 37, 40), (0, 0, 0, 0), (77, 0, 0, 0), (5, 1, 2, 3)])
def test_the_blocked_gemm_is_ragged_dot(group_sizes):
    """Uneven, empty and single groups, and rows past the groups (zeros): forward and gradients,
    tiles of 8 rows."""
    keys = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(keys[0], (77, 16)), jax.random.normal(keys[1], (4, 16, 8))
    sizes, cotangent = jnp.array(group_sizes, jnp.int32), jax.random.normal(keys[2], (77, 8))
    gemms = (functools.partial(grouped_gemm.blocked_gemm, block=8), functools.partial(jax.lax.ragged_dot,
                                                                            preferred_element_type=jnp.float32))
    outputs = [jax.jit(lambda x, w, f=f: f(x, w, sizes))(x, w) for f in gemms]
    assert_close_at_scale(*outputs)
    grads = [jax.jit(jax.grad(lambda x, w, f=f: jnp.sum(f(x, w, sizes) * cotangent), argnums=(0, 1)))(x, w)
             for f in gemms]
    for a, b in zip(grads[0], grads[1]):
        assert_close_at_scale(a, b)
    if sum(group_sizes):  # the control: the groups' matrices in another order
        with pytest.raises(AssertionError):
            assert_close_at_scale(grouped_gemm.blocked_gemm(x, w[::-1], sizes, 8), outputs[1])


def test_the_loop_is_a_real_control():
    """Renormalised and not differ here: the reference can tell the two apart."""
    p, h = moe_params(jax.random.key(0)), jax.random.normal(jax.random.key(1), (3, 8, 16))
    assert not np.allclose(per_expert_loop(h, p, 2, True), per_expert_loop(h, p, 2, False), rtol=1e-3)
    with pytest.raises(AssertionError):
        assert_close_at_scale(per_expert_loop(h, p, 2, True), per_expert_loop(h, p, 2, False))


def layer_by_layer(model, params, tokens, reverse_experts=False):
    """(logits, auxiliary losses) with each layer's block called in turn: the shared params at its
    index, its kind's (experts or dense MLP) at its rank among that kind's layers. A control:
    `reverse_experts` gives the sparse layers their experts in reverse order."""
    m, stacks = model.cfg, model.stacks()
    top = {name: value for name, value in params.items() if name != "blocks"}
    axes = {name: jax.tree.map(lambda names: names[1:], a, is_leaf=lambda n: isinstance(n, tuple))
            for name, a in model.axes()["blocks"].items()}
    plan = model.plan
    x, totals = model.family.embed(plan, top, tokens), {}
    for i, sparse in enumerate(m.sparse_layers):
        kind = "sparse_layers" if sparse else "dense_layers"
        rank = m.layers_in(kind).index(i)
        at = {"layers": i, kind: -1 - rank if reverse_experts and sparse else rank}
        layer = {name: jax.tree.map(lambda a, i=at[stacks[name]]: a[i], tree)
                 for name, tree in params["blocks"].items() if stacks[name] in at}
        x, losses, _ = llama.block(plan, x, layer, {name: axes[name] for name in layer}, m, jnp.float32, None)
        totals |= {name: totals.get(name, 0.0) + value for name, value in losses.items()}
    return model.family.logits(plan, top, x, model.vocab_size), totals


def test_dense_layers_between_sparse_ones_equal_a_loop_over_layers():
    """Layers 1 and 2 with experts, 0 and 3 dense (no repeat: one group of four in the scan): the
    logits and router losses against the blocks in a loop (training, gradients included, against
    one device: tests/test_moe_layouts.py)."""
    cfg = tiny_config(MOE, **{"model.n_layer": 4, "model.dense_layers": "0,3"})
    assert cfg.model.sparse_layers == (False, True, True, False)
    every_second = tiny_config(MOE, **{"model.n_layer": 4, "model.moe_every": 2}).model  # HF's decoder_sparse_step
    assert every_second.sparse_layers == (False, True, False, True) and every_second.layers_in("dense_layers") == (0, 2)
    model = build_model(cfg, 65)
    params, tokens = jax.jit(model.init, static_argnums=0)(0), jax.random.randint(jax.random.key(1), (2, 32), 0, 65)
    assert params["blocks"]["router"]["kernel"].shape[0] == params["blocks"]["gate_up"]["kernel"].shape[0] == 2

    scanned = jax.jit(model.apply)(params, tokens)
    looped, reversed_experts = (jax.jit(lambda p, r=r: layer_by_layer(model, p, tokens, r))(params) for r in (0, 1))
    np.testing.assert_allclose(scanned[0], looped[0], rtol=1e-5, atol=1e-6)
    for name in ("moe_balance", "moe_z", "moe_load"):
        np.testing.assert_allclose(scanned[1][name], looped[1][name], rtol=1e-5)
    assert not np.allclose(reversed_experts[0], scanned[0], rtol=1e-3)


def test_capacity_keeps_each_sequences_first_assignments_to_an_expert():
    experts = jnp.array([[0, 1], [0, 2], [0, 1], [2, 0]])  # 2 sequences of 2 tokens, k=2
    keep = routing.within_capacity(experts, 2, capacity=1)
    np.testing.assert_array_equal(keep, [[True, True], [False, True], [True, True], [True, False]])
    assert bool(routing.within_capacity(experts, 2, capacity=4).all())  # room for every assignment: none dropped


def test_cached_decoding_gives_one_text_on_every_mesh(trained):
    """Greedy text with the KV cache equals recomputing, and is the same on one device and on
    ep=2,tp=2 (each device's experts on every token, summed; ep=2 alone is inside it)."""
    kwargs = dict(prompt="ROMEO:", max_new_tokens=40, temperature=0, num_samples=2)
    texts = {}
    for spec in ("dp=1", "ep=2,tp=2"):
        model = sample.load(trained, spec)
        texts[spec] = sample.generate(model, use_cache=True, **kwargs).texts
        if spec == "ep=2,tp=2":
            assert texts[spec] == sample.generate(model, use_cache=False, **kwargs).texts
    assert texts["dp=1"] == texts["ep=2,tp=2"]
    assert len(texts["dp=1"][0]) == len("ROMEO:") + 40


def test_a_checkpoint_resumes_on_another_expert_layout(trained, tmp_path):
    """Saved on dp=2,ep=2, resumed on one device and on ep=4: the same next steps."""
    resumed = {}
    for spec, n_devices in (("dp=1", 1), ("ep=4", 4)):
        out = tmp_path / spec
        shutil.copytree(trained, out)
        cfg = tiny_config(MOE, **{"train.eval_every": 0, "train.steps": 12, **mesh_overrides(spec)})
        result = run(cfg, out, jax.devices()[:n_devices], progress=False)
        assert result.info["resumed_from"] == 10
        resumed[spec] = [result.losses[s] for s in (10, 11)]
    np.testing.assert_allclose(resumed["ep=4"], resumed["dp=1"], rtol=LOSS_RTOL)


@pytest.mark.parametrize("argv, expected", [
    (["--config", MOE, "--model.experts_per_token=9"], ["model.experts_per_token=9", "model.n_experts=4"]),
    (["--config", MOE, "--model.n_experts=6", "--mesh", "dp=2,ep=4"], ["ep=4 does not divide model.n_experts=6"]),
    (["--mesh", "dp=4,ep=2"], ["ep=2 splits a mixture of experts, and this model has none"]),
    (["--model.n_experts=4"], ["model.n_experts is a llama/deepseek-only setting"]),
    (["--config", MOE, "--model.router_aux_coef=-1"], ["model.router_aux_coef must be >= 0"]),
    (["--config", MOE, "--model.moe_dispatch=magic"], ["model.moe_dispatch must be one of"]),
    (["--config", MOE, "--model.moe_gemm=magic"], ["model.moe_gemm must be one of"]),
    (["--config", MOE, "--model.moe_capacity_factor=-1"], ["model.moe_capacity_factor must be >= 0"]),
    (["--config", MOE, "--model.moe_capacity_factor=1", "--mesh", "dp=4,cp=2"], ["cp=2 splits the sequences"]),
    (["--config", "tiny_llama", "--model.moe_every=2"], ["choose the layers with experts, and this model has none"]),
    (["--config", MOE, "--model.dense_layers=0,2"], ["model.dense_layers=0,2 distinct layer indices from 0 to 1"]),
    (["--config", MOE, "--model.dense_layers=0,x"], ["model.dense_layers takes comma-separated layer indices"]),
    (["--config", MOE, "--model.dense_layers=0,1"], ["leave no layer of 2 with experts"]),
    (["--config", MOE, "--model.n_layer=4", "--model.dense_layers=1", "--mesh", "dp=4,pp=2"],
     ["chunks of 2 layers differ in which layers have experts"]),
    (["--config", MOE, "--model.n_layer=4", "--model.dense_layers=0", "--mesh", "dp=4,pp=2"],
     ["pp=2 does not divide the 3 layers after the 1 dense first ones"]),
])
def test_bad_moe_settings_fail_in_one_line(capsys, tmp_path, argv, expected):
    fails_with(capsys, tmp_path, argv, *expected)

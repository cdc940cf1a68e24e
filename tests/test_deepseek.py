"""The DeepSeek-V3 family (configs/tiny_deepseek.toml: MLA with a query bottleneck, 8 routed experts
in 4 groups beside a shared one, the first layer dense): the router's choice within the best
groups against a hand-made case; the balance bias's counts and update against a hand count, and
only that update moving it; MLA against a plain per-head computation of it; the MTP loss
against the module computed over the whole row; its keys refused on another family; the presets'
sizes. Its layouts (dp=2,tp=2, dp=2,ep=2,pp=2 without the query bottleneck, a cp=2 ring, Ulysses,
DualPipeV) are tests/test_layouts.py's suite's.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from helpers import plain_mla, train

from jaxpar.core.errors import UserError
from jaxpar.core.execution import ExecutionPlan
from jaxpar.models.deepseek.model import latent_attention
from jaxpar.models.llama.model import Layer
from jaxpar.models.transformer import build_model
from jaxpar.nn import routing

DEEPSEEK = "tiny_deepseek"


def test_the_router_chooses_within_the_best_groups():
    """8 experts in 4 groups, the best 2 groups kept (a group scored by its two best): expert 0
    scores highest of all, but its group (0, 1) sums lowest, so it is passed over. The chosen
    scores sum to routed_scaling_factor. Control: a top-2 over every expert takes expert 0."""
    scores = np.array([[0.99, 0.01, 0.7, 0.6, 0.8, 0.75, 0.2, 0.3]])
    logits = np.log(scores / (1 - scores))  # sigmoid(logits) = scores
    router = jnp.eye(8, dtype=jnp.float32)
    _, probs, weights, experts = routing.route_in_groups(jnp.asarray(logits, jnp.float32), router, jnp.zeros(8),
                                                         k=2, n_group=4, topk_group=2, scale=2.5)
    assert sorted(np.asarray(experts)[0].tolist()) == [4, 5]  # groups (4, 5) and (2, 3) are the best two
    np.testing.assert_allclose(np.asarray(weights).sum(), 2.5, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(weights)[0], np.array([0.8, 0.75]) / 1.55 * 2.5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(probs).sum(), 1.0, rtol=1e-6)
    assert 0 in np.asarray(jax.lax.top_k(jnp.asarray(scores), 2)[1])  # the control


def hand_counts(x: np.ndarray, router: np.ndarray, balance: np.ndarray, k=2, n_group=4, topk_group=2):
    """Each expert's tokens, routed as DeepSeek-V3 routes them, one token at a time in numpy."""
    counts = np.zeros(router.shape[1])
    for choice in 1 / (1 + np.exp(-(x @ router))) + balance:
        groups = np.sort(choice.reshape(n_group, -1), axis=1)[:, -2:].sum(1)
        best = np.argsort(-groups)[:topk_group]
        allowed = np.isin(np.arange(choice.size) // (choice.size // n_group), best)
        counts[np.argsort(-np.where(allowed, choice, -np.inf))[:k]] += 1
    return counts


def test_the_balance_bias_steers_the_choice_and_moves_by_the_routed_counts():
    """A sparse layer's `moe_bias` is the biases' mean size, and its gradient for them is the tokens
    routed to each expert with the bias in the choice (here a mean over 4 sequences), counted by
    hand; the update moves each bias by +-rate towards the mean count, 0 at it. Control: the same
    tokens without the bias go to other experts."""
    from jaxpar.nn import moe
    cfg, rng = tiny_config(DEEPSEEK).model, np.random.default_rng(0)
    B, T, C, E, F = 4, 8, cfg.n_embd, cfg.n_experts, cfg.expert_width
    h, router = rng.normal(size=(B, T, C)).astype(np.float32), rng.normal(0, 0.3, (C, E)).astype(np.float32)
    balance = rng.normal(0, 0.2, E).astype(np.float32)
    p = {"experts_gate_up": {"kernel": jnp.asarray(rng.normal(0, 0.02, (E, C, 2, F)), jnp.float32)},
         "experts_out": {"kernel": jnp.asarray(rng.normal(0, 0.02, (E, F, C)), jnp.float32)}}

    def bias_term(balance):
        layer = p | {"router": {"kernel": jnp.asarray(router), "balance": balance}}
        return moe.moe_mlp(ExecutionPlan(), jnp.asarray(h), layer, cfg, jnp.float32)[1]["moe_bias"]
    size, routed = jax.value_and_grad(bias_term)(jnp.asarray(balance))
    counts = hand_counts(h.reshape(-1, C), router, balance)
    np.testing.assert_allclose(np.asarray(routed) * B, counts, rtol=1e-6)
    np.testing.assert_allclose(size, np.mean(np.abs(balance)), rtol=1e-6)
    assert (hand_counts(h.reshape(-1, C), router, 0 * balance) != counts).any()  # the control
    moved = routing.rebalanced(jnp.asarray(balance), routed, 1e-3)
    np.testing.assert_allclose(moved, balance + 1e-3 * np.sign(counts.mean() - counts), rtol=1e-6)
    tied = routing.rebalanced(jnp.zeros(3), jnp.asarray([2.0, 2.0, 2.0]) / 3, 1e-3)  # means, not integers
    np.testing.assert_array_equal(tied, np.zeros(3))


def test_only_the_balancing_update_moves_the_biases():
    """After 10 steps from 0, each bias is a whole number of updates (model.moe_bias_update_rate):
    the optimizer's steps (AdamW, weight decay) would have left fractions."""
    balance = np.asarray(train(config=DEEPSEEK).params["blocks"]["router"]["balance"]) / 1e-3
    assert np.abs(balance).max() >= 2
    np.testing.assert_allclose(balance, np.round(balance), atol=1e-3)


def test_latent_attention_is_mla_head_by_head():
    """latent_attention (values zero-padded to the query-key width through the kernel) against
    plain_mla, within 1e-5 of the output's largest magnitude. Controls: with the rotated dims taken
    as halves instead of pairs, or with the rotation off (every angle ~0), the output differs by 100
    times that."""
    cfg = tiny_config(DEEPSEEK).model
    model = build_model(tiny_config(DEEPSEEK), 65, None, ExecutionPlan())
    params = model.init(0)
    # Layer 0's attention (the dense first layer's), its matrices 10x the init's scale: scores and
    # outputs of order 1
    layer_p = {name: jax.tree.map(lambda a, scale=1.0 if "norm" in name else 10.0: a[0] * scale, w)
               for name, w in params["lead_blocks"].items() if name.startswith(("attn", "q_", "kv_", "k_", "v_"))}
    x = np.asarray(jax.random.normal(jax.random.key(1), (2, 16, cfg.n_embd)), np.float32)
    layer = Layer(ExecutionPlan(), layer_p, jax.tree.map(lambda _: None, layer_p), cfg, jnp.float32)
    got = np.asarray(latent_attention(layer, jnp.asarray(x), (None, None))[0]) - x
    want = plain_mla(jax.tree.map(lambda a: np.asarray(a, np.float64), layer_p), x.astype(np.float64), cfg)
    assert np.max(np.abs(want)) > 0.5
    np.testing.assert_allclose(got, want, atol=1e-5 * np.max(np.abs(want)), rtol=0)
    for change in ({"rope_interleave": False}, {"rope_theta": 1e30}):  # halves, not pairs; no rotation
        other = Layer(ExecutionPlan(), layer_p, jax.tree.map(lambda _: None, layer_p),
                      dataclasses.replace(cfg, **change), jnp.float32)
        wrong = np.asarray(latent_attention(other, jnp.asarray(x), (None, None))[0]) - x
        assert np.max(np.abs(wrong - want)) > 100 * 1e-5 * np.max(np.abs(want)), change  # 100x the tolerance


def test_layers_of_mixed_kinds_scan_after_their_irregular_first_ones():
    """repeat_of: layers before the kinds repeat run one by one, then the rest in a scan of one
    repeat a step (so ZeRO-3 gathers one layer at a time where it repeats every layer); a
    repeating pattern scans from the start, rather than one group of all the layers written out.
    (DeepSeek's dense first layers are stacked apart instead, jaxpar.models.lead.)"""
    from jaxpar.models.transformer import repeat_of
    d, s = "dense_layers", "sparse_layers"
    assert repeat_of([d, s, s, s]) == (1, 1) and repeat_of([d, d, d] + [s] * 58) == (3, 1)
    assert repeat_of([d, s, d, s]) == (0, 2) and repeat_of([s, s]) == (0, 1)


@pytest.mark.parametrize("documents", [False, True])
def test_the_mtp_loss_is_the_module_computed_over_the_whole_row(documents):
    """tiny_deepseek's one multi-token prediction module: `mtp_loss` equals the module computed
    another way, at rtol 1e-5: over all T positions (each position's next token being its
    target), the cross-entropy against the targets one place further, the last position (which
    has none) dropped. Control: against the next token's targets instead, it differs. With
    documents (data.document_mask: token 0 opens one), the module attends within the main
    positions' documents; the control, the module's block over the whole row, differs."""
    from jaxpar.models.llama.model import rms_norm
    from jaxpar.nn.loss import token_losses
    cfg = tiny_config(DEEPSEEK, **{"data.document_mask": documents})
    model, eps = build_model(cfg, 65, eot_id=0), cfg.model.norm_eps
    params = model.init(0)
    rows = np.random.default_rng(0).integers(1, 65, (4, cfg.model.block_size + 1))
    rows[:, [5, 11, 20]] = 0  # documents' openings (with documents)
    rows = jnp.asarray(rows, jnp.int32)
    tokens, targets = rows[:, :-1], rows[:, 1:]
    mtp_loss = jax.jit(model.loss)(params, tokens, targets)[1]["mtp_loss"]

    @functools.partial(jax.jit, static_argnums=1)
    def whole_row(params, within_documents: bool = True):  # (the loss against the targets one place further, next)
        top, x, _ = model.stream(params, tokens)
        p = jax.tree.map(lambda a: a[0], top["mtp"])
        joined = jnp.concatenate([rms_norm(model.family.embed(model.plan, top, targets), p["enorm"], eps),
                                  rms_norm(x, p["hnorm"], eps)], axis=-1)
        axes = jax.tree.map(lambda names: names[1:], model.axes()["mtp"]["block"],
                            is_leaf=lambda n: isinstance(n, tuple))
        docs = model.doc_starts(tokens) if within_documents else None
        h, _, _ = model.family.block(model.plan, joined @ p["eh_proj"]["kernel"], p["block"], axes, None, None, docs)
        logits = model.logits_of({**model.head(top), "norm": p["norm"]}, h)
        return jnp.mean(token_losses(logits[:, :-1], targets[:, 1:])), jnp.mean(token_losses(logits, targets))
    further, next_token = whole_row(params)
    np.testing.assert_allclose(mtp_loss, further, rtol=1e-5)
    assert abs(next_token / mtp_loss - 1) > 1e-3  # the control
    if documents:
        # the control, across documents, fails the tolerance the module meets (6e-5 relative)
        assert abs(whole_row(params, False)[0] / mtp_loss - 1) > 1e-5


def test_deepseek_keys_are_refused_on_another_family_and_bad_groups_in_one_line():
    with pytest.raises(UserError, match="model.kv_lora_rank is a deepseek-only setting"):
        tiny_config("tiny_llama", **{"model.kv_lora_rank": 8})
    with pytest.raises(UserError, match="model.n_group=3 must divide model.n_experts=8"):
        tiny_config(DEEPSEEK, **{"model.n_group": 3})
    with pytest.raises(UserError, match="model.mtp_layers is a deepseek-only setting"):
        tiny_config("tiny_llama", **{"model.mtp_layers": 1})
    with pytest.raises(UserError, match="model.mtp_layers=-1 and model.mtp_weight=0.3 must be >= 0"):
        tiny_config(DEEPSEEK, **{"model.mtp_layers": -1})
    with pytest.raises(UserError, match="model.v_head_dim=16 is wider than the query-key heads"):
        tiny_config(DEEPSEEK, **{"model.v_head_dim": 16})
    with pytest.raises(UserError, match=r"model.attention=cudnn takes heads up to 256 dims \(Hopper and later GPUs\) "
                                        "in multiples of 8, and this model's are 12"):  # 8 + 4: MLA's query-key heads
        tiny_config(DEEPSEEK, **{"model.attention": "cudnn", "model.dtype": "bfloat16"})  # refused as it loads


@pytest.mark.parametrize("preset, vocab, total, active", [("deepseek-v3-671b", 129280, 671e9, 37e9),
                                                          ("moonlight-16b-a3b", 163840, 16e9, 3e9)])
def test_the_presets_hold_their_published_sizes(preset, vocab, total, active):
    """All parameters within 0.5% of the published total, and the active ones (the matmuls a token
    runs, and its embedding row's table) within 5% of the published active count: a mistyped width
    is off by more. Nothing is allocated."""
    cfg = tiny_config(preset)
    model = build_model(cfg, vocab)
    count = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(model.shapes()))
    assert abs(count / total - 1) < 0.005, count
    runs = model.family.matmul_params(vocab) + vocab * cfg.model.n_embd
    assert abs(runs / active - 1) < 0.05, runs

"""Document masking (data.document_mask): a row holding documents A|B|C gives the per-token losses
and the gradients of A, B and C run separately, each from position 0, on one device and on
dp=2,tp=2, cp=2 (the ring, and Ulysses on cp=4) and pp=2 (per-token losses where the layout returns
them; the pipeline returns the mean loss and the gradients), for GPT-2's learned positions and
Llama's RoPE.

Tolerance: rtol 1e-5 for the losses (f32), and each gradient within 1e-5 of its tensor's largest
magnitude (test_equivalence's). Control: the same rows without the mask differ.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_overrides, tiny_config
from helpers import LOSS_RTOL, PARAM_TOL, fails_with

from jaxpar.models.transformer import build_model
from jaxpar.nn import context
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.step.build import build
from jaxpar.training.step.execution import plan_execution
from jaxpar.training.step.passes import laid_out, make_grad_fn

EOT, VOCAB, T = 256, 257, 32
# Where each row's documents open (an end-of-text token); the first starts mid-document.
OPENINGS = [(9, 20), (5, 6), (14, 30), (1, 17)]


def rows() -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.default_rng(0).integers(0, EOT, (len(OPENINGS), T + 1)).astype(np.int32)
    for row, opens in enumerate(OPENINGS):
        tokens[row, list(opens)] = EOT
    return tokens[:, :-1], tokens[:, 1:]


def token_losses(logits, targets):
    return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]


def separately(model, params, inputs, targets):
    """(per-token losses, gradients of their mean): each document run alone from position 0, as
    a row of its own, padded at its end (which causal attention keeps from its tokens)."""
    pieces = [(row, start, stop) for row, opens in enumerate(OPENINGS)
              for start, stop in zip((0,) + opens, opens + (T,))]
    alone_x, alone_y, used = (np.zeros((len(pieces), T), np.int32) for _ in range(3))
    for i, (row, start, stop) in enumerate(pieces):
        alone_x[i, :stop - start], alone_y[i, :stop - start] = inputs[row, start:stop], targets[row, start:stop]
        used[i, :stop - start] = 1

    def loss_sum(params):
        losses = token_losses(model(params, alone_x), alone_y)
        return jnp.sum(losses * used) / inputs.size, losses
    (_, alone), grads = jax.jit(jax.value_and_grad(loss_sum, has_aux=True))(params)
    losses = np.concatenate([np.asarray(alone)[i, :stop - start] for i, (_, start, stop) in enumerate(pieces)])
    return losses.reshape(inputs.shape), grads


def config(spec: str, family: str, mask: bool = True, **overrides):
    return tiny_config("tiny_llama" if family == "llama" else "tiny", **mesh_overrides(spec),
                       **{"data.document_mask": mask, "train.batch_size": len(OPENINGS), "model.block_size": T},
                       **overrides)


@pytest.fixture(scope="module")
def reference(request):
    cfg = config("dp=1", request.param)
    plain = build_model(cfg, VOCAB)  # no documents: each one alone
    params = plain.init(cfg.train.seed)
    inputs, targets = rows()
    return request.param, params, separately(plain, params, inputs, targets)


def on_mesh(spec: str, family: str, params, mask: bool = True, **overrides):
    """(per-token losses in the rows' order or None under a pipeline, mean loss, gradients) of
    the masked model on `spec`, through the train step's gradient function."""
    cfg = config(spec, family, mask, **overrides)
    mesh = build_mesh(cfg, jax.devices()[:math.prod(cfg.mesh.__dict__.values())])
    built = build(cfg, mesh, vocab=VOCAB, eot_id=EOT)
    model = built.model
    inputs, targets = rows()
    with jax.set_mesh(mesh):
        placed = jax.device_put(params, built.shardings.params)
        batch = [a.reshape(model.plan.passes, -1, T) for a in (inputs, targets)]
        metrics, grads = jax.jit(make_grad_fn(model, cfg.train.seed, built.zero.grads))(placed, *batch, 0)
        per_token = None
        if cfg.mesh.pp == 1:
            laid = jax.jit(laid_out(lambda p, x, y: token_losses(model(p, x), y), model.plan))(placed, inputs, targets)
            per_token = np.empty(inputs.shape, np.float32)
            order = context.of(model.plan).permutation(T, cfg.mesh.cp)
            order = np.arange(T) if order is None else order
            per_token[:, order] = np.asarray(laid)
    return per_token, float(metrics["loss"]), jax.tree.map(np.asarray, grads)


def grad_errors(grads, reference) -> dict:
    def error(a, b):
        return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
    return {jax.tree_util.keystr(p): e for p, e in jax.tree_util.tree_leaves_with_path(
        jax.tree.map(error, grads, jax.tree.map(np.asarray, reference))) if e > PARAM_TOL}


# Each layout once in the default run: each context strategy with Llama's RoPE (Ulysses on cp=4,
# its 2 KV heads repeated to 4), the others with GPT-2's learned positions (both families take the
# same document positions); the repeats are marked slow.
SLOW = pytest.mark.slow
ULYSSES = {"model.context_strategy": "ulysses"}
LAYOUTS = [("gpt2", "dp=1", {}), ("gpt2", "dp=2,tp=2", {}), pytest.param("gpt2", "cp=2", {}, marks=SLOW),
           ("gpt2", "pp=2", {}), ("llama", "dp=1", {}), ("llama", "cp=2", {}), ("llama", "cp=4", ULYSSES),
           pytest.param("gpt2", "cp=2", ULYSSES, marks=SLOW),
           *(pytest.param("llama", spec, {}, marks=SLOW) for spec in ("dp=2,tp=2", "pp=2"))]


@pytest.mark.parametrize("reference, spec, overrides", LAYOUTS, indirect=["reference"])
def test_a_row_of_documents_equals_each_document_alone(reference, spec, overrides):
    family, params, (losses, grads) = reference
    per_token, loss, got = on_mesh(spec, family, params, **overrides)
    if per_token is not None:
        np.testing.assert_allclose(per_token, losses, rtol=LOSS_RTOL)
    np.testing.assert_allclose(loss, losses.mean(), rtol=LOSS_RTOL)
    assert not grad_errors(got, grads)


@pytest.mark.parametrize("reference", ["llama"], indirect=True)
def test_tokamaxs_kernel_path_keeps_the_documents_apart(reference):
    """The GPUs' kernel for documents (model.attention=tokamax: tokamax's flash attention given
    the documents' mask), here through tokamax's XLA reference of it, on dp=2,tp=2 with GQA."""
    pytest.importorskip("tokamax")
    family, params, (losses, grads) = reference
    cfg = config("dp=2,tp=2", family, **{"model.attention": "tokamax"})
    assert plan_execution(cfg, build_mesh(cfg, jax.devices()[:4])).attention == "tokamax"
    per_token, loss, got = on_mesh("dp=2,tp=2", family, params, **{"model.attention": "tokamax"})
    np.testing.assert_allclose(per_token, losses, rtol=LOSS_RTOL)
    np.testing.assert_allclose(loss, losses.mean(), rtol=LOSS_RTOL)
    assert not grad_errors(got, grads)


@pytest.mark.parametrize("reference", ["gpt2", pytest.param("llama", marks=SLOW)], indirect=True)
def test_without_the_mask_the_documents_see_each_other(reference):
    """Control: the same row with data.document_mask off differs from the documents alone."""
    family, params, (losses, grads) = reference
    per_token, loss, got = on_mesh("dp=1", family, params, mask=False)
    first_document = np.arange(T) < OPENINGS[0][0]
    np.testing.assert_allclose(per_token[0, first_document], losses[0, first_document], rtol=LOSS_RTOL)
    assert not np.allclose(per_token, losses, rtol=LOSS_RTOL) and grad_errors(got, grads)


def test_document_mask_without_an_end_of_text_token_is_one_line(capsys, tmp_path):
    fails_with(capsys, tmp_path, ["--config", "tiny", "--data.document_mask=true"],
               "data.document_mask needs an end-of-text token", "(char)")

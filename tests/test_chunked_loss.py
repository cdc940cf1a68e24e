"""The chunked loss (model.loss_chunks): the lm_head and cross-entropy over pieces of the sequence,
each piece's gradient computed in the forward pass from its float32 logits (jaxpar.nn.loss).

It equals the whole loss: on one device the loss within rtol 1e-6 and the gradients within 1e-6
of each tensor's largest magnitude (float32; only the order of the sums differs), with a control
1e-4 away that must fail that; 10 steps with 4 pieces train as one device without them on
dp=2,tp=2 (the vocabulary split over tensor), cp=2 and tp=2,pp=2 (the pipeline's last stage), at
the equivalence tolerances (cp=2 marked slow). GPUs' one-pass log-sum-exp gives the two passes'
loss and gradients within 1e-6. Compiled with a 16,384-token vocabulary, the step's temporaries shrink
below the whole batch's float32 logits (XLA's memory analysis).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from helpers import assert_same_training, fails_with, train

from jaxpar.models.transformer import build_model

TIGHT = 1e-6


@functools.cache
def loss_and_grads(chunks: int, **keys):
    """(params -> (loss, grads)) of the tiny model on fixed rows, compiled once per chunking."""
    cfg = tiny_config(**{"model.loss_chunks": chunks, **keys})
    model = build_model(cfg, 65)
    rows = jnp.asarray(np.random.default_rng(0).integers(0, 65, (4, cfg.model.block_size + 1)), jnp.int32)
    return jax.jit(jax.value_and_grad(lambda p: model.loss(p, rows[:, :-1], rows[:, 1:])[0]))


def worst_error(grads, reference) -> float:
    errors = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))), grads, reference)
    return max(jax.tree.leaves(errors))


def test_the_chunked_loss_is_the_whole_loss_on_one_device():
    params = build_model(tiny_config(), 65).init(0)
    whole, whole_grads = loss_and_grads(1)(params)
    loss, grads = loss_and_grads(8)(params)
    np.testing.assert_allclose(loss, whole, rtol=TIGHT)
    assert worst_error(grads, whole_grads) < TIGHT
    # Control: params 1e-4 away fail the same comparison.
    _, moved = loss_and_grads(8)(jax.tree.map(lambda p: p * 1.0001, params))
    assert worst_error(moved, whole_grads) > TIGHT


def test_bf16_logits_chunked_are_the_whole_loss_on_bf16_logits():
    """model.logits_dtype=bfloat16 (nanoGPT's autocast logits): the head's output is bf16, and the
    chunked loss over it is the whole loss over it (float32 softmax both ways) within the same
    loss tolerance, the gradients within bf16's resolution (2^-7 of each tensor's largest: the two
    paths round the logits' gradient to bf16 at different points)."""
    bf16 = {"model.dtype": "bfloat16", "model.logits_dtype": "bfloat16"}
    model = build_model(tiny_config(**bf16), 65)
    params = model.init(0)
    x = jnp.zeros((2, model.cfg.block_size, model.cfg.n_embd))
    assert model.logits_of({k: params[k] for k in model.family.head_names}, x).dtype == jnp.bfloat16
    whole, whole_grads = loss_and_grads(1, **bf16)(params)
    loss, grads = loss_and_grads(8, **bf16)(params)
    np.testing.assert_allclose(loss, whole, rtol=TIGHT)
    assert worst_error(grads, whole_grads) < 2**-7


# cp=2 repeats dp=2,tp=2's proof with the sequence split instead of the vocabulary: marked slow.
@pytest.mark.parametrize("spec", ["dp=2,tp=2", pytest.param("cp=2", marks=pytest.mark.slow), "tp=2,pp=2"])
def test_the_chunked_loss_trains_as_one_device(spec):
    assert_same_training(train(spec, **{"model.loss_chunks": 4}), train())


def temp_bytes(chunks: int) -> int:
    from jaxpar.parallel import hlo
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.training.step.build import build
    cfg = tiny_config(**{"model.loss_chunks": chunks, "model.vocab_size": 16384})
    return hlo.memory_summary(build(cfg, build_mesh(cfg, jax.devices()[:1]), vocab=16384).compile_abstract())["temp_bytes"]


def test_the_whole_float32_logits_are_never_held():
    logits = 8 * 32 * 16384 * 4  # rows x block x vocab x float32: 16 MiB
    assert temp_bytes(1) > logits > temp_bytes(8)


def test_one_pass_log_sum_exp_is_the_two_pass_one():
    """GPUs' plan (one_pass_log_sum_exp): the pieces' log-sum-exp as one running (max, sum)
    reduction gives the chunked loss and its gradients of two passes, within rtol 1e-6, on logits
    up to 1e4 (whose plain sum of exp overflows: the control) with padding columns at -1e9."""
    from jaxpar.nn.loss import log_sum_exp_one_pass, sequence_loss
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(0, 3e3, (6, 40)), jnp.float32).at[:, 33:].set(-1e9)
    np.testing.assert_allclose(log_sum_exp_one_pass(logits), jax.nn.logsumexp(logits, -1, keepdims=True), rtol=TIGHT)
    assert not np.isfinite(np.log(np.sum(np.exp(np.asarray(logits)), -1))).all()  # control
    x = jnp.asarray(rng.normal(size=(2, 8, 5)), jnp.float32)
    head = {"w": jnp.asarray(rng.normal(size=(40, 5)), jnp.float32)}
    targets = jnp.asarray(rng.integers(0, 33, (2, 8)), jnp.int32)
    logits_of = lambda head, x: jnp.where(jnp.arange(40) < 33, 50 * x @ head["w"].T, -1e9)
    loss = {one_pass: jax.value_and_grad(functools.partial(sequence_loss, logits_of, chunks=4, one_pass=one_pass),
                                         (0, 1))(head, x, targets) for one_pass in (False, True)}
    np.testing.assert_allclose(loss[True][0], loss[False][0], rtol=TIGHT)
    assert worst_error(loss[True][1], loss[False][1]) < TIGHT


def test_loss_chunks_must_divide_the_block(capsys, tmp_path):
    fails_with(capsys, tmp_path, ["--config", "tiny", "--model.loss_chunks=3"],
               "model.loss_chunks=3 must be a positive divisor of model.block_size=32")

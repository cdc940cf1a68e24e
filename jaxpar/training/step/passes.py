"""A step's loss and gradients, from its passes.

A pass is one forward and backward: of the model on one microbatch, or with a pipeline (pp > 1),
of one round of M microbatches through the schedule (jaxpar.parallel.pipeline). A pass returns
its metrics (the cross-entropy `loss` and each auxiliary loss, means over its rows) and the
gradients of its training loss: the cross-entropy plus each auxiliary loss times its weight.

The step's gradients are the passes' mean. Each data-parallel device sums its own passes'
gradients and they are reduced over 'data' once (`accumulate_locally`), unless a pass reduces its
own (a pipeline round) or dropout draws each pass's masks over the whole batch, as one device does
(`accumulate`, which reduces after every pass): the model's execution plan says which
(jaxpar.training.step.execution).
"""

import functools

import jax
import jax.numpy as jnp

from jaxpar.core.axes import CONTEXT, DATA
from jaxpar.core.sharding import without_axis
from jaxpar.core.strategies import Accumulation
from jaxpar.models.transformer import Transformer
from jaxpar.nn import context
from jaxpar.parallel import pipeline


def make_loss_fn(model: Transformer):
    """loss_fn(params, inputs, targets, dropout_key) -> (training loss, metrics)."""
    weights = model.family.loss_weights()

    def loss_fn(params, inputs, targets, dropout_key=None):
        loss, aux = model.loss(params, inputs, targets, dropout_key)
        total = loss + sum(weights[name] * value for name, value in aux.items()) if aux else loss
        return total, {"loss": loss, **aux}
    return loss_fn


def make_pass(model: Transformer):
    """(one_pass(params, inputs, targets, step_key, i) -> (metrics, grads), rounds): one model
    pass per microbatch, or with a pipeline a round per `rounds` group of microbatches (None: one
    microbatch a pass). step_key is None without dropout."""
    schedule = model.plan.schedule
    if schedule is not None:
        round_fn = pipeline.make_round_fn(model)

        def one_round(params, inputs, targets, step_key, i):
            return round_fn(params, inputs, targets, None if step_key is None else (step_key, i))
        return one_round, model.plan.passes // schedule.microbatches  # train.grad_accum

    loss_and_grad = jax.value_and_grad(make_loss_fn(model), has_aux=True)

    def one_pass(params, inputs, targets, step_key, i):
        key = None if step_key is None else jax.random.fold_in(step_key, i)
        (_, metrics), grads = loss_and_grad(params, inputs, targets, key)
        return metrics, grads
    return one_pass, None


def make_grad_fn(model: Transformer, seed: int, grad_shardings: dict):
    """(params, inputs, targets, step) -> (metrics, gradients), each the mean over the passes;
    `seed`: the run's, from which dropout draws each step's key.

    inputs/targets are (microbatches, rows, seq). Gradients are pinned to `grad_shardings`: under
    ZeRO-2/3 that turns their all-reduce into a reduce-scatter.
    """
    use_dropout, plan = model.cfg.dropout > 0, model.plan

    def grads_of(params, inputs, targets, step):
        one_pass, rounds = make_pass(model)
        if rounds is not None:
            inputs, targets = (a.reshape(rounds, -1, *a.shape[1:]) for a in (inputs, targets))
        step_key = jax.random.fold_in(jax.random.key(seed), step) if use_dropout else None
        passes = inputs.shape[0]
        if plan.accumulation == Accumulation.ONE_PASS:  # its loss and gradients as they are
            if passes != 1:  # a plan made for other passes would leave rows out, silently
                raise ValueError(f"the plan says one pass and the batch holds {passes}: build the model "
                                 "with its step's plan (jaxpar.training.step.build)")
            metrics, grads = one_pass(params, inputs[0], targets[0], step_key, 0)
            return metrics, jax.lax.with_sharding_constraint(grads, grad_shardings)
        if plan.accumulation == Accumulation.REDUCED_ONCE:
            # The passes of each data-parallel device's rows, traced where 'data' splits nothing.
            group_pass, _ = make_pass(model.on(plan.unsplit(DATA)))
            metrics, grads = accumulate_locally(lambda i, x, y: group_pass(params, x, y, step_key, i),
                                                inputs, targets, params, grad_shardings, plan.sizes[DATA])
        else:
            metrics, grads = accumulate(lambda i, x, y: one_pass(params, x, y, step_key, i),
                                        inputs, targets, params, grad_shardings)
        return jax.tree.map(jnp.mean, metrics), jax.tree.map(lambda g: g / passes, grads)

    return laid_out(grads_of, plan)


def accumulate(run, inputs, targets, params, grad_shardings):
    """(each pass's metrics, the gradients summed over passes), each pass's pinned to grad_shardings."""
    def add(total, batch):
        metrics, grads = run(*batch)
        return jax.tree.map(jnp.add, total, jax.lax.with_sharding_constraint(grads, grad_shardings)), metrics
    zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), grad_shardings)
    grads, metrics = jax.lax.scan(add, zeros, (jnp.arange(inputs.shape[0]), inputs, targets))
    return metrics, grads


def accumulate_locally(run, inputs, targets, params, grad_shardings, dp: int):
    """accumulate, with one reduction over 'data' per step instead of one per pass.

    The rows of every pass are split into dp groups, one per data-parallel device as the batch is
    laid out, and `jax.vmap(..., spmd_axis_name=DATA)` runs the passes of each group on its own
    device: the groups' gradients stay apart (a leading axis over 'data'), so nothing is reduced
    inside the loop. Averaging that axis is the one all-reduce, or reduce-scatter where
    grad_shardings split over 'data' (ZeRO-2/3). `run` is traced with 'data' unsplit: vmap puts
    it on the groups' axis.
    """
    def grouped(a):  # (..., rows, seq) -> (..., dp, rows / dp, seq): group g is device g's rows
        return a.reshape(*a.shape[:-2], dp, a.shape[-2] // dp, a.shape[-1])

    def one_group(x, y):
        return accumulate(run, x, y, params, without_axis(grad_shardings, DATA))

    groups = jax.vmap(one_group, in_axes=inputs.ndim - 2, spmd_axis_name=DATA)
    metrics, grads = groups(grouped(inputs), grouped(targets))
    grads = jax.tree.map(lambda g: g.mean(0), grads)  # each group's loss is the mean over its rows
    return jax.tree.map(lambda m: m.mean(0), metrics), jax.lax.with_sharding_constraint(grads, grad_shardings)


def laid_out(fn, plan):
    """fn(params, inputs, targets, ...) with the batch in the layout the plan's context strategy
    computes it in (the ring's zigzag order), once per batch, tokens and targets alike (the
    targets were shifted before), never per layer."""
    @functools.wraps(fn)
    def wrapped(params, inputs, targets, *rest):
        order = context.of(plan).permutation(inputs.shape[-1], plan.sizes.get(CONTEXT, 1))
        if order is not None:
            inputs, targets = inputs[..., order], targets[..., order]
        return fn(params, inputs, targets, *rest)
    return wrapped

"""The train state, AdamW with nanoGPT's warmup + cosine schedule, the loss, and the jitted steps.

Shardings come from the rule table and are pinned through jit in/out shardings, so a step can
never change where a parameter or an optimizer moment lives.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.core.config import Config, TrainConfig
from jaxpar.core.sharding import (
    DATA,
    param_axes,
    rules_for,
    rules_without,
    shardings_for,
    traced_with_rules,
    without_axis,
)
from jaxpar.models.family import abstract_model, build_model
from jaxpar.models.kernels import traced_with_attention
from jaxpar.models.layers import cross_entropy
from jaxpar.models.ring_attention import zigzag_permutation
from jaxpar.parallel import pipeline, zero
from jaxpar.parallel.schedule import resolve_microbatches

# nanoGPT decays every weight of 2 or more dims: the matmul kernels, the embeddings (wte is also
# a tied lm_head) and an untied lm_head. Norm scales and biases are not decayed.
DECAYED = ("kernel", "wte", "wpe", "lm_head")


class TrainState(NamedTuple):
    step: jax.Array  # updates applied so far
    params: dict
    opt_state: optax.OptState


def learning_rate(step, t: TrainConfig, xp=jnp):
    """nanoGPT's schedule: linear warmup, cosine decay to min_lr at decay_steps, then flat."""
    warmup = t.lr * (step + 1) / (t.warmup_steps + 1)
    progress = xp.clip((step - t.warmup_steps) / max(t.decay_steps - t.warmup_steps, 1), 0.0, 1.0)
    cosine = t.min_lr + 0.5 * (1.0 + xp.cos(math.pi * progress)) * (t.lr - t.min_lr)
    return xp.where(step < t.warmup_steps, warmup, cosine)


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in DECAYED, params)

    clip = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
    return optax.chain(*clip, optax.adamw(functools.partial(learning_rate, t=t), b1=t.beta1,
                                          b2=t.beta2, eps=t.adam_eps, weight_decay=t.weight_decay,
                                          mask=decay_mask))


def state_shardings(cfg: Config, vocab_size: int, mesh, tx) -> tuple[TrainState, zero.ZeroPlan]:
    """The TrainState's NamedShardings and the ZeRO plan behind them.

    Params come from the rule table (then ZeRO-3 adds 'data'); AdamW's moments follow the plan's
    `moments`; the step count and other scalars are replicated.
    """
    _, shapes, axes = abstract_model(cfg, vocab_size)
    plan = zero.plan(cfg.train.zero, shardings_for(axes, shapes, mesh), shapes, mesh)
    replicated = NamedSharding(mesh, P())
    opt_state = optax.tree_map_params(tx, lambda _, sharding: sharding, jax.eval_shape(tx.init, shapes),
                                      plan.moments, transform_non_params=lambda _: replicated)
    return TrainState(replicated, plan.params, opt_state), plan


def init_state(cfg: Config, vocab_size: int, tx, shardings: TrainState) -> TrainState:
    """Initialise params and optimizer state directly into their shardings (never whole on one device)."""
    @functools.partial(jax.jit, out_shardings=shardings)
    def init():
        model = build_model(cfg, vocab_size)
        params = nnx.to_pure_dict(nnx.state(model))
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))
    return init()


def num_microbatches(t: TrainConfig, dp: int) -> int:
    """grad_accum, times the split that keeps each device's rows per pass <= train.micro_batch.

    Every split sums the same rows' gradients, so the update is the same for any count.
    """
    rows = t.batch_size // t.grad_accum // dp
    split = 1
    if t.micro_batch:
        split = next(k for k in range(-(-rows // t.micro_batch), rows + 1) if rows % k == 0)
    return t.grad_accum * split


def make_loss_fn(graphdef):
    def loss_fn(params, inputs, targets, dropout_key=None):
        return cross_entropy(nnx.merge(graphdef, params)(inputs, dropout_key), targets)
    return loss_fn


def microbatches_for(cfg: Config, mesh) -> int:
    """Microbatches per step: the pipeline's M per grad_accum round when pp > 1."""
    dp, pp = mesh.shape["data"], mesh.shape["pipe"]
    if pp > 1:
        return cfg.train.grad_accum * resolve_microbatches(cfg, dp, pp)
    return num_microbatches(cfg.train, dp)


def model_axes(graphdef, params) -> tuple[dict, int]:
    """(logical axes of every param, vocab size) of the model these params belong to."""
    model = nnx.merge(graphdef, params)
    return param_axes(nnx.state(model)), model.vocab_size


def make_grad_fn(cfg: Config, graphdef, grad_shardings: dict):
    """(params, inputs, targets, step) -> (mean loss, mean grads) over all microbatches.

    Without a pipeline each microbatch is one pass; with one (pp > 1) a round of M microbatches
    goes through the schedule at once. With several passes on data-parallel devices, each device
    sums its own passes' gradients and the reduction over 'data' runs once per step
    (accumulate_locally). Otherwise each pass's gradients are pinned to `grad_shardings`: under
    ZeRO-2/3 that turns their all-reduce into a reduce-scatter.
    """
    loss_and_grad = jax.value_and_grad(make_loss_fn(graphdef))
    use_dropout, seed = cfg.model.dropout > 0, cfg.train.seed

    def passes_of(params, inputs, targets, step):
        """(one_pass(i, x, y) -> (loss, grads), inputs, targets), these with a leading passes axis."""
        step_key = jax.random.fold_in(jax.random.key(seed), step) if use_dropout else None
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.shape["pipe"] > 1:
            axes, vocab = model_axes(graphdef, params)
            round_fn = pipeline.make_round_fn(cfg, vocab, axes, mesh)
            rounds = cfg.train.grad_accum
            inputs, targets = (a.reshape(rounds, -1, *a.shape[1:]) for a in (inputs, targets))

            def one_round(i, x, y):
                return round_fn(params, x, y, None if step_key is None else (step_key, i))
            return one_round, inputs, targets

        def one_pass(i, x, y):
            return loss_and_grad(params, x, y, None if step_key is None else jax.random.fold_in(step_key, i))
        return one_pass, inputs, targets

    def grads_of(params, inputs, targets, step):
        one_pass, inputs, targets = passes_of(params, inputs, targets, step)
        mesh = jax.sharding.get_abstract_mesh()
        passes, dp = inputs.shape[0], mesh.shape["data"]
        # Dropout draws each pass's masks over the whole batch, as one device does: a group of
        # rows alone would draw other masks, so dropout keeps the reduction per pass. A pipeline
        # reduces once per round itself (jaxpar.parallel.pipeline).
        if passes == 1:  # one pass: its loss and gradients as they are
            loss, grads = one_pass(0, inputs[0], targets[0])
            return loss, jax.lax.with_sharding_constraint(grads, grad_shardings)
        if dp == 1 or use_dropout or mesh.shape["pipe"] > 1:
            losses, grads = accumulate(one_pass, inputs, targets, params, grad_shardings)
        else:
            losses, grads = accumulate_locally(one_pass, inputs, targets, params, grad_shardings, dp)
        return losses.mean(), jax.tree.map(lambda g: g / passes, grads)

    return traced_for_mesh(grads_of, cfg)


def accumulate(one_pass, inputs, targets, params, grad_shardings):
    """(each pass's loss, the gradients summed over passes), each pass's pinned to grad_shardings."""
    def one(i, x, y):
        loss, grads = one_pass(i, x, y)
        return loss, jax.lax.with_sharding_constraint(grads, grad_shardings)

    def add(total, batch):
        loss, grads = one(*batch)
        return jax.tree.map(jnp.add, total, grads), loss
    zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), grad_shardings)
    grads, losses = jax.lax.scan(add, zeros, (jnp.arange(inputs.shape[0]), inputs, targets))
    return losses, grads


def accumulate_locally(one_pass, inputs, targets, params, grad_shardings, dp: int):
    """accumulate, with one reduction over 'data' per step instead of one per pass.

    The rows of every pass are split into dp groups, one per data-parallel device as the batch is
    laid out, and `jax.vmap(..., spmd_axis_name="data")` runs the passes of each group on its own
    device: the groups' gradients stay apart (a leading axis over 'data'), so nothing is reduced
    inside the loop. Averaging that axis is the one all-reduce, or reduce-scatter where
    grad_shardings split over 'data' (ZeRO-2/3). Inside, the rule table has no 'data': vmap adds it.
    """
    def grouped(a):  # (..., rows, seq) -> (..., dp, rows / dp, seq): group g is device g's rows
        return a.reshape(*a.shape[:-2], dp, a.shape[-2] // dp, a.shape[-1])

    def one_group(x, y):
        return accumulate(one_pass, x, y, params, without_axis(grad_shardings, DATA))

    groups = jax.vmap(traced_with_rules(one_group, rules_without(DATA)), in_axes=inputs.ndim - 2,
                      spmd_axis_name=DATA)
    losses, grads = groups(grouped(inputs), grouped(targets))
    grads = jax.tree.map(lambda g: g.mean(0), grads)  # each group's loss is the mean over its rows
    return losses.mean(0), jax.lax.with_sharding_constraint(grads, grad_shardings)


def traced_for_mesh(fn, cfg: Config):
    """fn(params, inputs, targets, ...), traced under the rule table of the mesh it runs on. Under
    context parallelism the batch is laid out in the ring's zigzag order first: once per batch,
    tokens and targets alike (the targets were shifted before), never per layer."""
    @functools.wraps(fn)
    def wrapped(params, inputs, targets, *rest):
        mesh = jax.sharding.get_abstract_mesh()
        context = 1 if mesh.empty else mesh.shape["context"]
        if context > 1:
            order = zigzag_permutation(inputs.shape[-1], context)
            inputs, targets = inputs[..., order], targets[..., order]
        traced = traced_with_attention(traced_with_rules(fn, rules_for(cfg.model, context)), cfg.model)
        return traced(params, inputs, targets, *rest)
    return wrapped


def make_train_step(cfg: Config, graphdef, tx, shardings: TrainState, plan: zero.ZeroPlan,
                    batch_sharding):
    """jit(step)(state, (inputs, targets)) -> (state, {'loss', 'grad_norm'}); state is donated.

    inputs/targets are (microbatches, rows, block_size); gradients are averaged over the
    microbatches, so the update equals one step on the whole global batch.
    """
    grads_of = make_grad_fn(cfg, graphdef, plan.grads)

    def step(state: TrainState, batch):
        loss, grads = grads_of(state.params, *batch, state.step)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(state.step + 1, params, opt_state), {"loss": loss, "grad_norm": grad_norm}

    return jax.jit(step, in_shardings=(shardings, (batch_sharding, batch_sharding)),
                   out_shardings=(shardings, None), donate_argnums=0)


def make_eval_step(cfg: Config, graphdef, param_shardings, batch_sharding):
    """jit(eval)(params, (inputs, targets)) -> mean loss over every row of the batch."""
    loss_fn = make_loss_fn(graphdef)

    def evaluate(params, inputs, targets):
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.shape["pipe"] > 1:  # a forward-only pipeline: each stage runs its own layers
            axes, vocab = model_axes(graphdef, params)
            forward = pipeline.make_round_fn(cfg, vocab, axes, mesh, forward_only=True)
            M = pipeline.schedule_for(cfg, mesh).microbatches
            inputs, targets = (a.reshape(-1, M, *a.shape[1:]) for a in (inputs, targets))
            return jnp.mean(jax.lax.map(lambda xy: forward(params, *xy), (inputs, targets)))
        return jnp.mean(jax.lax.map(lambda xy: loss_fn(params, *xy), (inputs, targets)))

    evaluate_on_mesh = traced_for_mesh(evaluate, cfg)
    return jax.jit(lambda params, batch: evaluate_on_mesh(params, *batch),
                   in_shardings=(param_shardings, (batch_sharding, batch_sharding)))


def bytes_per_device(tree) -> int:
    """The most bytes any one device holds of this tree, measured from the addressable shards."""
    per_device: dict = {}
    for array in jax.tree.leaves(tree):
        for shard in array.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)


def bytes_total(tree) -> int:
    """Bytes of this tree unsharded (each array counted once)."""
    return int(sum(np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(tree)))

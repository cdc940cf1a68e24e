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
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.config import Config, TrainConfig
from jaxpar.model import GPT
from jaxpar.sharding import param_axes, shardings_for

DECAYED = ("kernel", "embedding")  # weight decay on matmul weights and embeddings only


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
                                          b2=t.beta2, eps=1e-8, weight_decay=t.weight_decay,
                                          mask=decay_mask))


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy; logits are float32."""
    log_z = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(log_z - picked)


def abstract_model(cfg: Config, vocab_size: int):
    """(graphdef, pure dict of ShapeDtypeStructs, pure dict of logical axes), with no allocation."""
    abstract = nnx.eval_shape(lambda: GPT(cfg.model, vocab_size, nnx.Rngs(cfg.train.seed)))
    graphdef, state = nnx.split(abstract)
    return graphdef, nnx.to_pure_dict(state), param_axes(state)


def state_shardings(cfg: Config, vocab_size: int, mesh, tx) -> TrainState:
    """The TrainState's NamedShardings: params from the rule table, each AdamW moment as its param."""
    _, shapes, axes = abstract_model(cfg, vocab_size)
    params = shardings_for(axes, shapes, mesh)
    replicated = NamedSharding(mesh, P())
    opt_state = optax.tree_map_params(tx, lambda _, sharding: sharding, jax.eval_shape(tx.init, shapes),
                                      params, transform_non_params=lambda _: replicated)
    return TrainState(replicated, params, opt_state)


def init_state(cfg: Config, vocab_size: int, tx, shardings: TrainState) -> TrainState:
    """Initialise params and optimizer state directly into their shardings (never whole on one device)."""
    @functools.partial(jax.jit, out_shardings=shardings)
    def init():
        model = GPT(cfg.model, vocab_size, nnx.Rngs(cfg.train.seed))
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


def make_train_step(cfg: Config, graphdef, tx, shardings: TrainState, batch_sharding):
    """jit(step)(state, (inputs, targets)) -> (state, {'loss', 'grad_norm'}); state is donated.

    inputs/targets are (microbatches, rows, block_size); gradients are averaged over the
    microbatches, so the update equals one step on the whole global batch.
    """
    loss_and_grad = jax.value_and_grad(make_loss_fn(graphdef))
    use_dropout, seed = cfg.model.dropout > 0, cfg.train.seed

    def step(state: TrainState, batch):
        inputs, targets = batch
        accum = inputs.shape[0]
        step_key = jax.random.fold_in(jax.random.key(seed), state.step) if use_dropout else None

        def micro_key(i):
            return None if step_key is None else jax.random.fold_in(step_key, i)

        if accum == 1:
            loss, grads = loss_and_grad(state.params, inputs[0], targets[0], micro_key(0))
        else:
            def accumulate(total, micro):
                i, x, y = micro
                loss, grads = loss_and_grad(state.params, x, y, micro_key(i))
                return jax.tree.map(jnp.add, total, grads), loss
            zeros = jax.tree.map(jnp.zeros_like, state.params)
            grads, losses = jax.lax.scan(accumulate, zeros, (jnp.arange(accum), inputs, targets))
            grads, loss = jax.tree.map(lambda g: g / accum, grads), losses.mean()
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(state.step + 1, params, opt_state), {"loss": loss, "grad_norm": grad_norm}

    return jax.jit(step, in_shardings=(shardings, (batch_sharding, batch_sharding)),
                   out_shardings=(shardings, None), donate_argnums=0)


def make_eval_step(graphdef, param_shardings, batch_sharding):
    """jit(eval)(params, (inputs, targets)) -> mean loss over every row of the batch."""
    loss_fn = make_loss_fn(graphdef)

    def evaluate(params, batch):
        inputs, targets = batch
        return jnp.mean(jax.lax.map(lambda xy: loss_fn(params, *xy), (inputs, targets)))

    return jax.jit(evaluate, in_shardings=(param_shardings, (batch_sharding, batch_sharding)))


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

"""The train state, the optimizer and the jitted train and eval steps.

A step reads top to bottom: the passes' loss and gradients (jaxpar.training.passes), their global
norm, the clipped update of the optimizer from the registry (jaxpar.training.optimizers), and
where the routers have balance biases, their move by the step's routed counts, which reach the step
in the biases' gradient slots (jaxpar.nn.routing).
Shardings come from the rule table and are pinned through jit in/out shardings, so a step can
never change where a parameter or an optimizer moment lives.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.core.axes import PIPE, pipeline_microbatches
from jaxpar.core.config import Config, TrainConfig
from jaxpar.core.sharding import shardings_for, split_ways
from jaxpar.models.family import Transformer
from jaxpar.nn.params import BALANCE
from jaxpar.nn.routing import rebalanced
from jaxpar.parallel import pipeline, zero
from jaxpar.training import muon, optimizers
from jaxpar.training.passes import laid_out, make_grad_fn, make_loss_fn


class TrainState(NamedTuple):
    step: jax.Array  # updates applied so far
    params: dict
    opt_state: optax.OptState


def make_optimizer(cfg: Config, model: Transformer, mesh=None) -> optax.GradientTransformation:
    """The optimizer [optimizer] names, its parameter groups from the model's param roles. With
    `mesh`, Muon's Newton-Schulz work is split over it (optimizer.ns_split)."""
    split = None
    if mesh is not None and cfg.optimizer.name == "muon" and cfg.optimizer.ns_split:
        shapes = model.shapes()
        at_rest = zero.plan(cfg.train.zero, shardings_for(model.axes(), shapes, mesh), shapes, mesh).params
        split = muon.Split(mesh, at_rest)
    return optimizers.make_optimizer(cfg.optimizer, model.roles(), model.matrices(), split)


def state_shardings(cfg: Config, model: Transformer, mesh, tx) -> tuple[TrainState, zero.ZeroPlan]:
    """The TrainState's NamedShardings and the ZeRO plan behind them.

    Params come from the rule table (then ZeRO-3 adds 'data'); the optimizer's param-shaped state
    follows the plan's `moments`; the step count and other scalars are replicated.
    """
    shapes = model.shapes()
    plan = zero.plan(cfg.train.zero, shardings_for(model.axes(), shapes, mesh), shapes, mesh)
    replicated = NamedSharding(mesh, P())
    # A param-shaped leaf (AdamW's moments, Lion's) follows the plan; a factored one (Adafactor's
    # row and column means) is small, and replicated; a group's masked-out params (Muon's
    # partition) hold nothing.
    def where(leaf, sharding, shape):
        if isinstance(leaf, optax.MaskedNode):
            return leaf
        return sharding if leaf.shape == shape.shape else replicated

    opt_state = optax.tree_map_params(tx, where, jax.eval_shape(tx.init, shapes), plan.moments, shapes,
                                      transform_non_params=lambda _: replicated,
                                      is_leaf=lambda node: isinstance(node, optax.MaskedNode))
    return TrainState(replicated, plan.params, opt_state), plan


def init_state(cfg: Config, model: Transformer, tx, shardings: TrainState) -> TrainState:
    """Initialise params and optimizer state directly into their shardings (never whole on one device)."""
    @functools.partial(jax.jit, out_shardings=shardings)
    def init():
        params = model.init(cfg.train.seed)
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


def microbatches_for(cfg: Config, mesh) -> int:
    """Microbatches per step: the pipeline's M per grad_accum round when pp > 1."""
    dp, pp = split_ways(mesh, "batch"), mesh.shape[PIPE]  # dp: the ways the rows split
    if pp > 1:
        return cfg.train.grad_accum * pipeline_microbatches(cfg, dp, pp)
    return num_microbatches(cfg.train, dp)


def make_train_step(cfg: Config, model: Transformer, tx, shardings: TrainState, zero_plan: zero.ZeroPlan,
                    batch_sharding):
    """jit(step)(state, (inputs, targets)) -> (state, metrics); state is donated. Metrics: the
    cross-entropy `loss`, each auxiliary loss, and `grad_norm`. The model carries its execution
    plan (jaxpar.training.execution).

    inputs/targets are (microbatches, rows, block_size); gradients are averaged over the
    microbatches, so the update equals one step on the whole global batch.
    """
    grads_of = make_grad_fn(cfg, model, zero_plan.grads)
    roles, rate = model.roles(), getattr(cfg.model, "moe_bias_update_rate", 0.0)

    def step(state: TrainState, batch):
        metrics, routed = grads_of(state.params, *batch, state.step)
        grads = without_balance(routed, roles)
        grad_norm = optax.tree.norm(grads)
        clipped = optimizers.clip(grads, grad_norm, cfg.optimizer)
        updates, opt_state = tx.update(clipped, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)  # zero for the biases, their gradients zero
        params = jax.tree.map(lambda p, r, role: rebalanced(p, r, rate) if role == BALANCE else p,
                              params, routed, roles)
        return TrainState(state.step + 1, params, opt_state), {**metrics, "grad_norm": grad_norm}

    return jax.jit(step, in_shardings=(shardings, (batch_sharding, batch_sharding)),
                   out_shardings=(shardings, None), donate_argnums=0)


def without_balance(tree: dict, roles: dict) -> dict:
    """A params-shaped tree with zeros for the balance biases: their gradient slots hold routed
    counts, and only the balancing update moves them (from a zero gradient every registered
    optimizer's update is zero, and weight decay's mask leaves them out)."""
    return jax.tree.map(lambda a, role: jnp.zeros_like(a) if role == BALANCE else a, tree, roles)


def make_eval_step(cfg: Config, model: Transformer, param_shardings, batch_sharding):
    """jit(eval)(params, (inputs, targets)) -> mean cross-entropy over every row of the batch."""
    loss_fn = make_loss_fn(model)

    def evaluate(params, inputs, targets):
        if model.plan.pipeline:  # a forward-only pipeline: each stage runs its own layers
            forward = pipeline.make_round_fn(cfg, model, forward_only=True)
            M = model.plan.pipeline["microbatches"]
            inputs, targets = (a.reshape(-1, M, *a.shape[1:]) for a in (inputs, targets))
            return jnp.mean(jax.lax.map(lambda xy: forward(params, *xy), (inputs, targets)))
        return jnp.mean(jax.lax.map(lambda xy: loss_fn(params, *xy)[1]["loss"], (inputs, targets)))

    evaluate_on_mesh = laid_out(evaluate, model.plan)
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

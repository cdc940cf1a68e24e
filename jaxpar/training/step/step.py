"""The train state, its shardings and the jitted train and eval steps (jaxpar.training.step.build
makes them, once, for every caller).

A step reads top to bottom: the passes' loss and gradients (jaxpar.training.step.passes), their global
norm, the clipped update of the optimizer from the registry (jaxpar.training.optimizers.registry), and
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

from jaxpar.core.optimizer_config import OptimizerConfig
from jaxpar.core.remat import HOST
from jaxpar.models.transformer import Transformer
from jaxpar.nn.params import BALANCE
from jaxpar.nn.routing import rebalanced
from jaxpar.parallel import pipeline, zero
from jaxpar.training.optimizers import registry as optimizers
from jaxpar.training.step.passes import laid_out, make_grad_fn, make_loss_fn


class TrainState(NamedTuple):
    step: jax.Array  # updates applied so far
    params: dict
    opt_state: optax.OptState


def state_shardings(zero_plan: zero.ZeroPlan, tx, shapes: dict, mesh, offload: bool = False) -> TrainState:
    """The TrainState's NamedShardings: params where the ZeRO plan keeps them at rest (the rule
    table's, then ZeRO-3 adds 'data'); the optimizer's param-shaped state follows the plan's
    `moments`; the step count and other scalars are replicated. `offload`: the optimizer's state
    in host memory (train.offload=optimizer), split the same way."""
    replicated = NamedSharding(mesh, P())
    # A param-shaped leaf (AdamW's moments, Lion's) follows the plan; a factored one (Adafactor's
    # row and column means) is small, and replicated; a group's masked-out params (Muon's
    # partition) hold nothing.
    def where(leaf, sharding, shape):
        if isinstance(leaf, optax.MaskedNode):
            return leaf
        return sharding if leaf.shape == shape.shape else replicated

    opt_state = optax.tree_map_params(tx, where, jax.eval_shape(tx.init, shapes), zero_plan.moments, shapes,
                                      transform_non_params=lambda _: replicated,
                                      is_leaf=lambda node: isinstance(node, optax.MaskedNode))
    return TrainState(replicated, zero_plan.params, in_memory(opt_state, HOST) if offload else opt_state)


def in_memory(shardings, kind: str):
    """The same shardings in another memory kind of the devices ('device', 'pinned_host')."""
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)


def init_state(model: Transformer, tx, shardings: TrainState, seed: int) -> TrainState:
    """Initialise params and optimizer state directly into their shardings (never whole on one device)."""
    @functools.partial(jax.jit, out_shardings=shardings)
    def init():
        params = model.init(seed)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))
    return init()


def make_train_step(model: Transformer, tx, shardings: TrainState, zero_plan: zero.ZeroPlan, batch_sharding,
                    optimizer: OptimizerConfig, seed: int, offload: bool = False):
    """jit(step)(state, (inputs, targets)) -> (state, metrics); state is donated. Metrics: the
    cross-entropy `loss`, each auxiliary loss, and `grad_norm`. The model carries its execution
    plan (jaxpar.training.step.execution); `optimizer`: the [optimizer] keys clipping reads; `seed`:
    the run's, dropout's keys drawn from it; `offload`: the optimizer's state lives in host memory.

    inputs/targets are (microbatches, rows, block_size); gradients are averaged over the
    microbatches, so the update equals one step on the whole global batch.
    """
    grads_of = make_grad_fn(model, seed, zero_plan.grads)
    roles, rate = model.roles(), getattr(model.cfg, "moe_bias_update_rate", 0.0)

    def step(state: TrainState, batch):
        metrics, routed = grads_of(state.params, *batch, state.step)
        grads = without_balance(routed, roles)
        grad_norm = optax.tree.norm(grads)
        clipped = optimizers.clip(grads, grad_norm, optimizer)
        opt_state = state.opt_state
        if offload:  # streamed in from host memory for the update; out_shardings send it back
            opt_state = jax.device_put(opt_state, in_memory(shardings.opt_state, "device"))
        updates, opt_state = tx.update(clipped, opt_state, state.params)
        params = optax.apply_updates(state.params, updates)  # zero for the biases, their gradients zero
        params = jax.tree.map(lambda p, r, role: rebalanced(p, r, rate) if role == BALANCE else p,
                              params, routed, roles)
        return TrainState(state.step + 1, params, opt_state), {**metrics, "grad_norm": grad_norm}

    return jax.jit(step, in_shardings=(shardings, (batch_sharding, batch_sharding)),
                   out_shardings=(shardings, None), donate_argnums=0, compiler_options=model.plan.compiler_options)


def without_balance(tree: dict, roles: dict) -> dict:
    """A params-shaped tree with zeros for the balance biases: their gradient slots hold routed
    counts, and only the balancing update moves them (from a zero gradient every registered
    optimizer's update is zero, and weight decay's mask leaves them out)."""
    return jax.tree.map(lambda a, role: jnp.zeros_like(a) if role == BALANCE else a, tree, roles)


def make_eval_step(model: Transformer, param_shardings, batch_sharding):
    """jit(eval)(params, (inputs, targets)) -> mean cross-entropy over every row of the batch."""
    loss_fn = make_loss_fn(model)

    def evaluate(params, inputs, targets):
        if model.plan.schedule is not None:  # a forward-only pipeline: each stage runs its own layers
            forward = pipeline.make_round_fn(model, forward_only=True)
            M = model.plan.schedule.microbatches
            inputs, targets = (a.reshape(-1, M, *a.shape[1:]) for a in (inputs, targets))
            return jnp.mean(jax.lax.map(lambda xy: forward(params, *xy), (inputs, targets)))
        return jnp.mean(jax.lax.map(lambda xy: loss_fn(params, *xy)[1]["loss"], (inputs, targets)))

    evaluate_on_mesh = laid_out(evaluate, model.plan)
    return jax.jit(lambda params, batch: evaluate_on_mesh(params, *batch),
                   in_shardings=(param_shardings, (batch_sharding, batch_sharding)),
                   compiler_options=model.plan.compiler_options)


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

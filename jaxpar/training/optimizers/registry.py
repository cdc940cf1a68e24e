"""The optimizer registry: `[optimizer] name` picks an entry, which builds an optax transformation
from its own hyper-parameters, the learning-rate schedule, and the params' roles (jaxpar.nn.params),
which give the parameter groups.

Gradient clipping is applied by the train step before the update: it keeps no state, so the
optimizer state is the entry's alone, and a run may turn clipping on or off when it resumes.

Adding an optimizer: an entry here (its builder and the size of its state, which jaxpar.plan's
memory guess reads) and its own keys in jaxpar.core.optimizer_config (declared `only_for_optimizer`).
Adding a learning-rate schedule: its function and its entry in AFTER_WARMUP. Both are registries of
jaxpar.core.registry, which the config's checks ask as the config loads.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

from jaxpar.core.optimizer_config import OptimizerConfig, decay_start
from jaxpar.core.registry import Registry
from jaxpar.nn.params import EMBEDDING, MATRIX
from jaxpar.training.optimizers import muon as muon_split


def learning_rate(step, o: OptimizerConfig, xp=jnp):
    """o.schedule's lr at `step` (jaxpar.core.optimizer_config.OptimizerConfig says each), after a
    linear warmup."""
    warmup = o.lr * (step + 1) / (o.warmup_steps + 1)
    return xp.where(step < o.warmup_steps, warmup, AFTER_WARMUP[o.schedule](step, o, xp))


def cosine(step, o: OptimizerConfig, xp):
    """nanoGPT's: cosine decay to min_lr at decay_steps, then flat."""
    progress = xp.clip((step - o.warmup_steps) / max(o.decay_steps - o.warmup_steps, 1), 0.0, 1.0)
    return o.min_lr + 0.5 * (1.0 + xp.cos(math.pi * progress)) * (o.lr - o.min_lr)


def wsd(step, o: OptimizerConfig, xp):
    """Warmup-stable-decay: lr, then from decay_start down to min_lr at decay_steps."""
    start = decay_start(o)
    progress = xp.clip((step - start) / max(o.decay_steps - start, 1), 0.0, 1.0)
    remaining = {"linear": lambda: 1.0 - progress, "cosine": lambda: 0.5 * (1.0 + xp.cos(math.pi * progress)),
                 "1-sqrt": lambda: 1.0 - xp.sqrt(progress)}[o.decay_shape]()
    return o.min_lr + remaining * (o.lr - o.min_lr)


def constant(step, o: OptimizerConfig, xp):
    return o.lr + 0.0 * step


# optimizer.schedule: the lr after the warmup
AFTER_WARMUP = Registry("optimizer.schedule", {"cosine": cosine, "wsd": wsd, "constant": constant})


def decayed(roles: dict) -> dict:
    """Which params weight decay applies to: matrices and embeddings (nanoGPT decays every weight
    of two or more dims), not norm scales or biases."""
    return jax.tree.map(lambda role: role in (MATRIX, EMBEDDING), roles)


def adamw(o: OptimizerConfig, schedule, roles: dict, matrices=None, split=None) -> optax.GradientTransformation:
    """AdamW, decoupled weight decay on the decayed roles."""
    return optax.adamw(schedule, b1=o.beta1, b2=o.beta2, eps=o.eps, weight_decay=o.weight_decay,
                       mask=decayed(roles))


def lion(o: OptimizerConfig, schedule, roles: dict, matrices=None, split=None) -> optax.GradientTransformation:
    """Lion (Chen et al., 2023): the sign of an interpolated momentum; decoupled weight decay on
    the decayed roles. Its steps are all of size lr: it wants a smaller lr than AdamW."""
    return optax.lion(schedule, b1=o.beta1, b2=o.beta2, weight_decay=o.weight_decay, mask=decayed(roles))


def adafactor(o: OptimizerConfig, schedule, roles: dict, matrices=None, split=None) -> optax.GradientTransformation:
    """Adafactor with the schedule's lr as its absolute step (no relative step, no parameter
    scaling), factored second moments, no momentum; decoupled weight decay on the decayed roles."""
    return optax.adafactor(schedule, min_dim_size_to_factor=o.factored_min_dim, decay_rate=o.decay_rate,
                           multiply_by_parameter_scale=False, clipping_threshold=o.clip_threshold or None,
                           weight_decay_rate=o.weight_decay or None, weight_decay_mask=decayed(roles))


def muon(o: OptimizerConfig, schedule, roles: dict, matrices: dict, split=None) -> optax.GradientTransformation:
    """Muon (Jordan et al., 2024) on the matrices, as optax.contrib.muon computes it: Nesterov
    momentum, orthogonalised by ns_steps Newton-Schulz iterations per matrix of each param's matrix
    view (a layer's q, k and v, or gate and up, each a matrix), scaled by sqrt(max(1, out / in)),
    decoupled weight decay. Embeddings, the lm_head, norm scales and biases take AdamW with its
    own lr, adam_lr (modded-nanogpt's split), decayed by the roles' rule."""
    from optax.contrib import _muon  # scale_by_shape: optax.contrib.muon's own, not exported
    is_view = lambda view: view is None or isinstance(view, tuple)  # noqa: E731
    labels = jax.tree.map(lambda view: "adamw" if view is None else "muon", matrices, is_leaf=is_view)
    masked = jax.tree.map(lambda view: optax.MaskedNode() if view is None else _muon.MuonDimensionNumbers(*view),
                          matrices, is_leaf=is_view)  # the muon group's tree: AdamW's params masked out
    adam_lr = o.adam_lr or o.lr
    on_matrices = optax.chain(
        muon_split.scale_by_muon(o, masked, split),
        _muon.scale_by_shape(weight_dimension_numbers=masked),
        optax.add_decayed_weights(o.weight_decay), optax.scale_by_learning_rate(schedule))
    others = optax.adamw(lambda step: schedule(step) * (adam_lr / o.lr if o.lr else 0.0), b1=o.beta1, b2=o.beta2,
                         eps=o.eps, weight_decay=o.weight_decay, mask=decayed(roles))
    return optax.partition({"muon": on_matrices, "adamw": others}, labels)


@dataclass(frozen=True)
class Optimizer:
    """An entry of the registry. `build`: (its config, the schedule, the params' roles, Muon's
    matrix views and split) -> an optax transformation. `state_copies`: the float32 copies of a
    param that its state keeps per param, for jaxpar.plan's memory guess (the dry run counts the
    real state)."""
    build: Callable[..., optax.GradientTransformation]
    state_copies: float


OPTIMIZERS = Registry("optimizer.name", {
    "adamw": Optimizer(adamw, state_copies=2),  # the two moments
    "lion": Optimizer(lion, state_copies=1),  # the momentum
    "adafactor": Optimizer(adafactor, state_copies=0),  # a matrix's row and column means: ~0
    "muon": Optimizer(muon, state_copies=1),  # the momentum of the matrices, most of the params
})


def make_optimizer(o: OptimizerConfig, roles: dict, matrices: dict | None = None,
                   split=None) -> optax.GradientTransformation:
    """The optimizer `o.name`, on the schedule `learning_rate`, for params with these roles (and,
    for Muon, these matrix views, jaxpar.nn.params.Param.matrix, and the mesh its work is split
    over, jaxpar.training.optimizers.muon.Split); its names were checked as the config loaded."""
    return OPTIMIZERS[o.name].build(o, lambda step: learning_rate(step, o), roles, matrices, split)


def optimizer_for(o: OptimizerConfig, model, mesh=None, zero_plan=None) -> optax.GradientTransformation:
    """The optimizer `o` names, its parameter groups from the `model`'s param roles
    (jaxpar.models.transformer.Transformer). With a mesh and its ZeRO plan (jaxpar.parallel.zero),
    Muon's Newton-Schulz work is split over the mesh (optimizer.ns_split)."""
    split = None
    if zero_plan is not None and o.name == "muon" and o.ns_split:
        split = muon_split.Split(mesh, zero_plan.params)
    return make_optimizer(o, model.roles(), model.matrices(), split)


def clip(grads, grad_norm: jax.Array, o: OptimizerConfig):
    """The gradients, of global norm `grad_norm`, scaled down to o.grad_clip where the norm is
    larger (as they are when it is 0): optax.clip_by_global_norm's arithmetic, on the norm the
    step has already taken."""
    if o.grad_clip <= 0:
        return grads
    within = grad_norm < o.grad_clip
    return jax.tree.map(lambda g: jax.lax.select(within, g, (g / grad_norm.astype(g.dtype)) * o.grad_clip), grads)


def state_bytes_by_param(opt_state, shardings, param_paths: list[tuple]) -> dict[tuple, int]:
    """Bytes of optimizer state one device holds for each param: every state leaf under a
    param-shaped subtree (AdamW's two moments, or a factored optimizer's rows and columns), found
    by the param's path at the end of the leaf's."""
    wanted = {path: 0 for path in param_paths}
    leaves = jax.tree_util.tree_leaves_with_path(opt_state)
    for (path, leaf), sharding in zip(leaves, jax.tree.leaves(shardings)):
        names = tuple(getattr(k, "key", None) for k in path)
        for param in wanted:
            if names[-len(param):] == param:
                wanted[param] += math.prod(sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
    return wanted

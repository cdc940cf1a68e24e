"""The one rule table from logical axis names (used by the model) to mesh axes (used by JAX).

Model code names logical axes only; changing a parallel layout means changing this table.
"""

import contextvars
import functools
import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Megatron-style tensor parallelism: q/k/v and the MLP input are column-parallel (split over
# 'heads' / 'mlp'), the attention and MLP outputs are row-parallel (their input dim is split), and
# the tied embedding / lm_head is split over the vocabulary. Activations between blocks (the
# residual stream) are split over 'data' by batch and whole on every tensor rank, unless
# SEQUENCE_PARALLEL applies.
DATA = "data"
RULES: dict[str, str | tuple | None] = {
    "batch": "data",
    "tokens": "data",  # batch * seq, flattened for 2-D matmuls
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",  # grouped-query attention's K/V heads: tp must divide them
    "mlp": "tensor",
    "layers": "pipe",
    "embed": None,
    "pos": None,
    "seq": None,
    "qkv": None,
    "gate_up": None,  # SwiGLU's fused gate and up projections
    "head_dim": None,
    "microbatch": None,  # the pipeline's per-stage buffers of microbatches
    "stream_seq": None,  # the residual stream's sequence axis, between the blocks' matmuls
}

# Megatron's sequence parallelism (model.sequence_parallel): the residual stream, and with it
# LayerNorm, dropout and the residual adds, is split over 'tensor' along the sequence. Each block's
# matmuls gather the sequence first (an all-gather), and the row-parallel outputs are summed into
# the split layout (a reduce-scatter) instead of being all-reduced.
SEQUENCE_PARALLEL = {**RULES, "stream_seq": "tensor"}

# Context parallelism (mesh.cp > 1): every activation's sequence axis is split over 'context'; the
# flattened (batch*seq) tokens over data, then context. Attention runs as a ring over 'context'
# (jaxpar.models.ring_attention). Weights are not split over it: ZeRO-3 shards them over 'data' only.
CONTEXT_PARALLEL = {**RULES, "seq": "context", "stream_seq": "context", "tokens": ("data", "context")}

_active_rules = contextvars.ContextVar("jaxpar_rules", default=RULES)


# Both: the stream's sequence split over context, then each context shard over tensor.
CONTEXT_AND_SEQUENCE_PARALLEL = {**CONTEXT_PARALLEL, "stream_seq": ("context", "tensor")}


def rules_for(model_cfg, context: int = 1) -> dict:
    if context > 1:
        return CONTEXT_AND_SEQUENCE_PARALLEL if model_cfg.sequence_parallel else CONTEXT_PARALLEL
    return SEQUENCE_PARALLEL if model_cfg.sequence_parallel else RULES


def rules_without(axis: str) -> dict:
    """The active table with `axis` taken out of every rule: for code vmapped over that axis with
    `spmd_axis_name`, which puts it back on the vmapped dim."""
    return {name: drop_axis(mesh_axes, axis) for name, mesh_axes in _active_rules.get().items()}


def drop_axis(mesh_axes, axis: str):
    """One rule's or one spec entry's mesh axes without `axis` (None if nothing is left)."""
    kept = tuple(a for a in (mesh_axes if isinstance(mesh_axes, tuple) else (mesh_axes,)) if a not in (axis, None))
    return kept if len(kept) > 1 else (kept[0] if kept else None)


def without_axis(shardings, axis: str):
    """NamedShardings (a tree) with `axis` dropped from their specs."""
    return jax.tree.map(lambda s: NamedSharding(s.mesh, P(*(drop_axis(e, axis) for e in s.spec))), shardings)


def sequence_ring() -> tuple[str | None, int]:
    """(the mesh axis the sequence is split over while tracing, its size): (None, 1) without one."""
    axis = _active_rules.get()["seq"]
    mesh = jax.sharding.get_abstract_mesh()
    if axis is None or mesh.empty:
        return None, 1
    return axis, mesh.shape[axis]


def traced_with(fn, var: contextvars.ContextVar, value):
    """fn, traced with the context variable `var` set to `value`: a setting that jit's trace of the
    model reads (the rule table here, the attention kernel in jaxpar.models.kernels)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        token = var.set(value)
        try:
            return fn(*args, **kwargs)
        finally:
            var.reset(token)
    return wrapped


def traced_with_rules(fn, rules: dict):
    """fn, traced under `rules`: the table `constrain` applies while jit traces the model."""
    return traced_with(fn, _active_rules, rules)


def logical_to_spec(axes: tuple[str, ...], rules: dict | None = None) -> P:
    """PartitionSpec for a tuple of logical names (by the active table unless `rules` is given).
    Unknown or conflicting names raise."""
    rules = _active_rules.get() if rules is None else rules
    mesh_axes = []
    for name in axes:
        if name not in rules:
            raise ValueError(f"unknown logical axis '{name}' in {axes}; known: {sorted(rules)}")
        mesh_axes.append(rules[name])
    used = [a for m in mesh_axes for a in (m if isinstance(m, tuple) else (m,)) if a is not None]
    if len(used) != len(set(used)):
        raise ValueError(f"logical axes {axes} map to the same mesh axis twice: {mesh_axes}")
    return P(*mesh_axes)


def check_divisible(name: str, shape: tuple[int, ...], spec: P, mesh) -> None:
    """Refuse a sharding that would need padding: every split dim must divide evenly."""
    for size, mesh_axis in zip(shape, spec):
        names = () if mesh_axis is None else mesh_axis if isinstance(mesh_axis, tuple) else (mesh_axis,)
        ways = math.prod(mesh.shape[name] for name in names)
        if size % ways:
            raise ValueError(f"{name}: dim of size {size} does not divide over mesh axis "
                             f"'{mesh_axis}' of size {ways}")


def param_axes(abstract_state) -> dict:
    """Pure dict of logical axis tuples, read from each nnx.Param's `axes` metadata."""
    from flax import nnx
    out = {}
    for path, var in nnx.to_flat_state(abstract_state):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = tuple(var.get_metadata()["axes"])
    return out


def shardings_for(axes_tree: dict, shapes: dict, mesh, rules: dict = RULES) -> dict:
    """NamedShardings for a pure-dict tree, checked for even division."""
    def one(path, axes, shape):
        spec = logical_to_spec(axes, rules)
        check_divisible(jax.tree_util.keystr(path), shape.shape, spec, mesh)
        return NamedSharding(mesh, spec)
    return jax.tree_util.tree_map_with_path(one, axes_tree, shapes,
                                            is_leaf=lambda x: isinstance(x, tuple))


def per_device(fn, in_axes: tuple, out_axes: tuple):
    """fn on one device's shards: `jax.shard_map` manual over every mesh axis not already manual,
    each input and output split as the rule table splits its logical axes (out_axes: one tuple of
    names, or a tuple of them for several outputs). Under `jax.vmap(spmd_axis_name=...)` the
    vmapped axis is in no spec, so vmap can split the inputs over it."""
    mesh = jax.sharding.get_abstract_mesh()
    several = isinstance(out_axes[0], tuple)
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(logical_to_spec(a) for a in in_axes),
                         out_specs=tuple(map(logical_to_spec, out_axes)) if several else logical_to_spec(out_axes),
                         axis_names=frozenset(a for a in mesh.axis_names if a not in mesh.manual_axes),
                         check_vma=False)


def constrain(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Pin an activation's sharding by logical names; a no-op outside a mesh context."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes))

"""Logical axis names (used by the model) to mesh axes (used by JAX), through the one rule table
that jaxpar.core.axes builds from the mesh's axes.

Model code names logical axes only. While jit traces the model, `constrain` and `logical_to_spec`
read the active table: the model's (rules_for), less the mesh axes that are manual (inside
`shard_map`) or unsplit there (`with_axes_unsplit`, for a vmap over an axis).
"""

import contextvars
import functools
import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.core.axes import rule_table

_active_rules = contextvars.ContextVar("jaxpar_rules", default=rule_table())
# Mesh axes that split nothing in the code being traced: vmapped over (`spmd_axis_name`, which
# puts the axis back on the vmapped dim), or replicated over by an inference command.
_unsplit = contextvars.ContextVar("jaxpar_unsplit_axes", default=frozenset())


def rules_for(model_cfg) -> dict:
    """The rule table for a model: Megatron's sequence parallelism adds the stream's sequence to
    'tensor' (jaxpar.core.axes)."""
    return rule_table(model_cfg.sequence_parallel)


def active_rules() -> dict:
    """The active table, less the mesh axes that are manual (inside `shard_map`) or unsplit here."""
    mesh = jax.sharding.get_abstract_mesh()
    gone = _unsplit.get() | (frozenset() if mesh.empty else frozenset(mesh.manual_axes))
    rules = _active_rules.get()
    if not gone:
        return rules
    return {name: drop_axes(mesh_axes, gone) for name, mesh_axes in rules.items()}


def with_axes_unsplit(fn, *axes: str):
    """fn, traced with `axes` splitting none of its activations: for code vmapped over an axis
    with `spmd_axis_name`, or computing a whole batch or sequence on every device of an axis."""
    return traced_with(fn, _unsplit, _unsplit.get() | frozenset(axes))


def names_of(mesh_axes) -> tuple[str, ...]:
    """One rule's or one spec entry's mesh axes as a tuple: None, 'data' or ('data', 'context')."""
    return () if mesh_axes is None else mesh_axes if isinstance(mesh_axes, tuple) else (mesh_axes,)


def drop_axes(mesh_axes, axes) -> str | tuple | None:
    """One rule's or one spec entry's mesh axes without those in `axes` (None if nothing is left)."""
    kept = tuple(a for a in names_of(mesh_axes) if a not in axes)
    return kept if len(kept) > 1 else (kept[0] if kept else None)


def without_axis(shardings, axis: str):
    """NamedShardings (a tree) with `axis` dropped from their specs."""
    return jax.tree.map(lambda s: NamedSharding(s.mesh, P(*(drop_axes(e, {axis}) for e in s.spec))), shardings)


def sequence_ring() -> tuple[str | None, int]:
    """(the mesh axis the sequence is split over while tracing, its size): (None, 1) without one."""
    axis = active_rules()["seq"]
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
    rules = active_rules() if rules is None else rules
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
        ways = math.prod(mesh.shape[name] for name in names_of(mesh_axis))
        if size % ways:
            raise ValueError(f"{name}: dim of size {size} does not divide over mesh axis "
                             f"'{mesh_axis}' of size {ways}")


def shardings_for(axes_tree: dict, shapes: dict, mesh, rules: dict | None = None) -> dict:
    """NamedShardings for a pure-dict tree, checked for even division."""
    rules = rule_table() if rules is None else rules

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


def split_ways(mesh, logical: str) -> int:
    """How many ways the rule table splits a logical axis on this mesh."""
    return math.prod(mesh.shape[name] for name in names_of(rule_table()[logical]))


def batch_sharding(mesh, leading: int = 1) -> NamedSharding:
    """Where a batch of (..., rows, seq) tokens lives as it enters a step: its rows split as the
    rule table splits 'batch', each row whole; `leading` dims (microbatches) before the rows."""
    return NamedSharding(mesh, P(*(None,) * leading, rule_table()["batch"], None))


def constrain(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Pin an activation's sharding by logical names; a no-op outside a mesh context."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes))

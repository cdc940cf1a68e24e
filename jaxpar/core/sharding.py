"""Logical axis names (used by the model) to mesh axes (used by JAX), through the one rule table
that jaxpar.core.axes builds from the mesh's axes.

Model code names logical axes only; while it is traced, the execution plan (jaxpar.core.execution)
holds the table that applies there and constrains by it. The shardings of params, optimizer state
and batches, made before tracing, come from the table here.
"""

import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.core.axes import rule_table


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


def logical_to_spec(axes: tuple[str, ...], rules: dict | None = None) -> P:
    """PartitionSpec for a tuple of logical names by the rule table `rules` (default: the mesh
    axes' table, jaxpar.core.axes). Unknown or conflicting names raise."""
    rules = rule_table() if rules is None else rules
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


def split_ways(mesh, logical: str) -> int:
    """How many ways the rule table splits a logical axis on this mesh."""
    return math.prod(mesh.shape[name] for name in names_of(rule_table()[logical]))


def batch_sharding(mesh, leading: int = 1) -> NamedSharding:
    """Where a batch of (..., rows, seq) tokens lives as it enters a step: its rows split as the
    rule table splits 'batch', each row whole; `leading` dims (microbatches) before the rows."""
    return NamedSharding(mesh, P(*(None,) * leading, rule_table()["batch"], None))

"""ZeRO stages 1-3 as shardings over the 'data' axis: optimizer state, then gradients, then params.

Stage 1 shards AdamW's moments, stage 2 also the gradients (reduce-scatter rather than
all-reduce), and stage 3 (FSDP) also the params at rest; each layer gathers its weights when it
runs. Every tensor gets `data` on its largest dimension that stays divisible; the few that are too
small stay replicated and are reported. A startup check measures the bytes each device holds.
"""

import math
from dataclasses import dataclass

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.core.axes import DATA, PIPE
from jaxpar.core.sharding import names_of

BYTES_TOLERANCE = 0.02  # measured bytes/device may exceed the plan by 2% (rounding of shards)


def add_data_axis(spec: P, shape: tuple, mesh) -> P | None:
    """spec with 'data' on the largest dim that stays divisible, or None if no dim can take it.

    The stacked 'pipe' (layers) dim is never used: a layer must be whole on its pipeline stage.
    """
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        axes = names_of(entries[dim])
        ways = math.prod(mesh.shape[a] for a in axes) * mesh.shape[DATA]
        if DATA not in axes and PIPE not in axes and shape[dim] % ways == 0:
            new_axes = axes + (DATA,)
            entries[dim] = new_axes[0] if len(new_axes) == 1 else new_axes
            return P(*entries)
    return None


@dataclass
class ZeroPlan:
    """Where each tree lives for one ZeRO stage. Trees are pure dicts shaped like the params."""
    stage: int
    params: dict  # at rest (in the train state)
    grads: dict  # what the step constrains gradients to before the update
    moments: dict  # each AdamW moment (mu, nu)
    unsharded: list[str]  # tensors too small to split over 'data'; they stay replicated

    def describe(self) -> str:
        return (f"ZeRO stage {self.stage}" + (f"; replicated over data (too small to split): "
                                              f"{', '.join(self.unsharded)}" if self.unsharded else ""))


def zero_plan(stage: int, tp_shardings: dict, shapes: dict, mesh) -> ZeroPlan:
    """Shardings for ZeRO `stage` (0-3, checked by config.validate) on top of the rule table's."""
    unsharded = []

    def zero_sharding(path, sharding, shape):
        spec = add_data_axis(sharding.spec, shape.shape, mesh) if mesh.shape[DATA] > 1 else None
        if spec is None:
            if mesh.shape[DATA] > 1:
                unsharded.append(jax.tree_util.keystr(path, simple=True, separator="."))
            return sharding
        return NamedSharding(mesh, spec)

    sharded = jax.tree_util.tree_map_with_path(zero_sharding, tp_shardings, shapes)
    return ZeroPlan(stage=stage,
                    params=sharded if stage >= 3 else tp_shardings,
                    grads=sharded if stage >= 2 else tp_shardings,
                    moments=sharded if stage >= 1 else tp_shardings,
                    unsharded=sorted(unsharded) if stage >= 1 else [])


def expected_bytes_per_device(shardings: dict, shapes: dict) -> int:
    """Bytes one device holds if every tensor is split exactly as planned."""
    def one(sharding, shape):
        n = math.prod(sharding.shard_shape(shape.shape))
        return n * shape.dtype.itemsize
    return sum(jax.tree.leaves(jax.tree.map(one, shardings, shapes)))


def check_sharded(name: str, arrays: dict, planned: dict) -> None:
    """Stop if any array does not live where the plan says: never a silent fall back to replication.

    Compares each array's sharding with the plan, then the measured bytes on the fullest device
    with the plan's bytes (within BYTES_TOLERANCE).
    """
    wrong = [jax.tree_util.keystr(path, simple=True, separator=".")
             for (path, a), want in zip(jax.tree_util.tree_leaves_with_path(arrays),
                                        jax.tree.leaves(planned))
             if not a.sharding.is_equivalent_to(want, a.ndim)]
    if wrong:
        raise RuntimeError(f"ZeRO: {name} not sharded as planned: {', '.join(wrong)}")
    per_device: dict = {}
    for a in jax.tree.leaves(arrays):
        for shard in a.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    measured = max(per_device.values())
    expected = expected_bytes_per_device(planned, jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arrays))
    if measured > expected * (1 + BYTES_TOLERANCE):
        raise RuntimeError(f"ZeRO: {name} uses {measured} bytes on one device, planned {expected}")


def check_state(state, shardings) -> None:
    """Every param and optimizer tensor lives where the ZeRO plan put it, and so do its bytes."""
    check_sharded("params", state.params, shardings.params)
    check_sharded("optimizer state", state.opt_state, shardings.opt_state)

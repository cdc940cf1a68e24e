"""Checksums of a checkpoint's arrays, so that damaged bytes are found before anything trains on them.

Each array's checksum is two 32-bit sums over its elements of a hash of (the element's bits, its
position in the whole array). Integer addition modulo 2**32 gives the same sum in any order, so
the checksum is the same whichever mesh the array is split over: it is taken where the arrays
live, on their devices, at save and again after a restore onto another mesh. Two lanes of 32 bits
make a random change go unnoticed with odds of about 2**-64; the position makes swapped elements
count as a change.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.core.remat import HOST

# murmur3's 32-bit finaliser constants, and a seed for each lane.
_M1, _M2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)
_SEEDS = (np.uint32(0x9E3779B9), np.uint32(0x7F4A7C15))


def _mix(v):
    v = v ^ (v >> 16)
    v = v * _M1
    v = v ^ (v >> 13)
    v = v * _M2
    return v ^ (v >> 16)


def _bits(x) -> jax.Array:
    """x's elements' bits as uint32 (arrays of 1, 2 or 4 bytes an element)."""
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _positions(shape) -> jax.Array:
    """Each element's row-major index in the whole array, built per dimension so that each device
    computes its own shard's indices without gathering anything."""
    index, stride = jnp.zeros(shape, jnp.uint32), 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


def _digest(x) -> jax.Array:
    bits, position = _bits(x), _positions(x.shape)
    lanes = [_mix(bits ^ _mix(position + seed)) for seed in _SEEDS]
    return jnp.stack([jnp.sum(lane, dtype=jnp.uint32) for lane in lanes])


_digests = jax.jit(lambda leaves: [_digest(x) for x in leaves])


def digests_of(leaves: list) -> list:
    """Each array's digest: those in device memory in one pass; those kept in host memory
    (train.offload) one at a time on the device, so no more than one of them is there at once."""
    on_host = [getattr(x, "sharding", None) is not None and x.sharding.memory_kind == HOST for x in leaves]
    digests = iter(_digests([x for x, host in zip(leaves, on_host) if not host]))
    return [_digests([jax.device_put(x, x.sharding.with_memory_kind("device"))])[0] if host else next(digests)
            for x, host in zip(leaves, on_host)]


def item_checksums(items: dict) -> dict[str, dict[str, str]]:
    """{item name: {an array's path in the item: its checksum as 16 hex digits}}, every array of
    every item (a checkpoint's params and optimizer state) in one pass and one fetch."""
    flat = {name: jax.tree_util.tree_flatten_with_path(tree)[0] for name, tree in items.items()}
    digests = iter(jax.device_get(digests_of([leaf for pairs in flat.values() for _, leaf in pairs])))
    return {name: {jax.tree_util.keystr(path): "".join(f"{int(d):08x}" for d in next(digests)) for path, _ in pairs}
            for name, pairs in flat.items()}


def mismatches(items: dict, expected: dict[str, dict[str, str]]) -> list[str]:
    """Where an item's array has not the checksum `expected` records for it (or none):
    "params['wte']"-style names, the item's name first."""
    found = item_checksums(items)
    return [name + path for name, sums in found.items() for path, checksum in sums.items()
            if expected.get(name, {}).get(path) != checksum]

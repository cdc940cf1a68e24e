"""What sampling holds in memory, worked out before anything of it is allocated, so that too many
samples or tokens are one line, not a kill by the kernel's OOM killer.

On the devices: each decoder that sampling runs, compiled for its shapes (which it would be
anyway, as the warm-up runs them), and XLA's estimate of its peak past the params already there:
the KV cache, the logits, the window. On the host: each new token of each sample (its id, kept
until the end, and its share of the text), and the window's copies. An accelerator is compared
with the free part of its own memory; host (CPU) devices share the host's RAM with the tokens,
so there all of it is compared with what the host has free.
"""

import math

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.core.errors import UserError
from jaxpar.parallel import hlo

# A new token of one sample on the host: its int32 among the new tokens and again when they are
# stacked, its text (a few characters of up to 4 bytes), and the ints that decoding its sample
# builds. An upper estimate.
HOST_BYTES_PER_TOKEN = 64
HOST_BYTES_PER_STEP = 128  # each step's array of new tokens, as an object in a list
HOST_BYTES_PER_WINDOW_TOKEN = 64  # the window's copies: int64 and int32, padded, its documents' starts
GIB, MIB = 2**30, 2**20


def size(count: int) -> str:
    return f"{count / GIB:,.1f} GiB" if count >= GIB // 10 else f"{count / MIB:,.1f} MiB"


def host_bytes(rows: int, block: int, max_new_tokens: int) -> int:
    """The host memory that sampling `rows` samples of `max_new_tokens` tokens takes (an estimate)."""
    return (rows * max_new_tokens * HOST_BYTES_PER_TOKEN + max_new_tokens * HOST_BYTES_PER_STEP
            + rows * block * HOST_BYTES_PER_WINDOW_TOKEN)


def params_bytes_per_device(params) -> int:
    """What one device holds of the params (its shard of each)."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(params))


def compiled_decoders(model, decoders, rows: int, length: int, use_cache: bool, seed: int) -> list:
    """Each decoder that sampling runs, compiled for the shapes it runs on: a prompt of `length`
    tokens, the restarted window and the cached step; or the whole window without a cache. Call
    under jax.set_mesh(model.mesh), as the decoders run."""
    prefill, step, recompute = decoders
    block = model.cfg.model.block_size

    def ints(columns: int):
        return jax.ShapeDtypeStruct((rows, columns), np.int32, sharding=NamedSharding(model.mesh, P()))

    def starts(columns: int):  # the documents' starts, for a model trained with them
        return None if model.documents_eot is None else ints(columns)

    if not use_cache:
        return [recompute.lower(model.params, ints(block), 1, seed, 0, starts(block)).compile()]
    compiled = [prefill.lower(model.params, ints(n), seed, 0, starts(n)).compile()
                for n in sorted({length, max(block // 2, 1)})]
    # The step takes what the prefill gives: its shardings, and the weak types that out_info leaves
    # out (without them, the step run would be compiled again).
    typed = jax.eval_shape(prefill, model.params, ints(length), seed, 0, starts(length))
    token, cache = jax.tree.map(lambda info, t: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=info.sharding,
                                                                     weak_type=t.weak_type),
                                compiled[0].out_info, typed)
    return compiled + [step.lower(model.params, cache, token, 0, seed, 0, starts(1)).compile()]


def device_bytes(model, decoders, rows: int, length: int, use_cache: bool, seed: int) -> int | None:
    """The most that one decoder call holds on a device past the params (XLA's estimate); None
    where XLA gives no estimate."""
    peaks = [hlo.memory_summary(c).get("peak_memory_bytes")
             for c in compiled_decoders(model, decoders, rows, length, use_cache, seed)]
    if None in peaks:
        return None
    return max(peaks) - params_bytes_per_device(model.params)


def check_room(model, decoders, rows: int, length: int, max_new_tokens: int, use_cache: bool,
               seed: int) -> None:
    """A UserError, before sampling allocates anything, when `rows` samples of `max_new_tokens` new
    tokens after a prompt of `length` tokens cannot fit in the devices' or the host's free memory."""
    host = host_bytes(rows, model.cfg.model.block_size, max_new_tokens)
    host_free = hlo.host_available_bytes()
    what = (f"{rows:,} {'sample' if rows == 1 else 'samples'} of {max_new_tokens:,} {'token' if max_new_tokens == 1 else 'tokens'} "
            f"{'needs' if rows == 1 else 'need'}")
    fix = "lower --num-samples or --max-new-tokens"
    if host_free and host > host_free:  # before the compile: the sizes may be past anything XLA takes
        raise UserError(f"{what} about {size(host)} of host memory for the tokens and their text, but "
                        f"this host has {size(host_free)} free; {fix}")
    device = device_bytes(model, decoders, rows, length, use_cache, seed)
    if device is None:
        return
    local = [d for d in model.mesh.devices.flat if d.process_index == jax.process_index()]
    if (limit := hlo.device_bytes_limit(local[0])) is not None:
        free = min(limit - (d.memory_stats() or {}).get("bytes_in_use", 0) for d in local)
        if device > free:
            raise UserError(f"{what} about {size(device)} on each device for the KV cache and the logits "
                            f"(XLA's estimate), but a device has {size(free)} free; {fix}")
    elif host_free and device * len(local) + host > host_free:
        raise UserError(f"{what} about {size(device * len(local) + host)} of host memory "
                        f"(the KV cache and the logits as XLA estimates them, on {len(local)} host device"
                        f"{'s' if len(local) > 1 else ''}, and the tokens), but this host has "
                        f"{size(host_free)} free; {fix}")

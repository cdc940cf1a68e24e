"""`jaxpar.plan`'s step-time estimates: the roofline of a compiled step, and the cheap memory and
time guesses that order its compiles.

A compiled layout's step time is `jaxpar.planning.roofline`'s: every op at the longer of its FLOPs
at peak and its bytes at HBM bandwidth, plus the collectives' time that XLA's schedule does not
overlap, its experts' grouped GEMMs (`dispatch_rows_factor`) and the ragged all-to-alls that feed
them at their routed rows. It is an upper bound on speed, but for one term added to both estimates:
the host transfers of offloaded state (`host_transfer_bytes`: the optimizer's under
train.offload=optimizer, the layer inputs under model.remat=full_offloaded) at the chip's host
link, as if nothing overlapped them.

The guess that orders compiles is simpler and has no HLO:
    compute  = FLOPs per chip / the chip's peak
    comms    = sum over collectives of the bytes each chip sends / the ring's bandwidth
    step     = max(compute, comms) / (1 - pipeline bubble) + host transfers
Both time a collective over a group of n chips as one bidirectional ring (two links' bandwidth);
each chip sends 2(n-1)/n of an all-reduce's bytes, (n-1)/n of an all-gather's or all-to-all's
result, n-1 times a reduce-scatter's shard; a collective-permute sends its bytes over one link.

The layout's axes are read through their entries (jaxpar.core.axes, each with its `costs`): what
shares of a chip each divides, and the collectives each adds; no axis is named here.
"""

import math

from jaxpar.core.axes import AXES, CONTEXT_AXIS, batch_ways, layers_per_stage
from jaxpar.core.axis_costs import StepShape, collective
from jaxpar.core.config import ModelConfig
from jaxpar.core.errors import UserError
from jaxpar.core.remat import POLICIES
from jaxpar.models.flops import NO_PIPELINE, flops_per_token, hardware_flops_per_token
from jaxpar.nn.context import STRATEGIES
from jaxpar.nn.routing import capacity
from jaxpar.planning.hardware import Chip
from jaxpar.planning.placement import activation_bytes
from jaxpar.training.optimizers.registry import OPTIMIZERS

SENT_PER_BYTE = {  # bytes each chip sends per byte of the op's result, for a group of n
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    # Given the rows that cross under balanced routing (the roofline's `ragged_routed_bytes`), not
    # its receive buffer: the sources' rows for a device's own experts stay on it.
    "ragged-all-to-all": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: n - 1,
}


def dispatch_rows_factor(m, mode: str, ep: int) -> float:
    """How many times a device's routed rows (its tokens x k, under balanced routing) the experts'
    grouped GEMMs are given (jaxpar.nn.moe): the dispatch's receive buffer has `room` rows from
    each of ep sources, room being every assignment a source has (dropless) or, under a capacity
    factor, at most its sequences x E_l x capacity; with the tokens whole on every device of
    'expert' (replicated), each runs all of them for its E/ep experts. 1 without a dispatch, and
    at least 1: a capacity below the fair share fills a buffer smaller than the assignments."""
    if not m.n_experts or mode == "local":
        return 1.0
    if mode == "replicated" or not getattr(m, "moe_capacity_factor", 0):
        return float(ep)
    S, k = m.block_size, m.experts_per_token  # a capacity factor is refused on a context ring
    return max(1.0, ep * min(1.0, m.n_experts // ep * capacity(m, S) / (S * k)))


def collective_seconds(ops: list[dict], chip: Chip, devices: int) -> float:
    """Time of every collective of a step, one after another, under the ring model above."""
    total = 0.0
    for op in ops:
        n = op["group"] or devices
        if op["kind"] == "collective-permute":
            seconds = op["bytes"] / chip.link_bytes_per_s
        elif n <= 1:
            seconds = 0.0
        else:
            seconds = op["bytes"] * SENT_PER_BYTE[op["kind"]](n) / (2 * chip.link_bytes_per_s)
        total += op["count"] * seconds
    return total


def axis_sizes(layout: dict) -> dict[str, int]:
    """Every mesh axis's size in a layout, by --mesh key (1 where the layout leaves it out)."""
    return {axis.key: layout.get(axis.key, 1) for axis in AXES}


def ways(sizes: dict[str, int], share: str) -> int:
    """How many ways the axes split a chip's `share` (a term of jaxpar.core.axis_costs)."""
    return math.prod(sizes[axis.key] for axis in AXES if share in axis.costs.divides)


def devices_of(layout: dict) -> int:
    """The devices of a layout: the product of every mesh axis's size."""
    return math.prod(axis_sizes(layout).values())


def flop_terms(m: ModelConfig, batch_size: int, vocab: int, layout: dict, reruns: tuple = NO_PIPELINE) -> dict:
    """FLOPs per chip and step: the hardware's (the model's plus what reruns: model.remat's policy
    and, by `reruns`, a pipeline's backward, jaxpar.models.flops) and the model's, and their ratio."""
    devices, tokens = devices_of(layout), batch_size * m.block_size
    hardware = hardware_flops_per_token(m, vocab, reruns) * tokens / devices
    model = flops_per_token(m, vocab) * tokens / devices
    return {"flops_per_chip": hardware, "model_flops_per_chip": model, "rerun_flops_per_chip": hardware - model,
            "flops_over_model": hardware / model}


def speed(m: ModelConfig, batch_size: int, vocab: int, layout: dict, chip: Chip, step_s: float) -> dict:
    """tokens/s and the MFU bound of a step of step_s seconds over batch_size sequences."""
    tokens = batch_size * m.block_size
    return {"step_s": step_s, "tokens_per_s": tokens / step_s,
            "mfu": flops_per_token(m, vocab) * tokens / step_s / (devices_of(layout) * chip.peak_flops)}


def compiled_step_time(m: ModelConfig, batch_size: int, vocab: int, layout: dict, chip: Chip, roof: dict, bubble: float,
                       host_bytes: float = 0.0, reruns: tuple = NO_PIPELINE) -> dict:
    """A compiled layout's estimate from its roofline (`roofline.estimate`): tokens/s and MFU at
    most. A pipeline's bubble is in the roofline already (idle ticks wait for the busy stages).
    The host transfers of offloaded state (`host_transfer_bytes`) are added whole, as if nothing
    overlapped them: where the step hides them behind its ops, it runs faster than this bound."""
    host_s = host_seconds(host_bytes, chip)
    return {**roof, **flop_terms(m, batch_size, vocab, layout, reruns), "bubble": bubble, "host_bytes": host_bytes,
            "host_s": host_s, **speed(m, batch_size, vocab, layout, chip, roof["step_s"] + host_s)}


def step_time(m: ModelConfig, batch_size: int, vocab: int, layout: dict, chip: Chip, comm_s: float, bubble: float,
              host_bytes: float = 0.0, reruns: tuple = NO_PIPELINE) -> dict:
    """The cheap guess for one layout: seconds of compute, comms, host transfers and the step,
    tokens/s and MFU (`reruns`: its pipeline schedule's rerun_factors)."""
    flops = flop_terms(m, batch_size, vocab, layout, reruns)
    compute_s = flops["flops_per_chip"] / chip.peak_flops
    host_s = host_seconds(host_bytes, chip)
    step_s = max(compute_s, comm_s) / (1 - bubble) + host_s
    return {**flops, "compute_s": compute_s, "comm_s": comm_s, "bubble": bubble, "host_bytes": host_bytes,
            "host_s": host_s, **speed(m, batch_size, vocab, layout, chip, step_s)}


def weights_per_chip(n_params: int, expert_params: int, sizes: dict[str, int]) -> float:
    """Parameters per chip: split over the axes that split every weight, and a mixture's experts
    over those that split the experts too."""
    return (n_params - expert_params + expert_params / ways(sizes, "experts")) / ways(sizes, "weights")


def optimizer_state_bytes(optimizer: str, n_params: int, layout: dict, expert_params: int = 0) -> float:
    """Bytes per chip of the optimizer's param-sized state (its registry entry's `state_copies`),
    float32, split as the layout's ZeRO stage splits it."""
    sizes = axis_sizes(layout)
    share, shards = weights_per_chip(n_params, expert_params, sizes), ways(sizes, "state")
    return 4 * share * OPTIMIZERS[optimizer].state_copies * (1 / shards if layout["zero"] >= 1 else 1)


def guess_memory(m: ModelConfig, optimizer: str, vocab: int, n_params: int, layout: dict, rows_per_pass: int,
                 in_flight: int, expert_params: int = 0) -> float:
    """Device bytes per chip, roughly: float32 params, grads and the optimizer's state
    (`optimizer_state_bytes`; none under train.offload=optimizer, whose state is in host memory:
    the compile decides what its update brings in) split as the layout splits them, plus the
    saved activations of `in_flight` passes (placement.activation_bytes)."""
    sizes, zero = axis_sizes(layout), layout["zero"]
    share, shards = weights_per_chip(n_params, expert_params, sizes), ways(sizes, "state")
    state = 4 * share * ((1 / shards if zero >= 3 else 1) + (1 / shards if zero >= 2 else 1))
    if layout.get("offload", "none") == "none":
        state += optimizer_state_bytes(optimizer, n_params, layout, expert_params)
    saved = activation_bytes(m, vocab, rows_per_pass, ways(sizes, "width"),
                             layers=layers_per_stage(m, ways(sizes, "layers")), cp=ways(sizes, "sequence"))
    return state + saved * in_flight


def host_transfer_bytes(m: ModelConfig, batch_size: int, layout: dict, state_bytes: float) -> float:
    """Bytes a chip moves over its host link in a step: an offloaded optimizer state
    (`state_bytes` of it) in for the update and out again, and the layer inputs that
    model.remat's policy keeps in host memory (full_offloaded), out in the forward and back in
    the backward, for every row the chip runs."""
    sizes = axis_sizes(layout)
    moved = 2 * state_bytes if layout.get("offload", "none") == "optimizer" else 0.0
    split = ways(sizes, "width") if m.sequence_parallel else 1
    tokens = batch_size / batch_ways(sizes) * m.block_size / ways(sizes, "sequence")
    layers = layers_per_stage(m, ways(sizes, "layers"))
    return moved + 2 * tokens * layers * POLICIES[m.remat].host_bytes_per_token(m, split)


def host_seconds(host_bytes: float, chip: Chip) -> float:
    """The host transfers' time over the chip's host link, none of it overlapped."""
    if not host_bytes:
        return 0.0
    if not chip.host_bytes_per_s:
        raise UserError(f"{chip.kind} has no host link figure to time its offload by; plan without offload")
    return host_bytes / chip.host_bytes_per_s


def guess_collectives(m: ModelConfig, grad_accum: int, virtual: int, n_params: int, layout: dict, passes: int,
                      rows_per_pass: int, expert_params: int = 0) -> list[dict]:
    """The collectives a layout needs, counted from the model rather than from HLO: each axis's
    (its `costs.collectives`). expert_params: how many of the n_params are a mixture's experts."""
    sizes = axis_sizes(layout)
    stages = ways(sizes, "layers")
    activation = rows_per_pass * m.block_size * m.n_embd * (2 if m.dtype == "bfloat16" else 4) / ways(sizes, "sequence")
    step = StepShape(model=m, grad_accum=grad_accum, virtual=virtual, zero=layout["zero"], passes=passes,
                     batch_ways=batch_ways(sizes), width=ways(sizes, "width"), stages=stages,
                     layers=layers_per_stage(m, stages),
                     weight_bytes=4 * weights_per_chip(n_params, expert_params, sizes), activation_bytes=activation)
    ops = [op for axis in AXES for op in axis.costs.collectives(sizes[axis.key], step)]
    return ops + context_collectives(m, layout, step)


def context_collectives(m: ModelConfig, layout: dict, step: StepShape) -> list[dict]:
    """The context strategy's collectives (jaxpar.nn.context) where cp splits the sequence: the
    ring's K/V blocks, or Ulysses' all-to-alls of q, k, v and the output."""
    cp = axis_sizes(layout).get(CONTEXT_AXIS.key, 1)
    if cp == 1:
        return []
    strategy = STRATEGIES[layout.get("context", m.context_strategy)]
    per_head = m.head_size / m.n_embd / step.width * step.activation_bytes
    ops = strategy.collectives(cp, m, 2 * m.kv_heads * per_head, m.n_head * per_head, step.layers, step.passes)
    return [collective(kind, nbytes, cp, count) for kind, nbytes, count in ops]

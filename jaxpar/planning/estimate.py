"""`jaxpar.plan`'s step-time estimates: the roofline of a compiled step, and the cheap memory and
time guesses that order its compiles.

A compiled layout's step time is `jaxpar.planning.roofline`'s: every op at the longer of its FLOPs
at peak and its bytes at HBM bandwidth, plus the collectives' time that XLA's schedule does not
overlap. It is an upper bound on speed.

The guess that orders compiles is simpler and has no HLO:
    compute  = FLOPs per chip / the chip's peak
    comms    = sum over collectives of the bytes each chip sends / the ring's bandwidth
    step     = max(compute, comms) / (1 - pipeline bubble)
Both time a collective over a group of n chips as one bidirectional ring (two links' bandwidth);
each chip sends 2(n-1)/n of an all-reduce's bytes, (n-1)/n of an all-gather's or all-to-all's
result, n-1 times a reduce-scatter's shard; a collective-permute sends its bytes over one link.

The layout's axes are read through their entries (jaxpar.core.axes, each with its `costs`): what
shares of a chip each divides, and the collectives each adds; no axis is named here.
"""

import math

from jaxpar.core.axes import AXES, batch_ways, layers_per_stage
from jaxpar.core.axis_costs import StepShape
from jaxpar.core.config import Config
from jaxpar.models.flops import flops_per_token, hardware_flops_per_token
from jaxpar.planning.hardware import Chip
from jaxpar.planning.placement import activation_bytes
from jaxpar.training.optimizers import OPTIMIZERS

SENT_PER_BYTE = {  # bytes each chip sends per byte of the op's result, for a group of n
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    # Its result is the whole receive buffer, sized for every row routed here (dropless): the bytes
    # sent are at most the all-to-all's of that buffer, and the same under balanced routing.
    "ragged-all-to-all": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: n - 1,
}


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


def compiled_step_time(cfg: Config, vocab: int, layout: dict, chip: Chip, roof: dict, bubble: float) -> dict:
    """A compiled layout's estimate from its roofline (`roofline.estimate`): tokens/s and MFU at
    most. A pipeline's bubble is in the roofline already (idle ticks wait for the busy stages)."""
    devices = devices_of(layout)
    tokens = cfg.train.batch_size * cfg.model.block_size
    stages = ways(axis_sizes(layout), "layers")
    flops_per_chip = hardware_flops_per_token(cfg.model, vocab, stages, cfg.pipeline.schedule) * tokens / devices
    return {**roof, "flops_per_chip": flops_per_chip, "bubble": bubble, "tokens_per_s": tokens / roof["step_s"],
            "mfu": flops_per_token(cfg.model, vocab) * tokens / roof["step_s"] / (devices * chip.peak_flops)}


def step_time(cfg: Config, vocab: int, layout: dict, chip: Chip, comm_s: float, bubble: float) -> dict:
    """The cheap guess for one layout: seconds of compute, comms and the step, tokens/s and MFU."""
    devices = devices_of(layout)
    tokens = cfg.train.batch_size * cfg.model.block_size
    stages = ways(axis_sizes(layout), "layers")
    flops_per_chip = hardware_flops_per_token(cfg.model, vocab, stages, cfg.pipeline.schedule) * tokens / devices
    compute_s = flops_per_chip / chip.peak_flops
    step_s = max(compute_s, comm_s) / (1 - bubble)
    return {"flops_per_chip": flops_per_chip, "compute_s": compute_s, "comm_s": comm_s,
            "bubble": bubble, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "mfu": flops_per_token(cfg.model, vocab) * tokens / step_s / (devices * chip.peak_flops)}


def weights_per_chip(n_params: int, expert_params: int, sizes: dict[str, int]) -> float:
    """Parameters per chip: split over the axes that split every weight, and a mixture's experts
    over those that split the experts too."""
    return (n_params - expert_params + expert_params / ways(sizes, "experts")) / ways(sizes, "weights")


def guess_memory(cfg: Config, vocab: int, n_params: int, layout: dict, rows_per_pass: int,
                 in_flight: int, expert_params: int = 0) -> float:
    """Bytes per chip, roughly: float32 params, grads and the optimizer's param-sized state (its
    registry entry's `state_copies`) split as the layout splits them, plus the saved activations
    of `in_flight` passes (placement.activation_bytes)."""
    sizes, zero = axis_sizes(layout), layout["zero"]
    share, shards = weights_per_chip(n_params, expert_params, sizes), ways(sizes, "state")
    copies = OPTIMIZERS[cfg.optimizer.name].state_copies
    state = 4 * share * ((1 / shards if zero >= 3 else 1) + (1 / shards if zero >= 2 else 1)
                         + copies * (1 / shards if zero >= 1 else 1))
    saved = activation_bytes(cfg.model, vocab, rows_per_pass, ways(sizes, "width"),
                             layers=layers_per_stage(cfg.model, ways(sizes, "layers")), cp=ways(sizes, "sequence"))
    return state + saved * in_flight


def guess_collectives(cfg: Config, n_params: int, layout: dict, passes: int, rows_per_pass: int,
                      expert_params: int = 0) -> list[dict]:
    """The collectives a layout needs, counted from the model rather than from HLO: each axis's
    (its `costs.collectives`). expert_params: how many of the n_params are a mixture's experts."""
    m, sizes = cfg.model, axis_sizes(layout)
    stages = ways(sizes, "layers")
    activation = rows_per_pass * m.block_size * m.n_embd * (2 if m.dtype == "bfloat16" else 4) / ways(sizes, "sequence")
    step = StepShape(zero=layout["zero"], passes=passes, batch_ways=batch_ways(sizes), width=ways(sizes, "width"),
                     stages=stages, layers=layers_per_stage(m, stages),
                     weight_bytes=4 * weights_per_chip(n_params, expert_params, sizes), activation_bytes=activation)
    return [op for axis in AXES for op in axis.costs.collectives(sizes[axis.key], cfg, step)]

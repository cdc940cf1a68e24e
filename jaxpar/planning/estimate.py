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
"""

import math

from jaxpar.core.axes import AXES
from jaxpar.core.config import Config
from jaxpar.models.flops import flops_per_token, hardware_flops_per_token
from jaxpar.planning.hardware import Chip
from jaxpar.planning.placement import activation_bytes

SENT_PER_BYTE = {  # bytes each chip sends per byte of the op's result, for a group of n
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
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


def devices_of(layout: dict) -> int:
    """The devices of a layout: the product of every mesh axis's size (by --mesh key)."""
    return math.prod(layout.get(axis.key, 1) for axis in AXES)


def compiled_step_time(cfg: Config, vocab: int, layout: dict, chip: Chip, roof: dict, bubble: float) -> dict:
    """A compiled layout's estimate from its roofline (`roofline.estimate`): tokens/s and MFU at
    most. A pipeline's bubble is in the roofline already (idle ticks wait for the busy stages)."""
    devices = devices_of(layout)
    tokens = cfg.train.batch_size * cfg.model.block_size
    flops_per_chip = (hardware_flops_per_token(cfg.model, vocab, layout["pp"], cfg.pipeline.schedule)
                      * tokens / devices)
    return {**roof, "flops_per_chip": flops_per_chip, "bubble": bubble, "tokens_per_s": tokens / roof["step_s"],
            "mfu": flops_per_token(cfg.model, vocab) * tokens / roof["step_s"] / (devices * chip.peak_flops)}


def step_time(cfg: Config, vocab: int, layout: dict, chip: Chip, comm_s: float, bubble: float) -> dict:
    """The cheap guess for one layout: seconds of compute, comms and the step, tokens/s and MFU."""
    devices = devices_of(layout)
    tokens = cfg.train.batch_size * cfg.model.block_size
    flops_per_chip = (hardware_flops_per_token(cfg.model, vocab, layout["pp"], cfg.pipeline.schedule)
                      * tokens / devices)
    compute_s = flops_per_chip / chip.peak_flops
    step_s = max(compute_s, comm_s) / (1 - bubble)
    return {"flops_per_chip": flops_per_chip, "compute_s": compute_s, "comm_s": comm_s,
            "bubble": bubble, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "mfu": flops_per_token(cfg.model, vocab) * tokens / step_s / (devices * chip.peak_flops)}


def weights_per_chip(n_params: int, expert_params: int, layout: dict) -> float:
    """Parameters per chip: split over tensor and pipe, and a mixture's experts over expert too."""
    return (n_params - expert_params + expert_params / layout.get("ep", 1)) / (layout["tp"] * layout["pp"])


def guess_memory(cfg: Config, vocab: int, n_params: int, layout: dict, rows_per_pass: int,
                 in_flight: int, expert_params: int = 0) -> float:
    """Bytes per chip, roughly: float32 params, grads and the optimizer's param-sized state (two
    AdamW moments, Lion's one, Muon's one on the matrices, which are most of the params;
    Adafactor's factored rows and columns are left out) split as the
    layout splits them, plus the saved activations of `in_flight` passes (placement.activation_bytes)."""
    dp, tp, pp, zero = layout["dp"], layout["tp"], layout["pp"], layout["zero"]  # weights: not split by cp
    share = weights_per_chip(n_params, expert_params, layout)
    copies = {"adamw": 2, "lion": 1, "adafactor": 0, "muon": 1}[cfg.optimizer.name]
    state = 4 * share * ((1 / dp if zero >= 3 else 1) + (1 / dp if zero >= 2 else 1)
                         + copies * (1 / dp if zero >= 1 else 1))
    saved = activation_bytes(cfg, vocab, rows_per_pass, tp, layers=cfg.model.n_layer // pp, cp=layout.get("cp", 1))
    return state + saved * in_flight


def guess_collectives(cfg: Config, n_params: int, layout: dict, passes: int, rows_per_pass: int,
                      expert_params: int = 0) -> list[dict]:
    """The collectives a layout needs, counted from the model rather than from HLO. expert_params:
    how many of the n_params are a mixture's experts (split over 'expert')."""
    m, dp, tp, pp, zero = cfg.model, layout["dp"], layout["tp"], layout["pp"], layout["zero"]
    cp, ep = layout.get("cp", 1), layout.get("ep", 1)
    share = 4 * weights_per_chip(n_params, expert_params, layout)
    activation = rows_per_pass * m.block_size * m.n_embd * (2 if m.dtype == "bfloat16" else 4) / cp
    ops = [{"kind": "all-reduce", "bytes": share, "group": dp * ep, "count": 1}]
    if ep > 1:  # each MoE layer: tokens out and results back, forward and backward; all_to_all's
        # buffers hold ep times the k rows of every token, ragged_all_to_all's the rows alone
        rows = m.experts_per_token * activation * (ep if m.moe_dispatch == "all_to_all" else 1)
        ops.append({"kind": "all-to-all", "bytes": rows, "group": ep, "count": 4 * sum(m.sparse_layers) // pp * passes})
    if zero >= 3:  # each pass gathers the weights for the forward and again for the backward
        ops.append({"kind": "all-gather", "bytes": share, "group": dp, "count": 2 * passes})
    layers = m.n_layer // pp
    ops.append({"kind": "all-reduce", "bytes": activation, "group": tp, "count": 4 * layers * passes})
    if pp > 1:
        V = cfg.pipeline.virtual
        ops.append({"kind": "collective-permute", "bytes": activation, "group": pp, "count": 2 * V * passes})
        if V > 1:  # interleaved: the layers move into chunk order and their gradients back, each round
            ops.append({"kind": "all-to-all", "bytes": share, "group": pp, "count": 2 * cfg.train.grad_accum})
    if cp > 1:  # each layer's ring: K and V blocks cp-1 times forward, and with dK/dV in the backward
        kv = 2 * m.kv_heads * m.head_size / m.n_embd / tp * activation
        ops.append({"kind": "collective-permute", "bytes": kv, "group": cp, "count": 3 * (cp - 1) * layers * passes})
    return ops

"""A mixture-of-experts feed-forward: a float32 router picks k of E SwiGLU experts per token, and
every token reaches its k experts (dropless), unless a capacity factor caps what an expert takes
from each sequence: the assignments past it, in token order, are dropped (weight 0).

The experts are split over the 'expert' mesh axis, each device holding E/ep of them, and the tokens
are split over it as further data parallelism. Inside `shard_map`, each device sorts its tokens'
k assignments by expert and sends each device the rows for its experts:

- `all_to_all` (every platform): one buffer per destination with room for all of this device's
  assignments, so nothing can drop; ep times the bytes that are really sent;
- `ragged_all_to_all` (TPU and GPU): exactly the rows each destination needs, into a receive
  buffer with room for every source's.

With a capacity factor, the dropped assignments are not sent, and no device can send another more
than B x E_l x capacity rows (B sequences, E_l experts a device): the buffers have that room (the
`room`), about capacity_factor / ep of a dropless buffer's, not one row per assignment.

The receiving device runs its experts as one grouped GEMM over its rows sorted by expert (the
plan's: `jax.lax.ragged_dot`, the Megablox kernels, tokamax's Triton kernel on GPUs
(jaxpar.nn.tokamax_kernels), or the blocked GEMM, tiles of rows each times its expert's matrix, where
ragged_dot is a dense product over every expert), through the plan's matmul recipe
(jaxpar.nn.recipes), and the results go back the same way. Where the tokens are whole on every
device of 'expert' (decoding), each device runs its own experts on every token and the outputs are
summed.

The router's losses are per sequence, so that every layout gives the same values: the
load-balancing loss E * sum_i f_i * P_i (Hugging Face's form: f_i the tokens routed to expert i
over the sequence's length, P_i the mean router probability), the z-loss mean(logsumexp(logits)^2)
and, for the logs, the load: the busiest expert's tokens over the mean. A sequence split over a
context ring sums its parts first. Where the router has a balance bias (DeepSeek-V3's), `moe_bias`
logs its mean size and carries the routed counts to it as its gradient (jaxpar.nn.routing).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.core import remat
from jaxpar.core.axes import EXPERT
from jaxpar.core.errors import UserError
from jaxpar.core.sharding import names_of
from jaxpar.nn import recipes, tokamax_kernels
from jaxpar.nn.grouped_gemm import GEMM_KERNELS, LEGS, Tiles, grouped_gemm, legged_gemm
from jaxpar.nn.kernel_entry import (
    ALL_TO_ALL,
    AUTO,
    BLOCKS,
    MOE_DISPATCH,
    OTHERS,
    RAGGED,
    Kernel,
    auto_kernel,
    by_name,
    chosen,
)
from jaxpar.nn.routing import capacity, counted, router_of, sequence_stats, within_capacity

# model.moe_dispatch's entries (jaxpar.nn.kernel_entry): `auto` runs ragged_all_to_all on TPU and
# GPU, as XLA:CPU has none; the plan's moe_mode says whether a dispatch runs at all.
DISPATCH_KERNELS = by_name(Kernel(ALL_TO_ALL, MOE_DISPATCH, auto_on=("cpu",)),
                           Kernel(RAGGED, MOE_DISPATCH, auto_on=(OTHERS,)))


class Experts(NamedTuple):
    """A device's E_l experts and how they compute: their fused gate and up (E_l, C, 2, F) and
    down (E_l, F, C) weights, the matmuls' dtype, the grouped GEMM (the plan's moe_gemm), whether
    Pallas interprets Megablox (off TPU), each leg's kernel where the plan chose them (forward,
    dlhs, drhs; (): all three `gemm`, the GEMM's own backward), and the plan's matmul recipe, which
    the kernel's calls go through (None: the default's in dtype; jaxpar.nn.recipes)."""
    gate_up: jax.Array
    out: jax.Array
    dtype: object
    gemm: str
    interpret: bool = True
    legs: tuple = ()
    tuning: tuple[str, ...] = ()  # tokamax's configs tuned for this GPU at plan time (jaxpar.nn.kernel_tuning)
    recipe: recipes.MatmulRecipe | None = None


def grouped_swiglu(x: jax.Array, group_sizes: jax.Array, local: Experts) -> jax.Array:
    """x (rows, C) sorted by expert, group_sizes (E_l,) -> (rows, C): each group through its own
    expert as two grouped GEMMs; rows past the groups give zeros. The blocked GEMM's tiles are
    laid out once for both (a padding row stays zero through the SwiGLU)."""
    E_l, C, _, F = local.gate_up.shape
    dtype, put, take = local.dtype, (lambda a: a), (lambda a: a)
    legs, arrays = tuple(local.legs) or (local.gemm,) * len(LEGS), group_sizes
    if len(set(legs)) > 1 or local.tuning:  # else the one kernel's program, as it always was
        gemm = lambda x, w, sizes: legged_gemm(x, w, sizes, legs, local.interpret, local.tuning)
    elif legs[0] == BLOCKS:
        tiles = Tiles.of(group_sizes, x.shape[0])
        put, take, arrays = tiles.put, tiles.take, (tiles.to, tiles.group)
        gemm = lambda x, w, to_group: Tiles(*to_group, tiles.block).gemm(x, w)
    else:
        gemm = lambda x, w, sizes: grouped_gemm(x, w, sizes, legs[0], local.interpret)
    gemm = (local.recipe if local.recipe is not None else recipes.default(dtype)).grouped(gemm, arrays)
    x = checkpoint_name(put(x.astype(dtype)), remat.EXPERTS_IN)  # names a recompute policy may keep
    h = checkpoint_name(gemm(x, local.gate_up.reshape(E_l, C, 2 * F).astype(dtype)), remat.HIDDEN)
    h = (jax.nn.silu(h[..., :F].astype(dtype)) * h[..., F:].astype(dtype)).astype(dtype)
    return take(gemm(h, local.out.astype(dtype)))


def run_local_experts(rows: jax.Array, local_expert: jax.Array, local: Experts) -> jax.Array:
    """rows (R, C), each for local expert local_expert[r] (E_l: for none) -> (R, C) in the same
    order, zero where none: sorted by expert for one grouped GEMM, then put back."""
    E_l = local.gate_up.shape[0]
    order = jnp.argsort(local_expert, stable=True)
    group_sizes = jnp.bincount(local_expert, length=E_l + 1)[:E_l].astype(jnp.int32)
    y = grouped_swiglu(rows[order], group_sizes, local)
    y = jnp.zeros_like(y).at[order].set(y)
    return jnp.where((local_expert < E_l)[:, None], y, 0)


def exchange(x: jax.Array, axis: str) -> jax.Array:
    """(ep, ...) -> (ep, ...): slot d goes to device d, which receives it in slot s from device s."""
    return jax.lax.all_to_all(x, axis, 0, 0, tiled=False)


def by_expert(experts: jax.Array, ep: int, E_l: int):
    """(the order that sorts the assignments by expert, their counts per (destination device,
    its local expert)): sorted, each destination's rows are contiguous."""
    return jnp.argsort(experts, stable=True), jnp.bincount(experts, length=ep * E_l).reshape(ep, E_l)


def dispatch_all_to_all(rows: jax.Array, experts: jax.Array, local: Experts, ep: int, room: int) -> jax.Array:
    """rows (A, C) of this device's assignments, each for global expert experts[a] (ep * E_l: a
    dropped one, not sent) -> (A, C): sent to their experts' devices in fixed buffers of `room`
    rows each (at least the most any destination gets), computed there, sent back."""
    A, C = rows.shape
    E_l = local.gate_up.shape[0]
    order, counts = by_expert(experts, ep, E_l)
    per_device = counts.sum(1)
    start = jnp.cumsum(per_device) - per_device
    slot = jnp.arange(room)
    taken = jnp.clip(start[:, None] + slot[None], 0, A - 1)  # (ep, room): sorted row for each slot
    valid = slot[None] < per_device[:, None]
    send = jnp.where(valid[..., None], rows[order][taken], 0)
    received, received_counts = exchange(send, EXPERT), exchange(counts, EXPERT)
    # The rows from each source arrive sorted by this device's experts, then padding.
    ends = jnp.cumsum(received_counts, axis=1)
    local_of = jax.vmap(lambda e: jnp.searchsorted(e, slot, side="right"))(ends)  # (ep, room), E_l: padding
    y = run_local_experts(received.reshape(ep * room, C), local_of.reshape(-1), local)
    back = exchange(y.reshape(ep, room, C), EXPERT)
    destination = experts[order] // E_l  # of each sorted row, whose place in its buffer is its rank - start
    sent = destination < ep
    y_sorted = back[jnp.where(sent, destination, 0), jnp.where(sent, jnp.arange(A) - start[destination % ep], 0)]
    return jnp.zeros_like(y_sorted).at[order].set(jnp.where(sent[:, None], y_sorted, 0))


def dispatch_ragged(rows: jax.Array, experts: jax.Array, local: Experts, ep: int, room: int) -> jax.Array:
    """dispatch_all_to_all with `ragged_all_to_all`: each destination gets exactly its rows, into a
    buffer with `room` for every source's (TPU and GPU; XLA:CPU has no ragged-all-to-all)."""
    A, C = rows.shape
    E_l = local.gate_up.shape[0]
    order, counts = by_expert(experts, ep, E_l)
    send_sizes = counts.sum(1).astype(jnp.int32)
    send_starts = (jnp.cumsum(send_sizes) - send_sizes).astype(jnp.int32)
    received_counts = exchange(counts, EXPERT)  # (source, my expert)
    recv_sizes = received_counts.sum(1).astype(jnp.int32)
    recv_starts = (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32)
    me = jax.lax.axis_index(EXPERT)
    sizes = jax.lax.all_gather(send_sizes, EXPERT)  # (source, destination)
    # Each destination keeps its sources in order: mine land after those of the sources before me.
    land_at = (jnp.cumsum(sizes, axis=0) - sizes)[me].astype(jnp.int32)
    received = jax.lax.ragged_all_to_all(rows[order], jnp.zeros((ep * room, C), rows.dtype), send_starts,
                                         send_sizes, land_at, recv_sizes, axis_name=EXPERT)
    slot = jnp.arange(ep * room)
    source = jnp.clip(jnp.searchsorted(jnp.cumsum(recv_sizes), slot, side="right"), 0, ep - 1)
    ends = jnp.cumsum(received_counts, axis=1)[source]  # (ep * room, E_l)
    local_of = jnp.sum((slot - recv_starts[source])[:, None] >= ends, axis=1)
    local_of = jnp.where(slot < recv_sizes.sum(), local_of, E_l)
    y = run_local_experts(received, local_of, local).astype(rows.dtype)
    # Back to each source, at the offset its rows left from.
    came_from = jax.lax.all_gather(send_starts, EXPERT)[:, me]
    back = jax.lax.ragged_all_to_all(y, jnp.zeros((A, C), rows.dtype), recv_starts, recv_sizes, came_from,
                                     send_sizes, axis_name=EXPERT)
    return jnp.zeros_like(back).at[order].set(back)


def experts_of_device(rows, experts, local: Experts, ep: int, mode: str, room: int):
    """Each assignment's expert output (A, C) float32 (0 where it is dropped: expert ep * E_l), by
    `mode` (see `moe_mlp`); `room`: the most rows a device sends another."""
    if mode == ALL_TO_ALL:
        return dispatch_all_to_all(rows, experts, local, ep, room)
    if mode == RAGGED:
        return dispatch_ragged(rows, experts, local, ep, room)
    E_l = local.gate_up.shape[0]
    first = jax.lax.axis_index(EXPERT) * E_l if mode == "replicated" else 0
    mine = (experts >= first) & (experts < first + E_l)
    return run_local_experts(rows, jnp.where(mine, experts - first, E_l), local)


def experts_kernels(cfg, platform: str) -> dict:
    """The plan's fields for a mixture's kernels on `platform`: model.moe_gemm as it runs, with
    gemm_of's note, and model.moe_dispatch as it runs; a name no kernel has is refused in one line."""
    gemm, note = gemm_of(cfg, platform)
    return {"experts": True, "moe_gemm": gemm, "moe_gemm_note": note,
            "moe_dispatch": chosen(DISPATCH_KERNELS, cfg.moe_dispatch, platform)}


def gemm_of(cfg, platform: str) -> tuple[str, str | None]:
    """(model.moe_gemm as it runs, a one-line note when `auto` runs a dearer GEMM than the
    platform has). `auto` is Megablox on TPU, the blocked GEMM on CPU (XLA:CPU's ragged_dot
    multiplies every row by every expert), tokamax's Triton kernel on GPU (the blocks' gathered
    weights, (rows / 64 + E) x C x F, do not fit a large model), else XLA's ragged_dot there.
    Decided before tracing; the kernels' entries: jaxpar.nn.grouped_gemm.GEMM_KERNELS."""
    if cfg.moe_gemm != AUTO:
        kernel = GEMM_KERNELS.get(cfg.moe_gemm)
        if kernel and kernel.platforms and platform not in kernel.platforms:
            raise kernel.refused("platform")
        if kernel and not tokamax_kernels.installed(kernel):
            raise kernel.refused("package")
        return cfg.moe_gemm, None
    kernel = auto_kernel(GEMM_KERNELS, platform)
    if platform in kernel.platforms and not tokamax_kernels.installed(kernel):
        return kernel.stand_in, kernel.note("package")
    return kernel.name, None


def check_capacity(m, cp: int) -> None:
    """A capacity factor ranks each sequence's tokens in order, which a split of the sequences over
    cp > 1 devices breaks: refused in one line."""
    if m.n_experts and m.moe_capacity_factor:  # a mixture of experts has the key
        raise UserError(f"model.moe_capacity_factor={m.moe_capacity_factor} ranks each sequence's tokens in "
                        f"order, and cp={cp} splits the sequences; use cp=1, or drop the capacity factor")


def moe_mlp(plan, h: jax.Array, p: dict, cfg, dtype, capped: bool = True) -> tuple[jax.Array, dict]:
    """h (batch, seq, embed), normed -> (the experts' mixture (batch, seq, embed) in dtype, the
    router's per-sequence losses and load, means over this batch's sequences), dispatched as the
    execution plan says. `capped`: apply the capacity factor, if any (not while decoding, where a
    step sees part of a sequence; a context ring is refused with it before tracing)."""
    mode, sizes = plan.moe_mode, plan.sizes
    ep = sizes.get(EXPERT, 1)
    ring_axis, ring = plan.ring()
    seq_axes = (ring_axis,) if ring > 1 else ()
    summed_over = tuple(a for a in names_of(plan.rules["mlp"]) + ((EXPERT,) if mode == "replicated" else ())
                        if sizes and sizes[a] > 1)
    k, seq_len, factor = cfg.experts_per_token, h.shape[1], cfg.moe_capacity_factor if capped else 0
    routing = router_of(cfg)
    balance = p["router"].get("balance")  # DeepSeek's selection bias (jaxpar.nn.routing)

    # Manual over every axis that splits anything here (jaxpar.core.execution.ExecutionPlan.per_device).
    recipe = recipes.of(plan, dtype, every_axis=True)

    def on_device(h, router, gate_up, out, *balance):
        B, T, C = h.shape
        x = h.reshape(B * T, C)
        logits, probs, weights, experts = routing(x, router, *balance or (None,))
        weights, experts = checkpoint_name((weights, experts), remat.ROUTER)
        dropped, sent, room = jnp.zeros((B,), jnp.float32), experts, B * T * k
        if factor:  # a dropped assignment's weight is 0, and it is not sent: the token keeps the others
            keep = within_capacity(experts, B, capacity(cfg, seq_len))
            weights, dropped = weights * keep, 1 - keep.reshape(B, -1).mean(1)
            sent = jnp.where(keep, experts, cfg.n_experts)
            room = min(room, B * gate_up.shape[0] * capacity(cfg, seq_len))  # a destination's most
        local = Experts(gate_up, out, dtype, plan.moe_gemm, plan.interpret, plan.gemm_legs, plan.gemm_tuning,
                        recipe)
        y = experts_of_device(jnp.repeat(x, k, axis=0), sent.reshape(-1), local, ep, mode, room)
        y = checkpoint_name(y, remat.EXPERTS_OUT)  # back from the experts: no exchange reruns for it
        y = jnp.sum(y.reshape(B * T, k, C) * weights[..., None], axis=1)
        if summed_over:
            y = jax.lax.psum(y, summed_over)
        bias = [counted(balance[0], experts, B)] if balance else []  # carrying the routed counts
        return (y.astype(dtype).reshape(B, T, C),
                *sequence_stats(logits, probs, experts, B, seq_len, seq_axes), dropped, *bias)

    weights = (p["router"]["kernel"], p["experts_gate_up"]["kernel"], p["experts_out"]["kernel"])
    weights += () if balance is None else (balance,)
    if plan.mesh is not None:  # else one device's computation as it is
        on_device = plan.per_device(
            on_device, (("batch", "seq", "embed"), ("embed", "routes"), ("experts", "embed", "gate_up", "mlp"),
                        ("experts", "mlp", "embed"), ("routes",))[:1 + len(weights)],
            (("batch", "seq", "embed"),) + (("batch",),) * (4 + (balance is not None)))
        h = plan.constrain(h, ("batch", "seq", "embed"))
    y, balance_loss, z, load, dropped, *bias = on_device(h, *weights)
    return y, {"moe_balance": jnp.mean(balance_loss), "moe_z": jnp.mean(z), "moe_load": jnp.mean(load),
               "moe_dropped": jnp.mean(dropped), **({"moe_bias": jnp.mean(bias[0])} if bias else {})}

"""The experts' grouped GEMM: rows sorted by group, each group times its own matrix, by each of
model.moe_gemm's kernels: `jax.lax.ragged_dot`, the Megablox kernels (Pallas, TPU; interpreted
elsewhere), tokamax's Triton kernel on GPUs (jaxpar.nn.tokamax_kernels) and the blocked GEMM (tiles
of rows, each times its expert's matrix: on CPU, where ragged_dot is a dense product over every
expert). Their registry entries (jaxpar.nn.kernel_entry), where each runs and where `auto` picks it,
are `GEMM_KERNELS`.

Each leg (the product, its input's gradient, its weights' gradient) can be a different kernel:
`legged_gemm` runs the plan's choice of each (jaxpar.nn.kernel_tuning measures them on a GPU); with
one kernel for all three, jaxpar.nn.moe runs that kernel's own program. Whichever runs, jaxpar.nn.moe
calls it through the plan's matmul recipe (jaxpar.nn.recipes: `grouped`), which owns its operands'
precision.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxpar.core.platform import GPUS
from jaxpar.nn import tokamax_kernels
from jaxpar.nn.kernel_entry import BLOCKS, GPU_EXTRA, MEGABLOX, MOE_GEMM, OTHERS, RAGGED_DOT, TOKAMAX, Kernel, by_name

GEMM_KERNELS = by_name(  # model.moe_gemm's entries (jaxpar.nn.kernel_entry); jaxpar.nn.moe.gemm_of picks one
    Kernel(RAGGED_DOT, MOE_GEMM),
    Kernel(MEGABLOX, MOE_GEMM, auto_on=("tpu",)),  # interpreted off TPU
    Kernel(BLOCKS, MOE_GEMM, auto_on=("cpu",)),
    Kernel(TOKAMAX, MOE_GEMM, platforms=GPUS, auto_on=(OTHERS,), package="tokamax", stand_in=RAGGED_DOT,
           refusals={"platform": "model.moe_gemm=tokamax needs tokamax on an NVIDIA GPU (it runs on NVIDIA GPUs "
                                 "only); or use --model.moe_gemm=auto",
                     "package": "model.moe_gemm=tokamax needs tokamax on an NVIDIA GPU (install it: " + GPU_EXTRA
                                + "); or use --model.moe_gemm=auto"},
           notes={"package": "model.moe_gemm=auto runs XLA's ragged_dot, a masked product over every expert (E "
                             "times the routed FLOPs): tokamax is not installed (" + GPU_EXTRA + ")"}))


def megablox_gemm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, interpret: bool) -> jax.Array:
    """ragged_dot by the Megablox kernels (Pallas, TPU; interpreted elsewhere): their backward
    takes the weights' gradient group by group (tgmm), where XLA:TPU's ragged_dot transpose is a
    dense product over every group. Rows past the groups are zero, and so is their gradient."""
    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
    m, k, n = x.shape[0], x.shape[1], w.shape[-1]
    tm = 128 if m >= 128 else -(-m // 8) * 8
    rows = jnp.arange(-(-m // tm) * tm)
    grouped = rows < jnp.sum(group_sizes)
    x = jnp.where(grouped[:, None], jnp.pad(x, ((0, rows.shape[0] - m), (0, 0))), 0)
    y = megablox.gmm(x, w, group_sizes, jnp.float32, (tm, min(k, 128), min(n, 128)), None, None, False, interpret)
    return jnp.where(grouped[:, None], y, 0)[:m]


BLOCK_ROWS = 64  # the blocked GEMM's tile of rows: at most G * 64 padded rows beyond the routed ones


class Tiles(NamedTuple):
    """Rows sorted by group, laid out in tiles of `block` rows, each tile of one group (padded
    with zero rows): where each row goes (`to`; past the tiles: a row past the groups), and each
    tile's group. Made once for the SwiGLU's two GEMMs."""
    to: jax.Array
    group: jax.Array
    block: int

    @classmethod
    def of(cls, group_sizes: jax.Array, rows: int, block: int = BLOCK_ROWS) -> "Tiles":
        G = group_sizes.shape[0]
        count = rows // block + G  # a static bound: sum(ceil(size / block)) <= rows / block + G
        ends = jnp.cumsum(group_sizes)
        padded = (group_sizes + block - 1) // block * block
        row = jnp.arange(rows)
        group = jnp.searchsorted(ends, row, side="right")  # G: past the groups
        g = jnp.minimum(group, G - 1)
        to = jnp.where(group < G, jnp.cumsum(padded)[g] - padded[g] + row - (ends[g] - group_sizes[g]), count * block)
        tile_group = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(count) * block, side="right")
        return cls(to, jnp.minimum(tile_group, G - 1), block)

    def put(self, x: jax.Array) -> jax.Array:
        """(rows, K) -> (tiles, block, K)."""
        count = self.group.shape[0]
        tiles = jnp.zeros((count * self.block, x.shape[1]), x.dtype).at[self.to].set(x, mode="drop")
        return tiles.reshape(count, self.block, -1)

    def gemm(self, tiles: jax.Array, w: jax.Array) -> jax.Array:
        """Each tile times its group's matrix of w (G, K, N): one batched GEMM, float32."""
        return jnp.einsum("bmk,bkn->bmn", tiles, w[self.group], preferred_element_type=jnp.float32)

    def take(self, tiles: jax.Array) -> jax.Array:
        """(tiles, block, N) -> (rows, N); zeros for the rows past the groups."""
        return tiles.reshape(-1, tiles.shape[-1]).at[self.to].get(mode="fill", fill_value=0)


def blocked_gemm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, block: int = BLOCK_ROWS) -> jax.Array:
    """ragged_dot at about the routed rows' cost, where XLA lowers ragged_dot to a product of every
    row with every group's matrix (XLA:CPU, XLA:GPU): each group's rows padded to a multiple of
    `block`, and each tile of rows times its own group's matrix, one batched GEMM. The padded
    rows are at most G * block more than the routed ones; rows past the groups give zeros."""
    tiles = Tiles.of(group_sizes, x.shape[0], block)
    return tiles.take(tiles.gemm(tiles.put(x), w))


def grouped_gemm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, gemm: str, interpret: bool = True) -> jax.Array:
    """x (rows, K) sorted by group, w (G, K, N) -> (rows, N) float32: each group by its own matrix
    (ragged_dot, Megablox or tokamax's Triton kernel; the blocked GEMM's tiles are grouped_swiglu's)."""
    if gemm == MEGABLOX:
        return megablox_gemm(x, w, group_sizes, interpret=interpret)
    if gemm == TOKAMAX:
        return tokamax_kernels.ragged_dot(x, w, group_sizes)
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)


LEGS = ("forward", "dlhs", "drhs")  # the grouped GEMM's product, its input's gradient, its weights'


def kernel_gemm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, gemm: str, interpret: bool = True) -> jax.Array:
    """grouped_gemm by any of model.moe_gemm's kernels, the blocked GEMM laying out its own tiles."""
    if gemm == BLOCKS:
        return blocked_gemm(x, w, group_sizes)
    return grouped_gemm(x, w, group_sizes, gemm, interpret)


def gemm_leg(x, w, group_sizes, dy, gemm: str, leg: str, interpret: bool = True, tuning: tuple[str, ...] = ()) -> jax.Array:
    """One leg of the grouped GEMM by kernel `gemm`: the product (rows, N) float32, or, for dy
    (rows, N) float32, the gradient of x (dlhs) or of w (drhs) as that kernel's own backward
    takes it (jax.vjp of its forward in the one argument: the other leg is not computed). tokamax
    reads its tuned configs (`tuning`) as it traces, its backward's too: all inside them."""
    gemm_xw = functools.partial(kernel_gemm, group_sizes=group_sizes, gemm=gemm, interpret=interpret)
    with tokamax_kernels.tuned(tuning if gemm == TOKAMAX else ()):
        if leg == "forward":
            return gemm_xw(x, w)
        if leg == "dlhs":
            return jax.vjp(lambda x: gemm_xw(x, w), x)[1](dy)[0]
        return jax.vjp(lambda w: gemm_xw(x, w), w)[1](dy)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def legged_gemm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, legs: tuple, interpret: bool,
                tuning: tuple[str, ...]) -> jax.Array:
    """grouped_gemm with each leg (forward, dlhs, drhs) by its own kernel of `legs`."""
    return gemm_leg(x, w, group_sizes, None, legs[0], "forward", interpret, tuning)


def legged_forward(x, w, group_sizes, legs, interpret, tuning):
    return legged_gemm(x, w, group_sizes, legs, interpret, tuning), (x, w, group_sizes)


def legged_backward(legs, interpret, tuning, saved, dy):
    x, w, group_sizes = saved
    return (gemm_leg(x, w, group_sizes, dy, legs[1], "dlhs", interpret, tuning),
            gemm_leg(x, w, group_sizes, dy, legs[2], "drhs", interpret, tuning), None)


legged_gemm.defvjp(legged_forward, legged_backward)

"""The grouped GEMM on NVIDIA GPUs: tokamax's Pallas-Triton `ragged_dot`, forward and backward,
which multiplies each row by its own group's matrix only.

XLA:GPU lowers `jax.lax.ragged_dot` to a masked dense product over every group: E times the
routed FLOPs (11x slower than a dense dot of the same rows at 8 experts, 64x at 64, on an
H200). The execution plan chooses this kernel (`model.moe_gemm=tokamax`, which `auto` is on GPUs
where tokamax is installed). tokamax would pick its kernel from the host's default device; the
plan has decided already, so the Triton kernel is bound here whatever the host is (the planner
compiles H100 steps on a CPU host).
"""

import functools
import importlib.util

import jax
import jax.numpy as jnp


def available() -> bool:
    """tokamax is installed (`pip install -e '.[gpu]'`)."""
    return importlib.util.find_spec("tokamax") is not None


def block_config(rows: int):
    """tokamax's own heuristic tiles for the Triton kernel, given here so that no autotuning
    cache is looked up (and none warns) while tracing."""
    from tokamax._src.ops.ragged_dot import pallas_triton
    block_m = min(128, max(16, 1 << (max(rows, 1) - 1).bit_length()))
    return pallas_triton.Config(block_m=block_m, block_n=128, block_k=32, num_warps=4, num_stages=4)


@functools.cache
def triton_kernel():
    """tokamax's Triton ragged_dot, bound to run wherever the plan sends it, its backward too."""
    from tokamax._src.ops.ragged_dot import base, pallas_triton

    class Triton(pallas_triton.PallasTritonRaggedDot):
        def __post_init__(self):
            if self.vjp is None:  # the backward's two ragged dots: this kernel again
                again = lambda lhs, rhs, **kw: Triton(config=block_config(lhs.shape[0]))(lhs, rhs, **kw)
                object.__setattr__(self, "vjp", functools.partial(base.vjp, dlhs_ragged_dot=again,
                                                                  drhs_ragged_dot=again))

        def supported_on(self, device) -> bool:
            return True

    return Triton


def triton_ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x (rows, K) sorted by group, w (G, K, N) -> (rows, N) float32, as jax.lax.ragged_dot;
    rows past the groups give zeros."""
    import tokamax
    from absl import flags
    if not flags.FLAGS.is_parsed():  # tokamax reads its options from absl's flags, which would parse
        flags.FLAGS.mark_as_parsed()  # sys.argv, jaxpar's command line, on first use: the defaults
    kernel = triton_kernel()(config=block_config(x.shape[0]))
    return tokamax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32, implementation=[kernel])

"""tokamax's Pallas-Triton kernels on NVIDIA GPUs, bound to run where the execution plan sends them.

- `ragged_dot`, the experts' grouped GEMM (model.moe_gemm=tokamax, `auto` on GPUs): each row by
  its own group's matrix only, forward and both backward GEMMs, skipping every block of rows past
  its group's end. XLA:GPU lowers `jax.lax.ragged_dot` to a masked dense product over every group:
  E times the routed FLOPs (11x a dense dot of the same rows at 8 experts, 64x at 64, on an H200).
- `attention`, flash attention with a mask (model.attention=tokamax, `auto` on GPUs for
  data.document_mask, which jax's cuDNN call cannot keep apart): causal, within documents.

tokamax would pick its kernel from the host's default device; the plan has decided already, so
the Triton kernels are bound here whatever the host is (the planner compiles H100 steps on a CPU
host). Off a GPU the attention runs tokamax's XLA reference, the same function (the tests).
"""

import contextlib
import functools
import importlib.util
import logging

import jax
import jax.numpy as jnp


def available() -> bool:
    """tokamax is installed (`pip install -e '.[gpu]'`)."""
    return importlib.util.find_spec("tokamax") is not None


def installed(kernel) -> bool:
    """Whether what a registry kernel needs beyond jax (its `package`: none, or tokamax) is installed."""
    return not kernel.package or available()


class NoCacheMiss(logging.Filter):
    """Without an autotuning cache, tokamax warns once a kernel and shape that it takes its own
    heuristic tiles: what jaxpar expects, so not shown."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Autotuning cache miss")


@functools.cache
def prepared() -> None:
    """tokamax reads its options from absl's flags, which would parse sys.argv, jaxpar's own
    command line, on first use: they are marked parsed, with their defaults, first."""
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    logging.getLogger("absl").addFilter(NoCacheMiss())
    restore_pallas_dot()


def restore_pallas_dot() -> None:
    """tokamax 0.0.12's Triton kernels call `pl.dot`, which jax 0.10 deprecated and 0.11 removed
    from jax.experimental.pallas (an AttributeError there); the same function lives on as the
    Triton backend's `jax.experimental.pallas.triton.dot`, which tokamax 0.0.17 calls. It is put
    back under the old name."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    if "dot" not in vars(pl):  # jax >= 0.10 keeps it only as a deprecated alias, or not at all
        pl.dot = plgpu.dot


@functools.cache
def triton_ragged_dot():
    """tokamax's Triton ragged_dot, its backward's kernels too, on any host."""
    from tokamax._src.ops.ragged_dot import base, pallas_triton

    class Triton(pallas_triton.PallasTritonRaggedDot):
        def __post_init__(self):
            if self.vjp is None:  # the backward's two ragged dots: this kernel again
                again = lambda *args, **kw: Triton()(*args, **kw)
                object.__setattr__(self, "vjp", functools.partial(base.vjp, dlhs_ragged_dot=again,
                                                                  drhs_ragged_dot=again))

        def supported_on(self, device) -> bool:
            return True

    return Triton()


def tuned(configs: tuple[str, ...]):
    """A context in which tokamax reads `configs` (its AutotuningResults, each as JSON, tuned for
    this GPU at plan time: jaxpar.nn.kernel_tuning) before its shipped ones; none where empty."""
    if not configs:
        return contextlib.nullcontext()
    from tokamax import AutotuningResult
    return functools.reduce(lambda a, b: a | b, map(AutotuningResult.loads, configs))


def ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x (rows, K) sorted by group, w (G, K, N) -> (rows, N) float32, as jax.lax.ragged_dot;
    rows past the groups give zeros."""
    import tokamax
    prepared()
    return tokamax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32,
                              implementation=[triton_ragged_dot()])


@functools.cache
def triton_attention():
    """tokamax's Triton flash attention, forward and backward, on any host."""
    from tokamax._src.ops.attention import pallas_triton, pallas_triton_vjp

    class Backward(pallas_triton_vjp.PallasTritonFlashAttentionVjp):
        def supported_on(self, device) -> bool:
            return True

    class Forward(pallas_triton.PallasTritonFlashAttention):
        def __post_init__(self):
            if self.vjp is None:
                object.__setattr__(self, "vjp", Backward())

        def supported_on(self, device) -> bool:
            return True

    return Forward()


def attention(q, k, v, causal: bool = True, segments=None, on_gpu: bool = True):
    """Flash attention on one device: q (batch, heads, seq, head_dim), k, v (batch, kv_heads,
    seq, head_dim) -> (batch, seq, heads, head_dim); causal, and within documents where
    `segments` (the queries', the keys' (batch, seq) document ids) are given. Off a GPU
    (`on_gpu` False), tokamax's XLA reference of the same function."""
    import tokamax
    prepared()
    q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))  # tokamax's (batch, seq, heads, head_dim)
    mask = None
    if segments is not None:
        q_ids, kv_ids = segments
        mask = q_ids[:, None, :, None] == kv_ids[:, None, None, :]  # (batch, 1, queries, keys)
    return tokamax.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                         implementation=[triton_attention()] if on_gpu else "xla")

"""Which attention kernel runs, and the fused ones behind attention's one signature.

`model.attention` picks it: `xla` (jaxpar.nn.attention: blocks of queries, XLA:CPU's fastest
form), `splash` (the Pallas TPU kernel, jax.experimental.pallas.ops.tpu.splash_attention) or
`cudnn` (cuDNN's fused attention through jax.nn.dot_product_attention); `auto` picks by the mesh's
platform. `resolve` decides it once, before tracing, for the execution plan
(jaxpar.core.execution), which the model reads. A fused kernel runs per device under
`shard_map`, split as the rule table splits q (batch, heads, seq, head_dim) and k, v (batch,
kv_heads, seq, head_dim); grouped-query attention goes in as it is (splash's MQA form per KV
head; cuDNN takes fewer KV heads). Neither has dropout of the attention probabilities, so `auto`
keeps `xla` when model.dropout > 0. cuDNN takes heads up to 256 dims from Hopper on (compute
capability 9.0; 128 before), latent attention's 192 among them: the plan reads the width off the
mesh's devices and the host's (`cudnn_head_max`).

Documents (data.document_mask) go to splash as its SegmentIds. `jax.nn.dot_product_attention` has
sequence lengths but no segment ids (cuDNN's packed-document offsets are in jax's private API
alone, for Hopper), so model.attention=cudnn is refused with documents, and on GPUs `auto` runs
`tokamax` there: tokamax's Triton flash attention with the documents' mask
(jaxpar.nn.tokamax_kernels), where tokamax is installed and no context ring splits the sequence;
else xla, said in one line. Off a GPU, `tokamax` runs tokamax's XLA reference (the tests).
"""

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxpar.core.errors import UserError
from jaxpar.core.model_config import CUDNN_HEADS_BEFORE, CUDNN_HEADS_HOPPER, SPLASH_TILE, cudnn_takes
from jaxpar.core.platform import GPUS
from jaxpar.nn import tokamax_kernels

FUSED_ON = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn"}  # auto's choice by platform
# splash on CPU: interpreted; tokamax on CPU: its XLA reference
NEEDS_PLATFORM = {"splash": ("tpu", "cpu"), "cudnn": GPUS, "tokamax": (*GPUS, "cpu")}
Q_AXES, KV_AXES, OUT_AXES = ("batch", "heads", "seq", "head_dim"), ("batch", "kv_heads", "seq", "head_dim"), \
    ("batch", "seq", "heads", "head_dim")


def resolve(model_cfg, platform: str, context: int = 1, documents: bool = False,
            cudnn_heads: int = CUDNN_HEADS_BEFORE, device_heads: int | None = None) -> tuple[str, str | None]:
    """(the kernel that runs, a one-line note when `auto` keeps xla where a fused kernel exists, or
    plans a stand-in); `cudnn_heads`: the widest head cuDNN takes here, `device_heads`: on the
    mesh's GPUs (cudnn_head_max, with and without the host's check)."""
    if model_cfg.attention != "auto":
        return model_cfg.attention, None
    fused = FUSED_ON.get(platform)
    if fused is None:
        return "xla", None
    flash_ok = model_cfg.dropout == 0 and context == 1 and tokamax_kernels.available()
    if fused == "cudnn" and documents and flash_ok:
        return "tokamax", None  # tokamax's kernel takes the documents' mask
    head = model_cfg.head_size
    if fused == "cudnn" and cudnn_takes(head, device_heads or cudnn_heads) and not cudnn_takes(head, cudnn_heads) \
            and flash_ok and model_cfg.dtype != "float32":  # a compile-only Hopper planned on another host
        return "tokamax", (f"model.attention=auto plans tokamax: cuDNN runs {head}-dim heads on these GPUs, but jax "
                           "checks that against this host's device; tokamax's flash attention stands in for its "
                           "memory (on an H200 it took 4.2x cuDNN's time)")
    why = why_xla(model_cfg, fused, context, documents, cudnn_heads)
    if why and fused == "cudnn":  # measured: one H200, jax 0.11.2, GPT-2 124M at batch 16 (docs/benchmarks.md)
        why += "; xla keeps every head's scores: GPT-2 124M's step took 1.47x the time and 2.2x the memory on an H200"
    return ("xla", f"model.attention=auto runs xla: {why}") if why else (fused, None)


def why_xla(model_cfg, fused: str, context: int, documents: bool, cudnn_heads: int) -> str | None:
    """Why `auto` cannot run the platform's fused kernel, or None."""
    if model_cfg.dropout > 0:
        return f"{fused} has no attention dropout (model.dropout={model_cfg.dropout})"
    where = "runs no context ring" if context > 1 else "is not installed (pip install -e '.[gpu]')"
    if fused == "cudnn" and documents:
        return f"jax's cuDNN attention has no segment ids for data.document_mask, and tokamax's kernel, which has, {where}"
    if fused == "cudnn" and not cudnn_takes(model_cfg.head_size, cudnn_heads):
        return (f"cuDNN's fused attention takes heads up to {cudnn_heads} dims here (256 where the host's GPU is a Hopper), "
                f"in multiples of 8 (this model's: {model_cfg.head_size}); tokamax's kernel takes them, and took "
                "1.9x xla's time at 192-dim heads on an H200")
    if fused == "cudnn" and model_cfg.dtype == "float32":
        return "cuDNN's fused attention takes bfloat16 only (model.dtype=float32)"
    if fused == "splash" and model_cfg.block_size % SPLASH_TILE:
        return f"splash's tiles are {SPLASH_TILE} tokens (model.block_size={model_cfg.block_size})"
    return ring_chunks_too_small(model_cfg, context) if fused == "splash" else None


def cudnn_head_max(device, host=None) -> int:
    """The widest head cuDNN's flash attention takes on `device`: 256 dims from Hopper on (compute
    capability 9.0), else 128. jax checks the width against the host's own first device (`host`,
    by default jax.devices()[0]; jax._src.cudnn), so a compile-only H100 planned on a host without
    a Hopper GPU gets 128 too. Measured: latent attention's 192-dim heads on an H200, cuDNN in
    0.46x xla's time (docs/benchmarks.md)."""
    hopper = lambda d: tuple(int(c) for c in str(getattr(d, "compute_capability", "0.0")).split(".")[:2]) >= (9, 0)
    return CUDNN_HEADS_HOPPER if hopper(device) and hopper(host or jax.devices()[0]) else CUDNN_HEADS_BEFORE


def check_mesh(model_cfg, platform: str, context: int = 1, cudnn_heads: int = CUDNN_HEADS_HOPPER) -> None:
    """Refuse an explicit fused kernel on a mesh where it cannot run, in one line with the fix."""
    kernel = model_cfg.attention
    if kernel == "cudnn" and platform in GPUS and not cudnn_takes(model_cfg.head_size, cudnn_heads):
        raise UserError(f"model.attention=cudnn takes heads up to {cudnn_heads} dims here (256 where the host's GPU is "
                        f"a Hopper), and this model's are {model_cfg.head_size}; use --model.attention=auto")
    if kernel in ("auto", "xla"):
        return
    if kernel == "splash" and (why := ring_chunks_too_small(model_cfg, context)):
        raise UserError(f"model.attention=splash: {why}; use a block_size that is a multiple of "
                        f"{2 * context * SPLASH_TILE}, or --model.attention=auto")
    if kernel == "tokamax" and (context > 1 or not tokamax_kernels.available()):
        raise UserError("model.attention=tokamax " + ("runs no context ring" if context > 1 else
                        "needs tokamax: pip install -e '.[gpu]'") + "; use --model.attention=auto")
    if platform not in NEEDS_PLATFORM[kernel]:
        raise UserError(f"model.attention={kernel} needs {NEEDS_PLATFORM[kernel][0]} devices, and this "
                        f"mesh is on {platform}; use --model.attention=auto")


def ring_chunks_too_small(model_cfg, context: int) -> str | None:
    """Why splash cannot run a context ring's block pairs, or None: the ring's zigzag layout gives
    each device two chunks of block_size / (2 cp) tokens, and splash's tiles are 128."""
    chunk = model_cfg.block_size // (2 * context)
    if context > 1 and chunk % SPLASH_TILE:
        return f"the context ring's chunks are {chunk} tokens (block {model_cfg.block_size} / 2 cp={context}), " \
               f"not a multiple of splash's {SPLASH_TILE}-token tiles"
    return None


def platform_of(mesh) -> str:
    """The platform of a mesh's devices (a compile-only TPU's too); the default backend's for a
    mesh that names none. Asked once, before tracing (jaxpar.training.execution)."""
    device = device_of(mesh)
    return jax.default_backend() if device is None else device.platform


def device_of(mesh):
    """One of a mesh's devices (a compile-only GPU's too); an abstract mesh's abstract device, or
    None where it names none."""
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh.devices.flat[0]
    mesh = getattr(mesh, "abstract_mesh", mesh)
    return None if mesh.empty else mesh.abstract_device


def fused_attention(plan, q, k, v, doc_starts=None):
    """Causal attention by the plan's fused kernel (splash, cudnn or tokamax): q (batch, heads, seq,
    head_dim), k, v (batch, kv_heads, seq, head_dim) -> (batch, seq, heads, head_dim), per
    device; within documents when doc_starts (batch, seq) is given (splash and tokamax)."""
    if plan.attention == "tokamax":
        local = functools.partial(tokamax_kernels.attention, on_gpu=plan.platform in GPUS)
    else:
        local = local_kernel(plan.attention, plan.interpret)
    if doc_starts is None:
        in_axes, args = (Q_AXES, KV_AXES, KV_AXES), (q, k, v)
    else:
        local = functools.partial(lambda q, k, v, docs, fn: fn(q, k, v, segments=(docs, docs)), fn=local)
        in_axes, args = (Q_AXES, KV_AXES, KV_AXES, ("batch", "seq")), (q, k, v, doc_starts)
    if plan.mesh is None:
        return local(*args)
    return plan.per_device(local, in_axes, OUT_AXES)(*args)


def local_kernel(kernel: str, interpret: bool):
    """The one-device function of a fused kernel: splash (in Pallas interpret mode off TPU) or cuDNN."""
    if kernel == "splash":
        return functools.partial(splash, interpret=interpret)
    return cudnn


def block_sizes(seq_len: int, kv_len: int | None = None):
    from jax.experimental.pallas.ops.tpu.splash_attention import BlockSizes
    lengths = (seq_len, seq_len if kv_len is None else kv_len)
    block = next(b for b in (512, 256, SPLASH_TILE) if all(n % b == 0 for n in lengths))
    return BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                      block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)


def splash(q, k, v, residuals: bool = False, interpret: bool = True, causal: bool = True, segments=None):
    """Splash attention on one device's heads: the MQA kernel per (row, KV head) with that head's
    group of queries, q pre-scaled by 1/sqrt(d) as the kernel expects; causal, or every query
    against every key; segments: (the queries', the keys') (batch, seq) document ids, or None.
    `interpret`: off TPU (tests), the kernel in Pallas interpret mode."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    B, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    mask = sa.CausalMask((T, S)) if causal else sa.FullMask((T, S))
    kernel = sa.make_splash_mqa_single_device(sa.MultiHeadMask([mask] * (H // K)), block_sizes=block_sizes(T, S),
                                              save_residuals=residuals, interpret=interpret)
    grouped = (q * (1.0 / math.sqrt(D))).astype(q.dtype).reshape(B, K, H // K, T, D)
    if segments is None:
        result = jax.vmap(jax.vmap(kernel))(grouped, k, v)
    else:  # one row's ids for each of its KV heads
        def per_row(q, k, v, q_ids, kv_ids):
            ids = sa.SegmentIds(q=q_ids, kv=kv_ids)
            return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=ids))(q, k, v)
        result = jax.vmap(per_row)(grouped, k, v, *segments)
    out, lse = result if residuals else (result, None)
    out = out.reshape(B, H, T, D).transpose(0, 2, 1, 3)
    return (out, lse[0].reshape(B, H, T)) if residuals else out


@dataclass(frozen=True)
class BlockKernel:
    """What runs a context ring's block pairs: xla, or a fused kernel (splash in Pallas interpret
    mode off TPU)."""
    name: str = "xla"
    interpret: bool = True

    @property
    def fused(self) -> bool:
        return self.name != "xla"


XLA = BlockKernel()  # the ring's default: its block pairs by xla


def block_attention(kernel: BlockKernel, q, k, v, causal: bool, segments=None):
    """One block pair of a context ring on one device, by a fused kernel: q (batch, kv_heads,
    group, queries, head_dim), k, v (batch, kv_heads, keys, head_dim) -> (the output, float32, in
    q's shape; the float32 log-sum-exp of each query row), for the ring's online softmax.
    segments: (the queries', the keys') document ids, or None."""
    b, kv_heads, group, t, d = q.shape
    flat = q.reshape(b, kv_heads * group, t, d)
    extra = {} if segments is None else {"segments": segments}
    out, lse = local_kernel(kernel.name, kernel.interpret)(flat, k, v, residuals=True, causal=causal, **extra)
    out = out.transpose(0, 2, 1, 3).reshape(q.shape).astype(jnp.float32)
    return out, lse.reshape(b, kv_heads, group, t).astype(jnp.float32)


def cudnn(q, k, v, residuals: bool = False, causal: bool = True):
    """cuDNN's fused attention (NVIDIA GPUs, bfloat16), in its (batch, seq, heads, head_dim) layout."""
    q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
    result = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn",
                                          return_residual=residuals)
    return (result[0], result[1].astype(jnp.float32)) if residuals else result

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

Each kernel's needs and one-line reasons are its entry here (`ATTENTION_KERNELS`, each a
jaxpar.nn.kernel_entry.Kernel): `check_attention` asks them of the config as it is checked
(jaxpar.core.registry) and where the plan is made (jaxpar.training.step.execution), and the rest
of this module of the mesh and the platform.
"""

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxpar.core.platform import GPUS
from jaxpar.nn import kernel_entry as entry  # entry.XLA: the name; XLA below: the ring's BlockKernel
from jaxpar.nn import tokamax_kernels
from jaxpar.nn.attention import causal_attention
from jaxpar.nn.kernel_entry import (
    ATTENTION,
    AUTO,
    CAUSAL,
    CUDNN,
    DOCUMENTS,
    GPU_EXTRA,
    OTHERS,
    SPLASH,
    TOKAMAX,
    Kernel,
    auto_kernel,
    by_name,
    model_facts,
)

Q_AXES, KV_AXES, OUT_AXES = ("batch", "heads", "seq", "head_dim"), ("batch", "kv_heads", "seq", "head_dim"), \
    ("batch", "seq", "heads", "head_dim")
SPLASH_TILE = 128  # splash's blocks of queries and keys are multiples of the TPU's 128 lanes
CUDNN_HEADS_HOPPER, CUDNN_HEADS_BEFORE = 256, 128  # jax's check: compute capability 9.0 and up, or below

CUDNN_KERNEL = Kernel(
    CUDNN, ATTENTION, platforms=GPUS, auto_on=GPUS, widest_head=CUDNN_HEADS_HOPPER, head_multiple=8, masks=(CAUSAL,),
    dtypes=("bfloat16",), dropout=False, stand_in=TOKAMAX,
    refusals={
        "heads": "model.attention=cudnn takes heads up to {kernel.widest_head} dims (Hopper and later GPUs) in "
                 "multiples of {kernel.head_multiple}, and this model's are {head}; use --model.attention=auto "
                 "(tokamax's kernel on GPUs)",
        "heads here": "model.attention=cudnn takes heads up to {widest} dims here ({kernel.widest_head} where the "
                      "host's GPU is a Hopper), and this model's are {head}; use --model.attention=auto",
        "dtype": "model.attention=cudnn takes bfloat16 only; set --model.dtype=bfloat16, or --model.attention=auto",
        "documents": "model.attention=cudnn cannot keep data.document_mask's documents apart: jax's cuDNN attention "
                     "has no segment ids; use --model.attention=auto (tokamax's kernel on GPUs, where it is installed)"},
    notes={
        "documents": "jax's cuDNN attention has no segment ids for data.document_mask, and tokamax's kernel, which "
                     "has, {why_not_stand_in}",
        "heads": "cuDNN's fused attention takes heads up to {widest} dims here ({kernel.widest_head} where the host's "
                 "GPU is a Hopper), in multiples of {kernel.head_multiple} (this model's: {head}); tokamax's kernel "
                 "takes them, and took 1.9x xla's time at 192-dim heads on an H200",
        "dtype": "cuDNN's fused attention takes bfloat16 only (model.dtype={dtype})",
        # measured: one H200, jax 0.11.2, GPT-2 124M at batch 16 (docs/benchmarks.md)
        "xla's cost": "xla keeps every head's scores: GPT-2 124M's step took 1.47x the time and 2.2x the memory on "
                      "an H200",
        "stand-in": "model.attention=auto plans tokamax: cuDNN runs {head}-dim heads on these GPUs, but jax checks "
                    "that against this host's device; tokamax's flash attention stands in for its memory (on an "
                    "H200 it took 4.2x cuDNN's time)"})

ATTENTION_KERNELS = by_name(  # model.attention's entries, in the order its values are listed
    Kernel(entry.XLA, ATTENTION, auto_on=(OTHERS,)),
    # splash off TPU: in Pallas interpret mode (the tests)
    Kernel(SPLASH, ATTENTION, platforms=("tpu", "cpu"), auto_on=("tpu",), tile=SPLASH_TILE, dropout=False),
    CUDNN_KERNEL,
    # tokamax's flash attention off GPUs: its XLA reference (the tests)
    Kernel(TOKAMAX, ATTENTION, platforms=(*GPUS, "cpu"), dropout=False, ring=False, package="tokamax",
           notes={"ring": "runs no context ring", "package": "is not installed (" + GPU_EXTRA + ")"}),
    needs=lambda cfg: check_attention(cfg.model, cfg.data.document_mask))


def check_attention(model_cfg, documents: bool = False) -> None:
    """Refuse model.attention where the config alone rules it out, in one line with the fix: a
    name of no kernel, its kernel's own needs, and with `documents` (data.document_mask) a kernel
    that cannot keep them apart (its name is checked before, as every registry's). The mesh's
    needs are check_mesh's."""
    kernel = ATTENTION_KERNELS.get(model_cfg.attention)
    if kernel and (reason := kernel.unmet(model_cfg)):
        raise kernel.refused(reason, **model_facts(model_cfg))
    if kernel and documents and DOCUMENTS not in kernel.masks:
        raise kernel.refused("documents")


def resolve(model_cfg, platform: str, context: int = 1, documents: bool = False,
            cudnn_heads: int = CUDNN_HEADS_BEFORE, device_heads: int | None = None) -> tuple[str, str | None]:
    """(the kernel that runs, a one-line note when `auto` keeps xla where a fused kernel exists, or
    plans a stand-in); `cudnn_heads`: the widest head cuDNN takes here, `device_heads`: on the
    mesh's GPUs (cudnn_head_max, with and without the host's check)."""
    if model_cfg.attention != AUTO:
        return model_cfg.attention, None
    fused = auto_kernel(ATTENTION_KERNELS, platform)
    if fused.name == entry.XLA:
        return entry.XLA, None
    stand_in = ATTENTION_KERNELS.get(fused.stand_in)
    flash_ok = stand_in is not None and stand_in.unmet(model_cfg, context=context) is None \
        and tokamax_kernels.installed(stand_in)
    if documents and DOCUMENTS not in fused.masks and flash_ok:
        return stand_in.name, None  # tokamax's kernel takes the documents' mask
    head = model_cfg.head_size
    if fused.takes_heads(head, device_heads or cudnn_heads) and not fused.takes_heads(head, cudnn_heads) \
            and flash_ok and model_cfg.dtype in fused.dtypes:  # a compile-only Hopper planned on another host
        return stand_in.name, fused.note("stand-in", head=head)
    why = why_xla(model_cfg, fused, context, documents, cudnn_heads)
    if why and "xla's cost" in fused.notes:
        why += "; " + fused.note("xla's cost")
    return (entry.XLA, f"model.attention=auto runs xla: {why}") if why else (fused.name, None)


def why_xla(model_cfg, fused: Kernel, context: int, documents: bool, cudnn_heads: int) -> str | None:
    """Why `auto` cannot run the platform's fused kernel, or None; where it cannot keep the
    documents, why its stand-in cannot either (dropout is asked first)."""
    reason = fused.unmet(model_cfg, documents, cudnn_heads, context)
    if reason is None:
        return None
    stand_in = ATTENTION_KERNELS.get(fused.stand_in)
    why_not = stand_in.note("ring" if context > 1 else "package") if stand_in and reason == "documents" else ""
    return fused.note(reason, **model_facts(model_cfg, context), widest=cudnn_heads, why_not_stand_in=why_not)


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
    if model_cfg.attention in (AUTO, entry.XLA):
        return
    kernel = ATTENTION_KERNELS[model_cfg.attention]
    needs = kernel.needs(model_cfg, widest=cudnn_heads, context=context)
    unmet = (("heads here", platform in GPUS and needs["heads"]), ("chunks", needs["chunks"]), ("ring", needs["ring"]),
             ("package", not tokamax_kernels.installed(kernel)),
             ("platform", kernel.platforms and platform not in kernel.platforms))
    if reason := next((reason for reason, unmet in unmet if unmet), None):
        raise kernel.refused(reason, **model_facts(model_cfg, context), widest=cudnn_heads, platform=platform,
                             multiple=2 * context * kernel.tile)


def platform_of(mesh) -> str:
    """The platform of a mesh's devices (a compile-only TPU's too); the default backend's for a
    mesh that names none. Asked once, before tracing (jaxpar.training.step.execution)."""
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
    if plan.attention == TOKAMAX:
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


def local_attention(plan):
    """The plan's kernel on one device's arrays, the whole sequence there (a context strategy's
    attention after it gathers the sequence): (q, k, v, doc_starts or None) -> (batch, seq, heads,
    head_dim), causal, within documents where given."""
    if plan.attention == entry.XLA:
        return lambda q, k, v, docs: causal_attention(q, k, v, 0.0, None, docs)
    if plan.attention == TOKAMAX:
        fused = functools.partial(tokamax_kernels.attention, on_gpu=plan.platform in GPUS)
    else:
        fused = local_kernel(plan.attention, plan.interpret)
    return lambda q, k, v, docs: fused(q, k, v) if docs is None else fused(q, k, v, segments=(docs, docs))


def local_kernel(kernel: str, interpret: bool):
    """The one-device function of a fused kernel: splash (in Pallas interpret mode off TPU) or cuDNN."""
    if kernel == SPLASH:
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
    name: str = entry.XLA
    interpret: bool = True

    @property
    def fused(self) -> bool:
        return self.name != entry.XLA


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

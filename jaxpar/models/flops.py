"""FLOPs per token and the peak FLOP/s that MFU divides by: counted and looked up here, nowhere else.

Model FLOPs per token (training, forward + backward) follow PaLM / nanoGPT:
    6 * N  +  12 * n_layer * n_embd * block_size
where N counts the parameters that take part in matmuls (the family's `matmul_params`: the blocks'
projections, e.g. SwiGLU's three and grouped-query attention's smaller K/V, and the lm_head over
the real vocabulary). Embeddings, norms and biases are excluded, as is the vocabulary padding (an
implementation detail, not model work). The second term is attention's QK^T and AV.
"""

import functools
import time

import jax
import jax.numpy as jnp

from jaxpar.core.config import ModelConfig
from jaxpar.core.remat import POLICIES, RERUN_LAYER, RERUN_MLP, RERUN_WIDEST
from jaxpar.models.registry import family_of

# Dense peak FLOP/s per device from vendor data sheets, by compute dtype. On GPUs, float32 matmuls
# run as TF32 by default in XLA, so their peak is the TF32 tensor-core figure. FP8 (e4m3 and e5m2
# alike) only where the chip has FP8 units: the roofline times FP8 GEMMs at it (MFU never divides
# by it: an FP8 recipe's mfu_dtype is model.dtype).
FP8 = "float8"
PEAK_FLOPS = {
    # device_kind substring: {dtype: flop/s}
    # H100 and H200 SXM data sheets: FP8 Tensor Core 3,958 TFLOPS with sparsity, 1,979 dense.
    "H200": {"bfloat16": 989e12, "float32": 494e12, FP8: 1979e12},
    "H100": {"bfloat16": 989e12, "float32": 494e12, FP8: 1979e12},  # SXM; the PCIe part is lower
    "A100": {"bfloat16": 312e12, "float32": 156e12},
    "TPU v6": {"bfloat16": 918e12, "float32": 918e12},
    "TPU v5p": {"bfloat16": 459e12, "float32": 459e12},
    "TPU v5 lite": {"bfloat16": 197e12, "float32": 197e12},
    "TPU v5e": {"bfloat16": 197e12, "float32": 197e12},
    "TPU v4": {"bfloat16": 275e12, "float32": 275e12},
}


def matmul_params(cfg: ModelConfig, vocab_size: int) -> int:
    """N in 6N: the weights of every matmul, lm_head over the real vocab, no biases or norms."""
    return family_of(cfg).matmul_params(vocab_size)


def flops_per_token(cfg: ModelConfig, vocab_size: int) -> int:
    return 6 * matmul_params(cfg, vocab_size) + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def recompute_flops_per_token(cfg: ModelConfig) -> int:
    """FLOPs a pipeline backward adds by rerunning its stage's forward: the blocks' 2N and attention."""
    block_params = matmul_params(cfg, 0)
    return 2 * block_params + 4 * cfg.n_layer * cfg.n_embd * cfg.block_size


def routed_and_shared(cfg: ModelConfig) -> int:
    """The experts each token passes through in a sparse layer: its k routed and any shared."""
    return cfg.experts_per_token + getattr(cfg, "n_shared_experts", 0)


def mlp_rerun_flops_per_token(cfg: ModelConfig) -> int:
    """FLOPs of the MLPs' forward that `attention` reruns (2 x their matmul params per token): a
    dense layer's first matmul (GELU's C x F, SwiGLU's gate and up, C x 2F; the last one's output
    feeds only the residual add, which its backward does not read), a sparse layer's router and
    its k routed and any shared experts (three C x F_e each: the routing weights' gradient reads
    the experts' outputs)."""
    C, sparse = cfg.n_embd, sum(cfg.sparse_layers)
    dense = (cfg.n_layer - sparse) * (1 if cfg.family == "gpt2" else 2) * C * cfg.mlp_width
    if not sparse:
        return 2 * dense
    experts = cfg.n_experts * C + routed_and_shared(cfg) * 3 * C * cfg.expert_width
    return 2 * (dense + sparse * experts)


def widest_rerun_flops_per_token(cfg: ModelConfig) -> int:
    """FLOPs of the widest matmul's forward, which `dots_except_widest` reruns: GPT-2's MLP in
    (C x F), SwiGLU's fused gate and up (C x 2F), and the experts' (k routed and any shared)."""
    C, sparse = cfg.n_embd, sum(cfg.sparse_layers)
    dense = (cfg.n_layer - sparse) * (1 if cfg.family == "gpt2" else 2) * C * cfg.mlp_width
    if not sparse:
        return 2 * dense
    return 2 * (dense + sparse * routed_and_shared(cfg) * 2 * C * cfg.expert_width)


RERUNS = {RERUN_LAYER: recompute_flops_per_token, RERUN_MLP: mlp_rerun_flops_per_token,
          RERUN_WIDEST: widest_rerun_flops_per_token}  # by a policy's `reruns`


def policy_rerun_flops_per_token(cfg: ModelConfig) -> int:
    """FLOPs per token that model.remat's policy reruns in the backward (its `reruns`)."""
    rerun = RERUNS.get(POLICIES[cfg.remat].reruns)  # None: RERUN_NOTHING
    return rerun(cfg) if rerun else 0


NO_PIPELINE = (0.0, 1.0)  # reruns without a pipeline: no stage reruns, the policy's once


def hardware_flops_per_token(cfg: ModelConfig, vocab_size: int, reruns: tuple[float, float] = NO_PIPELINE) -> float:
    """Model FLOPs plus what is run again: what model.remat's policy reruns (each layer's forward
    under full and full_offloaded, the MLPs' under attention, the widest matmul's under
    dots_except_widest), and what a pipeline's backward reruns from each stage's saved input.

    `reruns`: (the forwards of each layer a pipeline's backward runs again, the times the policy's
    reruns happen), as its schedule counts them (jaxpar.parallel.schedules.base.rerun_factors):
    (1, 1) where each backward reruns its stage once; where a backward's W runs apart (ZB-H1),
    B and W are each a vjp from the saved input and W recomputes the input gradients on its way,
    (3, 2).
    """
    stage_reruns, policy_reruns = reruns
    return (flops_per_token(cfg, vocab_size) + stage_reruns * recompute_flops_per_token(cfg)
            + policy_reruns * policy_rerun_flops_per_token(cfg))


def datasheet_peak(kind: str, dtype: str) -> float | None:
    """PEAK_FLOPS for a device kind ('TPU v5e', 'NVIDIA H100 SXM', ...) in `dtype` (or FP8), or None
    if unknown (FP8 on a chip without FP8 units)."""
    return next((by_dtype.get(dtype) for name, by_dtype in PEAK_FLOPS.items()
                 if name.lower() in kind.lower()), None)


@functools.cache
def measure_matmul_peak(device, dtype: str, size: int = 2048, repeats: int = 5) -> float:
    """Best FLOP/s of a jitted size^3 matmul on one device (on CPU, all host cores take part)."""
    a = jax.device_put(jnp.ones((size, size), dtype), device)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()  # compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def peak_flops(devices, dtype: str) -> tuple[float, str]:
    """(total peak FLOP/s of these devices in `dtype`, where the figure came from); MFU's dtype is
    the matmul recipe's (jaxpar.nn.recipes: mfu_dtype).

    Accelerators: the data-sheet figure per device times the device count. CPU: forced host
    devices share the same cores, so the peak is one measured matmul over all cores, not times n.
    """
    kind = devices[0].device_kind
    if devices[0].platform == "cpu":
        return measure_matmul_peak(devices[0], dtype), f"measured {dtype} 2048^3 matmul on the host CPU"
    if (peak := datasheet_peak(kind, dtype)) is not None:
        return peak * len(devices), f"data sheet: {kind} {dtype} x {len(devices)}"
    # Unknown accelerator: measure rather than guess.
    return measure_matmul_peak(devices[0], dtype) * len(devices), f"measured {dtype} matmul on {kind} x {len(devices)}"

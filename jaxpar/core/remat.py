"""Recompute policies (model.remat): what each layer keeps for its backward pass, one registry entry
a policy.

The model tags the arrays a policy may keep with `jax.ad_checkpoint.checkpoint_name` (the names
below); a policy names the ones it keeps in device memory and the ones it keeps in host memory
(`pinned_host`), and the backward pass runs again whatever it needs that was not kept. A policy
also declares the bytes it keeps per token and layer and the part of the layer it reruns, which the
planner and the FLOP count read. Nothing here changes the math: every policy gives `none`'s losses.
"""

from dataclasses import dataclass

import jax

from jaxpar.core.errors import UserError
from jaxpar.core.registry import Registry

# The arrays a layer may keep, by checkpoint name.
LAYER_INPUT = "layer_input"  # the residual stream entering the layer (float32)
QKV = "qkv"  # the attention's projected queries, keys and values
CONTEXT = "context"  # the attention's output, before its output projection
ATTENTION_OUT = "attention_out"  # the output projection's result, in the stream's layout
MLP_INPUT = "mlp_input"  # the MLP's (or experts') normed input
HIDDEN = "mlp_hidden"  # the MLP's or experts' hidden activations: the widest matmul output
MLP_OUT = "mlp_out"  # the MLP's (or experts') output, in the stream's layout
ROUTER = "router"  # the router's choice: each token's experts and weights
EXPERTS_IN = "experts_in"  # each expert's rows, received and sorted for the grouped GEMM
EXPERTS_OUT = "experts_out"  # the experts' outputs, before the routing weights mix them

HOST = "pinned_host"  # the memory kind a policy offloads to (and optimizer state, train.offload)

# What the backward reruns under a policy, for the FLOP count (jaxpar.models.flops).
RERUN_NOTHING, RERUN_LAYER, RERUN_MLP, RERUN_WIDEST = "nothing", "layer", "mlp", "widest"


@dataclass(frozen=True)
class Policy:
    """One recompute policy: the names kept on the device and in host memory, and what reruns."""

    name: str
    keeps: tuple[str, ...]  # kept in device memory
    offloads: tuple[str, ...] = ()  # kept in host memory, moved back for the backward
    reruns: str = RERUN_LAYER
    about: str = ""

    @property
    def checkpointed(self) -> bool:
        """Whether the layer runs under jax.checkpoint (`none` keeps everything autodiff keeps)."""
        return self.reruns != RERUN_NOTHING

    def jax_policy(self):
        """The jax.checkpoint policy: save these names (and offload those), rerun the rest; None
        (jax's default) where nothing is named: the checkpoint's input alone is kept."""
        if not self.keeps and not self.offloads:
            return None
        if self.offloads:
            return jax.checkpoint_policies.save_and_offload_only_these_names(
                names_which_can_be_saved=list(self.keeps), names_which_can_be_offloaded=list(self.offloads),
                offload_src="device", offload_dst=HOST)
        return jax.checkpoint_policies.save_only_these_names(*self.keeps)

    def bytes_per_token(self, m, tp: int = 1, split: int = 1, activation_units: float | None = None) -> float:
        """Device bytes this policy keeps per token and layer (the layers' mean where experts and
        dense MLPs mix): tp splits the matmuls' activations, `split` (tp under sequence
        parallelism) the stream's. `none` keeps what autodiff keeps: the family's
        `activation_units` (bytes for 2-byte activations, Korthikanti et al.'s count), which the
        caller passes."""
        if not self.checkpointed:
            return activation_units * (4 / 2 if m.dtype == "float32" else 1)
        widths = kept_widths(m, tp, split)
        return sum(widths[name] for name in self.keeps) + (0 if LAYER_INPUT in self.offloads else widths[LAYER_INPUT])

    def host_bytes_per_token(self, m, split: int = 1) -> float:
        """Host bytes this policy keeps per token and layer."""
        return sum(kept_widths(m, 1, split)[name] for name in self.offloads)


def kept_widths(m, tp: int = 1, split: int = 1) -> dict[str, float]:
    """Bytes per token and layer of each named array (the layers' mean where experts and dense
    MLPs mix): the stream float32, the rest in the compute dtype, the router's logits float32."""
    b = 4 if m.dtype == "float32" else 2
    C, heads, D = m.n_embd, m.n_head, m.head_size
    sparse = sum(m.sparse_layers) / m.n_layer  # the fraction of layers with experts
    k = getattr(m, "experts_per_token", 0)
    gated = 2 if m.family != "gpt2" else 1  # SwiGLU's gate and up, or GELU's one
    dense_hidden = gated * m.mlp_width * (1 - sparse) if sparse < 1 else 0
    expert_hidden = gated * k * getattr(m, "expert_width", 0) * sparse
    return {LAYER_INPUT: 4 * C / split,
            QKV: (heads + 2 * m.kv_heads) * D * b / tp,
            CONTEXT: heads * D * b / tp,
            ATTENTION_OUT: C * b / split,
            MLP_INPUT: C * b,
            HIDDEN: (dense_hidden + expert_hidden) * b / tp,
            MLP_OUT: C * b / split,
            ROUTER: sparse * (m.n_experts * 4 + k * 8),
            EXPERTS_IN: sparse * k * C * b,
            EXPERTS_OUT: sparse * k * C * 4}


ATTENTION_KEPT = (QKV, CONTEXT, ATTENTION_OUT)
POLICIES = Registry("model.remat", {p.name: p for p in (
    Policy("none", (), reruns=RERUN_NOTHING, about="keep what autodiff keeps; nothing reruns"),
    Policy("full", (), about="keep each layer's input alone; the backward reruns the layer"),
    Policy("attention", ATTENTION_KEPT, reruns=RERUN_MLP,
           about="keep the attention's q, k, v and outputs; the backward reruns the MLP or experts"),
    Policy("dots_except_widest", ATTENTION_KEPT + (MLP_INPUT, MLP_OUT, ROUTER, EXPERTS_IN, EXPERTS_OUT),
           reruns=RERUN_WIDEST, about="keep every matmul's output but the MLP's or experts' hidden one, "
                                      "whose matmul the backward reruns"),
    Policy("full_offloaded", (), offloads=(LAYER_INPUT,),
           about="as full, with each layer's input kept in host memory instead of the device's"),
)})
REMAT_KINDS = tuple(POLICIES)
DEFAULT = "none"


def has_host_memory(devices) -> bool:
    """Whether these devices have the host memory kind that offloading keeps arrays in. Only this
    process's devices are asked: a compile-only topology's other hosts list no memories."""
    devices = list(devices)
    own = [d for d in devices if d.process_index == devices[0].process_index]
    return all(HOST in {m.kind for m in d.addressable_memories()} for d in own)


def check_host_memory(offload: str, policy: str, devices, platform: str) -> None:
    """Offloading (train.offload, or a model.remat `policy` that offloads) needs the `devices`'
    host memory kind (pinned_host); a UserError where it is missing."""
    asked = [f"train.offload={offload}"] * (offload != "none")
    asked += [f"model.remat={policy}"] * bool(POLICIES[policy].offloads)
    if asked and not has_host_memory(devices):
        raise UserError(f"{' and '.join(asked)} keeps arrays in host memory ({HOST}), which the {platform} "
                        f"devices here do not have; use train.offload=none and a remat policy without offload")

"""DeepSeek-V3's [model] keys beyond Llama's (jaxpar.models.llama.config): multi-head latent
attention (MLA) and the router of its mixture of experts; and their checks.

Hugging Face's names: q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
n_shared_experts, n_group, topk_group, routed_scaling_factor, first_k_dense_replace (here the
first k of model.dense_layers); the router's balance bias is e_score_correction_bias.
"""

from dataclasses import dataclass

from jaxpar.core.errors import UserError
from jaxpar.models.llama.config import ROPE_TYPES, LlamaConfig, at_least, check_llama


@dataclass
class DeepseekConfig(LlamaConfig):
    family: str = "deepseek"  # MLA; sigmoid routing within the best groups of experts; shared experts
    # MLA: queries through a rank-q_lora_rank bottleneck and an RMSNorm (0: one projection, as
    # DeepSeek-V2-Lite); keys and values from one kv_lora_rank latent per token and its RMSNorm,
    # each head's key qk_nope_head_dim wide from the latent plus a qk_rope_head_dim rotated key
    # shared by every head; values v_head_dim wide.
    q_lora_rank: int = 0
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    # The rotated dims in pairs (x0, x1), (x2, x3), ... as DeepSeek's checkpoints lay them out
    # (transformers' rope_interleave); false: in halves, as Llama's are.
    rope_interleave: bool = True
    # YaRN (rope_type "yarn", DeepSeek-V3's long context): rope_factor and rope_original_max_position
    # as Llama 3's keys; the ramp between rope_beta_fast and rope_beta_slow rotations; cos and sin
    # scaled by mscale(rope_mscale) / mscale(rope_mscale_all_dim), the scores by
    # mscale(rope_mscale_all_dim)^2, mscale(m) = 0.1 m ln(factor) + 1 (0: unset, as transformers').
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    # The router: sigmoid scores; the topk_group best of n_group groups of experts (a group scored
    # by its two best), then experts_per_token within them; the chosen scores normalised to sum to
    # 1 and times routed_scaling_factor. n_shared_experts experts that every token passes through,
    # beside the routed ones.
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Balancing without an auxiliary loss: each expert's selection bias moves by this much after
    # each step, up where the step routed it fewer tokens than the mean, down where more
    # (DeepSeek-V3's gamma; 0 keeps the biases as they are).
    moe_bias_update_rate: float = 0.001
    # Multi-token prediction: mtp_layers modules after the model, module k predicting the token
    # k + 1 ahead (jaxpar.models.deepseek.mtp); their mean loss times mtp_weight joins the loss.
    mtp_layers: int = 0
    mtp_weight: float = 0.3
    router_z_coef: float = 0.0  # sigmoid scores: no softmax for a z-loss to keep in range

    @property
    def rope_types(self) -> tuple[str, ...]:
        return (*ROPE_TYPES, "yarn")

    @property
    def routed_layers(self) -> int:
        """The sparse layers and the multi-token prediction modules (each one sparse block)."""
        return sum(self.sparse_layers) + self.mtp_layers

    @property
    def head_size(self) -> int:
        """The query-key head width: the latent part and the rotated part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_heads(self) -> int:
        return self.n_head

    def check(self) -> None:
        check_mla(self)  # before Llama's checks: MLA's heads are its own keys, not n_embd / n_head's
        check_llama(self)
        check_yarn(self)
        check_router(self)
        if self.mtp_layers < 0 or self.mtp_weight < 0 or self.mtp_layers >= self.block_size:
            raise UserError(f"model.mtp_layers={self.mtp_layers} and model.mtp_weight={self.mtp_weight} must be "
                            f">= 0, and mtp_layers below model.block_size={self.block_size} (module k predicts "
                            "k + 1 tokens ahead within a row)")


def check_mla(m: DeepseekConfig) -> None:
    """MLA's widths. The unrotated query-key dims and the values are concatenated and projected
    as they are, so any width of them works; the rotated ones turn in pairs."""
    if m.n_kv_head not in (0, m.n_head) or m.head_dim or m.qk_norm != "none":
        raise UserError("DeepSeek's latent attention sets its own heads: drop model.n_kv_head, "
                        "model.head_dim and model.qk_norm")
    at_least(m, ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"), 1)
    at_least(m, ("q_lora_rank",), 0)
    if m.qk_rope_head_dim % 2:
        raise UserError(f"model.qk_rope_head_dim={m.qk_rope_head_dim} is odd, and rotary positions rotate "
                        "pairs of dims; choose an even one")
    if m.v_head_dim > m.head_size:  # the values go through the kernel padded to the query-key width
        raise UserError(f"model.v_head_dim={m.v_head_dim} is wider than the query-key heads (qk_nope_head_dim + "
                        f"qk_rope_head_dim = {m.head_size}); choose at most {m.head_size}")


def check_yarn(m: DeepseekConfig) -> None:
    """YaRN's keys, under any rope_type as Llama's scaling keys are: its ramp takes the log of
    original / (beta x 2 pi) over the log of rope_theta, and its mscale divides."""
    at_least(m, ("rope_beta_fast", "rope_beta_slow"), 0, strict=True)
    at_least(m, ("rope_mscale", "rope_mscale_all_dim"), 0)
    if m.rope_type == "yarn" and m.rope_theta == 1:
        raise UserError("model.rope_theta must not be 1 for yarn rope scaling (its ramp divides by log(rope_theta)); "
                        "choose another, e.g. 10000")


def check_router(m: DeepseekConfig) -> None:
    if not m.n_experts:
        return
    if m.n_group < 1 or m.n_experts % m.n_group or m.n_experts // m.n_group < 2:
        raise UserError(f"model.n_group={m.n_group} must divide model.n_experts={m.n_experts} into groups "
                        "of 2 or more (a group is scored by its two best experts)")
    if not 1 <= m.topk_group <= m.n_group or m.experts_per_token > m.topk_group * (m.n_experts // m.n_group):
        raise UserError(f"model.topk_group={m.topk_group} must be between 1 and model.n_group={m.n_group}, "
                        f"and its groups must hold model.experts_per_token={m.experts_per_token} experts")
    at_least(m, ("n_shared_experts", "moe_bias_update_rate"), 0)
    at_least(m, ("routed_scaling_factor",), 0, strict=True)

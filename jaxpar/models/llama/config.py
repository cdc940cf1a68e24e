"""Llama's [model] keys beyond the shared ones (jaxpar.core.model_config): grouped-query attention,
the MLP's width, RMSNorm, rotary positions, QK-norm and the mixture of experts; and their checks."""

from dataclasses import dataclass

from jaxpar.core.errors import UserError
from jaxpar.core.model_config import AUTO, ModelConfig
from jaxpar.core.registry import one_of

ROPE_TYPES = ("default", "llama3")
QK_NORMS = ("none", "head", "full")


@dataclass
class LlamaConfig(ModelConfig):
    family: str = "llama"  # RoPE, RMSNorm, SwiGLU, GQA; Qwen3's QK-norm; Mixtral's experts
    # Grouped-query attention with n_kv_head K/V heads (0: n_head; it divides
    # n_head), a SwiGLU MLP mlp_dim wide (0: 8/3 n_embd rounded up to a multiple of 64), RMSNorm,
    # rotary positions (rope_type "llama3" adds Llama 3's frequency scaling), an untied lm_head
    # unless tie_embeddings. Hugging Face's names: num_key_value_heads, intermediate_size,
    # rms_norm_eps, rope_theta, rope_scaling / rope_parameters, tie_word_embeddings.
    n_kv_head: int = 0
    mlp_dim: int = 0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    tie_embeddings: bool = True
    # Positions the model is made for (HF's max_position_embeddings), kept through fine-tuning at a
    # shorter block_size so an export says what the model was; 0: block_size.
    max_positions: int = 0
    # Each attention head's width (HF's head_dim; 0: n_embd / n_head). Qwen3 sets it apart.
    head_dim: int = 0
    # RMSNorm on the queries and keys before the rotary positions: "head" over each head's dims
    # with one scale shared by the heads (Qwen3's q_norm/k_norm), "full" over all the heads' dims
    # together (OLMoE's), or "none".
    qk_norm: str = "none"
    # A mixture of experts in every layer's MLP (jaxpar.nn.moe; 0: a dense MLP): n_experts SwiGLU
    # experts moe_mlp_dim wide (0: mlp_dim's rule), experts_per_token chosen per token by a float32
    # router, their weights renormalised to sum to 1 unless moe_renormalize is false (Mixtral: true;
    # Qwen3-MoE's norm_topk_prob). Dropless. router_aux_coef weights the load-balancing loss and
    # router_z_coef the z-loss. moe_dispatch: how tokens reach experts on other devices of 'expert'
    # (auto: ragged_all_to_all on TPU and GPU, all_to_all on CPU).
    n_experts: int = 0
    experts_per_token: int = 2
    moe_mlp_dim: int = 0
    moe_renormalize: bool = True
    router_aux_coef: float = 0.01
    router_z_coef: float = 0.001
    moe_dispatch: str = AUTO
    # The experts' grouped GEMM: ragged_dot (jax.lax), megablox (the Pallas kernels: their backward
    # takes the weights' gradient group by group; interpreted off TPU), blocks (each expert's rows
    # in tiles of 64, each tile times its expert's matrix: about the routed FLOPs where XLA's
    # ragged_dot is a dense product over every expert), tokamax (its Pallas-Triton ragged_dot, the
    # routed rows only, on NVIDIA GPUs), or auto (megablox on TPU, blocks on CPU, tokamax on GPU
    # where it is installed, else ragged_dot, said in one line).
    moe_gemm: str = AUTO
    # 0: dropless. Else each expert takes at most ceil(factor * T * k / E) assignments of a sequence
    # of T tokens, in token order; the rest are dropped (their weight 0) and counted (moe_dropped).
    moe_capacity_factor: float = 0.0
    # Which layers have the experts (HF's decoder_sparse_step and mlp_only_layers): every
    # moe_every-th (layers moe_every-1, 2*moe_every-1, ...) but the dense_layers, comma-separated
    # indices; the others keep the dense SwiGLU MLP, mlp_dim wide.
    moe_every: int = 1
    dense_layers: str = ""

    @property
    def rope_types(self) -> tuple[str, ...]:
        """The rope_type values this family computes."""
        return ROPE_TYPES

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_size(self) -> int:
        """Each attention head's width: head_dim, or n_embd / n_head."""
        return self.head_dim or self.n_embd // self.n_head

    @property
    def mlp_width(self) -> int:
        """The dense MLP's hidden width: mlp_dim, or 8/3 n_embd rounded up to a multiple of 64."""
        return self.mlp_dim or -(-8 * self.n_embd // 3 // 64) * 64

    @property
    def expert_width(self) -> int:
        """Each expert's hidden width: moe_mlp_dim, or the dense MLP's."""
        return self.moe_mlp_dim or self.mlp_width

    @property
    def dense_layer_ids(self) -> tuple[int, ...]:
        """model.dense_layers as indices: '0,3', or a TOML list, which arrives as '[0, 3]'."""
        text = str(self.dense_layers).strip().strip("[]")
        try:
            return tuple(int(part) for part in text.replace(" ", "").split(",") if part)
        except ValueError:
            raise UserError(f"model.dense_layers takes comma-separated layer indices such as 0,3; got "
                            f"'{self.dense_layers}'") from None

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer: whether its MLP is the mixture of experts."""
        dense = self.dense_layer_ids if self.n_experts else ()
        return tuple(bool(self.n_experts) and (i + 1) % self.moe_every == 0 and i not in dense
                     for i in range(self.n_layer))

    def check(self) -> None:
        check_heads(self)
        check_llama(self)


def check_heads(m: LlamaConfig) -> None:
    """Llama's heads: grouped-query attention, each head's width rotated in pairs, QK-norm."""
    if m.n_embd % m.n_head and not m.head_dim:
        raise UserError(f"model.n_embd={m.n_embd} must be divisible by model.n_head={m.n_head}")
    if m.n_kv_head < 0 or m.n_head % m.kv_heads:
        raise UserError(f"model.n_kv_head={m.n_kv_head} must divide model.n_head={m.n_head} (each KV "
                        f"head serves n_head/n_kv_head query heads); choose a divisor of {m.n_head}")
    at_least(m, ("head_dim",), 0)
    if m.head_size % 2:
        width = (f"model.head_dim={m.head_dim}" if m.head_dim else
                 f"each head's width, model.n_embd / model.n_head = {m.n_embd}/{m.n_head} = {m.head_size},")
        raise UserError(f"{width} is odd, and rotary positions rotate pairs of dims; choose an even one")
    one_of("model.qk_norm", m.qk_norm, QK_NORMS)


def at_least(m: LlamaConfig, names: tuple[str, ...], least: float, strict: bool = False) -> None:
    """Each key of `names` >= least (> least if strict), else one line naming that key."""
    for name in names:
        value = getattr(m, name)
        if value < least or strict and value == least:
            raise UserError(f"model.{name} must be {'>' if strict else '>='} {least:g}, got {value}")


def check_llama(m: LlamaConfig) -> None:
    """What every Llama-like family reads beside its heads: the MLP, RMSNorm, rotary positions
    and the mixture of experts."""
    at_least(m, ("mlp_dim",), 0)
    at_least(m, ("norm_eps", "rope_theta"), 0, strict=True)
    check_experts(m)
    check_rope(m)


def check_rope(m: LlamaConfig) -> None:
    """rope_type, and the scaling keys, checked under any rope_type: a value that is set must be
    one that could be used. A message names the rope_type set where it uses the key."""
    one_of("model.rope_type", m.rope_type, m.rope_types)
    users = {"rope_factor": ("llama3", "yarn"), "rope_original_max_position": ("llama3", "yarn"),
             "rope_low_freq_factor": ("llama3",), "rope_high_freq_factor": ("llama3",)}
    rules = [("rope_factor", m.rope_factor > 0, "> 0"),
           ("rope_original_max_position", m.rope_original_max_position > 0, "> 0"),
           ("rope_low_freq_factor", m.rope_low_freq_factor > 0, "> 0"),
           ("rope_high_freq_factor", m.rope_high_freq_factor > m.rope_low_freq_factor,
            f"> model.rope_low_freq_factor={m.rope_low_freq_factor}")]
    for name, ok, need in rules:
        if not ok:
            kind = m.rope_type if m.rope_type in users[name] else "/".join(t for t in users[name] if t in m.rope_types)
            raise UserError(f"model.{name} must be {need} for {kind} rope scaling, got {getattr(m, name)}; "
                            f"choose another, or drop it (default {getattr(type(m)(), name)})")


def check_experts(m: LlamaConfig) -> None:
    """The mixture of experts' keys (jaxpar.nn.moe); the kernels that moe_gemm and moe_dispatch
    name are their registries' (jaxpar.core.registry)."""
    at_least(m, ("n_experts", "moe_mlp_dim"), 0)
    if m.n_experts and not 1 <= m.experts_per_token <= m.n_experts:
        raise UserError(f"model.experts_per_token={m.experts_per_token} must be between 1 and "
                        f"model.n_experts={m.n_experts}; choose fewer experts per token or more experts")
    at_least(m, ("router_aux_coef", "router_z_coef", "moe_capacity_factor"), 0)
    check_sparse_layers(m)


def check_sparse_layers(m: LlamaConfig) -> None:
    """moe_every and dense_layers: layers that exist, and at least one layer with experts."""
    dense = m.dense_layer_ids
    if m.moe_every < 1 or any(not 0 <= i < m.n_layer for i in dense) or len(set(dense)) < len(dense):
        raise UserError(f"model.moe_every={m.moe_every} must be >= 1 and model.dense_layers={m.dense_layers} "
                        f"distinct layer indices from 0 to {m.n_layer - 1}")
    if (m.moe_every != 1 or dense) and not m.n_experts:
        raise UserError("model.moe_every and model.dense_layers choose the layers with experts, and this model "
                        "has none (model.n_experts=0); set --model.n_experts, or drop them")
    if m.n_experts and not any(m.sparse_layers):
        raise UserError(f"model.moe_every={m.moe_every} and model.dense_layers={m.dense_layers} leave no layer "
                        f"of {m.n_layer} with experts; choose fewer dense layers, or model.n_experts=0")

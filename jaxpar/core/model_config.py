"""The model's configuration: the [model] section's keys of every family, and their checks.

A key that only one family reads is declared `only_for(family, default)`; setting it on a model
of another family is an error (`check_family_keys`).
"""

from dataclasses import dataclass, field, fields

from jaxpar.core.errors import UserError

GELU_KINDS = ("exact", "tanh")
REMAT_KINDS = ("none", "full")
ATTENTION_KERNELS = ("auto", "xla", "splash", "cudnn")  # jaxpar.nn.kernels
SPLASH_TILE = 128  # splash's blocks of queries and keys are multiples of the TPU's 128 lanes
FAMILIES = ("gpt2", "llama")  # model.family: a module each in jaxpar/models (jaxpar.models.family)
ROPE_TYPES = ("default", "llama3")
QK_NORMS = ("none", "head", "full")
MOE_DISPATCHES = ("auto", "all_to_all", "ragged")  # jaxpar.nn.moe
MOE_GEMMS = ("auto", "ragged_dot", "megablox")


def only_for(family: str, default):
    """A model field that only `family` reads: setting it on another family is an error."""
    return field(default=default, metadata={"family": family})


@dataclass
class ModelConfig:
    family: str = "gpt2"  # gpt2 (learned positions, LayerNorm, GELU) or llama (RoPE, RMSNorm, SwiGLU, GQA)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    dropout: float = 0.0
    # The attention kernel (jaxpar.nn.kernels): auto (splash on TPU, cuDNN on NVIDIA GPUs in
    # bfloat16, xla elsewhere and with dropout), xla, splash or cudnn.
    attention: str = "auto"
    bias: bool = only_for("gpt2", True)  # biases in Linear and LayerNorm layers (nanoGPT's `bias` flag)
    # Rows of the embedding. 0: the data's vocabulary. Larger leaves room, as GPT-2's 50257 does
    # for any tokenizer with fewer tokens; smaller than the data's vocabulary is an error.
    vocab_size: int = 0
    dtype: str = "float32"  # compute dtype; master weights and optimizer state stay float32
    unroll_layers: bool = True  # unroll the layer scan: faster steps, longer compiles for deep models
    # The MLP's GELU: "exact" (erf) as nanoGPT's nn.GELU(), or "tanh", the approximation that
    # Hugging Face GPT-2 checkpoints were trained with (activation_function "gelu_new").
    gelu: str = only_for("gpt2", "exact")
    # "full": keep only each layer's input and rerun the layer in the backward pass (jax.checkpoint):
    # activation memory of one layer instead of all, for about a third more FLOPs.
    remat: str = "none"
    # The lm_head and loss over this many pieces of the sequence, each piece's float32 logits
    # recomputed in the backward pass: the whole batch's logits (rows x seq x vocab x 4 bytes) are
    # never held. 1: at once. It divides block_size.
    loss_chunks: int = 1
    # Megatron sequence parallelism: with tp > 1, the residual stream between the matmuls (LayerNorm,
    # dropout, the residual adds) is split over 'tensor' along the sequence. Same math; those
    # activations shrink by tp. No effect at tp = 1.
    sequence_parallel: bool = False
    # Tests only: the coefficient of an auxiliary loss, the mean square of each block's output
    # (jaxpar.models.interface), which proves the auxiliary-loss path on every layout. 0: off.
    test_activation_l2: float = 0.0
    # The llama family: grouped-query attention with n_kv_head K/V heads (0: n_head; it divides
    # n_head), a SwiGLU MLP mlp_dim wide (0: 8/3 n_embd rounded up to a multiple of 64), RMSNorm,
    # rotary positions (rope_type "llama3" adds Llama 3's frequency scaling), an untied lm_head
    # unless tie_embeddings. Hugging Face's names: num_key_value_heads, intermediate_size,
    # rms_norm_eps, rope_theta, rope_scaling / rope_parameters, tie_word_embeddings.
    n_kv_head: int = only_for("llama", 0)
    mlp_dim: int = only_for("llama", 0)
    norm_eps: float = only_for("llama", 1e-5)
    rope_theta: float = only_for("llama", 10000.0)
    rope_type: str = only_for("llama", "default")
    rope_factor: float = only_for("llama", 8.0)
    rope_low_freq_factor: float = only_for("llama", 1.0)
    rope_high_freq_factor: float = only_for("llama", 4.0)
    rope_original_max_position: int = only_for("llama", 8192)
    tie_embeddings: bool = only_for("llama", True)
    # Positions the model is made for (HF's max_position_embeddings), kept through fine-tuning at a
    # shorter block_size so an export says what the model was; 0: block_size.
    max_positions: int = only_for("llama", 0)
    # Each attention head's width (HF's head_dim; 0: n_embd / n_head). Qwen3 sets it apart.
    head_dim: int = only_for("llama", 0)
    # RMSNorm on the queries and keys before the rotary positions: "head" over each head's dims
    # with one scale shared by the heads (Qwen3's q_norm/k_norm), "full" over all the heads' dims
    # together (OLMoE's), or "none".
    qk_norm: str = only_for("llama", "none")
    # A mixture of experts in every layer's MLP (jaxpar.nn.moe; 0: a dense MLP): n_experts SwiGLU
    # experts moe_mlp_dim wide (0: mlp_dim's rule), experts_per_token chosen per token by a float32
    # router, their weights renormalised to sum to 1 unless moe_renormalize is false (Mixtral: true;
    # Qwen3-MoE's norm_topk_prob). Dropless. router_aux_coef weights the load-balancing loss and
    # router_z_coef the z-loss. moe_dispatch: how tokens reach experts on other devices of 'expert'
    # (auto: ragged_all_to_all on TPU and GPU, all_to_all on CPU).
    n_experts: int = only_for("llama", 0)
    experts_per_token: int = only_for("llama", 2)
    moe_mlp_dim: int = only_for("llama", 0)
    moe_renormalize: bool = only_for("llama", True)
    router_aux_coef: float = only_for("llama", 0.01)
    router_z_coef: float = only_for("llama", 0.001)
    moe_dispatch: str = only_for("llama", "auto")
    # The experts' grouped GEMM: ragged_dot (jax.lax), megablox (the Pallas kernels: their backward
    # takes the weights' gradient group by group; interpreted off TPU), or auto (megablox on TPU).
    moe_gemm: str = only_for("llama", "auto")
    # 0: dropless. Else each expert takes at most ceil(factor * T * k / E) assignments of a sequence
    # of T tokens, in token order; the rest are dropped (their weight 0) and counted (moe_dropped).
    moe_capacity_factor: float = only_for("llama", 0.0)
    # Which layers have the experts (HF's decoder_sparse_step and mlp_only_layers): every
    # moe_every-th (layers moe_every-1, 2*moe_every-1, ...) but the dense_layers, comma-separated
    # indices; the others keep the dense SwiGLU MLP, mlp_dim wide.
    moe_every: int = only_for("llama", 1)
    dense_layers: str = only_for("llama", "")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_size(self) -> int:
        """Each attention head's width: llama's head_dim, or n_embd / n_head."""
        return self.head_dim or self.n_embd // self.n_head

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width: llama's mlp_dim (or its rule), GPT-2's 4 n_embd."""
        if self.family != "llama":
            return 4 * self.n_embd
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

    @property
    def mixed_layers(self) -> bool:
        """Whether some layers have experts and others a dense MLP (each kind then has its own stack)."""
        return any(self.sparse_layers) and not all(self.sparse_layers)

    def layers_in(self, stack: str) -> tuple[int, ...]:
        """The layers whose weights a stacked leading axis holds: 'layers' all of them; where the
        kinds mix, 'sparse_layers' those with experts and 'dense_layers' the others."""
        if stack == "layers":
            return tuple(range(self.n_layer))
        return tuple(i for i, sparse in enumerate(self.sparse_layers) if sparse == (stack == "sparse_layers"))


def check_family_keys(m: ModelConfig, explicit: set[str]) -> None:
    """Refuse a model key set (in the file or on the command line) that the family never reads."""
    if m.family not in FAMILIES:
        raise UserError(f"model.family must be one of {', '.join(FAMILIES)}, got '{m.family}'")
    for f in fields(ModelConfig):
        family = f.metadata.get("family")
        if family and family != m.family and f"model.{f.name}" in explicit:
            raise UserError(f"model.{f.name} is a {family}-only setting, and this model is "
                            f"model.family={m.family}; drop it, or set --model.family={family}")


def check_attention(m: ModelConfig) -> None:
    """The attention kernel's own needs (jaxpar.nn.kernels), in one line with the fix."""
    if m.attention not in ATTENTION_KERNELS:
        raise UserError(f"model.attention must be one of {', '.join(ATTENTION_KERNELS)}, got '{m.attention}'")
    if m.attention in ("splash", "cudnn") and m.dropout > 0:
        raise UserError(f"model.attention={m.attention} has no attention dropout, and model.dropout="
                        f"{m.dropout}; set --model.dropout=0, or --model.attention=auto (xla)")
    if m.attention == "splash" and m.block_size % SPLASH_TILE:
        raise UserError(f"model.attention=splash runs tiles of {SPLASH_TILE} tokens, and model.block_size="
                        f"{m.block_size} is not a multiple; choose one, or --model.attention=auto")
    if m.attention == "cudnn" and m.dtype == "float32":
        raise UserError("model.attention=cudnn takes bfloat16 only; set --model.dtype=bfloat16, "
                        "or --model.attention=auto")


def validate_model(m: ModelConfig) -> None:
    if m.family not in FAMILIES:
        raise UserError(f"model.family must be one of {', '.join(FAMILIES)}, got '{m.family}'")
    if m.n_embd % m.n_head and not m.head_dim:
        raise UserError(f"model.n_embd={m.n_embd} must be divisible by model.n_head={m.n_head}")
    if m.gelu not in GELU_KINDS:
        raise UserError(f"model.gelu must be one of {', '.join(GELU_KINDS)}, got '{m.gelu}'")
    if m.loss_chunks < 1 or m.block_size % m.loss_chunks:
        raise UserError(f"model.loss_chunks={m.loss_chunks} must be a positive divisor of "
                        f"model.block_size={m.block_size}")
    if m.remat not in REMAT_KINDS:
        raise UserError(f"model.remat must be one of {', '.join(REMAT_KINDS)}, got '{m.remat}'")
    if m.dtype not in ("float32", "bfloat16"):
        raise UserError(f"model.dtype must be float32 or bfloat16, got '{m.dtype}'")
    if not 0 <= m.dropout < 1:
        raise UserError(f"model.dropout must be in [0, 1), got {m.dropout}")
    if m.test_activation_l2 < 0:
        raise UserError(f"model.test_activation_l2 must be >= 0, got {m.test_activation_l2}")
    check_attention(m)
    if m.family != "llama":
        return
    if m.n_kv_head < 0 or m.n_head % m.kv_heads:
        raise UserError(f"model.n_kv_head={m.n_kv_head} must divide model.n_head={m.n_head} (each KV "
                        f"head serves n_head/n_kv_head query heads); choose a divisor of {m.n_head}")
    if m.head_dim < 0 or m.head_size % 2:
        raise UserError(f"the head dim (model.head_dim, or n_embd/n_head) = {m.head_size} is odd or "
                        "negative, and rotary positions rotate pairs of dims; choose an even one")
    if m.qk_norm not in QK_NORMS:
        raise UserError(f"model.qk_norm must be one of {', '.join(QK_NORMS)}, got '{m.qk_norm}'")
    if m.mlp_dim < 0 or m.norm_eps <= 0 or m.rope_theta <= 0:
        raise UserError(f"model.mlp_dim must be >= 0 and model.norm_eps, model.rope_theta > 0; got "
                        f"{m.mlp_dim}, {m.norm_eps}, {m.rope_theta}")
    check_experts(m)
    if m.rope_type not in ROPE_TYPES:
        raise UserError(f"model.rope_type must be one of {', '.join(ROPE_TYPES)}, got '{m.rope_type}'")
    # Checked under any rope_type: a value that is set must be one that could be used.
    if not (m.rope_factor > 0 and m.rope_high_freq_factor > m.rope_low_freq_factor > 0
            and m.rope_original_max_position > 0):
        raise UserError("llama3 rope scaling needs model.rope_factor > 0, model.rope_high_freq_factor > "
                        "model.rope_low_freq_factor > 0 and model.rope_original_max_position > 0; got "
                        f"{m.rope_factor}, {m.rope_high_freq_factor}, {m.rope_low_freq_factor}, "
                        f"{m.rope_original_max_position}")


def check_experts(m: ModelConfig) -> None:
    """The mixture of experts' keys (jaxpar.nn.moe)."""
    if m.n_experts < 0 or m.moe_mlp_dim < 0:
        raise UserError(f"model.n_experts and model.moe_mlp_dim must be >= 0, got {m.n_experts} and {m.moe_mlp_dim}")
    if m.n_experts and not 1 <= m.experts_per_token <= m.n_experts:
        raise UserError(f"model.experts_per_token={m.experts_per_token} must be between 1 and "
                        f"model.n_experts={m.n_experts}; choose fewer experts per token or more experts")
    for name in ("router_aux_coef", "router_z_coef", "moe_capacity_factor"):
        if getattr(m, name) < 0:
            raise UserError(f"model.{name} must be >= 0, got {getattr(m, name)}")
    if m.moe_dispatch not in MOE_DISPATCHES:
        raise UserError(f"model.moe_dispatch must be one of {', '.join(MOE_DISPATCHES)}, got '{m.moe_dispatch}'")
    if m.moe_gemm not in MOE_GEMMS:
        raise UserError(f"model.moe_gemm must be one of {', '.join(MOE_GEMMS)}, got '{m.moe_gemm}'")
    check_sparse_layers(m)


def check_sparse_layers(m: ModelConfig) -> None:
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

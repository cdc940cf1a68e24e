"""The [model] section: the keys every family reads (ModelConfig), the registry of the families'
own configs, and the checks.

A family's own keys are a dataclass of its own that extends ModelConfig, in
jaxpar/models/<family>/config.py. The config is read and checked before any model is built, and
core may not import the families, so the registry of families (jaxpar.models.registry, which
jaxpar's package imports) files each one's config in FAMILY_CONFIGS (a jaxpar.core.registry
Registry). `model_config(family, **keys)` builds a family's config; a key that only other
families declare is refused in one line that names them (`not_this_family`).
"""

from dataclasses import dataclass, fields

from jaxpar.core.errors import UserError
from jaxpar.core.registry import Registry
from jaxpar.core.remat import REMAT_KINDS  # noqa: F401

DEFAULT_FAMILY = "gpt2"  # the default config's, nanoGPT's
# Every kernel key's default (model.attention, a mixture's moe_gemm and moe_dispatch): the platform
# picks. The kernels each key names, and their needs, are nn's registries (jaxpar.core.registry).
AUTO = "auto"

FAMILY_CONFIGS = Registry("model.family", {})  # model.family -> its config class, filled by jaxpar.models.registry


@dataclass
class ModelConfig:
    family: str = DEFAULT_FAMILY  # a folder of jaxpar/models, whose config extends this one
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    dropout: float = 0.0
    # The attention kernel (jaxpar.nn.kernels): auto (splash on TPU, cuDNN on NVIDIA GPUs in
    # bfloat16, xla elsewhere and with dropout), xla, splash or cudnn.
    attention: str = AUTO
    # Rows of the embedding. 0: the data's vocabulary. Larger leaves room, as GPT-2's 50257 does
    # for any tokenizer with fewer tokens; smaller than the data's vocabulary is an error.
    vocab_size: int = 0
    dtype: str = "float32"  # compute dtype; master weights and optimizer state stay float32
    unroll_layers: bool = True  # unroll the layer scan: faster steps, longer compiles for deep models
    # What each layer keeps for the backward pass, a policy of jaxpar.core.remat: none, full (the
    # layer's input alone, about a third more FLOPs), attention, dots_except_widest, full_offloaded.
    remat: str = "none"
    # The lm_head and loss over this many pieces of the sequence, each piece's float32 logits
    # recomputed in the backward pass: the whole batch's logits (rows x seq x vocab x 4 bytes) are
    # never held. 1: at once. It divides block_size.
    loss_chunks: int = 1
    # The lm_head's output: float32, or bfloat16 as PyTorch autocast's (nanoGPT's) logits are, with
    # model.dtype=bfloat16; the loss's softmax and log-sum-exp still run in float32 either way.
    logits_dtype: str = "float32"
    # Megatron sequence parallelism: with tp > 1, the residual stream between the matmuls (LayerNorm,
    # dropout, the residual adds) is split over 'tensor' along the sequence. Same math; those
    # activations shrink by tp. No effect at tp = 1.
    sequence_parallel: bool = False
    # How attention runs with the sequence split over 'context' (cp > 1), a strategy of
    # jaxpar.nn.context: ring (the zigzag ring, K/V passed round) or ulysses (all-to-alls to a head split).
    context_strategy: str = "ring"
    # FP8 matmuls (jaxpar.nn.recipes.fp8): none, tensorwise (a scale a tensor) or rowwise (a scale
    # a row), current scaling; every projection and the experts' grouped GEMM, the lm_head only
    # with fp8_head. Master weights and the optimizer stay float32, the rest computes in dtype.
    fp8: str = "none"
    fp8_head: bool = False
    # Tests only: the coefficient of an auxiliary loss, the mean square of each block's output
    # (jaxpar.models.family), which proves the auxiliary-loss path on every layout. 0: off.
    test_activation_l2: float = 0.0

    # What the mesh, the planner and the reports may ask of any model; a family's config that
    # has other answers gives them (a mixture of experts declares the n_experts key).
    n_experts = 0

    @property
    def kv_heads(self) -> int:
        """The attention's K/V heads."""
        return self.n_head

    @property
    def head_size(self) -> int:
        """Each attention head's width."""
        return self.n_embd // self.n_head

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width."""
        raise NotImplementedError(f"{type(self).__name__} gives its MLP's width")

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer: whether its MLP is a mixture of experts."""
        return (False,) * self.n_layer

    @property
    def routed_layers(self) -> int:
        """The layers with a router, whose logged router figures are averaged over them."""
        return sum(self.sparse_layers)

    @property
    def mixed_layers(self) -> bool:
        """Whether some layers have experts and others a dense MLP (each kind then has its own stack)."""
        return any(self.sparse_layers) and not all(self.sparse_layers)

    @property
    def lead_layers(self) -> int:
        """k where the first k layers are dense and every later one has experts (DeepSeek's
        first_k_dense_replace), else 0. Those k are stacked apart, on 'lead_layers', and run ahead
        of the other layers' scan, and of a pipeline (jaxpar.models.lead)."""
        sparse = self.sparse_layers
        k = sparse.index(True) if any(sparse) else 0
        return k if all(sparse[k:]) else 0

    def layers_in(self, stack: str) -> tuple[int, ...]:
        """The layers whose weights a stacked leading axis holds: 'lead_layers' the dense first
        ones (lead_layers), 'layers' all the others; where the kinds mix otherwise,
        'sparse_layers' those with experts and 'dense_layers' the others."""
        if stack == "lead_layers":
            return tuple(range(self.lead_layers))
        if stack == "layers":
            return tuple(range(self.lead_layers, self.n_layer))
        return tuple(i for i, sparse in enumerate(self.sparse_layers) if sparse == (stack == "sparse_layers"))

    def check(self) -> None:
        """The family's own keys' checks, each a UserError naming the key and the fix."""


def field_names(cls) -> set[str]:
    return {f.name for f in fields(cls)}


def model_config(family: str = DEFAULT_FAMILY, **keys) -> ModelConfig:
    """The config of a model of `family`, its keys set (the others at their defaults)."""
    cls = FAMILY_CONFIGS.named(family)
    for name in sorted(set(keys) - field_names(cls)):
        raise not_this_family(family, name) or UserError(f"unknown config key 'model.{name}'")
    return cls(**keys | {"family": family})


def with_family(m: ModelConfig, family: str) -> ModelConfig:
    """m as a model of `family`: the keys both families read kept, the others at the new
    family's defaults."""
    if family == m.family:
        return m
    keep = field_names(m) & field_names(FAMILY_CONFIGS.get(family, ModelConfig)) - {"family"}
    return model_config(family, **{name: getattr(m, name) for name in keep})


def not_this_family(family: str, name: str) -> UserError | None:
    """The one-line error for a key that other families declare and `family` does not, or None."""
    owners = [other for other, cls in FAMILY_CONFIGS.items() if name in field_names(cls)]
    if not owners or family in owners:
        return None
    return UserError(f"model.{name} is a {'/'.join(owners)}-only setting, and this model is "
                     f"model.family={family}; drop it, or set --model.family={owners[0]}")


def model_keys() -> list[str]:
    """Every family's keys, the shared ones first, each once."""
    names = [f.name for f in fields(ModelConfig)]
    for cls in FAMILY_CONFIGS.values():
        names += [f.name for f in fields(cls) if f.name not in names]
    return names


def validate_model(m: ModelConfig) -> None:
    if m.loss_chunks < 1 or m.block_size % m.loss_chunks:
        raise UserError(f"model.loss_chunks={m.loss_chunks} must be a positive divisor of "
                        f"model.block_size={m.block_size}")
    if m.dtype not in ("float32", "bfloat16"):
        raise UserError(f"model.dtype must be float32 or bfloat16, got '{m.dtype}'")
    if m.logits_dtype not in ("float32", m.dtype):
        raise UserError(f"model.logits_dtype must be float32 or model.dtype ({m.dtype}), got '{m.logits_dtype}'")
    if not 0 <= m.dropout < 1:
        raise UserError(f"model.dropout must be in [0, 1), got {m.dropout}")
    if m.test_activation_l2 < 0:
        raise UserError(f"model.test_activation_l2 must be >= 0, got {m.test_activation_l2}")
    m.check()

"""GPT-2's [model] keys beyond the shared ones (jaxpar.core.model_config), and their checks."""

from dataclasses import dataclass

from jaxpar.core.errors import UserError
from jaxpar.core.model_config import ModelConfig
from jaxpar.core.registry import one_of

GELU_KINDS = ("exact", "tanh")
NORM_KERNELS = ("xla", "pallas")


@dataclass
class GPT2Config(ModelConfig):
    family: str = "gpt2"  # learned positions, LayerNorm, GELU, tied embeddings
    bias: bool = True  # biases in Linear and LayerNorm layers (nanoGPT's `bias` flag)
    # The MLP's GELU: "exact" (erf) as nanoGPT's nn.GELU(), or "tanh", the approximation that
    # Hugging Face GPT-2 checkpoints were trained with (activation_function "gelu_new").
    gelu: str = "exact"
    # The residual add after attention and the LayerNorm before the MLP: "xla" (separate fusions), or
    # "pallas", one kernel forward and one backward (jaxpar.nn.fused_norm; interpret mode off GPUs).
    norm_kernel: str = "xla"

    @property
    def mlp_width(self) -> int:
        return 4 * self.n_embd

    def check(self) -> None:
        if self.n_embd % self.n_head:
            raise UserError(f"model.n_embd={self.n_embd} must be divisible by model.n_head={self.n_head}")
        one_of("model.gelu", self.gelu, GELU_KINDS)
        one_of("model.norm_kernel", self.norm_kernel, NORM_KERNELS)

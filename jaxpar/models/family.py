"""The model-family interface: the abstract class every family derives from, and its registry entry.

A family (GPT2, Llama, Deepseek: each in the model.py of its folder) declares its params
(jaxpar.nn.params) and computes with them a piece at a time (the embedding, one layer, the
logits), each piece under the jaxpar.core.execution.ExecutionPlan its caller passes. Its abstract
methods are what a family must define: a class that lacks one cannot be constructed. The stacked
layers' params are under "blocks", each leading with 'layers' (or, where layers of two kinds mix,
with its kind's stack: 'sparse_layers', 'dense_layers'; dense first layers are then stacked apart
for it, jaxpar.models.lead).

The train step, the pipeline executor, ZeRO, remat, the KV-cache sampler, the FLOP count,
`--dry-run`, `jaxpar.plan` and `jaxpar.bench` call these and nothing else, so a new family is one
folder, jaxpar/models/<family>/ (model, config, Hugging Face format), whose package names its
`Registered` entry, and that entry in jaxpar.models.registry.FAMILIES.

A block's auxiliary losses are a dict of scalars (empty for GPT-2 and Llama, unless the test-only
model.test_activation_l2 asks for one); `loss_weights` gives each one's coefficient in the loss.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import jax
import jax.numpy as jnp

from jaxpar.core.config import ModelConfig
from jaxpar.core.execution import ExecutionPlan
from jaxpar.nn.layers import KVCache


class Family(ABC):
    """A family's model on one config: the methods every family defines, and the defaults they
    share (the compute dtype, the test-only auxiliary loss, no predictions further ahead)."""

    head_names: tuple[str, ...] = ()  # the top-level params the loss reads after the last block
    shape_fields: tuple[str, ...] = ()  # the model config fields `declare` reads
    vmappable = True  # whether a block runs under jax.vmap (local gradient accumulation vmaps over 'data')
    kv_heads: int  # the KV cache's heads, and each one's width: set by every family's __init__
    head_dim: int

    def __init__(self, cfg: ModelConfig):
        self.cfg, self.dtype = cfg, jnp.dtype(cfg.dtype)

    @abstractmethod
    def declare(self, vocab_size: int) -> dict:
        """Every param's declaration (a jaxpar.nn.params.Param: shape, logical axes, role,
        initialiser) in a nested dict, for a vocabulary of vocab_size tokens."""

    @abstractmethod
    def embed(self, plan: ExecutionPlan, top: dict, tokens: jax.Array, key: jax.Array | None = None,
              positions: jax.Array | None = None) -> jax.Array:
        """(batch, seq) tokens -> the float32 residual stream; key: dropout's (None: no dropout);
        positions: each token's, (seq,) or (batch, seq), or None: in order."""

    @abstractmethod
    def block(self, plan: ExecutionPlan, x: jax.Array, p: dict, axes: dict, key: jax.Array | None = None,
              cache: KVCache | None = None,
              doc_starts: jax.Array | None = None) -> tuple[jax.Array, dict, KVCache | None]:
        """One layer on its params p (axes: their logical axes) -> (x, auxiliary losses, cache), in
        training and in cached decoding (cache: the layer's, or None); doc_starts: each token's
        document start, which attention and positions keep to (None: a row is one sequence)."""

    @abstractmethod
    def logits(self, plan: ExecutionPlan, head: dict, x: jax.Array, vocab_size: int) -> jax.Array:
        """The stream x, on the head_names params -> float32 logits over the padded vocabulary."""

    @abstractmethod
    def matmul_params(self, vocab_size: int) -> int:
        """N in MFU's 6N: the params that take part in matmuls."""

    @abstractmethod
    def activation_units(self, tp: int, split: int) -> float:
        """Saved activations per token and layer, in 2-byte units, under tensor parallelism tp;
        split: tp where sequence parallelism splits the norms' and residuals' activations too, else 1."""

    def block_losses(self, x: jax.Array) -> dict:
        """A block's auxiliary losses of its output x. model.test_activation_l2 (tests only) adds
        the mean square of the stream, to prove the auxiliary-loss path on every layout."""
        if self.cfg.test_activation_l2 == 0:
            return {}
        return {"activation_l2": jnp.mean(jnp.square(x.astype(jnp.float32)))}

    def loss_weights(self) -> dict[str, float]:
        """Each auxiliary loss's coefficient in the training loss (summed over layers first)."""
        weights = {"activation_l2": self.cfg.test_activation_l2}
        return {name: w for name, w in weights.items() if w != 0}

    def cache_widths(self) -> tuple[int, int, int]:
        """What decoding caches of a token in each layer: (heads, a key's width, a value's)."""
        return self.kv_heads, self.head_dim, self.head_dim

    def ahead_params(self) -> tuple[str, ...]:
        """The top-level params that ahead_losses reads beside the head's (a pipeline's last
        stage holds them); none by default."""
        return ()

    def ahead_losses(self, model, top: dict, x, targets, doc_starts=None) -> dict:
        """Auxiliary losses of predictions further ahead than the next token (DeepSeek's
        multi-token prediction), from the last layer's output x and the rows' next tokens; none by
        default."""
        return {}


@dataclass(frozen=True)
class Registered:
    """A family's entry in the registry: its class, its config (the [model] keys it reads, a
    jaxpar.core.model_config.ModelConfig), and its Hugging Face formats (modules with
    MODEL_TYPES, LOADS, model_fields, readers, state_dict, hf_config: jaxpar.models.hf), read by the
    config.json model_types they name; `exported_as` picks the one a model of the family is
    written in."""
    model: type[Family]
    config: type[ModelConfig]
    hf_formats: tuple[ModuleType, ...]
    exported_as: Callable[[ModelConfig], ModuleType] | None  # None: no HF format yet

"""The model-family interface: the class every family derives from.

A family is one class (jaxpar.models.gpt2.model.GPT2, jaxpar.models.llama.Llama) that declares its
parameters and computes with them:

    declare(vocab_size)                 every param's shape, logical axes, role and initialiser
                                        (jaxpar.nn.params); the stacked layers under "blocks",
                                        each leading with 'layers' (or, where layers of two kinds
                                        mix, with its kind's stack: 'sparse_layers', 'dense_layers';
                                        dense first layers are then stacked apart for it,
                                        jaxpar.models.lead)
    shape_fields                        the model config fields `declare` reads
    head_names                          the top-level params the loss needs after the last block
    embed(top, tokens, key, positions)  (batch, seq) tokens -> the float32 residual stream
                                        (positions: (seq,) or (batch, seq), or None: in order)
    block(x, p, axes, key, cache,       one layer on its params -> (x, auxiliary losses, cache):
          doc_starts)                   training's and cached decoding's one block (cache: None,
                                        or the layer's jaxpar.nn.layers.KVCache; doc_starts:
                                        None, or each token's document start, which attention
                                        and positions keep to)
    logits(head, x, vocab_size)         the stream -> float32 logits over the padded vocabulary
    kv_heads, head_dim                  the KV cache's shape
    vmappable                           whether a block runs under jax.vmap (the local gradient
                                        accumulation vmaps the passes over 'data')
    matmul_params(vocab_size)           N in MFU's 6N
    activation_units(tp, split)         saved activations per token and layer, 2-byte units

The train step, the pipeline executor, ZeRO, remat, the KV-cache sampler, the FLOP count,
`--dry-run`, `jaxpar.plan` and `jaxpar.bench` call these and nothing else, so a new family is one
folder, jaxpar/models/<family>/ (model, config, Hugging Face format), whose package names its
`Registered` entry, and that entry in jaxpar.models.family.FAMILIES.

A block's auxiliary losses are a dict of scalars (empty for GPT-2 and Llama, unless the test-only
model.test_activation_l2 asks for one); `loss_weights` gives each one's coefficient in the loss.
"""

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import jax
import jax.numpy as jnp

from jaxpar.core.config import ModelConfig


class Family:
    """What the families share: their config and compute dtype, and the test-only auxiliary loss."""

    head_names: tuple[str, ...] = ()
    shape_fields: tuple[str, ...] = ()
    vmappable = True

    def __init__(self, cfg: ModelConfig):
        self.cfg, self.dtype = cfg, jnp.dtype(cfg.dtype)

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
    MODEL_TYPES, model_fields, readers, state_dict, hf_config: jaxpar.models.hf), read by the
    config.json model_types they name; `exported_as` picks the one a model of the family is
    written in."""
    model: type[Family]
    config: type[ModelConfig]
    hf_formats: tuple[ModuleType, ...]
    exported_as: Callable[[ModelConfig], ModuleType] | None  # None: no HF format yet

"""The model-family interface, and the one model class built on it.

A family is a module with a class of the methods below; the train step, the pipeline executor,
ZeRO, remat, the KV-cache sampler, the FLOP count, `--dry-run`, `jaxpar.plan` and `jaxpar.bench`
call these and nothing else, so a new family is one new module and one entry in FAMILIES.

    build(model, vocab_size, rngs)       set the family's nnx.Params on `model`; the stacked
                                         layers under `model.blocks`, each leading with 'layers'
    head_names                           the top-level params the loss needs after the last block
    embed(top, tokens, rate, key)        (batch, seq) tokens -> the float32 residual stream
    block(x, p, axes, key)               one layer on its params (the scan's body)
    logits(head, x, vocab_size)          the stream -> float32 logits over the padded vocabulary
    decode_embed(params, tokens, pos)    embed for generation at positions pos...
    decode_block(x, p, k, v, pos, attend) one layer with its KV cache (kv_heads x head_dim)
    kv_heads, head_dim                   the cache's shape
    matmul_params(vocab_size)            N in MFU's 6N
    activation_units(tp, split)          saved activations per token and layer, 2-byte units
"""

import jax
from flax import nnx

from jaxpar.core.config import FAMILIES as FAMILY_NAMES
from jaxpar.core.config import Config, ModelConfig
from jaxpar.core.sharding import param_axes
from jaxpar.models.gpt import GPT2
from jaxpar.models.layers import GATHERED, weights_for_compute
from jaxpar.models.llama import Llama

FAMILIES = {"gpt2": GPT2, "llama": Llama}
assert tuple(FAMILIES) == FAMILY_NAMES, "jaxpar.core.config.FAMILIES names the same families"


def family_of(cfg: ModelConfig):
    return FAMILIES[cfg.family](cfg)


def split_layers(params: dict, axes: dict) -> tuple[dict, dict, dict, dict]:
    """(top params, top axes, stacked layer params, per-layer axes without the 'layers' axis)."""
    top, top_axes = dict(params), dict(axes)
    layer_params, stacked_axes = top.pop("blocks"), top_axes.pop("blocks")
    layer_axes = jax.tree.map(lambda names: names[1:], stacked_axes,
                              is_leaf=lambda n: isinstance(n, tuple))
    return top, top_axes, layer_params, layer_axes


def apply_blocks(layer_params: dict, layer_axes: dict, x: jax.Array, cfg: ModelConfig,
                 layer_keys=None, regather_weights: bool = False) -> jax.Array:
    """Run x through the stacked layers in `layer_params` (all of them, or one pipeline stage's)."""
    family = family_of(cfg)

    def step(x, layer):
        p, key = layer
        return family.block(x, p, layer_axes, key), None

    # Recomputation needs a rolled scan: unrolled, XLA:CPU schedules the reruns early and keeps
    # every layer's activations all the same (the tiny model at block 128: 34 MB of temporaries
    # with remat or without; rolled, 10 MB with remat).
    unroll = cfg.unroll_layers and not regather_weights and cfg.remat == "none"
    if cfg.remat == "full":  # save each layer's input alone; the backward reruns the layer
        step = jax.checkpoint(step, prevent_cse=False)
    elif regather_weights:
        # A rolled scan gathers one layer at a time, in the forward and again in the backward.
        step = jax.checkpoint(step, policy=jax.checkpoint_policies.save_anything_except_these_names(
            GATHERED))
    x, _ = jax.lax.scan(step, x, (layer_params, layer_keys), unroll=unroll)
    return x


class Transformer(nnx.Module):
    """Embedding, the stacked blocks and the head of cfg.family."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, rngs: nnx.Rngs,
                 regather_weights: bool = False):
        self.cfg = cfg
        self.vocab_size = vocab_size
        # Recompute each layer's gathered weights in the backward pass instead of saving them.
        self.regather_weights = regather_weights
        family_of(cfg).build(self, vocab_size, rngs)

    def __call__(self, tokens: jax.Array, dropout_key=None) -> jax.Array:
        """tokens (batch, seq) int -> logits (batch, seq, padded vocab) float32."""
        family = family_of(self.cfg)
        state = nnx.state(self)
        top, top_axes, layer_params, layer_axes = split_layers(nnx.to_pure_dict(state),
                                                               param_axes(state))
        top = weights_for_compute(top, top_axes)
        keys = layer_keys = None
        if dropout_key is not None:
            keys = jax.random.split(dropout_key, self.cfg.n_layer + 1)
            layer_keys = keys[1:]
        x = family.embed(top, tokens, self.cfg.dropout, None if keys is None else keys[0])
        x = apply_blocks(layer_params, layer_axes, x, self.cfg, layer_keys, self.regather_weights)
        return family.logits(top, x, self.vocab_size)


def build_model(cfg: Config, vocab_size: int) -> Transformer:
    # ZeRO-3 gathers each layer's weights when it runs; recomputing the gather in the backward
    # pass (rather than saving the gathered weights) is what keeps them from piling up.
    return Transformer(cfg.model, vocab_size, nnx.Rngs(cfg.train.seed), regather_weights=cfg.train.zero == 3)


def abstract_model(cfg: Config, vocab_size: int):
    """(graphdef, pure dict of ShapeDtypeStructs, pure dict of logical axes), with no allocation."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(cfg, vocab_size)))
    return graphdef, nnx.to_pure_dict(state), param_axes(state)


"""The forward pass for generation, with a per-layer KV cache: any family, through the same block
that training runs (jaxpar.models.interface; the cache is its last argument).

New tokens enter at any position: k and v of earlier positions come from the cache, of shape
(layers, batch, kv_heads, block_size, head_dim): the KV heads only, under grouped-query attention.
"""

import jax
import jax.numpy as jnp

from jaxpar.core.axes import splitting
from jaxpar.models.family import Transformer, split_layers
from jaxpar.nn.layers import KVCache, weights_for_compute


def empty_cache(model: Transformer, batch: int) -> KVCache:
    cfg, family = model.cfg, model.family
    shape = (cfg.n_layer, batch, family.kv_heads, cfg.block_size, family.head_dim)
    return KVCache(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype), jnp.int32(0))


def forward(model: Transformer, params: dict, tokens, cache: KVCache, pos, doc_starts=None):
    """tokens (B, T) at positions pos..pos+T-1 -> (logits (B, T, padded vocab) f32, new cache).
    doc_starts (B, T): each token's document start (the cache's slot of the end-of-text token
    that opened it), or None without documents. Every device of the mesh's axes that split rows or
    the sequence computes every sample whole (the plan has them unsplit)."""
    plan = model.plan.unsplit(*splitting("batch", "seq"))
    model = model.on(plan)
    top, top_axes, layer_params, layer_axes = split_layers(params, model.axes())
    top = weights_for_compute(plan, top, top_axes)
    positions = pos + jnp.arange(tokens.shape[1])
    x = model.family.embed(plan, top, tokens, positions=positions if doc_starts is None else positions - doc_starts)
    x, _, cache = model.run_layers(layer_params, layer_axes, x, cache=cache._replace(pos=pos), doc_starts=doc_starts)
    return model.family.logits(plan, top, x, model.vocab_size), cache


def pick(logits, key, temperature: float, top_k: int):
    """The next token from (B, V) logits: argmax when temperature is 0, else a top-k sample."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)

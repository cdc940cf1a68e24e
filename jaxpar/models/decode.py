"""The forward pass for generation, with a per-layer KV cache: any family, through the same block
that training runs (jaxpar.models.transformer; the cache is its last argument).

New tokens enter at any position: k and v of earlier positions come from the cache, of shape
(layers, batch, kv_heads, block_size, head_dim): the KV heads only, under grouped-query attention;
a family may cache something else of the same rank (DeepSeek's latent and rotated key).
"""

import jax
import jax.numpy as jnp

from jaxpar.core.axes import splitting
from jaxpar.models.transformer import Transformer, split_layers
from jaxpar.nn.layers import KVCache, weights_for_compute


def empty_cache(model: Transformer, batch: int) -> KVCache:
    """Every layer's cache of `batch` rows of block_size tokens, empty: the family's widths
    (DeepSeek's: a latent and a rotated key per token, not each head's key and value)."""
    cfg, (heads, k_width, v_width) = model.cfg, model.family.cache_widths()
    shape = (cfg.n_layer, batch, heads, cfg.block_size)
    return KVCache(jnp.zeros((*shape, k_width), cfg.dtype), jnp.zeros((*shape, v_width), cfg.dtype), jnp.int32(0))


def cache_bytes_per_token(model: Transformer) -> int:
    """What the decoding cache holds of one token, over every layer."""
    heads, k_width, v_width = model.family.cache_widths()
    return model.cfg.n_layer * heads * (k_width + v_width) * jnp.dtype(model.cfg.dtype).itemsize


def forward(model: Transformer, params: dict, tokens, cache: KVCache, pos, doc_starts=None):
    """tokens (B, T) at positions pos..pos+T-1 -> (logits (B, T, padded vocab) f32, new cache).
    doc_starts (B, T): each token's document start (the cache's slot of the end-of-text token
    that opened it), or None without documents. Every device of the mesh's axes that split rows or
    the sequence computes every sample whole (the plan has them unsplit)."""
    plan = model.plan.unsplit(*splitting("batch", "seq"))
    model = model.on(plan)
    top, top_axes, _, _ = split_layers(params, model.axes())
    top = weights_for_compute(plan, top, top_axes)
    positions = pos + jnp.arange(tokens.shape[1])
    x = model.family.embed(plan, top, tokens, positions=positions if doc_starts is None else positions - doc_starts)
    x, _, cache = model.run_all(params, x, cache=cache._replace(pos=pos), doc_starts=doc_starts)
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

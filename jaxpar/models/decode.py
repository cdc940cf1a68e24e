"""The forward pass for generation, on the params dict, with a per-layer KV cache: any family.

It computes what jaxpar.models.family.Transformer computes (tests/test_sample.py checks the logits)
but feeds new tokens at any position: k and v of earlier positions come from the cache, of shape
(layers, batch, kv_heads, block_size, head_dim): the KV heads only, under grouped-query attention.
"""

import math

import jax
import jax.numpy as jnp

from jaxpar.core.config import ModelConfig
from jaxpar.models.family import family_of


def empty_cache(cfg: ModelConfig, batch: int) -> dict:
    family = family_of(cfg)
    shape = (cfg.n_layer, batch, family.kv_heads, cfg.block_size, family.head_dim)
    return {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype)}


def cached_attention(pos):
    """attend(q (B, H, T, D), k_cache, v_cache (B, K, T_max, D)) -> (B, T, H, D) for queries at
    positions pos..pos+T-1; query head h reads KV head h // (H / K)."""
    def attend(q, k_cache, v_cache):
        B, H, T, D = q.shape
        K, T_max = k_cache.shape[1], k_cache.shape[2]
        q = q.reshape(B, K, H // K, T, D)
        scores = jnp.einsum("bkgtd,bksd->bkgts", q, k_cache, preferred_element_type=jnp.float32)
        # A query sees the cached positions up to its own; later slots are empty or stale.
        visible = jnp.arange(T_max)[None, :] <= pos + jnp.arange(T)[:, None]
        scores = jnp.where(visible, scores / math.sqrt(D), jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1)
        y = jnp.einsum("bkgts,bksd->btkgd", probs.astype(v_cache.dtype), v_cache)
        return y.reshape(B, T, H, D)
    return attend


def forward(params: dict, tokens, cache: dict, pos, vocab_size: int, cfg: ModelConfig):
    """tokens (B, T) at positions pos..pos+T-1 -> (logits (B, T, padded vocab) f32, new cache)."""
    family = family_of(cfg)
    x = family.decode_embed(params, tokens, pos)
    attend = cached_attention(pos)

    def layer(x, xs):
        p, k_cache, v_cache = xs
        x, k_cache, v_cache = family.decode_block(x, p, k_cache, v_cache, pos, attend)
        return x, (k_cache, v_cache)

    x, (k, v) = jax.lax.scan(layer, x, (params["blocks"], cache["k"], cache["v"]))
    head = {name: params[name] for name in family.head_names}
    return family.logits(head, x, vocab_size), {"k": k, "v": v}


def pick(logits, key, temperature: float, top_k: int):
    """The next token from (B, V) logits: argmax when temperature is 0, else a top-k sample."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)

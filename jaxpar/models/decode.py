"""The GPT forward pass for generation, on the params dict, with a per-layer KV cache.

It computes what jaxpar.model.GPT computes (tests/test_sample.py checks the logits) but feeds
new tokens at any position: k and v of earlier positions come from the cache, of shape
(layers, batch, heads, block_size, head_dim).
"""

import math

import jax
import jax.numpy as jnp

from jaxpar.core.config import ModelConfig
from jaxpar.models.gpt import add_bias, gelu, layer_norm, mlp_output


def empty_cache(cfg: ModelConfig, batch: int) -> dict:
    shape = (cfg.n_layer, batch, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)
    return {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype)}


def block(x, p: dict, k_cache, v_cache, pos, dtype, gelu_kind: str):
    """One block on tokens at positions pos..pos+T-1, x (B, T, C); returns x and both caches."""
    B, T, C = x.shape
    p = jax.tree.map(lambda a: a.astype(dtype), p)
    h = layer_norm(x.reshape(B * T, C), p["ln_1"]).astype(dtype)
    qkv = add_bias(jnp.einsum("nc,cshd->nshd", h, p["qkv"]["kernel"]), p["qkv"])
    q, k, v = (qkv.reshape(B, T, *qkv.shape[1:])[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    k_cache = jax.lax.dynamic_update_slice(k_cache, k, (0, 0, pos, 0))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v, (0, 0, pos, 0))
    D, T_max = q.shape[3], k_cache.shape[2]
    scores = jnp.einsum("bhtd,bhsd->bhts", q, k_cache, preferred_element_type=jnp.float32)
    # A query sees the cached positions up to its own; later slots are empty or stale.
    visible = jnp.arange(T_max)[None, :] <= pos + jnp.arange(T)[:, None]
    scores = jnp.where(visible, scores / math.sqrt(D), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    y = jnp.einsum("bhts,bhsd->bthd", probs.astype(dtype), v_cache).reshape(B * T, *q.shape[1:2],
                                                                             D)
    x = x.reshape(B * T, C) + add_bias(jnp.einsum("nhd,hdc->nc", y, p["attn_out"]["kernel"]),
                                       p["attn_out"])
    h = layer_norm(x, p["ln_2"]).astype(dtype)
    h = gelu(add_bias(h @ p["mlp_in"]["kernel"], p["mlp_in"]), gelu_kind)
    x = x + mlp_output(h, p["mlp_out"])
    return x.reshape(B, T, C), k_cache, v_cache


def forward(params: dict, tokens, cache: dict, pos, vocab_size: int, dtype,
            gelu_kind: str = "exact"):
    """tokens (B, T) at positions pos..pos+T-1 -> (logits (B, T, padded vocab) f32, new cache).

    `gelu_kind` is the model's model.gelu."""
    dtype = jnp.dtype(dtype)
    T = tokens.shape[1]
    x = params["wte"][tokens] + jax.lax.dynamic_slice_in_dim(params["wpe"], pos, T)

    def layer(x, xs):
        p, k_cache, v_cache = xs
        x, k_cache, v_cache = block(x, p, k_cache, v_cache, pos, dtype, gelu_kind)
        return x, (k_cache, v_cache)

    x, (k, v) = jax.lax.scan(layer, x, (params["blocks"], cache["k"], cache["v"]))
    x = layer_norm(x, params["ln_f"])
    logits = jnp.einsum("btc,vc->btv", x.astype(dtype), params["wte"].astype(dtype),
                        preferred_element_type=jnp.float32)
    is_real = jnp.arange(logits.shape[-1]) < vocab_size  # padding can never be sampled
    return jnp.where(is_real, logits, -1e9), {"k": k, "v": v}


def pick(logits, key, temperature: float, top_k: int):
    """The next token from (B, V) logits: argmax when temperature is 0, else a top-k sample."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)

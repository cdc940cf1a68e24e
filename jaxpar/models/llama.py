"""The Llama family (SmolLM2, TinyLlama, Llama 3.x): RMSNorm, rotary positions, a SwiGLU MLP and
grouped-query attention, no biases, the lm_head tied to the embedding or not. One model family
behind jaxpar.models.family's interface, laid out so Hugging Face's LlamaForCausalLM maps onto it
with transposes alone (jaxpar.interop.hf_llama).

The code names logical axes only: the KV heads have their own, 'kv_heads', split over 'tensor' as
the query heads are. `kernel`s, `wte` and `lm_head` get weight decay; `scale`s do not.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.core.config import ModelConfig
from jaxpar.core.sharding import constrain
from jaxpar.models import rope
from jaxpar.models.layers import (
    STREAM,
    StackedDense,
    attend,
    dropout,
    gather_stream,
    head_logits,
    normal_param,
    padded_vocab,
    sequence_positions,
    to_stream,
    weights_for_compute,
)
from jaxpar.models.matmul import project


class RMSNorm(nnx.Module):
    def __init__(self, shape: tuple, axes: tuple):
        self.scale = nnx.Param(jnp.ones(shape, jnp.float32), axes=axes)


class Blocks(nnx.Module):
    """All n_layer pre-RMSNorm blocks; every weight leads with the 'layers' axis. q and the fused
    k, v are separate kernels, so that their heads split over 'tensor' each in its own group."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        L, C, H, K, F = cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.mlp_width
        D = C // H
        std, resid_std = 0.02, 0.02 / math.sqrt(2 * L)  # GPT-2's scaled residual projections
        self.attn_norm = RMSNorm((L, C), ("layers", "embed"))
        self.q = StackedDense(rngs, std, (L, C, H, D), ("layers", "embed", "heads", "head_dim"), 2, False)
        self.kv = StackedDense(rngs, std, (L, C, 2, K, D), ("layers", "embed", "qkv", "kv_heads", "head_dim"),
                               3, False)
        self.attn_out = StackedDense(rngs, resid_std, (L, H, D, C), ("layers", "heads", "head_dim", "embed"),
                                     1, False)
        self.mlp_norm = RMSNorm((L, C), ("layers", "embed"))
        self.gate_up = StackedDense(rngs, std, (L, C, 2, F), ("layers", "embed", "gate_up", "mlp"), 2, False)
        # Stored (layers, embed, mlp), out first, as HF's down_proj is (and GPT-2's mlp_out here).
        self.mlp_out = StackedDense(rngs, resid_std, (L, F, C), ("layers", "mlp", "embed"), 1, False,
                                    out_first=True)


def rms_norm(x: jax.Array, p: dict, eps: float) -> jax.Array:
    """HF's LlamaRMSNorm: normalised in float32, cast back to the input's dtype, then scaled."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + eps)
    return p["scale"] * normed.astype(x.dtype)


def swiglu(gate_up: jax.Array, dtype) -> jax.Array:
    """silu(gate) * up of the fused (tokens, 2, mlp) projection."""
    gate, up = (part[:, 0] for part in jnp.split(gate_up.astype(dtype), 2, axis=1))
    return jax.nn.silu(gate) * up


def heads_first(a: jax.Array, B: int, T: int, axes: tuple) -> jax.Array:
    """(batch*seq, heads, head_dim) -> (batch, heads, seq, head_dim), pinned to `axes`."""
    return constrain(a.reshape(B, T, *a.shape[1:]).transpose(0, 2, 1, 3), axes)


def block(x: jax.Array, p: dict, axes: dict, cfg: ModelConfig, dtype, key) -> jax.Array:
    """One block on one layer's params: the stream float32, (batch, seq, embed) in the STREAM
    layout; matmuls in dtype on the gathered (batch*seq, features) activations."""
    B, T, C = x.shape
    keys = jax.random.split(key, 3) if key is not None else (None,) * 3
    p = jax.tree.map(lambda a: a.astype(dtype), weights_for_compute(p, axes))

    def matmul_input(x, norm):  # an all-gather of the sequence under sequence parallelism
        return gather_stream(rms_norm(x, norm, cfg.norm_eps).astype(dtype))

    h = matmul_input(x, p["attn_norm"])
    q = project("nc,chd->nhd", h, p["q"]["kernel"], dtype).astype(dtype)
    kv = project("nc,cskd->nskd", h, p["kv"]["kernel"], dtype).astype(dtype)
    positions = sequence_positions(T)  # a token's true position, in a context ring's layout too
    cos, sin = rope.angles(cfg, q.shape[-1], jnp.arange(T) if positions is None else positions)
    q = rope.apply(heads_first(q, B, T, ("batch", "heads", "seq", "head_dim")), cos, sin)
    k, v = (heads_first(part[:, 0], B, T, ("batch", "kv_heads", "seq", "head_dim")) for part in jnp.split(kv, 2, 1))
    y = attend(q, rope.apply(k, cos, sin), v, cfg.dropout, keys[0]).reshape(B * T, *q.shape[1:2], -1)
    y = project("nhd,hdc->nc", constrain(y, ("tokens", "heads", "head_dim")), p["attn_out"]["kernel"], dtype)
    x = x + dropout(to_stream(y, (B, T, C)), cfg.dropout, keys[1])
    h = project("nc,czf->nzf", matmul_input(x, p["mlp_norm"]), p["gate_up"]["kernel"], dtype)
    h = constrain(swiglu(h, dtype), ("tokens", "mlp"))
    y = project("nf,cf->nc", h, p["mlp_out"]["kernel"], dtype)
    return constrain(x + dropout(to_stream(y, (B, T, C)), cfg.dropout, keys[2]), STREAM)


def decode_block(x, p: dict, k_cache, v_cache, pos, cfg: ModelConfig, dtype, attend):
    """One block on tokens at positions pos..pos+T-1, x (B, T, C), with the layer's cache of the
    KV heads (already rotated); `attend(q, k_cache, v_cache)` is the cached attention."""
    B, T, C = x.shape
    p = jax.tree.map(lambda a: a.astype(dtype), p)
    h = rms_norm(x.reshape(B * T, C), p["attn_norm"], cfg.norm_eps).astype(dtype)
    q = jnp.einsum("nc,chd->nhd", h, p["q"]["kernel"], preferred_element_type=jnp.float32).astype(dtype)
    kv = jnp.einsum("nc,cskd->nskd", h, p["kv"]["kernel"], preferred_element_type=jnp.float32).astype(dtype)
    cos, sin = rope.angles(cfg, q.shape[-1], pos + jnp.arange(T))
    q = rope.apply(q.reshape(B, T, *q.shape[1:]).transpose(0, 2, 1, 3), cos, sin)
    k, v = (kv.reshape(B, T, *kv.shape[1:])[:, :, i].transpose(0, 2, 1, 3) for i in range(2))
    k_cache = jax.lax.dynamic_update_slice(k_cache, rope.apply(k, cos, sin), (0, 0, pos, 0))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v, (0, 0, pos, 0))
    y = attend(q, k_cache, v_cache).reshape(B * T, *q.shape[1:2], q.shape[3])
    x = x.reshape(B * T, C) + jnp.einsum("nhd,hdc->nc", y, p["attn_out"]["kernel"], preferred_element_type=jnp.float32)
    h = rms_norm(x, p["mlp_norm"], cfg.norm_eps).astype(dtype)
    h = swiglu(jnp.einsum("nc,czf->nzf", h, p["gate_up"]["kernel"], preferred_element_type=jnp.float32), dtype)
    x = x + jnp.einsum("nf,cf->nc", h, p["mlp_out"]["kernel"], preferred_element_type=jnp.float32)
    return x.reshape(B, T, C), k_cache, v_cache


class Llama:
    """The Llama family: jaxpar.models.family.Family for model.family = "llama"."""

    def __init__(self, cfg: ModelConfig):
        self.cfg, self.dtype = cfg, jnp.dtype(cfg.dtype)
        self.kv_heads, self.head_dim = cfg.kv_heads, cfg.n_embd // cfg.n_head
        self.lm_head = "wte" if cfg.tie_embeddings else "lm_head"
        self.head_names = (self.lm_head, "norm")

    def build(self, model: nnx.Module, vocab_size: int, rngs: nnx.Rngs) -> None:
        cfg, rows = self.cfg, padded_vocab(vocab_size)
        model.wte = normal_param(rngs, 0.02, (rows, cfg.n_embd), ("vocab", "embed"))
        model.blocks = Blocks(cfg, rngs)
        model.norm = RMSNorm((cfg.n_embd,), ("embed",))
        if not cfg.tie_embeddings:
            model.lm_head = normal_param(rngs, 0.02, (rows, cfg.n_embd), ("vocab", "embed"))

    def embed(self, top: dict, tokens: jax.Array, rate: float, key) -> jax.Array:
        return dropout(constrain(top["wte"][tokens], STREAM), rate, key)

    def block(self, x: jax.Array, p: dict, axes: dict, key) -> jax.Array:
        return block(x, p, axes, self.cfg, self.dtype, key)

    def logits(self, head: dict, x: jax.Array, vocab_size: int) -> jax.Array:
        normed = rms_norm(x, head["norm"], self.cfg.norm_eps)
        return head_logits(normed, head[self.lm_head], vocab_size, self.dtype)

    def decode_embed(self, params: dict, tokens, pos) -> jax.Array:
        return params["wte"][tokens]

    def decode_block(self, x, p: dict, k_cache, v_cache, pos, attend):
        return decode_block(x, p, k_cache, v_cache, pos, self.cfg, self.dtype, attend)

    def matmul_params(self, vocab_size: int) -> int:
        """N in 6N: q, k and v (GQA's smaller K/V), attention out, SwiGLU's three matmuls, lm_head."""
        C, H, K, D, F = self.cfg.n_embd, self.cfg.n_head, self.kv_heads, self.head_dim, self.cfg.mlp_width
        return self.cfg.n_layer * (2 * C * H * D + 2 * C * K * D + 3 * C * F) + vocab_size * C

    def activation_units(self, tp: int, split: int) -> float:
        """Saved activations of a layer per token, in 2-byte units, counted as Korthikanti et al.
        (2022) count GPT's: the norms' and matmuls' inputs (8h, split by sequence parallelism);
        q, k, v before and after RoPE and the attention output (6h + 6 kv); SwiGLU's gate, up, silu
        and product (8f); softmax's output (2as) and, with dropout, its mask and output (3as)."""
        m = self.cfg
        h, kv, f, a, s = m.n_embd, self.kv_heads * self.head_dim, m.mlp_width, m.n_head, m.block_size
        return 8 * h / split + (6 * h + 6 * kv + 8 * f + a * s * (2 + 3 * (m.dropout > 0))) / tp

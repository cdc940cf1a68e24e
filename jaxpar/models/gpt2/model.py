"""GPT-2 as in nanoGPT: learned positions, pre-LayerNorm blocks with biases, a GELU MLP, and the
lm_head tied to the token embedding. One model family behind jaxpar.models.family.

The code names logical axes only ('vocab', 'embed', 'heads', ...); jaxpar.core.sharding maps them to
the mesh. Each parameter's role (jaxpar.nn.params) is declared with it.
"""

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.core import remat
from jaxpar.core.config import ModelConfig
from jaxpar.core.platform import GPUS
from jaxpar.models.family import Family
from jaxpar.nn import recipes
from jaxpar.nn.layers import (
    STREAM,
    attention,
    dropout,
    gather_stream,
    head_logits,
    padded_vocab,
    recomputed,
    sequence_positions,
    to_stream,
    weights_for_compute,
)
from jaxpar.nn.params import EMBEDDING, Param, dense, norm

LN_EPS = 1e-5


def declare_blocks(cfg: ModelConfig) -> dict:
    """All n_layer pre-LayerNorm transformer blocks; every weight leads with the 'layers' axis."""
    L, C, H = cfg.n_layer, cfg.n_embd, cfg.n_head
    D, F = C // H, cfg.mlp_width
    std, resid_std = 0.02, 0.02 / math.sqrt(2 * L)  # GPT-2's scaled residual projections
    b = cfg.bias
    return {
        "ln_1": norm((L, C), ("layers", "embed"), b),
        "qkv": dense(std, (L, C, 3, H, D), ("layers", "embed", "qkv", "heads", "head_dim"), 3, b),
        "attn_out": dense(resid_std, (L, H, D, C), ("layers", "heads", "head_dim", "embed"), 1, b),
        "ln_2": norm((L, C), ("layers", "embed"), b),
        "mlp_in": dense(std, (L, C, F), ("layers", "embed", "mlp"), 1, b),
        # Stored (layers, embed, mlp): its weight gradient dy^T·h then has the wide 'mlp' axis
        # last, which XLA:CPU computes about 1.4x faster than h^T·dy (the whole step: about 4%).
        "mlp_out": dense(resid_std, (L, F, C), ("layers", "mlp", "embed"), 1, b, transposed=True),
    }


def layer_norm(x: jax.Array, p: dict) -> jax.Array:
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return add_bias((x - mean) * jax.lax.rsqrt(var + LN_EPS) * p["scale"], p)


def add_bias(y: jax.Array, p: dict) -> jax.Array:
    """y + p['bias'], for layers built with bias=True (nanoGPT's `bias` flag)."""
    return y + p["bias"] if "bias" in p else y


def gelu(x: jax.Array, kind: str = "exact") -> jax.Array:
    """GELU of model.gelu's `kind`: "exact" (erf) as nanoGPT's nn.GELU(), where erf compiles to
    faster CPU code than erfc; "tanh", GPT-2's own approximation (Hugging Face's gelu_new)."""
    if kind == "tanh":
        return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1.0 + jax.lax.erf(x * (1.0 / math.sqrt(2.0))))


def exact_qkv_bias(bias: jax.Array) -> jax.Array:
    """The q/k/v bias, with the key bias given its exact gradient: zero.

    A key bias adds q.b_k to every score of a query's row, which softmax ignores. Autodiff returns
    rounding noise instead of 0, and Adam would scale that noise into lr-sized updates that differ
    from one mesh layout to another. The forward pass is unchanged.
    """
    is_key = (jnp.arange(3) == 1)[:, None, None]
    return jnp.where(is_key, jax.lax.stop_gradient(bias), bias)


def block(plan, x: jax.Array, p: dict, axes: dict, cfg: ModelConfig, dtype, key, cache=None, doc_starts=None):
    """One block on one layer's params, laid out and computed as the execution plan says -> (x,
    cache). The residual stream stays float32; matmuls run in dtype. With a KV cache (decoding),
    attention reads and extends it; with doc_starts, it stays within each document.

    The stream, with LayerNorm, dropout and the residual adds, is (batch, seq, embed) in the
    STREAM layout (split along the sequence under sequence parallelism). Matmuls see the
    activations whole, as (batch*seq, features): plain 2-D dots are the fastest on CPU.
    """
    B, T, C = x.shape
    rate = cfg.dropout
    keys = jax.random.split(key, 3) if key is not None else (None,) * 3
    p = jax.tree.map(lambda a: a.astype(dtype), weights_for_compute(plan, p, axes))

    def matmul_input(x, ln):  # an all-gather of the sequence under sequence parallelism
        return gather_stream(plan, layer_norm(x, ln).astype(dtype))

    def branch(y, p_out, key, name):  # a row-parallel output, summed into the stream's layout
        return dropout(checkpoint_name(add_bias(to_stream(plan, y, (B, T, C)), p_out), name), rate, key)

    def dot(spec, a, w):
        return recipes.of(plan, dtype).project(spec, a, w)

    qkv = dot("nc,cshd->nshd", matmul_input(x, p["ln_1"]), p["qkv"]["kernel"])
    if "bias" in p["qkv"]:
        qkv = qkv + exact_qkv_bias(p["qkv"]["bias"])
    qkv = plan.constrain(qkv.astype(dtype).reshape(B, T, *qkv.shape[1:]), ("batch", "seq", "qkv", "heads", "head_dim"))
    qkv = checkpoint_name(qkv, remat.QKV)  # the names a recompute policy may keep: jaxpar.core.remat
    # Split, not indexed: the backward joins the three gradients (a concatenate) instead of adding
    # three zero-padded copies of the whole qkv.
    q, k, v = (plan.constrain(part[:, :, 0].transpose(0, 2, 1, 3), ("batch", "heads", "seq", "head_dim"))
               for part in jnp.split(qkv, 3, axis=2))
    y, cache = attention(plan, q, k, v, rate, keys[0], cache, doc_starts)
    y = plan.constrain(y.reshape(B * T, *q.shape[1:2], q.shape[3]), ("tokens", "heads", "head_dim"))
    y = checkpoint_name(y, remat.CONTEXT)
    y = branch(dot("nhd,hdc->nc", y, p["attn_out"]["kernel"]), p["attn_out"], keys[1], remat.ATTENTION_OUT)
    if cfg.norm_kernel == "pallas":
        x, normed = add_norm(plan, x, y, p["ln_2"], dtype)
        h = gather_stream(plan, normed)
    else:
        x = x + y
        h = matmul_input(x, p["ln_2"])
    h = dot("nc,cf->nf", checkpoint_name(h, remat.MLP_INPUT), p["mlp_in"]["kernel"])
    h = checkpoint_name(add_bias(h, p["mlp_in"]).astype(dtype), remat.HIDDEN)
    h = plan.constrain(recomputed(plan, gelu, cfg.gelu)(h), ("tokens", "mlp"))
    x = x + branch(dot("nf,cf->nc", h, p["mlp_out"]["kernel"]), p["mlp_out"], keys[2], remat.MLP_OUT)
    return plan.constrain(x, STREAM), cache


def add_norm(plan, x: jax.Array, y: jax.Array, ln: dict, dtype) -> tuple[jax.Array, jax.Array]:
    """(x + y, layer_norm(x + y) in dtype) by jaxpar.nn.fused_norm's kernel (model.norm_kernel =
    "pallas"), each device on its own rows of the stream: a row's LayerNorm needs no other's."""
    # Imported here: `python -m jaxpar.nn.fused_norm` (its benchmark) runs after jaxpar imports GPT-2.
    from jaxpar.nn.fused_norm import add_layer_norm

    def fused(x, y, scale, bias):
        return add_layer_norm(x, y, scale, bias, out_dtype=dtype, interpret=plan.platform not in GPUS)
    args = (x, y, ln["scale"], ln["bias"] if "bias" in ln else jnp.zeros_like(ln["scale"]))
    if plan.mesh is None:
        return fused(*args)
    return plan.per_device(fused, (STREAM, STREAM, ("embed",), ("embed",)), (STREAM, STREAM))(*args)


class GPT2(Family):
    """The GPT-2 family (model.family = "gpt2")."""

    head_names = ("wte", "ln_f")  # the tied lm_head and the final LayerNorm
    shape_fields = ("n_layer", "n_head", "n_embd", "block_size", "bias")  # what `declare` reads

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.kv_heads, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head

    def declare(self, vocab_size: int) -> dict:
        cfg = self.cfg
        return {"wte": Param((padded_vocab(vocab_size), cfg.n_embd), ("vocab", "embed"), EMBEDDING, 0.02),
                "wpe": Param((cfg.block_size, cfg.n_embd), ("pos", "embed"), EMBEDDING, 0.02),
                "blocks": declare_blocks(cfg),
                "ln_f": norm((cfg.n_embd,), ("embed",), cfg.bias)}

    def embed(self, plan, top: dict, tokens: jax.Array, key=None, positions=None) -> jax.Array:
        """Token + position embeddings of (batch, seq) tokens, with dropout; `positions`: each
        token's, (seq,) or (batch, seq), when not the sequence's own (decoding, documents)."""
        if positions is None:
            positions = sequence_positions(plan, tokens.shape[1])  # None: in order
        x = top["wte"][tokens] + (top["wpe"][: tokens.shape[1]] if positions is None else top["wpe"][positions])
        return dropout(plan.constrain(x, STREAM), self.cfg.dropout, key)

    def block(self, plan, x: jax.Array, p: dict, axes: dict, key=None, cache=None, doc_starts=None):
        x, cache = block(plan, x, p, axes, self.cfg, self.dtype, key, cache, doc_starts)
        return x, self.block_losses(x), cache

    def logits(self, plan, head: dict, x: jax.Array, vocab_size: int) -> jax.Array:
        """Final LayerNorm and the tied lm_head: logits (model.logits_dtype) over the padded vocab."""
        return head_logits(plan, layer_norm(x, head["ln_f"]), head["wte"], vocab_size, self.dtype,
                           self.cfg.logits_dtype)

    def matmul_params(self, vocab_size: int) -> int:
        """N in 6N: qkv, attention out, MLP in and out per layer, and the lm_head over the real vocab."""
        C = self.cfg.n_embd
        return self.cfg.n_layer * (3 * C * C + C * C + 2 * 4 * C * C) + vocab_size * C

    def activation_units(self, tp: int, split: int) -> float:
        """Saved activations of a layer per token, in 2-byte units: Korthikanti et al. (2022), eq. 2
        (eq. 4 with sequence parallelism): h*(10/split + 24/tp + 5*a*s/(h*tp))."""
        s, h, a = self.cfg.block_size, self.cfg.n_embd, self.cfg.n_head
        return h * (10 / split + 24 / tp + 5 * a * s / (h * tp))

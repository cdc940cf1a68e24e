"""The Llama family (SmolLM2, TinyLlama, Llama 3.x): RMSNorm, rotary positions, a SwiGLU MLP and
grouped-query attention, no biases, the lm_head tied to the embedding or not. One model family
behind jaxpar.models.family, laid out so Hugging Face's LlamaForCausalLM maps onto it with
transposes alone (jaxpar.models.llama.hf).

The code names logical axes only: the KV heads have their own, 'kv_heads', split over 'tensor' as
the query heads are. Each parameter's role (jaxpar.nn.params) is declared with it.
"""

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.core import remat
from jaxpar.core.config import ModelConfig
from jaxpar.models.family import Family
from jaxpar.models.llama import rope
from jaxpar.nn import moe, recipes
from jaxpar.nn.layers import (
    STREAM,
    attention,
    dropout,
    gather_stream,
    head_logits,
    padded_vocab,
    recomputed,
    to_stream,
    token_positions,
    weights_for_compute,
)
from jaxpar.nn.params import EMBEDDING, MATRIX, Param, dense, norm


def declare_blocks(cfg: ModelConfig) -> dict:
    """All n_layer pre-RMSNorm blocks; every weight leads with the 'layers' axis. q and the fused
    k, v are separate kernels, so that their heads split over 'tensor' each in its own group."""
    L, C, H, K, D = cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_size
    std, resid_std = 0.02, 0.02 / math.sqrt(2 * L)  # GPT-2's scaled residual projections
    return {
        "attn_norm": norm((L, C), ("layers", "embed")),
        "q": dense(std, (L, C, H, D), ("layers", "embed", "heads", "head_dim"), 2, False),
        "kv": dense(std, (L, C, 2, K, D), ("layers", "embed", "qkv", "kv_heads", "head_dim"), 3, False),
        "attn_out": dense(resid_std, (L, H, D, C), ("layers", "heads", "head_dim", "embed"), 1, False),
        **declare_qk_norm(cfg),
        "mlp_norm": norm((L, C), ("layers", "embed")),
        **declare_mlps(cfg, std, resid_std),
    }


def declare_mlps(cfg: ModelConfig, std: float, resid_std: float) -> dict:
    """Every layer's experts or every layer's dense MLP, stacked on 'layers'; where the kinds mix,
    the experts of the sparse layers on 'sparse_layers' and the dense MLPs on 'dense_layers'."""
    if not cfg.mixed_layers:
        return declare_experts(cfg, std, resid_std) if cfg.n_experts else declare_mlp(cfg, std, resid_std)
    return (declare_experts(cfg, std, resid_std, "sparse_layers")
            | declare_mlp(cfg, std, resid_std, "dense_layers"))


def declare_mlp(cfg: ModelConfig, std: float, resid_std: float, stack: str = "layers") -> dict:
    """The SwiGLU MLP: the fused gate and up projection, and the down projection."""
    L, C, F = len(cfg.layers_in(stack)), cfg.n_embd, cfg.mlp_width
    return {
        "gate_up": dense(std, (L, C, 2, F), (stack, "embed", "gate_up", "mlp"), 2, False),
        # Stored (layers, embed, mlp), out first, as HF's down_proj is (and GPT-2's mlp_out here).
        "mlp_out": dense(resid_std, (L, F, C), (stack, "mlp", "embed"), 1, False, transposed=True),
    }


def declare_qk_norm(cfg: ModelConfig) -> dict:
    """The queries' and keys' RMSNorm scales: one per head dim ("head"), or per head and dim ("full")."""
    L, D = cfg.n_layer, cfg.head_size
    if cfg.qk_norm == "none":
        return {}
    if cfg.qk_norm == "head":
        return {"q_norm": norm((L, D), ("layers", "head_dim")), "k_norm": norm((L, D), ("layers", "head_dim"))}
    return {"q_norm": norm((L, cfg.n_head, D), ("layers", "heads", "head_dim")),
            "k_norm": norm((L, cfg.kv_heads, D), ("layers", "kv_heads", "head_dim"))}


def declare_experts(cfg: ModelConfig, std: float, resid_std: float, stack: str = "layers") -> dict:
    """A mixture of experts in place of the MLP (jaxpar.nn.moe): the float32 router, and each
    expert's fused gate and up projection and its down projection, split over 'expert'."""
    L, C, E, F = len(cfg.layers_in(stack)), cfg.n_embd, cfg.n_experts, cfg.expert_width
    return {
        "router": dense(std, (L, C, E), (stack, "embed", "routes"), 1, False),
        "experts_gate_up": {"kernel": Param((L, E, C, 2, F), (stack, "experts", "embed", "gate_up", "mlp"),
                                            MATRIX, std, matrix=((2,), (4,)))},
        "experts_out": {"kernel": Param((L, E, F, C), (stack, "experts", "mlp", "embed"), MATRIX, resid_std,
                                        matrix=((2,), (3,)))},
    }


def rms_norm(x: jax.Array, p: dict, eps: float, axes: tuple = (-1,)) -> jax.Array:
    """HF's LlamaRMSNorm over `axes`: normalised in float32, cast back to the input's dtype, then scaled."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axes, keepdims=True) + eps)
    return p["scale"] * normed.astype(x.dtype)


def swiglu(gate_up: jax.Array, dtype) -> jax.Array:
    """silu(gate) * up of the fused (tokens, 2, mlp) projection."""
    gate, up = (part[:, 0] for part in jnp.split(gate_up.astype(dtype), 2, axis=1))
    return jax.nn.silu(gate) * up


def heads_first(plan, a: jax.Array, B: int, T: int, axes: tuple) -> jax.Array:
    """(batch*seq, heads, head_dim) -> (batch, heads, seq, head_dim), pinned to `axes`."""
    return plan.constrain(a.reshape(B, T, *a.shape[1:]).transpose(0, 2, 1, 3), axes)


class Layer:
    """One layer's work on its params: the matmuls in dtype on gathered (batch*seq, features)
    activations; the stream float32, (batch, seq, embed) in the STREAM layout."""

    def __init__(self, plan, p: dict, axes: dict, cfg: ModelConfig, dtype):
        self.plan, self.cfg, self.dtype = plan, cfg, dtype
        self.p = {name: w if name == "router" else jax.tree.map(lambda a: a.astype(dtype), w)  # the router: float32
                  for name, w in weights_for_compute(plan, p, axes).items()}

    def normed(self, x: jax.Array, norm: dict) -> jax.Array:
        """A matmul's input: normed, in dtype, the sequence all-gathered under sequence parallelism."""
        return gather_stream(self.plan, rms_norm(x, norm, self.cfg.norm_eps).astype(self.dtype))

    def dot(self, spec: str, a: jax.Array, w: jax.Array) -> jax.Array:
        return recipes.of(self.plan, self.dtype).project(spec, a, w)

    def residual(self, x: jax.Array, y: jax.Array, key, name: str) -> jax.Array:
        """x + y, y summed into the stream's layout and named for the recompute policies."""
        B, T, C = x.shape
        return x + dropout(checkpoint_name(to_stream(self.plan, y, (B, T, C)), name), self.cfg.dropout, key)

    def swiglu_mlp(self, h: jax.Array, gate_up: dict, out: dict) -> jax.Array:
        h = checkpoint_name(self.dot("nc,czf->nzf", h, gate_up["kernel"]), remat.HIDDEN)
        h = self.plan.constrain(recomputed(self.plan, swiglu, self.dtype)(h), ("tokens", "mlp"))
        return self.dot("nf,cf->nc", h, out["kernel"])

    def mlp(self, x: jax.Array, key, decoding: bool) -> tuple[jax.Array, dict]:
        """The dense SwiGLU MLP, or the mixture of experts (with shared experts beside it where
        declared) -> (x after the residual, the router's losses)."""
        B, T, C = x.shape
        p, cfg, h = self.p, self.cfg, checkpoint_name(self.normed(x, self.p["mlp_norm"]), remat.MLP_INPUT)
        if "router" not in p:
            return self.residual(x, self.swiglu_mlp(h, p["gate_up"], p["mlp_out"]), key, remat.MLP_OUT), {}
        y, losses = moe.moe_mlp(self.plan, h.reshape(B, T, C), p, cfg, self.dtype, not decoding)
        for logged in ("moe_load", "moe_dropped", "moe_bias"):  # summed over the routed layers: their mean
            if logged in losses:
                losses[logged] = losses[logged] / cfg.routed_layers
        if "shared_gate_up" in p:  # experts every token passes through
            y = y + self.swiglu_mlp(h, p["shared_gate_up"], p["shared_out"]).reshape(B, T, C)
        return self.residual(x, y, key, remat.MLP_OUT), losses


def attention_part(layer: Layer, x: jax.Array, keys: tuple, cache=None, doc_starts=None):
    """Grouped-query attention with RoPE (and QK-norm) -> (x after the residual, cache); `keys`:
    dropout's, of the probabilities and of the output. With a KV cache (decoding), the rotated
    keys and the values go into it and attention reads it. With doc_starts, positions count from
    each document's start and attention stays within it."""
    plan, cfg, p, dtype = layer.plan, layer.cfg, layer.p, layer.dtype
    B, T, _ = x.shape
    h = layer.normed(x, p["attn_norm"])
    q = checkpoint_name(layer.dot("nc,chd->nhd", h, p["q"]["kernel"]).astype(dtype), remat.QKV)
    kv = checkpoint_name(layer.dot("nc,cskd->nskd", h, p["kv"]["kernel"]).astype(dtype), remat.QKV)
    # A token's true position: in a context ring's layout too, and after the cache's.
    k, v = (part[:, 0] for part in jnp.split(kv, 2, 1))
    if cfg.qk_norm != "none":  # over (head_dim,) or (heads, head_dim) of the (tokens, heads, head_dim)
        axes_normed = (-1,) if cfg.qk_norm == "head" else (-2, -1)
        q, k = (rms_norm(a, p[name], cfg.norm_eps, axes_normed) for a, name in ((q, "q_norm"), (k, "k_norm")))
    cos, sin = rope.angles(cfg, q.shape[-1], token_positions(plan, T, cache, doc_starts))
    q = rope.apply(heads_first(plan, q, B, T, ("batch", "heads", "seq", "head_dim")), cos, sin)
    k, v = (heads_first(plan, a, B, T, ("batch", "kv_heads", "seq", "head_dim")) for a in (k, v))
    y, cache = attention(plan, q, rope.apply(k, cos, sin), v, cfg.dropout, keys[0], cache, doc_starts)
    y = checkpoint_name(plan.constrain(y.reshape(B * T, *q.shape[1:2], -1), ("tokens", "heads", "head_dim")),
                        remat.CONTEXT)
    return layer.residual(x, layer.dot("nhd,hdc->nc", y, p["attn_out"]["kernel"]), keys[1], remat.ATTENTION_OUT), cache


def block(plan, x: jax.Array, p: dict, axes: dict, cfg: ModelConfig, dtype, key, cache=None, doc_starts=None,
          attend=attention_part):
    """One block on one layer's params -> (x, the router's losses, cache): `attend` (the family's
    attention), then the MLP or the experts."""
    layer = Layer(plan, p, axes, cfg, dtype)
    keys = jax.random.split(key, 3) if key is not None else (None,) * 3
    x, cache = attend(layer, x, keys[:2], cache, doc_starts)
    x, losses = layer.mlp(x, keys[2], cache is not None)
    return plan.constrain(x, STREAM), losses, cache


class Llama(Family):
    """The Llama family (model.family = "llama")."""

    shape_fields = ("n_layer", "n_head", "n_embd", "n_kv_head", "mlp_dim", "tie_embeddings",  # what `declare` reads
                    "n_experts", "moe_mlp_dim", "head_dim", "qk_norm", "moe_every", "dense_layers")

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.kv_heads, self.head_dim = cfg.kv_heads, cfg.head_size
        self.lm_head = "wte" if cfg.tie_embeddings else "lm_head"
        self.head_names = (self.lm_head, "norm")
        # jax.lax.ragged_dot, the experts' grouped GEMM, has no vmap rule in jax 0.10 ("NYI").
        self.vmappable = not cfg.n_experts

    def declare(self, vocab_size: int) -> dict:
        cfg, rows = self.cfg, padded_vocab(vocab_size)
        declared = {"wte": Param((rows, cfg.n_embd), ("vocab", "embed"), EMBEDDING, 0.02),
                    "blocks": self.declare_blocks(),
                    "norm": norm((cfg.n_embd,), ("embed",))}
        if not cfg.tie_embeddings:
            declared["lm_head"] = Param((rows, cfg.n_embd), ("vocab", "embed"), EMBEDDING, 0.02)
        return declared

    def declare_blocks(self) -> dict:
        """The n_layer blocks' params (a family built on Llama's block declares its own)."""
        return declare_blocks(self.cfg)

    def embed(self, plan, top: dict, tokens: jax.Array, key=None, positions=None) -> jax.Array:
        """The token embedding (positions enter as RoPE, in the blocks), with dropout."""
        return dropout(plan.constrain(top["wte"][tokens], STREAM), self.cfg.dropout, key)

    def block(self, plan, x: jax.Array, p: dict, axes: dict, key=None, cache=None, doc_starts=None):
        x, losses, cache = block(plan, x, p, axes, self.cfg, self.dtype, key, cache, doc_starts)
        return x, self.block_losses(x) | losses, cache

    def loss_weights(self) -> dict[str, float]:
        """The test-only loss's, and a mixture of experts' router losses (the load: logged only)."""
        m = self.cfg
        router = {"moe_balance": m.router_aux_coef, "moe_z": m.router_z_coef, "moe_load": 0.0, "moe_dropped": 0.0}
        return super().loss_weights() | (router if m.n_experts else {})

    def logits(self, plan, head: dict, x: jax.Array, vocab_size: int) -> jax.Array:
        normed = rms_norm(x, head["norm"], self.cfg.norm_eps)
        return head_logits(plan, normed, head[self.lm_head], vocab_size, self.dtype, self.cfg.logits_dtype)

    def matmul_params(self, vocab_size: int) -> int:
        """N in 6N: q, k and v (GQA's smaller K/V), attention out, SwiGLU's three matmuls (with
        experts: the router's, and the k chosen experts' alone), lm_head."""
        m = self.cfg
        C, H, K, D = m.n_embd, m.n_head, self.kv_heads, self.head_dim
        sparse = sum(m.sparse_layers)
        mlp = sparse * (m.n_experts * C + m.experts_per_token * 3 * C * m.expert_width)
        mlp += (m.n_layer - sparse) * 3 * C * m.mlp_width
        return m.n_layer * (2 * C * H * D + 2 * C * K * D) + mlp + vocab_size * C

    def activation_units(self, tp: int, split: int) -> float:
        """Saved activations of a layer per token, in 2-byte units, counted as Korthikanti et al.
        (2022) count GPT's: the norms' and matmuls' inputs (8h, split by sequence parallelism);
        q, k, v before and after RoPE and the attention output (6h + 6 kv); SwiGLU's gate, up, silu
        and product (8f); softmax's output (2as) and, with dropout, its mask and output (3as)."""
        m = self.cfg
        h, kv, a, s = m.n_embd, self.kv_heads * self.head_dim, m.n_head, m.block_size
        sparse = sum(m.sparse_layers)  # the layers' mean, where experts and dense MLPs mix
        f = (sparse * m.experts_per_token * m.expert_width + (m.n_layer - sparse) * m.mlp_width) / m.n_layer
        return 8 * h / split + (6 * h + 6 * kv + 8 * f + a * s * (2 + 3 * (m.dropout > 0))) / tp

"""The DeepSeek-V3 family: Llama's block (jaxpar.models.llama.model) with multi-head latent
attention (MLA) and a mixture of experts routed in groups, with shared experts beside the routed ones,
balanced by a per-expert selection bias that the step moves (jaxpar.nn.routing), not by a loss alone.

MLA: each token's keys and values come from one kv_lora_rank latent (after its RMSNorm), each
head's key qk_nope_head_dim wide from it, plus one qk_rope_head_dim key rotated by position and
shared by every head; the query likewise in two parts, through a q_lora_rank bottleneck where
one is set. The values are v_head_dim wide; narrower than the query-key heads, they go through
the attention kernel zero-padded to that width, and the padding is dropped after. The weights are
laid out as Hugging Face's are (hf.py): the latent and the rotated key from one projection
(`kv_a`), each head's key and value from another (`kv_b`); with model.rope_interleave the rotated
dims are pairs (x0, x1), (x2, x3), ... as DeepSeek's checkpoints lay them out.

The code names logical axes only: the latents' 'latent' axis is replicated; heads split over
'tensor' as Llama's do.
"""

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.core import remat
from jaxpar.core.config import ModelConfig
from jaxpar.models.deepseek.mtp import declare_mtp, mtp_losses
from jaxpar.models.llama import rope
from jaxpar.models.llama.model import Layer, Llama, block, declare_mlps, heads_first, rms_norm
from jaxpar.nn.layers import KVCache, attention, cached_attention, token_positions
from jaxpar.nn.params import BALANCE, Param, dense, norm

QKV = ("batch", "heads", "seq", "head_dim")


def declare_attention(cfg: ModelConfig, std: float, resid_std: float) -> dict:
    L, C, H = cfg.n_layer, cfg.n_embd, cfg.n_head
    Dn, Dr, Dv, Rq, Rkv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank
    heads = ("latent", "heads", "head_dim")
    query = ({"q_a": dense(std, (L, C, Rq), ("layers", "embed", "latent"), 1, False),
              "q_a_norm": norm((L, Rq), ("layers", "latent")),
              "q_b": dense(std, (L, Rq, H, Dn + Dr), ("layers", *heads), 2, False)} if Rq else
             {"q": dense(std, (L, C, H, Dn + Dr), ("layers", "embed", "heads", "head_dim"), 2, False)})
    return {
        "attn_norm": norm((L, C), ("layers", "embed")), **query,
        "kv_a": dense(std, (L, C, Rkv + Dr), ("layers", "embed", "latent"), 1, False),  # the latent, the rotated key
        "kv_a_norm": norm((L, Rkv), ("layers", "latent")),
        "kv_b": dense(std, (L, Rkv, H, Dn + Dv), ("layers", *heads), 2, False),  # each head's key, its value
        "attn_out": dense(resid_std, (L, H, Dv, C), ("layers", "heads", "head_dim", "embed"), 1, False),
    }


def declare_shared_experts(cfg: ModelConfig, std: float, resid_std: float) -> dict:
    """n_shared_experts SwiGLU experts as one MLP n_shared_experts times an expert's width, on
    the sparse layers' stack."""
    if not (cfg.n_experts and cfg.n_shared_experts):
        return {}
    stack = "sparse_layers" if cfg.mixed_layers else "layers"
    L, C, F = len(cfg.layers_in(stack)), cfg.n_embd, cfg.n_shared_experts * cfg.expert_width
    return {"shared_gate_up": dense(std, (L, C, 2, F), (stack, "embed", "gate_up", "mlp"), 2, False),
            "shared_out": dense(resid_std, (L, F, C), (stack, "mlp", "embed"), 1, False, transposed=True)}


def paired(x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Rotated dims laid out in pairs (x0, x1), (x2, x3), ... (model.rope_interleave) regrouped
    into the halves that rope.apply rotates: the evens, then the odds, as transformers does."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1) if cfg.rope_interleave else x


def latent_attention(layer: Layer, x: jax.Array, keys: tuple, cache=None, doc_starts=None):
    """MLA -> (x after the residual, cache); as Llama's attention_part otherwise. Decoding caches
    each token's latent and rotated key (kv_lora_rank + qk_rope_head_dim numbers a layer), not its
    heads' keys and values, and every step expands the cached ones through kv_b."""
    plan, cfg, p, dtype = layer.plan, layer.cfg, layer.p, layer.dtype
    B, T, _ = x.shape
    H, Dn, Dr = cfg.n_head, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    h = layer.normed(x, p["attn_norm"])
    if "q_a" in p:
        q_latent = rms_norm(layer.dot("nc,cr->nr", h, p["q_a"]["kernel"]), p["q_a_norm"], cfg.norm_eps)
        q = layer.dot("nr,rhd->nhd", q_latent.astype(dtype), p["q_b"]["kernel"])
    else:
        q = layer.dot("nc,chd->nhd", h, p["q"]["kernel"])
    q = checkpoint_name(q, remat.QKV)
    latent_and_rope = checkpoint_name(layer.dot("nc,cr->nr", h, p["kv_a"]["kernel"]), remat.QKV)
    latent = rms_norm(latent_and_rope[:, :-Dr], p["kv_a_norm"], cfg.norm_eps).astype(dtype).reshape(B, 1, T, -1)
    cos, sin = rope.angles(cfg, Dr, token_positions(plan, T, cache, doc_starts))
    q = heads_first(plan, q.astype(dtype), B, T, QKV)
    q = jnp.concatenate([q[..., :Dn], rope.apply(paired(q[..., Dn:], cfg), cos, sin)], axis=-1)
    if cfg.rope_type == "yarn" and cfg.rope_mscale_all_dim:  # YaRN's scores times mscale^2: as the query's
        q = (q.astype(jnp.float32) * rope.mscale(cfg, cfg.rope_mscale_all_dim) ** 2).astype(dtype)
    k_rope = latent_and_rope[:, -Dr:].astype(dtype).reshape(B, T, 1, Dr).transpose(0, 2, 1, 3)
    k_rope = rope.apply(paired(k_rope, cfg), cos, sin)  # (B, 1, T, Dr): one for every head
    if cache is None:
        k, v = keys_and_values(layer, latent, k_rope, q.shape[-1])
        y, _ = attention(plan, q, k, v, cfg.dropout, keys[0], None, doc_starts)
    else:
        cache = cache.write(latent, k_rope)
        y = cached_attention(q, KVCache(*keys_and_values(layer, cache.k, cache.v, q.shape[-1]), cache.pos), doc_starts)
    Dv = cfg.v_head_dim
    y = checkpoint_name(plan.constrain(y[..., :Dv].reshape(B * T, H, Dv), ("tokens", "heads", "head_dim")),
                        remat.CONTEXT)
    return layer.residual(x, layer.dot("nhd,hdc->nc", y, p["attn_out"]["kernel"]), keys[1], remat.ATTENTION_OUT), cache


def keys_and_values(layer: Layer, latent: jax.Array, k_rope: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """Every head's keys (B, H, S, Dn + Dr) and values (B, H, S, width: zero-padded, as the
    kernels take one head width) from the latents (B, 1, S, kv_lora_rank) and the rotated keys
    (B, 1, S, Dr)."""
    plan, cfg, dtype = layer.plan, layer.cfg, layer.dtype
    B, _, S, R = latent.shape
    H, Dn = cfg.n_head, cfg.qk_nope_head_dim
    k_nope_and_v = layer.dot("nr,rhd->nhd", latent.reshape(B * S, R), layer.p["kv_b"]["kernel"]).astype(dtype)
    k_rope = jnp.broadcast_to(k_rope, (B, H, S, k_rope.shape[-1]))
    k = plan.constrain(jnp.concatenate([heads_first(plan, k_nope_and_v[..., :Dn], B, S, QKV), k_rope], axis=-1),
                       ("batch", "kv_heads", "seq", "head_dim"))
    v = heads_first(plan, k_nope_and_v[..., Dn:], B, S, ("batch", "kv_heads", "seq", "head_dim"))
    return k, jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, width - v.shape[-1])))


class Deepseek(Llama):
    """The DeepSeek-V3 family (model.family = "deepseek")."""

    shape_fields = Llama.shape_fields + ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                         "v_head_dim", "n_shared_experts", "mtp_layers")

    def declare(self, vocab_size: int) -> dict:
        """Llama's params, then the multi-token prediction modules' (declared last, so that the
        rest draw the same values with or without them)."""
        declared = super().declare(vocab_size)
        return declared | ({"mtp": declare_mtp(self)} if self.cfg.mtp_layers else {})

    def cache_widths(self) -> tuple[int, int, int]:
        """A token's latent and its rotated key, one of each a layer."""
        return 1, self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim

    def ahead_params(self) -> tuple[str, ...]:
        return ("wte", "mtp") if self.cfg.mtp_layers else ()

    def ahead_losses(self, model, top: dict, x, targets, doc_starts=None) -> dict:
        return mtp_losses(model, top, x, targets, doc_starts) if self.cfg.mtp_layers else {}

    def declare_blocks(self) -> dict:
        cfg = self.cfg
        std, resid_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layer)  # as Llama's
        mlps = declare_mlps(cfg, std, resid_std)
        if "router" in mlps:  # each expert's selection bias (jaxpar.nn.routing), on the router's stack
            stack = mlps["router"]["kernel"].axes[0]
            mlps["router"]["balance"] = Param((len(cfg.layers_in(stack)), cfg.n_experts), (stack, "routes"), BALANCE)
        mlp_norm = norm((cfg.n_layer, cfg.n_embd), ("layers", "embed"))
        return {**declare_attention(cfg, std, resid_std), "mlp_norm": mlp_norm, **mlps,
                **declare_shared_experts(cfg, std, resid_std)}

    def loss_weights(self) -> dict[str, float]:
        """Llama's, and `moe_bias`: the balance biases' mean size, logged; in the training loss
        it adds a constant, and carries the routed counts to the biases as their gradient."""
        mtp = {"mtp_loss": self.cfg.mtp_weight} if self.cfg.mtp_layers else {}
        return super().loss_weights() | ({"moe_bias": 1.0} if self.cfg.n_experts else {}) | mtp

    def block(self, plan, x: jax.Array, p: dict, axes: dict, key=None, cache=None, doc_starts=None):
        x, losses, cache = block(plan, x, p, axes, self.cfg, self.dtype, key, cache, doc_starts, latent_attention)
        return x, self.block_losses(x) | losses, cache

    def matmul_params(self, vocab_size: int) -> int:
        """N in 6N: MLA's projections, then Llama's MLP or experts (the k chosen and the shared
        ones), lm_head; and each multi-token prediction module's projection, block and lm_head."""
        m = self.cfg
        C, H, Dq, Dv, Rkv = m.n_embd, m.n_head, m.head_size, m.v_head_dim, m.kv_lora_rank
        query = m.q_lora_rank * (C + H * Dq) if m.q_lora_rank else C * H * Dq
        attention = query + C * (Rkv + m.qk_rope_head_dim) + Rkv * H * (m.qk_nope_head_dim + Dv) + H * Dv * C
        sparse, dense = sum(m.sparse_layers), 3 * C * m.mlp_width
        experts = m.n_experts * C + (m.experts_per_token + m.n_shared_experts) * 3 * C * m.expert_width
        main = m.n_layer * attention + sparse * experts + (m.n_layer - sparse) * dense + vocab_size * C
        return main + m.mtp_layers * (2 * C * C + attention + (experts if m.n_experts else dense) + vocab_size * C)

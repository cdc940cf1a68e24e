"""Which experts a token goes to, and the router's losses (jaxpar.nn.moe runs the experts).

Two routers: the softmax top-k (Mixtral, Qwen3-MoE, OLMoE), its k weights renormalised or not;
and DeepSeek-V3's, sigmoid scores and a top-k within the best groups of experts, where the
config declares groups. A capacity factor drops the assignments past an expert's share of a
sequence, in token order. The balance loss, the z-loss and the load are per sequence.
"""

import functools
import math

import jax
import jax.numpy as jnp


def route(h: jax.Array, router: jax.Array, k: int, renormalize: bool):
    """(logits (N, E) float32, probs (N, E), the chosen k weights (N, k) and experts (N, k))."""
    logits = jnp.dot(h.astype(jnp.float32), router.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return logits, probs, weights, experts


def route_in_groups(h: jax.Array, router: jax.Array, k: int, n_group: int, topk_group: int, scale: float):
    """DeepSeek-V3's routing, as `route` returns it: sigmoid scores; the topk_group best of n_group
    groups of experts, each scored by its two best; the top k within those; the chosen scores
    normalised to sum to 1, times `scale`. `probs`, for the balance loss, are the scores
    normalised over the experts (the paper's s'_{i,t})."""
    logits = jnp.dot(h.astype(jnp.float32), router.astype(jnp.float32))
    scores = jax.nn.sigmoid(logits)
    N, E = scores.shape
    group_scores = jax.lax.top_k(scores.reshape(N, n_group, E // n_group), 2)[0].sum(-1)
    best_groups = jax.lax.top_k(group_scores, topk_group)[1]
    allowed = jnp.repeat(jax.nn.one_hot(best_groups, n_group).sum(1), E // n_group, axis=1) > 0
    experts = jax.lax.top_k(jnp.where(allowed, scores, 0.0), k)[1]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20) * scale
    return logits, scores / jnp.sum(scores, axis=-1, keepdims=True), weights, experts


def router_of(cfg):
    """The family's routing (h, router) -> `route`'s four: DeepSeek's in groups where the config
    declares groups, else the softmax top-k."""
    if hasattr(cfg, "n_group"):
        return functools.partial(route_in_groups, k=cfg.experts_per_token, n_group=cfg.n_group,
                                 topk_group=cfg.topk_group, scale=cfg.routed_scaling_factor)
    return functools.partial(route, k=cfg.experts_per_token, renormalize=cfg.moe_renormalize)


def within_capacity(experts: jax.Array, B: int, capacity: int) -> jax.Array:
    """experts (B*T, k) -> (B*T, k) bool: whether each assignment is among the first `capacity` of
    its sequence to its expert, in token order (then choice order)."""
    k = experts.shape[-1]
    flat = experts.reshape(B, -1)
    order = jnp.argsort(flat, axis=1, stable=True)
    by_expert_sorted = jnp.take_along_axis(flat, order, axis=1)
    first = jax.vmap(lambda e: jnp.searchsorted(e, e, side="left"))(by_expert_sorted)
    rank_sorted = jnp.arange(flat.shape[1])[None] - first
    rank = jnp.zeros_like(rank_sorted).at[jnp.arange(B)[:, None], order].set(rank_sorted)
    return (rank < capacity).reshape(-1, k)


def sequence_stats(logits, probs, experts, B: int, seq_len: int, seq_axes: tuple):
    """Per sequence (B,): the load-balancing loss, the z-loss and the load, from this device's
    tokens of each sequence, summed over the axes that split the sequence."""
    E = probs.shape[-1]
    counts = jax.nn.one_hot(experts, E, dtype=jnp.float32).sum(1).reshape(B, -1, E).sum(1)
    prob_sums = probs.reshape(B, -1, E).sum(1)
    z_sums = jnp.square(jax.nn.logsumexp(logits, axis=-1)).reshape(B, -1).sum(1)
    if seq_axes:
        counts, prob_sums, z_sums = jax.lax.psum((counts, prob_sums, z_sums), seq_axes)
    balance = E * jnp.sum(counts / seq_len * prob_sums / seq_len, axis=-1)
    load = jnp.max(counts, axis=-1) / jnp.mean(counts, axis=-1)
    return balance, z_sums / seq_len, load


def capacity(cfg, seq_len: int) -> int:
    """Assignments an expert takes from one sequence: capacity_factor x its fair share, T k / E."""
    return max(1, math.ceil(cfg.moe_capacity_factor * seq_len * cfg.experts_per_token / cfg.n_experts))

"""Which experts a token goes to, and the router's losses (jaxpar.nn.moe runs the experts).

Two routers: the softmax top-k (Mixtral, Qwen3-MoE, OLMoE), its k weights renormalised or not;
and DeepSeek-V3's, sigmoid scores and a top-k within the best groups of experts, where the
config declares groups. A capacity factor drops the assignments past an expert's share of a
sequence, in token order. The balance loss, the z-loss and the load are per sequence.

DeepSeek-V3 balances its experts without an auxiliary loss (arXiv 2412.19437, section 2.1.2): a
per-expert bias (a `balance` param) is added to the scores where experts are chosen, not to the
weights, and after each step it moves by model.moe_bias_update_rate towards the experts that the
step's tokens, over the whole mesh, routed to less than the mean. The counts reach the update as
the bias's gradient: `counted` is zero in value, and its gradient for the bias is the tokens
routed to each expert. So every layout's gradient machinery (passes, data, tensor, expert and
pipeline axes, ZeRO) sums them as it sums any gradient, scaled alike for every expert, which the
update's sign ignores. The step takes them out before the norm and the optimizer.
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


def route_in_groups(h: jax.Array, router: jax.Array, balance: jax.Array, k: int, n_group: int, topk_group: int,
                    scale: float, renormalize: bool = True):
    """DeepSeek-V3's routing, as `route` returns it: sigmoid scores, each expert's `balance` bias
    added where experts are chosen (transformers' e_score_correction_bias); the topk_group best of
    n_group groups of experts, each scored by its two best; the top k within those; the chosen
    scores (without the bias) normalised to sum to 1 (unless not `renormalize`: norm_topk_prob),
    times `scale`. `probs`, for the balance loss, are the scores normalised over the experts (the
    paper's s'_{i,t})."""
    logits = jnp.dot(h.astype(jnp.float32), router.astype(jnp.float32))
    scores = jax.nn.sigmoid(logits)
    N, E = scores.shape
    choice = scores + balance
    group_scores = jax.lax.top_k(choice.reshape(N, n_group, E // n_group), 2)[0].sum(-1)
    best_groups = jax.lax.top_k(group_scores, topk_group)[1]
    allowed = jnp.repeat(jax.nn.one_hot(best_groups, n_group).sum(1), E // n_group, axis=1) > 0
    experts = jax.lax.top_k(jnp.where(allowed, choice, -jnp.inf), k)[1]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * scale
    return logits, scores / jnp.sum(scores, axis=-1, keepdims=True), weights, experts


def router_of(cfg):
    """The family's routing (h, router, balance) -> `route`'s four: DeepSeek's in groups where the
    config declares groups, else the softmax top-k (which has no balance bias: None)."""
    if hasattr(cfg, "n_group"):
        return functools.partial(route_in_groups, k=cfg.experts_per_token, n_group=cfg.n_group,
                                 topk_group=cfg.topk_group, scale=cfg.routed_scaling_factor,
                                 renormalize=cfg.moe_renormalize)
    return lambda h, router, balance: route(h, router, cfg.experts_per_token, cfg.moe_renormalize)


def counted(balance: jax.Array, experts: jax.Array, B: int) -> jax.Array:
    """(B,): the bias's mean size (logged as moe_bias), whose gradient for `balance` (E,) is the
    assignments of this device's tokens (B * T, k) to each expert: each sequence's counts times the
    bias, less the same stopped, is zero in value."""
    counts = jax.nn.one_hot(experts, balance.shape[0], dtype=jnp.float32).sum(1).reshape(B, -1, balance.shape[0]).sum(1)
    carried = counts @ balance
    return carried - jax.lax.stop_gradient(carried) + jax.lax.stop_gradient(jnp.mean(jnp.abs(balance)))


def rebalanced(balance: jax.Array, routed: jax.Array, rate: float) -> jax.Array:
    """balance (..., E) moved by rate towards the experts routed to less than the mean: + rate
    where an expert's count is below its layer's mean, - rate above it. `routed` (..., E): the
    counts, as one scale times the step's (means over passes and devices, not integers), so a
    count within a millionth of the mean counts as equal."""
    mean = jnp.mean(routed, axis=-1, keepdims=True)
    below = mean - routed
    return balance + rate * jnp.where(jnp.abs(below) <= 1e-6 * mean, 0.0, jnp.sign(below))


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

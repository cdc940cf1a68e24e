"""What every model family is made of: dropout, the weights' compute layout, the residual stream's
layout, documents in a row, attention (causal, or against a KV cache while decoding), the masked
lm_head logits (the loss: jaxpar.nn.loss).

Documents (data.document_mask): an end-of-text token opens a document, as modded-nanogpt's BOS
does. `doc_starts` (batch, seq) holds each token's document start, the position of the end-of-text
token that opened it (0 for the row's first document). Two tokens share a document when their
starts are equal, and a token's position in its document is its position less its start.

Layers are stacked on a leading 'layers' axis; the code names logical axes only, and each
function that lays out or chooses takes the execution plan (jaxpar.core.execution) first.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxpar.nn import context, recipes
from jaxpar.nn.attention import apply_dropout, causal_attention
from jaxpar.nn.kernels import BlockKernel, fused_attention

VOCAB_MULTIPLE = 64  # pad the vocabulary so it splits over any tensor-parallel size up to 64
GATHERED = "gathered_weights"  # checkpoint name of weights pinned to their compute layout
STREAM = ("batch", "stream_seq", "embed")  # the residual stream's logical axes between blocks


def padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def dropout(x: jax.Array, rate: float, key) -> jax.Array:
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return apply_dropout(x, keep, rate).astype(x.dtype)


def weights_for_compute(plan, p: dict, axes: dict) -> dict:
    """Pin weights to their rule-table layout where they are used.

    Under ZeRO-3 they are stored split over 'data' as well, so this is where each layer gathers
    its own weights; otherwise it changes nothing. The name lets a remat policy drop them.
    """
    return jax.tree.map(lambda a, names: checkpoint_name(plan.constrain(a, names), GATHERED), p, axes)


def recomputed(plan, fn, *static):
    """fn(x, *static), which on an accelerator keeps only x for the backward pass and runs fn
    again there. Autodiff of an elementwise activation otherwise keeps each of its (tokens x
    features) intermediates (six for the tanh GELU), each written to memory in the forward pass
    and read back in the backward: the bytes an accelerator's step waits on. A CPU's step waits
    on arithmetic instead (recomputing the baby GPT's GELU made it about 4% slower), so there fn
    is autodiff's as before."""
    def apply(x):
        return fn(x, *static)
    return jax.checkpoint(apply) if plan.recompute_activations else apply


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gather_stream(plan, h: jax.Array) -> jax.Array:
    """(batch, seq, embed) from the stream's layout to the matmuls' (batch*seq, embed): an
    all-gather under sequence parallelism. Its gradient, a partial sum over 'tensor', goes
    straight to the stream's layout, where XLA:TPU sums it as a reduce-scatter."""
    B, T, C = h.shape
    return plan.constrain(h.reshape(B * T, C), ("tokens", "embed"))


gather_stream.defvjp(lambda plan, h: (gather_stream(plan, h), h.shape),
                     lambda plan, shape, g: (plan.constrain(g.reshape(shape), STREAM),))


def to_stream(plan, y: jax.Array, shape: tuple) -> jax.Array:
    """A row-parallel output (tokens, embed) back in the stream's layout: under tensor parallelism
    a sum over 'tensor' (an all-reduce, or with sequence parallelism a reduce-scatter)."""
    return plan.constrain(y.reshape(shape), STREAM)


def sequence_positions(plan, seq_len: int) -> jax.Array | None:
    """Each token's true position while the sequence is laid out for the plan's context strategy
    (the ring's zigzag: jaxpar.nn.context), or None when it is in order."""
    order = context.of(plan).permutation(seq_len, plan.ring()[1])
    return None if order is None else jnp.asarray(order)


def document_starts(plan, tokens: jax.Array, eot_id: int) -> jax.Array:
    """Each token's document start, (batch, seq) int32, in the sequence's layout: tokens laid out
    for a context strategy are put back in order for the running maximum, and the starts laid out
    as they were."""
    T = tokens.shape[1]
    order = context.of(plan).permutation(T, plan.ring()[1])
    in_order = tokens if order is None else tokens[:, np.argsort(order)]
    index = jnp.arange(T, dtype=jnp.int32)
    starts = jax.lax.cummax(jnp.where(in_order == eot_id, index, 0), axis=1)
    return plan.constrain(starts if order is None else starts[:, order], ("batch", "seq"))


def document_positions(plan, doc_starts: jax.Array | None, seq_len: int) -> jax.Array | None:
    """Each token's position in its document, (batch, seq); None without documents."""
    return None if doc_starts is None else token_positions(plan, seq_len, None, doc_starts)


class KVCache(NamedTuple):
    """One layer's cache while decoding: k and v (batch, kv_heads, block_size, head_dim) of every
    position so far, and `pos`, the position of the first token being fed."""
    k: jax.Array
    v: jax.Array
    pos: jax.Array

    def write(self, k: jax.Array, v: jax.Array) -> "KVCache":
        """The cache with k, v (batch, kv_heads, tokens, head_dim) written at pos..pos+tokens-1."""
        at = (0, 0, self.pos, 0)
        return KVCache(jax.lax.dynamic_update_slice(self.k, k, at), jax.lax.dynamic_update_slice(self.v, v, at),
                       self.pos)


def token_positions(plan, seq_len: int, cache: KVCache | None, doc_starts: jax.Array | None = None) -> jax.Array:
    """Each token's position: after the cache's, while decoding; else in the sequence's layout;
    with documents, less its document's start ((batch, seq) then)."""
    if cache is not None:
        positions = cache.pos + jnp.arange(seq_len)
    else:
        positions = sequence_positions(plan, seq_len)
        positions = jnp.arange(seq_len) if positions is None else positions
    return positions if doc_starts is None else positions - doc_starts


def attention(plan, q, k, v, rate: float, key, cache: KVCache | None = None, doc_starts: jax.Array | None = None):
    """(causal attention of q with k, v as `attend` computes it, or with a cache: q against every
    cached position up to its own after k and v are written in; the cache, or None). With
    `doc_starts`, a query sees its own document's keys alone."""
    if cache is None:
        return attend(plan, q, k, v, rate, key, doc_starts), None
    cache = cache.write(k, v)
    return cached_attention(q, cache, doc_starts), cache


def cached_attention(q: jax.Array, cache: KVCache, doc_starts: jax.Array | None = None) -> jax.Array:
    """q (B, H, T, D) for positions pos..pos+T-1 against the cache (B, K, T_max, D) -> (B, T, H, D);
    query head h reads KV head h // (H / K). With doc_starts (B, T), a query sees the cached
    positions from its document's start on."""
    B, H, T, D = q.shape
    K, T_max = cache.k.shape[1], cache.k.shape[2]
    q = q.reshape(B, K, H // K, T, D)
    scores = jnp.einsum("bkgtd,bksd->bkgts", q, cache.k, preferred_element_type=jnp.float32)
    # A query sees the cached positions up to its own; later slots are empty or stale.
    slots = jnp.arange(T_max)[None, None, :]
    visible = slots <= cache.pos + jnp.arange(T)[None, :, None]
    if doc_starts is not None:
        visible &= slots >= doc_starts[:, :, None]
    visible = visible[:, None, None]  # (B, 1, 1, T, T_max)
    scores = jnp.where(visible, scores / math.sqrt(D), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    y = jnp.einsum("bkgts,bksd->btkgd", probs.astype(cache.v.dtype), cache.v)
    return y.reshape(B, T, H, D)


def attend(plan, q: jax.Array, k: jax.Array, v: jax.Array, rate: float, key, doc_starts=None) -> jax.Array:
    """Causal attention of q (batch, heads, seq, head_dim) with k, v (batch, kv_heads, seq,
    head_dim) -> (batch, seq, heads, head_dim), within documents when doc_starts is given, by the
    plan's kernel: on one device's whole sequence, or, where the sequence is split over 'context',
    by the plan's context strategy (jaxpar.nn.context; no dropout there)."""
    if plan.ring()[1] > 1:
        return context.of(plan).attend(plan, q, k, v, doc_starts)
    if not BlockKernel(plan.attention, plan.interpret).fused:
        return causal_attention(q, k, v, rate, key, doc_starts)
    return fused_attention(plan, q, k, v, doc_starts)


def head_logits(plan, x: jax.Array, head: jax.Array, vocab_size: int, dtype, logits_dtype="float32") -> jax.Array:
    """The lm_head (padded vocab, embed) on the normed (batch, seq, embed) stream: logits in
    `logits_dtype` (model.logits_dtype; accumulated in float32 either way), the vocabulary's
    padding rows masked so they can never be predicted."""
    x = plan.constrain(x, ("batch", "seq", "embed"))  # the whole sequence
    recipe = recipes.of(plan, dtype)
    logits = recipe.project("btc,vc->btv", x.astype(dtype), head.astype(dtype), recipes.HEAD).astype(logits_dtype)
    logits = plan.constrain(logits, ("batch", "seq", "vocab"))
    is_real = jnp.arange(logits.shape[-1]) < vocab_size
    return jnp.where(is_real, logits, -1e9)

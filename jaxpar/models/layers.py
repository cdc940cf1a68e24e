"""What every model family is made of: dropout, the weights' compute layout, the residual stream's
layout, attention (causal, or against a KV cache while decoding), the masked lm_head logits and the
loss.

Layers are stacked on a leading 'layers' axis; the code names logical axes only.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.core.axes import zigzag_permutation
from jaxpar.core.sharding import constrain, per_device, sequence_ring
from jaxpar.models.attention import apply_dropout, causal_attention
from jaxpar.models.kernels import KV_AXES, Q_AXES, active_kernel, fused_attention
from jaxpar.models.matmul import project
from jaxpar.models.ring_attention import ring_attention

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


def weights_for_compute(p: dict, axes: dict) -> dict:
    """Pin weights to their rule-table layout where they are used.

    Under ZeRO-3 they are stored split over 'data' as well, so this is where each layer gathers
    its own weights; otherwise it changes nothing. The name lets a remat policy drop them.
    """
    return jax.tree.map(lambda a, names: checkpoint_name(constrain(a, names), GATHERED), p, axes)


@jax.custom_vjp
def gather_stream(h: jax.Array) -> jax.Array:
    """(batch, seq, embed) from the stream's layout to the matmuls' (batch*seq, embed): an
    all-gather under sequence parallelism. Its gradient, a partial sum over 'tensor', goes
    straight to the stream's layout, where XLA:TPU sums it as a reduce-scatter."""
    B, T, C = h.shape
    return constrain(h.reshape(B * T, C), ("tokens", "embed"))


gather_stream.defvjp(lambda h: (gather_stream(h), h.shape),
                     lambda shape, g: (constrain(g.reshape(shape), STREAM),))


def to_stream(y: jax.Array, shape: tuple) -> jax.Array:
    """A row-parallel output (tokens, embed) back in the stream's layout: under tensor parallelism
    a sum over 'tensor' (an all-reduce, or with sequence parallelism a reduce-scatter)."""
    return constrain(y.reshape(shape), STREAM)


def sequence_positions(seq_len: int) -> jax.Array | None:
    """Each token's true position while the sequence is laid out for a context ring (zigzag: see
    jaxpar.models.ring_attention), or None when it is in order."""
    _, ring = sequence_ring()
    return None if ring == 1 else jnp.asarray(zigzag_permutation(seq_len, ring))


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


def token_positions(seq_len: int, cache: KVCache | None) -> jax.Array:
    """Each token's position: after the cache's, while decoding; else in the sequence's layout."""
    if cache is not None:
        return cache.pos + jnp.arange(seq_len)
    positions = sequence_positions(seq_len)
    return jnp.arange(seq_len) if positions is None else positions


def attention(q, k, v, rate: float, key, cache: KVCache | None = None):
    """(causal attention of q with k, v as `attend` computes it, or with a cache: q against every
    cached position up to its own after k and v are written in; the cache, or None)."""
    if cache is None:
        return attend(q, k, v, rate, key), None
    cache = cache.write(k, v)
    return cached_attention(q, cache), cache


def cached_attention(q: jax.Array, cache: KVCache) -> jax.Array:
    """q (B, H, T, D) for positions pos..pos+T-1 against the cache (B, K, T_max, D) -> (B, T, H, D);
    query head h reads KV head h // (H / K)."""
    B, H, T, D = q.shape
    K, T_max = cache.k.shape[1], cache.k.shape[2]
    q = q.reshape(B, K, H // K, T, D)
    scores = jnp.einsum("bkgtd,bksd->bkgts", q, cache.k, preferred_element_type=jnp.float32)
    # A query sees the cached positions up to its own; later slots are empty or stale.
    visible = jnp.arange(T_max)[None, :] <= cache.pos + jnp.arange(T)[:, None]
    scores = jnp.where(visible, scores / math.sqrt(D), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    y = jnp.einsum("bkgts,bksd->btkgd", probs.astype(cache.v.dtype), cache.v)
    return y.reshape(B, T, H, D)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, rate: float, key) -> jax.Array:
    """Causal attention of q (batch, heads, seq, head_dim) with k, v (batch, kv_heads, seq,
    head_dim) -> (batch, seq, heads, head_dim): on one device's whole sequence, or as a ring over
    the mesh axis the sequence is split over (context parallelism; no dropout there)."""
    axis, ring = sequence_ring()
    kernel = active_kernel()
    if ring == 1:
        return causal_attention(q, k, v, rate, key) if kernel == "xla" else fused_attention(kernel, q, k, v)

    def ring_of_shards(q, k, v):
        B, H, T, D = q.shape
        K = k.shape[1]
        return ring_attention(q.reshape(B, K, H // K, T, D), k, v, axis_name=axis, kernel=kernel).reshape(B, H, T, D)
    return per_device(ring_of_shards, (Q_AXES, KV_AXES, KV_AXES), Q_AXES)(q, k, v).transpose(0, 2, 1, 3)


def head_logits(x: jax.Array, head: jax.Array, vocab_size: int, dtype) -> jax.Array:
    """The lm_head (padded vocab, embed) on the normed (batch, seq, embed) stream: float32
    logits, the vocabulary's padding rows masked so they can never be predicted."""
    x = constrain(x, ("batch", "seq", "embed"))  # the whole sequence
    logits = project("btc,vc->btv", x.astype(dtype), head.astype(dtype), dtype)
    logits = constrain(logits, ("batch", "seq", "vocab"))
    is_real = jnp.arange(logits.shape[-1]) < vocab_size
    return jnp.where(is_real, logits, -1e9)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy; logits are float32."""
    log_z = jax.nn.logsumexp(logits, axis=-1)
    # A one-hot sum, not a gather: exact all the same, it splits over a vocab-parallel axis, and
    # XLA's partitioner crashes on this gather inside a pipeline stage with data and tensor axes.
    picked = jnp.sum(jnp.where(jax.nn.one_hot(targets, logits.shape[-1], dtype=bool), logits, 0.0), -1)
    return jnp.mean(log_z - picked)

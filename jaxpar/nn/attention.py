"""Causal self-attention with a hand-written backward pass, in blocks of queries that skip the
masked keys: the shape of the work that XLA:CPU runs fastest (docs/benchmarks.md, "What the
single-device speed comes from").

q is (batch, heads, seq, head_dim); k and v are (batch, kv_heads, seq, head_dim), with kv_heads
dividing heads (grouped-query attention; GPT-2 has as many as heads). Query head h attends with KV
head h // (heads / kv_heads), as Hugging Face's `repeat_kv` pairs them, but K and V are never
repeated: a group's queries are rows of one matrix against its KV head. Dropout masks the
attention probabilities. With documents (`doc_starts`, jaxpar.nn.layers), a query sees the
keys of its own document alone.
"""

import functools
import math

import jax
import jax.numpy as jnp

# Attention runs in blocks of queries that skip the masked keys (query_blocks). Measured on
# XLA:CPU: at block 256, 4 blocks of 64 take 0.67x the time of the whole square (fwd + bwd); at
# block 64, blocks of 32 or 16 gain nothing.
QUERY_BLOCK = 64
MAX_QUERY_BLOCKS = 8  # each block is its own ops in every layer: more of them cost compile time
# Every dot accumulates into float32: in bfloat16 that is the form XLA:CPU's bf16 kernels take
# (jaxpar.nn.recipes.model_dtype); in float32 it is the same dot.
F32 = jnp.float32


def apply_dropout(x: jax.Array, keep, rate: float) -> jax.Array:
    """x zeroed outside the mask `keep` and scaled by 1/(1 - rate) inside it (x if keep is None)."""
    return x if keep is None else jnp.where(keep, x / (1.0 - rate), 0.0)


def causal_attention(q, k, v, rate: float, key, doc_starts=None) -> jax.Array:
    """softmax(q k^T / sqrt(d) + causal mask) v for q (batch, heads, seq, head_dim) and k, v
    (batch, kv_heads, seq, head_dim); returns (batch, seq, heads, head_dim). doc_starts (batch,
    seq) or None: the documents' mask too."""
    B, H, T, D = q.shape
    K = k.shape[1]
    keep = None
    if key is not None and rate > 0.0:
        keep = jax.random.bernoulli(key, 1.0 - rate, q.shape[:3] + k.shape[2:3])
        keep = keep.reshape(B, K, H // K, T, -1)
    out = attention_core(q.reshape(B, K, H // K, T, D), k, v, keep, doc_starts, rate)
    return out.reshape(B, H, T, D).transpose(0, 2, 1, 3)


def group_rows(a: jax.Array, start: int, stop: int) -> jax.Array:
    """Queries [start, stop) of every head in a group, as the rows of one matrix:
    (batch, kv_heads, group, seq, ...) -> (batch, kv_heads, group * (stop - start), ...)."""
    block = a[:, :, :, start:stop]
    return block.reshape(block.shape[:2] + (-1,) + block.shape[4:])


def ungroup_rows(a: jax.Array, group: int) -> jax.Array:
    """The inverse of group_rows: (batch, kv_heads, group * n, d) -> (batch, kv_heads, group, n, d)."""
    return a.reshape(a.shape[:2] + (group, -1) + a.shape[3:])


def physical_transpose(x: jax.Array) -> jax.Array:
    """x with its last two axes swapped in memory. Without the barrier XLA folds the transpose into
    the next dot, and XLA:CPU runs a batched dot that contracts its left operand's rows about 3x
    slower than one that contracts its columns."""
    return jax.lax.optimization_barrier(jnp.swapaxes(x, -1, -2))


def key_gradient(a: jax.Array, b: jax.Array) -> jax.Array:
    """a^T b per (batch, head): (..., queries, keys) and (..., queries, d) -> (..., keys, d), float32.

    In bfloat16 the keys are split in two: XLA:CPU converts the plain batched dot to float32, at
    half the speed of the split one's bf16 (the gradient of v at block 256: 97 against 245 GFLOP/s).
    """
    a = physical_transpose(a)
    if a.dtype == F32 or a.shape[2] % 2:
        return jnp.einsum("bhst,bhtd->bhsd", a, b, preferred_element_type=F32)
    B, H, S, T = a.shape
    halves = a.reshape(B, H, 2, S // 2, T)
    return jnp.einsum("bhzst,bhtd->bhzsd", halves, b, preferred_element_type=F32).reshape(B, H, S, -1)


def query_blocks(seq_len: int) -> list[tuple[int, int]]:
    """(start, stop) of each block of queries. Queries in a block see keys [0, stop) only, which
    skips the masked corner above the diagonal: a quarter of attention's work in 2 blocks."""
    n = min(MAX_QUERY_BLOCKS, seq_len // QUERY_BLOCK) or 1
    if seq_len % n:
        n = 1
    step = seq_len // n
    return [(i * step, (i + 1) * step) for i in range(n)]


def attention_scores(q, k, start: int, group: int, docs=None) -> jax.Array:
    """Masked, scaled scores of `group` heads' queries [start, start + n) (their rows stacked)
    against keys [0, len(k)); docs (batch, seq) or None: only keys of a query's own document."""
    T, S, D = q.shape[2] // group, k.shape[2], q.shape[3]
    scores = jnp.einsum("bhtd,bhsd->bhts", q, k, preferred_element_type=F32)
    visible = jnp.tile(jnp.tril(jnp.ones((T, S), dtype=bool), k=start), (group, 1))
    if docs is not None:
        same = docs[:, start:start + T, None] == docs[:, None, :S]  # (batch, queries, keys)
        visible = visible & jnp.tile(same, (1, group, 1))[:, None]
    return jnp.where(visible, scores / math.sqrt(D), jnp.finfo(jnp.float32).min)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def attention_core(q, k, v, keep, docs, rate: float) -> jax.Array:
    """Attention of q (batch, kv_heads, group, seq, head_dim) with k, v (batch, kv_heads, seq,
    head_dim); `keep` is the dropout mask of the probs or None; `docs` the document starts
    (batch, seq) or None.

    The backward pass is autodiff's, written out so that every dot is in XLA:CPU's fast form.
    """
    return attention_forward(q, k, v, keep, docs, rate)[0]


def block_mask(keep, start: int, stop: int):
    return None if keep is None else group_rows(keep[..., :stop], start, stop)


def attention_forward(q, k, v, keep, docs, rate: float):
    outs, probs, group = [], [], q.shape[2]
    for start, stop in query_blocks(q.shape[3]):
        p = jax.nn.softmax(attention_scores(group_rows(q, start, stop), k[:, :, :stop], start, group, docs), axis=-1)
        dropped = apply_dropout(p, block_mask(keep, start, stop), rate).astype(v.dtype)
        out = jnp.einsum("bhts,bhsd->bhtd", dropped, v[:, :, :stop], preferred_element_type=F32)
        outs.append(ungroup_rows(out.astype(v.dtype), group))
        probs.append(p)
    return jnp.concatenate(outs, axis=3), (q, k, v, keep, docs, probs)


def sum_by_key_block(parts: list, blocks: list[tuple[int, int]]) -> jax.Array:
    """Gradients for keys [0, stop) from each query block, summed into one for all keys: block by
    block, so that no part is padded to the full length."""
    return jnp.concatenate([sum(part[:, :, start:stop] for part in parts[i:])
                            for i, (start, stop) in enumerate(blocks)], axis=2)


def attention_backward(rate: float, saved, d_out):
    q, k, v, keep, docs, probs = saved
    group, blocks = q.shape[2], query_blocks(q.shape[3])
    d_q, d_k, d_v = [], [], []
    for (start, stop), p in zip(blocks, probs):
        mask, d_o, q_rows = block_mask(keep, start, stop), group_rows(d_out, start, stop), group_rows(q, start, stop)
        dropped = apply_dropout(p, mask, rate).astype(v.dtype)
        d_v.append(key_gradient(dropped, d_o))
        d_dropped = jnp.einsum("bhtd,bhsd->bhts", d_o, v[:, :, :stop], preferred_element_type=F32)
        d_probs = apply_dropout(d_dropped, mask, rate)
        # softmax's backward, then the 1/sqrt(d) scale; masked scores have probs 0, so gradient 0
        d_scores = p * (d_probs - jnp.sum(d_probs * p, -1, keepdims=True))
        d_scores = (d_scores / math.sqrt(q.shape[-1])).astype(q.dtype)
        d_q_rows = jnp.einsum("bhts,bhsd->bhtd", d_scores, k[:, :, :stop], preferred_element_type=F32)
        d_q.append(ungroup_rows(d_q_rows, group))
        d_k.append(key_gradient(d_scores, q_rows))
    # float32 sums over the key blocks, then the inputs' dtype
    return (jnp.concatenate(d_q, axis=3).astype(q.dtype), sum_by_key_block(d_k, blocks).astype(k.dtype),
            sum_by_key_block(d_v, blocks).astype(v.dtype), None, None)


attention_core.defvjp(attention_forward, attention_backward)

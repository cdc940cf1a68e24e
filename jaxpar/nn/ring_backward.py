"""The context ring's backward pass, flash-attention style: the probabilities are recomputed from
q, k and the forward's saved log-sum-exp, K/V go round the ring as in the forward
(jaxpar.nn.ring_attention), and each block's dK/dV accumulator follows it home.
"""

import math

import jax
import jax.numpy as jnp

from jaxpar.nn.attention import F32
from jaxpar.nn.ring_blocks import causal, ids, late_mask, ring_send, rows, scores, shares_document, source_before

# Backward, flash-attention style: the probabilities are recomputed from q, k and the saved
# log-sum-exp. `rows_in` is (q, d_out, lse, delta) of some query rows, delta = rowsum(d_out * out).

def block_grads(rows_in, k, v, mask, qs=None, ks=None):
    """float32 (dq of the rows, dk, dv of the block) from one block pair; dk and dv sum over the
    group's heads, as the group's query rows all use the one KV head."""
    q, d_out, lse, delta = rows_in
    p = jnp.exp(scores(q, k, mask, qs, ks) - lse[..., None])  # masked scores: p = 0, so no gradient
    d_p = jnp.einsum("bkgtd,bksd->bkgts", d_out, v, preferred_element_type=F32)
    d_s = p * (d_p - delta[..., None]) / math.sqrt(q.shape[-1])  # softmax's backward, then the scale
    d_q = jnp.einsum("bkgts,bksd->bkgtd", d_s.astype(k.dtype), k, preferred_element_type=F32)
    d_k = jnp.einsum("bkgts,bkgtd->bksd", d_s.astype(q.dtype), q, preferred_element_type=F32)
    d_v = jnp.einsum("bkgts,bkgtd->bksd", p.astype(d_out.dtype), d_out, preferred_element_type=F32)
    return d_q, d_k, d_v


def zigzag_diagonal_grads(rows_in, k, v, qs=None, ks=None):
    """The block pairs of zigzag_diagonal."""
    c = k.shape[2] // 2
    dq_early, dk_early, dv_early = block_grads(rows(rows_in, 0, c), k[:, :, :c], v[:, :, :c], causal(c),
                                               ids(qs, 0, c), ids(ks, 0, c))
    dq_late, dk, dv = block_grads(rows(rows_in, c, 2 * c), k, v, late_mask(c), ids(qs, c, 2 * c), ks)
    return (jnp.concatenate([dq_early, dq_late], axis=3), dk.at[:, :, :c].add(dk_early),
            dv.at[:, :, :c].add(dv_early))


def grads_if_shared(qs, ks, work, rows_in, k, v):
    """work(rows_in) where the queries and keys share a document (always without ids), else zeros
    of its shapes: (dq of rows_in's queries, dk, dv)."""
    if qs is None:
        return work(rows_in)
    return jax.lax.cond(shares_document(qs, ks), work, lambda rows_in: (
        jnp.zeros_like(rows_in[0], F32), jnp.zeros_like(k, F32), jnp.zeros_like(v, F32)), rows_in)


def zigzag_step_grads(rows_in, k, v, src_before, qs=None, ks=None):
    """The block pairs of zigzag_step, as full-size gradients (zeros where a chunk saw nothing)."""
    c = k.shape[2] // 2

    def early_keys(rows_in):
        early = ids(ks, 0, c)
        d_q, d_k, d_v = grads_if_shared(qs, early, lambda r: block_grads(r, k[:, :, :c], v[:, :, :c], None, qs, early),
                                        rows_in, k[:, :, :c], v[:, :, :c])
        return d_q, jnp.concatenate([d_k, jnp.zeros_like(d_k)], axis=2), jnp.concatenate([d_v, jnp.zeros_like(d_v)], 2)

    def late_queries(rows_in):
        late = ids(qs, c, 2 * c)
        d_q, d_k, d_v = grads_if_shared(late, ks, lambda r: block_grads(r, k, v, None, late, ks),
                                        rows(rows_in, c, 2 * c), k, v)
        return jnp.concatenate([jnp.zeros_like(d_q), d_q], axis=3), d_k, d_v
    return jax.lax.cond(src_before, early_keys, late_queries, rows_in)


def contiguous_diagonal_grads(rows_in, k, v, qs=None, ks=None):
    return block_grads(rows_in, k, v, causal(k.shape[2]), qs, ks)


def contiguous_step_grads(rows_in, k, v, src_before, qs=None, ks=None):
    def skipped(rows_in):  # zeros_like keeps the inputs' varying manual axes, as check_vma wants
        return (jnp.zeros_like(rows_in[0], F32), jnp.zeros_like(k, F32), jnp.zeros_like(v, F32))
    return jax.lax.cond(src_before, lambda rows_in: grads_if_shared(
        qs, ks, lambda r: block_grads(r, k, v, None, qs, ks), rows_in, k, v), skipped, rows_in)


BACKWARD = {"zigzag": (zigzag_diagonal_grads, zigzag_step_grads),
            "contiguous": (contiguous_diagonal_grads, contiguous_step_grads)}


def ring_backward(axis_name: str, layout: str, kernel, saved, d_out):
    """(dq, dk, dv, None for the ids) in the inputs' dtypes. K/V go round as in the forward; each
    block's float32 dK/dV accumulator follows one step behind it and is sent on once more at the
    end, which brings it home."""
    q, k, v, segments, out, lse = saved
    n = jax.lax.axis_size(axis_name)
    diagonal, step = BACKWARD[layout]
    send = ring_send(axis_name, n)
    rows_in = (q, d_out, lse, jnp.sum(d_out.astype(F32) * out.astype(F32), axis=-1))
    kv = send((k, v, segments)) if n > 1 else None
    d_q, d_k, d_v = diagonal(rows_in, k, v, segments, segments)

    def ring_step(s, d_q, kv, grads, send_kv: bool):
        # Both sends go out before this step's work: the block for step s + 1, and the dK/dV of the
        # block held now, summed by the devices before this one (it is added only after the work).
        next_kv = send(kv) if send_kv else None
        arrived = send(grads)
        k_s, v_s, ks = kv
        dq_part, dk_part, dv_part = step(rows_in, k_s, v_s, source_before(axis_name, s), segments, ks)
        return d_q + dq_part, next_kv, (arrived[0] + dk_part, arrived[1] + dv_part)
    if n > 1:
        d_q, kv, grads = jax.lax.fori_loop(1, n - 1, lambda s, c: ring_step(s, *c, send_kv=True), (d_q, kv, (d_k, d_v)))
        d_q, _, grads = ring_step(n - 1, d_q, kv, grads, send_kv=False)
        d_k, d_v = send(grads)  # home: the block held after N - 1 steps is the next device's
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None

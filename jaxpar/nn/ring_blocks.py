"""What the context ring's forward and backward passes share (jaxpar.nn.ring_attention,
jaxpar.nn.ring_backward): the block pairs' masks and scores, documents, the rows of a state,
and the ring's sends.
"""

import functools
import math

import jax
import jax.numpy as jnp

from jaxpar.nn.attention import F32

MASKED = jnp.finfo(F32).min  # a masked score: exp(MASKED - anything finite) is 0


def causal(n: int) -> jax.Array:
    return jnp.tril(jnp.ones((n, n), dtype=bool))


def late_mask(c: int) -> jax.Array:
    """Zigzag's own late chunk of queries against both its key chunks: all of the early, causal in the late."""
    return jnp.concatenate([jnp.ones((c, c), dtype=bool), causal(c)], axis=1)


def same_document(qs, ks):
    """(batch, 1, 1, queries, keys): whether each query and key share a document; None without ids."""
    return None if qs is None else (qs[:, :, None] == ks[:, None, :])[:, None, None]


def shares_document(qs, ks):
    """Whether any row's queries and keys share a document (ids rise along the true order, so
    their ranges meet); True without ids."""
    if qs is None:
        return True
    return jnp.any((qs.min(1) <= ks.max(1)) & (ks.min(1) <= qs.max(1)))


def scores(q, k, mask, qs=None, ks=None) -> jax.Array:
    """Scaled float32 scores (batch, kv_heads, group, queries, keys); mask (queries, keys) or None,
    and the documents' mask where ids are given."""
    s = jnp.einsum("bkgtd,bksd->bkgts", q, k, preferred_element_type=F32) / math.sqrt(q.shape[-1])
    same = same_document(qs, ks)
    if same is not None:
        mask = same if mask is None else mask & same
    return s if mask is None else jnp.where(mask, s, MASKED)


def rows(state, start: int, stop: int):
    """Query rows [start, stop) of a state (or of any arrays whose fourth axis is the queries)."""
    return tuple(a[:, :, :, start:stop] for a in state)


def ids(a, start, stop):
    """Document ids [start, stop) of the sequence, or None."""
    return None if a is None else a[:, start:stop]


def ring_send(axis_name: str, n: int):
    """x -> what the previous device on the ring sent: every device passes to the next."""
    return functools.partial(jax.lax.ppermute, axis_name=axis_name, perm=[(i, (i + 1) % n) for i in range(n)])


def source_before(axis_name: str, s):
    """Whether the block a device holds at ring step s (device (r - s) mod N's) comes from before it."""
    n, r = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    return (r - s + n) % n < r

"""Ring attention: causal attention over a sequence split across one mesh axis (context parallelism).

`ring_attention` runs inside `jax.shard_map`, manual over that axis. Each of its N devices holds T/N
tokens of every sequence and keeps its queries; the K/V blocks go around the ring with `ppermute`,
and the partial results merge by a float32 online softmax (log-sum-exp). The backward pass is a
second ring in which the dK/dV accumulators travel with their K/V blocks and arrive home at the end.

Where the tokens live is the layout. "contiguous": device r holds chunk r of N, so device r has r + 1
blocks of causal work and the last one about twice the average. "zigzag": the sequence is cut into
2N chunks and device r holds chunks r and 2N - 1 - r; every device then has the same work, and the
ring skips, rather than masks, the block pairs that causality rules out (`pair_work` counts them).
The caller lays a batch out with `layout_permutation` before the split and undoes it after.

Conventions as in jaxpar.models.attention: q is (batch, kv_heads, group, seq, head_dim), k and v are
(batch, kv_heads, seq, head_dim); the `group` query heads share a KV head (grouped-query attention);
dots accumulate in float32; scores are scaled by 1/sqrt(head_dim). No dropout.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.core.axes import zigzag_permutation
from jaxpar.models.attention import F32
from jaxpar.models.kernels import block_attention

MASKED = jnp.finfo(F32).min  # a masked score: exp(MASKED - anything finite) is 0
LAYOUTS = ("zigzag", "contiguous")


def contiguous_permutation(seq_len: int, ring: int) -> np.ndarray:
    """The identity: device r holds chunk r of `ring` equal chunks."""
    if seq_len % ring:
        raise ValueError(f"ring attention needs seq_len divisible by ring: seq_len {seq_len}, ring {ring}")
    return np.arange(seq_len)


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown ring attention layout {layout!r}: expected one of {LAYOUTS}")
    return layout


def layout_permutation(layout: str, seq_len: int, ring: int) -> np.ndarray:
    permute = {"zigzag": zigzag_permutation, "contiguous": contiguous_permutation}[check_layout(layout)]
    return permute(seq_len, ring)


def step_blocks(layout: str, local: int, r: int, src: int) -> list[tuple[int, int]]:
    """(query rows, keys) of each block of scores that device r computes against device src's K/V,
    with `local` tokens per device: what ring_forward's diagonal and step functions compute."""
    if layout == "contiguous":
        return [(local, local)] if src <= r else []
    c = local // 2
    if src == r:  # early queries against early keys; late queries against both
        return [(c, c), (c, 2 * c)]
    return [(2 * c, c)] if src < r else [(c, 2 * c)]


def pair_work(seq_len: int, ring: int, layout: str) -> list[int]:
    """(query, key) score elements each device computes over all ring steps of one pass (the
    backward computes the same pairs again). A causal diagonal chunk pair counts as its full
    square: the code computes the whole square and masks its upper corner."""
    layout_permutation(layout, seq_len, ring)  # the same checks as the layout
    local = seq_len // ring
    return [sum(rows * keys for s in range(ring) for rows, keys in step_blocks(layout, local, r, (r - s) % ring))
            for r in range(ring)]


def causal(n: int) -> jax.Array:
    return jnp.tril(jnp.ones((n, n), dtype=bool))


def late_mask(c: int) -> jax.Array:
    """Zigzag's own late chunk of queries against both its key chunks: all of the early, causal in the late."""
    return jnp.concatenate([jnp.ones((c, c), dtype=bool), causal(c)], axis=1)


def scores(q, k, mask) -> jax.Array:
    """Scaled float32 scores (batch, kv_heads, group, queries, keys); mask (queries, keys) or None."""
    s = jnp.einsum("bkgtd,bksd->bkgts", q, k, preferred_element_type=F32) / math.sqrt(q.shape[-1])
    return s if mask is None else jnp.where(mask, s, MASKED)


# Forward. The state of a device's queries is (max, sum, output) of their softmax rows so far, all
# float32 and the output unnormalised: (batch, kv_heads, group, queries) twice and (..., head_dim).

def block_state(q, k, v, mask: str | None, kernel: str = "xla"):
    """The softmax state of q's rows against one block of keys: mask None (every key), "causal" or
    "late" (zigzag's late queries: the early keys whole, the late causally). Every row sees a key,
    so the max is finite. A fused kernel's output and log-sum-exp are the state (lse, 1, output)."""
    if kernel != "xla":
        if mask == "late":
            c = q.shape[3]
            return merge(block_state(q, k[:, :, :c], v[:, :, :c], None, kernel),
                         block_state(q, k[:, :, c:], v[:, :, c:], "causal", kernel))
        out, lse = block_attention(kernel, q, k, v, causal=mask == "causal")
        return lse, jnp.ones_like(lse), out
    s = scores(q, k, None if mask is None else causal(q.shape[3]) if mask == "causal" else late_mask(q.shape[3]))
    m = s.max(-1)
    p = jnp.exp(s - m[..., None])
    out = jnp.einsum("bkgts,bksd->bkgtd", p.astype(v.dtype), v, preferred_element_type=F32)
    return m, p.sum(-1), out


def merge(a, b):
    """Two states of the same rows as one: each rescaled to the common max."""
    m = jnp.maximum(a[0], b[0])
    wa, wb = jnp.exp(a[0] - m), jnp.exp(b[0] - m)
    return m, a[1] * wa + b[1] * wb, a[2] * wa[..., None] + b[2] * wb[..., None]


def rows(state, start: int, stop: int):
    """Query rows [start, stop) of a state (or of any arrays whose fourth axis is the queries)."""
    return tuple(a[:, :, :, start:stop] for a in state)


def concat_rows(a, b):
    return tuple(jnp.concatenate(pair, axis=3) for pair in zip(a, b))


def zigzag_diagonal(q, k, v, kernel):
    """Step 0, own block: early queries see the early keys causally; late queries see all the early
    keys and the late ones causally. Early queries against late keys are all masked: not computed."""
    c = q.shape[3] // 2
    early = block_state(q[:, :, :, :c], k[:, :, :c], v[:, :, :c], "causal", kernel)
    return concat_rows(early, block_state(q[:, :, :, c:], k, v, "late", kernel))


def zigzag_step(state, q, k, v, src_before, kernel):
    """Another device's block. From an earlier device (src < r): both query chunks see its early key
    chunk whole and none of its late one. From a later device: only the late query chunk sees
    anything, both key chunks whole. Either way 2 c^2 scores, so no device waits on another."""
    c = q.shape[3] // 2

    def early_keys(state):
        return merge(state, block_state(q, k[:, :, :c], v[:, :, :c], None, kernel))

    def late_queries(state):
        return concat_rows(rows(state, 0, c), merge(rows(state, c, 2 * c), block_state(q[:, :, :, c:], k, v, None, kernel)))
    return jax.lax.cond(src_before, early_keys, late_queries, state)


def contiguous_diagonal(q, k, v, kernel):
    return block_state(q, k, v, "causal", kernel)


def contiguous_step(state, q, k, v, src_before, kernel):
    """An earlier device's block is seen whole; a later one's is skipped (cond runs no work)."""
    return jax.lax.cond(src_before, lambda state: merge(state, block_state(q, k, v, None, kernel)),
                        lambda state: state, state)


FORWARD = {"zigzag": (zigzag_diagonal, zigzag_step), "contiguous": (contiguous_diagonal, contiguous_step)}


def ring_send(axis_name: str, n: int):
    """x -> what the previous device on the ring sent: every device passes to the next."""
    return functools.partial(jax.lax.ppermute, axis_name=axis_name, perm=[(i, (i + 1) % n) for i in range(n)])


def source_before(axis_name: str, s):
    """Whether the block a device holds at ring step s (device (r - s) mod N's) comes from before it."""
    n, r = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    return (r - s + n) % n < r


def ring_forward(q, k, v, axis_name: str, layout: str, kernel: str = "xla"):
    """(output in q's dtype, float32 log-sum-exp of each query row); each block pair by `kernel`."""
    n = jax.lax.axis_size(axis_name)
    diagonal, step = FORWARD[layout]
    send = ring_send(axis_name, n)
    kv = send((k, v)) if n > 1 else None  # step 1's block travels while step 0 computes
    state = diagonal(q, k, v, kernel)

    def body(s, carry):
        state, kv = carry
        next_kv = send(kv)  # issued before this step's work, so the two can overlap
        return step(state, q, *kv, source_before(axis_name, s), kernel), next_kv
    if n > 1:
        state, kv = jax.lax.fori_loop(1, n - 1, body, (state, kv))
        state = step(state, q, *kv, source_before(axis_name, n - 1), kernel)  # the last block: nothing to send on
    m, total, out = state
    return (out / total[..., None]).astype(q.dtype), m + jnp.log(total)


# Backward, flash-attention style: the probabilities are recomputed from q, k and the saved
# log-sum-exp. `rows_in` is (q, d_out, lse, delta) of some query rows, delta = rowsum(d_out * out).

def block_grads(rows_in, k, v, mask):
    """float32 (dq of the rows, dk, dv of the block) from one block pair; dk and dv sum over the
    group's heads, as the group's query rows all use the one KV head."""
    q, d_out, lse, delta = rows_in
    p = jnp.exp(scores(q, k, mask) - lse[..., None])  # masked scores: p = 0, so no gradient
    d_p = jnp.einsum("bkgtd,bksd->bkgts", d_out, v, preferred_element_type=F32)
    d_s = p * (d_p - delta[..., None]) / math.sqrt(q.shape[-1])  # softmax's backward, then the scale
    d_q = jnp.einsum("bkgts,bksd->bkgtd", d_s.astype(k.dtype), k, preferred_element_type=F32)
    d_k = jnp.einsum("bkgts,bkgtd->bksd", d_s.astype(q.dtype), q, preferred_element_type=F32)
    d_v = jnp.einsum("bkgts,bkgtd->bksd", p.astype(d_out.dtype), d_out, preferred_element_type=F32)
    return d_q, d_k, d_v


def zigzag_diagonal_grads(rows_in, k, v):
    """The block pairs of zigzag_diagonal."""
    c = k.shape[2] // 2
    dq_early, dk_early, dv_early = block_grads(rows(rows_in, 0, c), k[:, :, :c], v[:, :, :c], causal(c))
    dq_late, dk, dv = block_grads(rows(rows_in, c, 2 * c), k, v, late_mask(c))
    return (jnp.concatenate([dq_early, dq_late], axis=3), dk.at[:, :, :c].add(dk_early),
            dv.at[:, :, :c].add(dv_early))


def zigzag_step_grads(rows_in, k, v, src_before):
    """The block pairs of zigzag_step, as full-size gradients (zeros where a chunk saw nothing)."""
    c = k.shape[2] // 2

    def early_keys(rows_in):
        d_q, d_k, d_v = block_grads(rows_in, k[:, :, :c], v[:, :, :c], None)
        return d_q, jnp.concatenate([d_k, jnp.zeros_like(d_k)], axis=2), jnp.concatenate([d_v, jnp.zeros_like(d_v)], 2)

    def late_queries(rows_in):
        d_q, d_k, d_v = block_grads(rows(rows_in, c, 2 * c), k, v, None)
        return jnp.concatenate([jnp.zeros_like(d_q), d_q], axis=3), d_k, d_v
    return jax.lax.cond(src_before, early_keys, late_queries, rows_in)


def contiguous_diagonal_grads(rows_in, k, v):
    return block_grads(rows_in, k, v, causal(k.shape[2]))


def contiguous_step_grads(rows_in, k, v, src_before):
    def skipped(rows_in):  # zeros_like keeps the inputs' varying manual axes, as check_vma wants
        return (jnp.zeros_like(rows_in[0], F32), jnp.zeros_like(k, F32), jnp.zeros_like(v, F32))
    return jax.lax.cond(src_before, lambda rows_in: block_grads(rows_in, k, v, None), skipped, rows_in)


BACKWARD = {"zigzag": (zigzag_diagonal_grads, zigzag_step_grads),
            "contiguous": (contiguous_diagonal_grads, contiguous_step_grads)}


def ring_backward(axis_name: str, layout: str, kernel: str, saved, d_out):
    """(dq, dk, dv) in the inputs' dtypes. K/V go round as in the forward; each block's float32 dK/dV
    accumulator follows one step behind it and is sent on once more at the end, which brings it home."""
    q, k, v, out, lse = saved
    n = jax.lax.axis_size(axis_name)
    diagonal, step = BACKWARD[layout]
    send = ring_send(axis_name, n)
    rows_in = (q, d_out, lse, jnp.sum(d_out.astype(F32) * out.astype(F32), axis=-1))
    kv = send((k, v)) if n > 1 else None
    d_q, d_k, d_v = diagonal(rows_in, k, v)

    def ring_step(s, d_q, kv, grads, send_kv: bool):
        # Both sends go out before this step's work: the block for step s + 1, and the dK/dV of the
        # block held now, summed by the devices before this one (it is added only after the work).
        next_kv = send(kv) if send_kv else None
        arrived = send(grads)
        dq_part, dk_part, dv_part = step(rows_in, *kv, source_before(axis_name, s))
        return d_q + dq_part, next_kv, (arrived[0] + dk_part, arrived[1] + dv_part)
    if n > 1:
        d_q, kv, grads = jax.lax.fori_loop(1, n - 1, lambda s, c: ring_step(s, *c, send_kv=True), (d_q, kv, (d_k, d_v)))
        d_q, _, grads = ring_step(n - 1, d_q, kv, grads, send_kv=False)
        d_k, d_v = send(grads)  # home: the block held after N - 1 steps is the next device's
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def ring_core(q, k, v, axis_name: str, layout: str, kernel: str) -> jax.Array:
    return ring_forward(q, k, v, axis_name, layout, kernel)[0]


def ring_core_forward(q, k, v, axis_name: str, layout: str, kernel: str):
    out, lse = ring_forward(q, k, v, axis_name, layout, kernel)
    return out, (q, k, v, out, lse)  # the LSE is all the backward needs to recompute the probabilities


ring_core.defvjp(ring_core_forward, ring_backward)


def ring_attention(q, k, v, axis_name: str, layout: str = "zigzag", kernel: str = "xla") -> jax.Array:
    """Causal attention of this device's queries against the whole sequence, inside `jax.shard_map`
    manual over `axis_name`: q (batch, kv_heads, group, local, head_dim), k and v (batch, kv_heads,
    local, head_dim), the local tokens in `layout`'s order (layout_permutation). Causal in the true
    global positions. Returns (batch, kv_heads, group, local, head_dim) in q's dtype. `kernel` runs
    the forward's block pairs (xla, splash, cudnn); the backward's are xla's, from the ring's lse."""
    check_layout(layout)
    B, K, _, T, D = q.shape
    if k.shape != (B, K, T, D) or v.shape != k.shape:
        raise ValueError(f"ring attention needs k, v of shape {(B, K, T, D)} for q {q.shape}: got {k.shape}, {v.shape}")
    if layout == "zigzag" and T % 2:
        raise ValueError(f"zigzag ring attention needs an even number of local tokens: got {T}")
    return ring_core(q, k, v, axis_name, layout, kernel)

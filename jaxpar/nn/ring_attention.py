"""Ring attention: causal attention over a sequence split across one mesh axis (context parallelism).

`ring_attention` runs inside `jax.shard_map`, manual over that axis. Each of its N devices holds T/N
tokens of every sequence and keeps its queries; the K/V blocks go around the ring with `ppermute`,
and the partial results merge by a float32 online softmax (log-sum-exp). The backward pass
(jaxpar.nn.ring_backward) is a second ring in which the dK/dV accumulators travel with their K/V
blocks and arrive home at the end.

Where the tokens live is the layout. "contiguous": device r holds chunk r of N, so device r has r + 1
blocks of causal work and the last one about twice the average. "zigzag": the sequence is cut into
2N chunks and device r holds chunks r and 2N - 1 - r; every device then has the same work, and the
ring skips, rather than masks, the block pairs that causality rules out (`pair_work` counts them).
The caller lays a batch out with `layout_permutation` before the split and undoes it after.

Conventions as in jaxpar.nn.attention: q is (batch, kv_heads, group, seq, head_dim), k and v are
(batch, kv_heads, seq, head_dim); the `group` query heads share a KV head (grouped-query attention);
dots accumulate in float32; scores are scaled by 1/sqrt(head_dim). No dropout.

Documents: the tokens' document ids (batch, seq), `qs` for the queries and `ks` for the keys,
travel round the ring with K/V, and a query sees its own document's keys alone. A block pair whose
chunks share no document in any row is skipped (a cond), as causality's are. With documents the
block pairs run in xla: a fused kernel's row that sees no key of a block has no defined output.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.nn.attention import F32
from jaxpar.nn.kernels import XLA, BlockKernel, block_attention
from jaxpar.nn.ring_backward import ring_backward
from jaxpar.nn.ring_blocks import causal, ids, late_mask, ring_send, rows, scores, shares_document, source_before

LAYOUTS = ("zigzag", "contiguous")


def zigzag_permutation(seq_len: int, ring: int) -> np.ndarray:
    """Global positions in zigzag order: device 0's tokens first (chunks 0 and 2*ring - 1 of the
    2*ring equal chunks), then device 1's (chunks 1 and 2*ring - 2), and so on; `x[:, perm]` lays
    a batch out for a split of the sequence axis over `ring` devices."""
    if seq_len % (2 * ring):
        raise ValueError(f"zigzag ring attention needs seq_len divisible by 2 * ring: seq_len {seq_len}, "
                         f"ring {ring}")
    chunks = np.arange(seq_len).reshape(2 * ring, -1)
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * ring - 1 - r]]) for r in range(ring)])


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


# Forward. The state of a device's queries is (max, sum, output) of their softmax rows so far, all
# float32 and the output unnormalised: (batch, kv_heads, group, queries) twice and (..., head_dim).

def block_state(q, k, v, mask: str | None, kernel: BlockKernel = XLA, qs=None, ks=None):
    """The softmax state of q's rows against one block of keys: mask None (every key), "causal" or
    "late" (zigzag's late queries: the early keys whole, the late causally). A row that sees no key
    (another document's block) has the max MASKED, which any block it sees outweighs in `merge`;
    every row sees itself. A fused kernel's output and log-sum-exp are the state (lse, 1, output)."""
    if kernel.fused and qs is None:
        if mask == "late":
            c = q.shape[3]
            return merge(block_state(q, k[:, :, :c], v[:, :, :c], None, kernel),
                         block_state(q, k[:, :, c:], v[:, :, c:], "causal", kernel))
        out, lse = block_attention(kernel, q, k, v, causal=mask == "causal")
        return lse, jnp.ones_like(lse), out
    s = scores(q, k, None if mask is None else causal(q.shape[3]) if mask == "causal" else late_mask(q.shape[3]),
               qs, ks)
    m = s.max(-1)
    p = jnp.exp(s - m[..., None])
    out = jnp.einsum("bkgts,bksd->bkgtd", p.astype(v.dtype), v, preferred_element_type=F32)
    return m, p.sum(-1), out


def merge(a, b):
    """Two states of the same rows as one: each rescaled to the common max."""
    m = jnp.maximum(a[0], b[0])
    wa, wb = jnp.exp(a[0] - m), jnp.exp(b[0] - m)
    return m, a[1] * wa + b[1] * wb, a[2] * wa[..., None] + b[2] * wb[..., None]


def concat_rows(a, b):
    return tuple(jnp.concatenate(pair, axis=3) for pair in zip(a, b))


def zigzag_diagonal(q, k, v, kernel, qs=None, ks=None):
    """Step 0, own block: early queries see the early keys causally; late queries see all the early
    keys and the late ones causally. Early queries against late keys are all masked: not computed."""
    c = q.shape[3] // 2
    early = block_state(q[:, :, :, :c], k[:, :, :c], v[:, :, :c], "causal", kernel, ids(qs, 0, c), ids(ks, 0, c))
    return concat_rows(early, block_state(q[:, :, :, c:], k, v, "late", kernel, ids(qs, c, 2 * c), ks))


def if_shared(qs, ks, work, state):
    """work(state) where the queries and keys share a document (always without ids), else state."""
    if qs is None:
        return work(state)
    return jax.lax.cond(shares_document(qs, ks), work, lambda state: state, state)


def zigzag_step(state, q, k, v, src_before, kernel, qs=None, ks=None):
    """Another device's block. From an earlier device (src < r): both query chunks see its early key
    chunk whole and none of its late one. From a later device: only the late query chunk sees
    anything, both key chunks whole. Either way 2 c^2 scores, so no device waits on another."""
    c = q.shape[3] // 2

    def early_keys(state):
        early = ids(ks, 0, c)
        return if_shared(qs, early, lambda state: merge(
            state, block_state(q, k[:, :, :c], v[:, :, :c], None, kernel, qs, early)), state)

    def late_queries(state):
        late = ids(qs, c, 2 * c)
        return concat_rows(rows(state, 0, c), if_shared(late, ks, lambda part: merge(
            part, block_state(q[:, :, :, c:], k, v, None, kernel, late, ks)), rows(state, c, 2 * c)))
    return jax.lax.cond(src_before, early_keys, late_queries, state)


def contiguous_diagonal(q, k, v, kernel, qs=None, ks=None):
    return block_state(q, k, v, "causal", kernel, qs, ks)


def contiguous_step(state, q, k, v, src_before, kernel, qs=None, ks=None):
    """An earlier device's block is seen whole; a later one's is skipped (cond runs no work)."""
    return jax.lax.cond(src_before, lambda state: if_shared(qs, ks, lambda state: merge(
        state, block_state(q, k, v, None, kernel, qs, ks)), state), lambda state: state, state)


FORWARD = {"zigzag": (zigzag_diagonal, zigzag_step), "contiguous": (contiguous_diagonal, contiguous_step)}


def ring_forward(q, k, v, segments, axis_name: str, layout: str, kernel: BlockKernel = XLA):
    """(output in q's dtype, float32 log-sum-exp of each query row); each block pair by `kernel`.
    segments: this device's tokens' document ids (batch, local), or None."""
    n = jax.lax.axis_size(axis_name)
    diagonal, step = FORWARD[layout]
    send = ring_send(axis_name, n)
    kv = send((k, v, segments)) if n > 1 else None  # step 1's block travels while step 0 computes
    state = diagonal(q, k, v, kernel, segments, segments)

    def at_step(state, kv, s):
        k, v, ks = kv
        return step(state, q, k, v, source_before(axis_name, s), kernel, segments, ks)

    def body(s, carry):
        state, kv = carry
        next_kv = send(kv)  # issued before this step's work, so the two can overlap
        return at_step(state, kv, s), next_kv
    if n > 1:
        state, kv = jax.lax.fori_loop(1, n - 1, body, (state, kv))
        state = at_step(state, kv, n - 1)  # the last block: nothing to send on
    m, total, out = state
    return (out / total[..., None]).astype(q.dtype), m + jnp.log(total)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def ring_core(q, k, v, segments, axis_name: str, layout: str, kernel: BlockKernel) -> jax.Array:
    return ring_forward(q, k, v, segments, axis_name, layout, kernel)[0]


def ring_core_forward(q, k, v, segments, axis_name: str, layout: str, kernel: BlockKernel):
    out, lse = ring_forward(q, k, v, segments, axis_name, layout, kernel)
    return out, (q, k, v, segments, out, lse)  # the LSE is all the backward needs to recompute the probabilities


ring_core.defvjp(ring_core_forward, ring_backward)


def ring_attention(q, k, v, axis_name: str, layout: str = "zigzag", kernel: BlockKernel = XLA,
                   segments=None) -> jax.Array:
    """Causal attention of this device's queries against the whole sequence, inside `jax.shard_map`
    manual over `axis_name`: q (batch, kv_heads, group, local, head_dim), k and v (batch, kv_heads,
    local, head_dim), the local tokens in `layout`'s order (layout_permutation). Causal in the true
    global positions. Returns (batch, kv_heads, group, local, head_dim) in q's dtype. `kernel` runs
    the forward's block pairs (xla, splash, cudnn); the backward's are xla's, from the ring's lse.
    segments: the local tokens' document ids (batch, local), or None."""
    check_layout(layout)
    B, K, _, T, D = q.shape
    if k.shape != (B, K, T, D) or v.shape != k.shape:
        raise ValueError(f"ring attention needs k, v of shape {(B, K, T, D)} for q {q.shape}: got {k.shape}, {v.shape}")
    if layout == "zigzag" and T % 2:
        raise ValueError(f"zigzag ring attention needs an even number of local tokens: got {T}")
    return ring_core(q, k, v, segments, axis_name, layout, kernel)

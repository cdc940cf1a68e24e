"""The next-token cross-entropy, whole or over pieces of the sequence (model.loss_chunks).

Over pieces, each piece's gradient is computed in the forward pass, as Liger-Kernel's fused
linear cross-entropy does: the piece's float32 logits give its loss and its logit gradient
(softmax less the one-hot target) at once, and the head's backward runs on them there and then.
So no piece's logits outlive its step of the scan, the whole batch's float32 logits are never
held, and nothing is recomputed: the backward pass only scales the kept gradients by the loss's
cotangent. Levanter's blockwise loss and MaxText's vocabulary tiling keep the logits out of
memory the same way; torchtitan's ChunkedLossWrapper recomputes them instead.

`one_pass` (the execution plan's decision) takes each piece's log-sum-exp in one pass over its
logits, a running (max, sum) per row as flash attention's online softmax keeps. XLA:GPU otherwise
reads a piece's float32 logits once for the max and again for the sum (XLA:TPU fuses the max into
the head's matmul, and a CPU waits on arithmetic, so there it stays two passes).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np


def token_losses(logits: jax.Array, targets: jax.Array, one_pass: bool = False) -> jax.Array:
    """Each token's next-token cross-entropy (taken in float32)."""
    return losses_and_softmax_terms(logits, targets, one_pass)[0]


def log_sum_exp_one_pass(x: jax.Array) -> jax.Array:
    """log(sum(exp(x))) over the last axis, kept, in one reduction: each element enters as (x, 1),
    and two partial (max, sum of exp(x - max)) combine on the larger max. Not differentiable (the
    chunked loss writes its own gradient)."""
    def combine(a, b):
        (max_a, sum_a), (max_b, sum_b) = a, b
        top = jnp.maximum(max_a, max_b)
        # The side that holds the max needs no rescaling; that also keeps exp(-inf - -inf) out.
        rescale = lambda high, total: jnp.where(high == top, total, total * jnp.exp(high - top))
        return top, rescale(max_a, sum_a) + rescale(max_b, sum_b)
    top, total = jax.lax.reduce((x, jnp.ones_like(x)), (jnp.float32(-jnp.inf), jnp.float32(0)), combine, (x.ndim - 1,))
    return (top + jnp.log(total))[..., None]


def losses_and_softmax_terms(logits: jax.Array, targets: jax.Array,
                             one_pass: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(each token's cross-entropy, its log-sum-exp with the vocab axis kept, the one-hot target
    mask): the loss, and what its logit gradient softmax - one-hot is made of. Logits in a lower
    dtype (model.logits_dtype) are taken in float32 here."""
    logits = logits.astype(jnp.float32)
    log_z = log_sum_exp_one_pass(logits) if one_pass else jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    # A one-hot sum, not a gather: exact all the same, it splits over a vocab-parallel axis, and
    # XLA's partitioner crashes on this gather inside a pipeline stage with data and tensor axes.
    is_target = jax.nn.one_hot(targets, logits.shape[-1], dtype=bool)
    return log_z[..., 0] - jnp.sum(jnp.where(is_target, logits, 0.0), -1), log_z, is_target


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy; logits are float32."""
    return jnp.mean(token_losses(logits, targets))


def sequence_loss(logits_of, head: dict, x: jax.Array, targets: jax.Array, chunks: int = 1,
                  one_pass: bool = False) -> jax.Array:
    """Mean next-token cross-entropy of the final stream x (batch, seq, embed), where
    logits_of(head, x) gives its float32 logits (the final norm and lm_head on the `head`
    weights). With chunks > 1, over that many pieces of the sequence, each piece's log-sum-exp
    in one pass if `one_pass` (the module's docstring)."""
    if chunks == 1:
        return cross_entropy(logits_of(head, x), targets)
    return chunked_loss(logits_of, chunks, one_pass, head, x, targets)


def pieces(x: jax.Array, targets: jax.Array, chunks: int) -> tuple[jax.Array, jax.Array]:
    """(x, targets) cut along the sequence into `chunks` pieces on a new leading axis."""
    B, T = targets.shape
    return (x.reshape(B, chunks, T // chunks, *x.shape[2:]).swapaxes(0, 1),
            targets.reshape(B, chunks, T // chunks).swapaxes(0, 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def chunked_loss(logits_of, chunks: int, one_pass: bool, head: dict, x: jax.Array, targets: jax.Array) -> jax.Array:
    def add_piece(total, piece):
        x, targets = piece
        return total + jnp.sum(token_losses(logits_of(head, x), targets, one_pass)), None
    total, _ = jax.lax.scan(add_piece, jnp.float32(0), pieces(x, targets, chunks))
    return total / targets.size


def _forward(logits_of, chunks, one_pass, head, x, targets):
    """The loss and, kept for the backward, its gradients for a cotangent of 1."""
    scale = jnp.float32(targets.size)

    def add_piece(carry, piece):
        total, head_grad = carry
        x, targets = piece
        logits, head_backward = jax.vjp(logits_of, head, x)
        logits32 = logits.astype(jnp.float32)  # model.logits_dtype's logits, taken in float32
        losses, log_z, is_target = losses_and_softmax_terms(logits32, targets, one_pass)
        total = total + jnp.sum(losses)
        # d(mean loss)/d(logits) = (softmax - one-hot) / tokens: the piece's logits alone give it.
        logit_grad = (jnp.exp(logits32 - log_z) - is_target) / scale
        piece_head_grad, x_grad = head_backward(logit_grad.astype(logits.dtype))
        return (total, jax.tree.map(jnp.add, head_grad, piece_head_grad)), x_grad

    (total, head_grad), x_grads = jax.lax.scan(add_piece, (jnp.float32(0), jax.tree.map(jnp.zeros_like, head)),
                                               pieces(x, targets, chunks))
    return total / scale, (head_grad, x_grads.swapaxes(0, 1).reshape(x.shape))


def _backward(logits_of, chunks, one_pass, kept, cotangent):
    head_grad, x_grad = kept
    no_targets_grad = np.zeros(x_grad.shape[:2], jax.dtypes.float0)  # integer targets
    return jax.tree.map(lambda g: g * cotangent, head_grad), x_grad * cotangent, no_targets_grad


chunked_loss.defvjp(_forward, _backward)

"""The next-token cross-entropy, whole or over pieces of the sequence (model.loss_chunks).

Over pieces, each piece's gradient is computed in the forward pass, as Liger-Kernel's fused
linear cross-entropy does: the piece's float32 logits give its loss and its logit gradient
(softmax less the one-hot target) at once, and the head's backward runs on them there and then.
So no piece's logits outlive its step of the scan, the whole batch's float32 logits are never
held, and nothing is recomputed: the backward pass only scales the kept gradients by the loss's
cotangent. Levanter's blockwise loss and MaxText's vocabulary tiling keep the logits out of
memory the same way; torchtitan's ChunkedLossWrapper recomputes them instead.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np


def token_losses(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Each token's next-token cross-entropy; logits are float32."""
    return losses_and_softmax_terms(logits, targets)[0]


def losses_and_softmax_terms(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(each token's cross-entropy, its log-sum-exp with the vocab axis kept, the one-hot target
    mask): the loss, and what its logit gradient softmax - one-hot is made of."""
    log_z = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    # A one-hot sum, not a gather: exact all the same, it splits over a vocab-parallel axis, and
    # XLA's partitioner crashes on this gather inside a pipeline stage with data and tensor axes.
    is_target = jax.nn.one_hot(targets, logits.shape[-1], dtype=bool)
    return log_z[..., 0] - jnp.sum(jnp.where(is_target, logits, 0.0), -1), log_z, is_target


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy; logits are float32."""
    return jnp.mean(token_losses(logits, targets))


def sequence_loss(logits_of, head: dict, x: jax.Array, targets: jax.Array, chunks: int = 1) -> jax.Array:
    """Mean next-token cross-entropy of the final stream x (batch, seq, embed), where
    logits_of(head, x) gives its float32 logits (the final norm and lm_head on the `head`
    weights). With chunks > 1, over that many pieces of the sequence (the module's docstring)."""
    if chunks == 1:
        return cross_entropy(logits_of(head, x), targets)
    return chunked_loss(logits_of, chunks, head, x, targets)


def pieces(x: jax.Array, targets: jax.Array, chunks: int) -> tuple[jax.Array, jax.Array]:
    """(x, targets) cut along the sequence into `chunks` pieces on a new leading axis."""
    B, T = targets.shape
    return (x.reshape(B, chunks, T // chunks, *x.shape[2:]).swapaxes(0, 1),
            targets.reshape(B, chunks, T // chunks).swapaxes(0, 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def chunked_loss(logits_of, chunks: int, head: dict, x: jax.Array, targets: jax.Array) -> jax.Array:
    def add_piece(total, piece):
        x, targets = piece
        return total + jnp.sum(token_losses(logits_of(head, x), targets)), None
    total, _ = jax.lax.scan(add_piece, jnp.float32(0), pieces(x, targets, chunks))
    return total / targets.size


def _forward(logits_of, chunks, head, x, targets):
    """The loss and, kept for the backward, its gradients for a cotangent of 1."""
    scale = jnp.float32(targets.size)

    def add_piece(carry, piece):
        total, head_grad = carry
        x, targets = piece
        logits, head_backward = jax.vjp(logits_of, head, x)
        losses, log_z, is_target = losses_and_softmax_terms(logits, targets)
        total = total + jnp.sum(losses)
        # d(mean loss)/d(logits) = (softmax - one-hot) / tokens: the piece's logits alone give it.
        piece_head_grad, x_grad = head_backward((jnp.exp(logits - log_z) - is_target) / scale)
        return (total, jax.tree.map(jnp.add, head_grad, piece_head_grad)), x_grad

    (total, head_grad), x_grads = jax.lax.scan(add_piece, (jnp.float32(0), jax.tree.map(jnp.zeros_like, head)),
                                               pieces(x, targets, chunks))
    return total / scale, (head_grad, x_grads.swapaxes(0, 1).reshape(x.shape))


def _backward(logits_of, chunks, kept, cotangent):
    head_grad, x_grad = kept
    no_targets_grad = np.zeros(x_grad.shape[:2], jax.dtypes.float0)  # integer targets
    return jax.tree.map(lambda g: g * cotangent, head_grad), x_grad * cotangent, no_targets_grad


chunked_loss.defvjp(_forward, _backward)

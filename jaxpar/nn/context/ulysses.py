"""Ulysses (DeepSpeed-Ulysses, Jacobs et al., 2023; MaxText's context_parallel_strategy=ulysses):
before attention, all-to-alls turn the sequence-split q, k and v into head-split ones, each device
then attends over the whole sequence with its share of the heads, and one more all-to-all turns
the output back. The batch stays in order. It needs the heads to split over tp x cp devices;
grouped-query attention's key/value heads are repeated up to the context size where there are
fewer, and latent attention (MLA) splits its heads after the latent up-projection, as any head.
"""

import math

import jax
import jax.numpy as jnp

from jaxpar.core.errors import UserError
from jaxpar.nn.context.base import ContextStrategy
from jaxpar.nn.kernels import KV_AXES, OUT_AXES, Q_AXES, local_attention


def kv_repeats(kv_heads: int, cp: int) -> int:
    """How many times each of a device's KV heads is repeated so that they split over cp devices."""
    return cp // math.gcd(kv_heads, cp)


class Ulysses(ContextStrategy):
    name = "ulysses"
    about = "all-to-alls trade the sequence split for a head split: each device attends to the whole sequence"

    def check(self, m, cp, tp, dropout):
        heads = m.n_head
        if heads % (tp * cp):
            raise UserError(f"model.context_strategy={self.name} splits the {heads} heads over tp x cp = {tp * cp} "
                            f"devices, which do not divide them; choose tp and cp whose product divides "
                            f"n_head={heads}, or --model.context_strategy=ring")
        if m.block_size % cp:
            raise UserError(f"cp={cp} does not divide model.block_size={m.block_size}; choose a block size "
                            "divisible by cp")
        if dropout > 0:
            raise UserError(f"model.dropout={dropout} with cp={cp}: {self.name}'s attention runs without "
                            "dropout; pass --model.dropout=0 or drop cp")

    def kernel_context(self, cp):
        return 1  # each device attends over the whole sequence

    def attend(self, plan, q, k, v, doc_starts=None):
        axis, cp = plan.ring()
        local = local_attention(plan)

        def heads_of_the_whole_sequence(q, k, v, *docs):
            """On one device: (b, h, t, d) for t = T/cp -> attention over T with h/cp heads -> back."""
            r = kv_repeats(k.shape[1], cp)
            k, v = (jnp.repeat(a, r, axis=1) if r > 1 else a for a in (k, v))
            q, k, v = (jax.lax.all_to_all(a, axis, 1, 2, tiled=True) for a in (q, k, v))
            starts = jax.lax.all_gather(docs[0], axis, axis=1, tiled=True) if docs else None
            y = local(q, k, v, starts)  # (b, T, h/cp, d)
            return jax.lax.all_to_all(y, axis, 1, 2, tiled=True)  # (b, t, h, d)
        in_axes, args = (Q_AXES, KV_AXES, KV_AXES), (q, k, v)
        if doc_starts is not None:
            in_axes, args = in_axes + (("batch", "seq"),), args + (doc_starts,)
        return plan.per_device(heads_of_the_whole_sequence, in_axes, OUT_AXES)(*args)

    def collectives(self, cp, m, kv_bytes, q_bytes, layers, passes):
        """Each layer: q, k and v to head splits and the output back, forward; the four again in
        the backward, for their gradients. A device sends (cp-1)/cp of each."""
        share = (cp - 1) / cp
        sent = share * (2 * q_bytes + kv_bytes * kv_repeats(max(1, m.kv_heads), cp))
        return [("all-to-all", sent, 2 * layers * passes)]


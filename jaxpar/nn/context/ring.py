"""Ring attention (jaxpar.nn.ring_attention), the load-balanced zigzag ring: the sequence is cut into
2cp chunks and device r holds chunks r and 2cp-1-r; its queries stay, the K/V blocks go round the
ring with collective-permutes, and the partial results merge by an online softmax. The default.
"""

from jaxpar.core.errors import UserError
from jaxpar.nn.context.base import ContextStrategy
from jaxpar.nn.kernels import KV_AXES, Q_AXES, BlockKernel
from jaxpar.nn.ring_attention import ring_attention, zigzag_permutation


class Ring(ContextStrategy):
    name = "ring"
    about = "the zigzag ring: K/V blocks passed round the devices (collective-permutes), the work balanced"

    def check(self, m, cp, tp, dropout):
        if m.block_size % (2 * cp):
            raise UserError(f"cp={cp} needs model.block_size divisible by 2*cp={2 * cp} (the sequence is "
                            f"cut into 2*cp chunks, two per device); got {m.block_size}")
        if dropout > 0:
            raise UserError(f"model.dropout={dropout} with cp={cp}: ring attention has no attention "
                            "dropout; pass --model.dropout=0 or drop cp")

    def permutation(self, seq_len, cp):
        return None if cp == 1 else zigzag_permutation(seq_len, cp)

    def attend(self, plan, q, k, v, doc_starts=None):
        axis, _ = plan.ring()
        kernel = BlockKernel(plan.attention, plan.interpret)

        def ring_of_shards(q, k, v, *segments):
            B, H, T, D = q.shape
            K = k.shape[1]
            return ring_attention(q.reshape(B, K, H // K, T, D), k, v, axis_name=axis, kernel=kernel,
                                  segments=segments[0] if segments else None).reshape(B, H, T, D)
        in_axes, args = (Q_AXES, KV_AXES, KV_AXES), (q, k, v)
        if doc_starts is not None:
            in_axes, args = in_axes + (("batch", "seq"),), args + (doc_starts,)
        return plan.per_device(ring_of_shards, in_axes, Q_AXES)(*args).transpose(0, 2, 1, 3)

    def collectives(self, cp, m, kv_bytes, q_bytes, layers, passes):
        """Each layer's ring: the K and V blocks passed on cp-1 times forward, and with dK and dV
        in the backward."""
        return [("collective-permute", kv_bytes, 3 * (cp - 1) * layers * passes)]

"""A context-parallel strategy: how a layer's attention runs when every activation's sequence is
split over the mesh's 'context' axis (cp devices), and what that asks of the rest.

A strategy owns its batch layout (the order the tokens are split in: `permutation`), each token's
true position in that layout, its checks (one UserError line each), what the attention kernel
sees of the sequence (`kernel_context`), its collectives for the planner, and `attend`. The model
names none of them: it calls the plan's strategy (jaxpar.nn.layers). A new strategy is a file in
this package and a line in its registry.
"""

from typing import ClassVar

import numpy as np


class ContextStrategy:
    """One way of computing attention over a sequence split cp ways."""
    name: ClassVar[str]
    about: ClassVar[str]  # one line: how it works, and whose it is

    def check(self, m, cp: int, tp: int, dropout: float) -> None:
        """Refuse, in one UserError line naming the fix, a model this strategy cannot run at cp
        (`m`: the [model] section; tp: the tensor axis's size)."""

    def kernel_context(self, cp: int) -> int:
        """The split of the sequence the attention kernel sees: the cp a kernel's needs are checked
        against (jaxpar.nn.kernels.resolve)."""
        return cp

    def permutation(self, seq_len: int, cp: int) -> np.ndarray | None:
        """The batch's layout: global positions in the order they are split over the devices (None:
        in order). Each token's true position is the permutation's entry."""
        return None

    def attend(self, plan, q, k, v, doc_starts=None):
        """Causal attention of q (batch, heads, seq, head_dim) with k, v (batch, kv_heads, seq,
        head_dim), the sequence split over the plan's context axis, within documents when
        doc_starts (batch, seq) is given -> (batch, seq, heads, head_dim)."""
        raise NotImplementedError

    def collectives(self, cp: int, m, kv_bytes: float, q_bytes: float, layers: int, passes: int) -> list[tuple]:
        """The planner's guess of the strategy's collectives a step: (kind, bytes a device sends,
        times) each; `kv_bytes`/`q_bytes`: one layer's K and V / its queries on a device a pass."""
        return []

"""DualPipeV (DeepSeek, `deepseek-ai/DualPipe`'s dualpipev.py; torchtitan's `DualPipeV`): two layer
chunks a stage, placed in a V (stage s holds chunks s and 2pp-1-s), so stage 0 both embeds and
computes the loss, and the turn at the bottom stays on the last stage; the weight gradients of
the warm-up's and the drain's backwards run apart (W), as in ZB-H1, to fill the bubble.

The orders are dualpipev.py's `step`, phase 0 the first chunk and phase 1 the second, each of its
overlapped forward-and-backward pairs run as its forward, then its backward. It needs
M >= 2pp.
"""

from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp

from jaxpar.core.errors import UserError
from jaxpar.parallel.schedules.base import PipelineSchedule
from jaxpar.parallel.schedules.ops import BACKWARD, DOWN, FORWARD, INPUT_GRAD, KEPT, NOWHERE, UP, WEIGHT, Op, Placement


@dataclass(frozen=True)
class VPlacement(Placement):
    """Two chunks a stage, in a V: chunk g < pp on stage g (its chunk 0), chunk g >= pp on stage
    2pp-1-g (its chunk 1). The first and last chunks share stage 0, so it embeds and computes the
    loss; the turn at the bottom, from chunk pp-1 to chunk pp, stays on stage pp-1."""
    virtual: int = 2

    @property
    def wraps(self) -> bool:
        return False

    def home(self, g: int) -> tuple[int, int]:
        return (g, 0) if g < self.pp else (2 * self.pp - 1 - g, 1)

    def chunk(self, stage: int, local: int) -> int:
        return stage if local == 0 else 2 * self.pp - 1 - stage

    def direction(self, forward: bool, stage: int, local: int) -> int:
        to = self.next(stage, local) if forward else self.previous(stage, local)
        if to is None:
            return NOWHERE
        return KEPT if to[0] == stage else DOWN if to[0] == stage + 1 else UP

    def stage_major(self, tree, axis: int = 0, inverse: bool = False):
        """Chunks in model order (2, pp) <-> stage-major (pp, 2), the second half reversed."""
        pp = self.pp

        def move(a):
            shape = a.shape
            per = shape[axis] // self.chunks
            if not inverse:
                halves = a.reshape(shape[:axis] + (2, pp, per) + shape[axis + 1:])
                down, up = jnp.take(halves, 0, axis), jnp.flip(jnp.take(halves, 1, axis), axis)
                return jnp.stack([down, up], axis=axis + 1).reshape(shape)
            staged = a.reshape(shape[:axis] + (pp, 2, per) + shape[axis + 1:])
            down, up = jnp.take(staged, 0, axis + 1), jnp.flip(jnp.take(staged, 1, axis + 1), axis)
            return jnp.stack([down, up], axis=axis).reshape(shape)
        return jax.tree.map(move, tree)


class DualPipeV(PipelineSchedule):
    name = "dualpipev"
    about = "DeepSeek's DualPipeV: two chunks a stage in a V (loss on stage 0), W apart at the ends"
    bubble_formula = "about (pp-1)/(3M+pp-1), W apart"

    @classmethod
    def chunks_per_stage(cls, virtual):
        if virtual not in (1, 2):
            raise UserError(f"pipeline.virtual={virtual}: {cls.name} runs two layer chunks a stage, in a V; "
                            "leave --pipeline.virtual unset")
        return 2

    @classmethod
    def check(cls, pp, microbatches, virtual):
        super().check(pp, microbatches, virtual)
        if microbatches < 2 * pp:
            raise UserError(f"{cls.name} needs at least 2*pp={2 * pp} microbatches, got {microbatches}; "
                            "raise pipeline.microbatches or use another --pipeline.schedule")

    @cached_property
    def placement(self) -> Placement:
        return VPlacement(self.pp)

    def orders(self) -> list[list[Op]]:
        return [StageOrder(self.pp, s, self.microbatches).ops() for s in range(self.pp)]


class StageOrder:
    """dualpipev.py's step on stage `rank` of `ranks`, written down as ops: F(phase), B(phase)
    with or without its W apart (zb), and W, each phase's microbatches in order, W's first in first out."""

    def __init__(self, ranks: int, rank: int, microbatches: int):
        self.ranks, self.rank, self.M = ranks, rank, microbatches
        self.next_f, self.next_b, self.waiting, self.out = [0, 0], [0, 0], [], []

    def f(self, phase: int) -> None:
        self.out.append(Op(FORWARD, self.next_f[phase], phase))
        self.next_f[phase] += 1

    def b(self, phase: int, zb: bool = False) -> None:
        self.out.append(Op(INPUT_GRAD if zb else BACKWARD, self.next_b[phase], phase))
        if zb:
            self.waiting.append((self.next_b[phase], phase))
        self.next_b[phase] += 1

    def w(self) -> None:
        k, phase = self.waiting.pop(0)
        self.out.append(Op(WEIGHT, k, phase))

    def ops(self) -> list[Op]:
        R, r, f, b, w = self.ranks, self.rank, self.f, self.b, self.w
        for _ in range((R - r - 1) * 2):  # step 1: nF0
            f(0)
        for _ in range(r + 1):  # step 2: nF0F1
            f(0), f(1)
        for _ in range(R - r - 1):  # step 3: nB1W1F1, zero bubble
            b(1, zb=True), w(), f(1)
        for _ in range(self.M - 2 * R + r + 1):  # step 4, the main step: nF0B1F1B0
            f(0), b(1), f(1), b(0)
        for _ in range(R - r - 1):  # step 5: nB1F1B0
            b(1), f(1), b(0)
        zb, half = False, (r + 1) // 2
        for i in range(r + 1):  # step 6: nB1B0, the second half zero bubble
            zb = zb or (i == half and r % 2 == 1)
            b(1, zb)
            zb = zb or (i == half and r % 2 == 0)
            b(0, zb)
        for _ in range(R - r - 1):  # step 7: nWB0, zero bubble
            w(), b(0, zb=True)
        for _ in range(r + 1):  # step 8: nW
            w()
        assert not self.waiting and self.next_f == self.next_b == [self.M, self.M]
        return self.out

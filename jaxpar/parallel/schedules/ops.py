"""What a pipeline stage runs at a tick: an op (F, B, W, or B without W), on one microbatch and one
of the stage's layer chunks, and where each layer chunk lives (`Placement`).

A schedule splits the model's layers into pp x V chunks, numbered from the first layer to the
last (the global chunks). Its placement says which stage holds each, and which of that stage's V
chunks it is (the local chunk): in a loop (stage s holds s, s+pp, ...: GPipe, 1F1B, interleaved,
ZB-H1) or in a V (stage s holds s and 2pp-1-s: DualPipeV). A forward's output goes to the next
global chunk's home, a backward's input gradient to the previous one's: down the stages (s to
s+1), up them, or, where both chunks are on one stage, nowhere (kept on the stage).
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp

IDLE, FORWARD, BACKWARD, WEIGHT, INPUT_GRAD = 0, 1, 2, 3, 4  # BACKWARD: input and weight gradients
LETTERS = {FORWARD: "F", BACKWARD: "B", WEIGHT: "W", INPUT_GRAD: "B"}  # INPUT_GRAD: B, its W apart
NOWHERE, DOWN, UP, KEPT = 0, 1, 2, 3  # where an op's output goes: to stage s+1, s-1, or stays


@dataclass(frozen=True)
class Op:
    kind: int  # FORWARD, BACKWARD, INPUT_GRAD (the input gradient alone, W later) or WEIGHT
    microbatch: int
    chunk: int = 0  # which of the stage's V layer chunks: the local chunk

    def label(self, chunks: bool = False) -> str:
        return f"{LETTERS[self.kind]}{self.microbatch}" + (f".{self.chunk}" if chunks else "")

    def __str__(self):
        return self.label()


@dataclass(frozen=True)
class Placement:
    """Where each global chunk runs: in a loop, chunk g on stage g % pp as its chunk g // pp."""
    pp: int
    virtual: int = 1

    @property
    def chunks(self) -> int:
        return self.pp * self.virtual

    @property
    def wraps(self) -> bool:
        """Whether stage pp-1 sends to stage 0 (round the ring, down) and back (up)."""
        return self.virtual > 1

    def home(self, g: int) -> tuple[int, int]:
        """(stage, local chunk) of global chunk g."""
        return g % self.pp, g // self.pp

    def chunk(self, stage: int, local: int) -> int:
        return local * self.pp + stage

    def next(self, stage: int, local: int) -> tuple[int, int] | None:
        """Where a forward's output goes: the next global chunk's home (None: the loss takes it)."""
        g = self.chunk(stage, local)
        return self.home(g + 1) if g + 1 < self.chunks else None

    def previous(self, stage: int, local: int) -> tuple[int, int] | None:
        """Where a backward's input gradient goes (None: the embedding's backward takes it)."""
        g = self.chunk(stage, local)
        return self.home(g - 1) if g > 0 else None

    @property
    def last(self) -> tuple[int, int]:
        """The last chunk's home: its stage computes the loss."""
        return self.home(self.chunks - 1)

    def direction(self, forward: bool, stage: int, local: int) -> int:
        """Where an op's output goes: a forward's on, a backward's back (NOWHERE at either end)."""
        to = self.next(stage, local) if forward else self.previous(stage, local)
        if to is None:
            return NOWHERE
        return DOWN if forward else UP  # round the ring too

    def stage_major(self, tree, axis: int = 0, inverse: bool = False):
        """A layer axis (in model order) reordered so that stage s's contiguous share holds its
        chunks in local order: chunks s, s+pp, ... Params stay in layer order everywhere else
        (checkpoints, evaluation, export); under jit the reorder and its inverse for the gradients
        are communication over 'pipe' every round."""
        if self.virtual == 1:
            return tree
        order = (self.virtual, self.pp) if not inverse else (self.pp, self.virtual)

        def move(a):
            shape = a.shape
            split = a.reshape(shape[:axis] + order + (shape[axis] // self.chunks,) + shape[axis + 1:])
            return jnp.swapaxes(split, axis, axis + 1).reshape(shape)
        return jax.tree.map(move, tree)

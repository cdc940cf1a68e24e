"""A pipeline schedule as data: (pp, M, V) -> a table of (tick, stage) -> an op or idle, and the
arrays the executor (jaxpar.parallel.pipeline) reads from it.

Each schedule is a subclass in a file of its own that owns its per-stage orders, its placement of
the layer chunks (jaxpar.parallel.schedules.ops), its checks, its bubble formula and its layer
chunks a stage. This class places the orders on ticks, each op at the first tick where what it
needs on other stages has finished: F(k) of a chunk after F(k) of the chunk before it, B(k) after
the backward of the chunk after it (or, for the last chunk, its own F), W(k) after its B. It
then gives each stage's buffers their slots, and the executor its arrays. `python -m
jaxpar.schedule` and the tests read the same table.
"""

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import numpy as np

from jaxpar.core.errors import UserError
from jaxpar.parallel.schedules.ops import (
    BACKWARD,
    DOWN,
    FORWARD,
    IDLE,
    INPUT_GRAD,
    KEPT,
    NOWHERE,
    UP,
    WEIGHT,
    Op,
    Placement,
)

NO_SLOT = -1  # a tick at which a stage stores nothing
SOURCES = {DOWN: "below", UP: "above", KEPT: "kept"}  # where an arrival comes from: the stage above it sent it down


def event(op: Op, stage: int, placement: Placement) -> tuple[str, int, int]:
    """What finishing `op` makes available: ("F" | "B" | "W", microbatch, global chunk)."""
    letter = "F" if op.kind == FORWARD else "W" if op.kind == WEIGHT else "B"
    return letter, op.microbatch, placement.chunk(stage, op.chunk)


def needs(op: Op, stage: int, placement: Placement) -> list[tuple[str, int, int]]:
    """The events `op` waits for: F(k) the chunk before's F, B(k) the chunk after's B (the last
    chunk's B, its own F), W(k) its own B."""
    _, k, g = event(op, stage, placement)
    if op.kind == FORWARD:
        return [("F", k, g - 1)] if g > 0 else []
    if op.kind == WEIGHT:
        return [("B", k, g)]
    return [("B", k, g + 1)] if g + 1 < placement.chunks else [("F", k, g)]


def place_on_ticks(orders: list[list[Op]], placement: Placement) -> list[list[Op | None]]:
    """Run each stage's next op at the first tick where everything it needs finished earlier."""
    pp = len(orders)
    finished: dict[tuple[str, int, int], int] = {}
    position, table, tick = [0] * pp, [], 0
    while any(position[s] < len(orders[s]) for s in range(pp)):
        row: list[Op | None] = [None] * pp
        for s in range(pp):
            if position[s] < len(orders[s]):
                op = orders[s][position[s]]
                if all(finished.get(need, tick) < tick for need in needs(op, s, placement)):
                    row[s] = op
        for s, op in enumerate(row):
            if op is not None:
                finished[event(op, s, placement)] = tick
                position[s] += 1
        table.append(row)
        tick += 1
        if tick > 4 * sum(map(len, orders)) + pp:
            raise RuntimeError("schedule deadlocks: a stage waits for work that never runs")
    return table


def assign_slots(intervals: dict[tuple, tuple[int, int]]) -> dict[tuple, int]:
    """Buffer slot per value, for values stored at the end of tick a and last read at tick b.

    Two values may share a slot when one's last read is no later than the other's store.
    """
    slot_free_after: list[int] = []  # per slot: tick of its last read
    slots = {}
    for key, (stored, last_read) in sorted(intervals.items(), key=lambda item: item[1]):
        slot = next((i for i, free in enumerate(slot_free_after) if free <= stored), len(slot_free_after))
        if slot == len(slot_free_after):
            slot_free_after.append(last_read)
        slot_free_after[slot] = last_read
        slots[key] = slot
    return slots


@dataclass(frozen=True)
class PipelineSchedule:
    """One schedule on pp stages with M microbatches and V layer chunks a stage."""
    pp: int
    microbatches: int
    virtual: int = 1

    name: ClassVar[str]
    about: ClassVar[str]  # one line: what it is, and whose
    bubble_formula: ClassVar[str] = "(pp-1)/(M+pp-1)"

    @classmethod
    def chunks_per_stage(cls, virtual: int) -> int:
        """The layer chunks a stage holds, from pipeline.virtual (a UserError where it cannot run)."""
        if virtual != 1:
            raise UserError(f"pipeline.virtual={virtual}: {cls.name} runs one layer chunk per stage; pass "
                            "--pipeline.virtual=1, or an interleaved schedule")
        return 1

    @classmethod
    def check(cls, pp: int, microbatches: int, virtual: int) -> None:
        """Refuse, naming the fix, what this schedule cannot run."""
        if microbatches < 1:
            raise UserError(f"pipeline.microbatches must be positive, got {microbatches}")

    def orders(self) -> list[list[Op]]:
        """The order in which each stage runs its ops."""
        raise NotImplementedError

    @cached_property
    def placement(self) -> Placement:
        return Placement(self.pp, self.virtual)

    @cached_property
    def table(self) -> list[list[Op | None]]:
        return place_on_ticks(self.orders(), self.placement)

    @property
    def ticks(self) -> int:
        return len(self.table)

    @cached_property
    def kinds(self) -> tuple[int, ...]:
        """The kinds of op the table runs, idle first: the executor's branches."""
        return tuple(sorted({IDLE} | {op.kind for row in self.table for op in row if op is not None}))

    @property
    def trains(self) -> bool:
        return self.kinds != (IDLE, FORWARD)

    @cached_property
    def _ticks(self) -> dict[tuple[int, int, int, int], int]:
        return {(op.kind, op.microbatch, op.chunk, s): t for t, row in enumerate(self.table)
                for s, op in enumerate(row) if op is not None}

    def tick_of(self, kind: int, microbatch: int, stage: int, chunk: int = 0) -> int:
        """The tick of an op; BACKWARD finds a B whose W runs apart (INPUT_GRAD) too."""
        found = self._ticks.get((kind, microbatch, chunk, stage))
        return found if found is not None or kind != BACKWARD else self._ticks[(INPUT_GRAD, microbatch, chunk, stage)]

    @cached_property
    def last_reads(self) -> dict[tuple[int, int, int], int]:
        """(stage, microbatch, local chunk) -> the tick of the last op there that reads its stage
        input and output gradient: the backward (which reruns the forward from the input), or
        where W runs apart, W; the forward where nothing follows it."""
        last = {}
        for t, row in enumerate(self.table):
            for s, op in enumerate(row):
                if op is not None:
                    last[(s, op.microbatch, op.chunk)] = t
        return last

    @property
    def bubble_fraction(self) -> float:
        """Share of (tick, stage) cells that are idle, with every op counted as one tick."""
        return sum(op is None for row in self.table for op in row) / (self.ticks * self.pp)

    @property
    def rerun_factors(self) -> tuple[float, float]:
        """(the forwards each layer runs again, the recompute policy's reruns), a microbatch on
        average: a backward reruns its chunk from the saved input once; one whose W runs apart
        runs B and W each from the input, and W recomputes the input gradients on its way, about
        three forwards' FLOPs, the policy's reruns in both."""
        ops = [op.kind for row in self.table for op in row if op is not None]
        split, whole = ops.count(INPUT_GRAD), ops.count(BACKWARD)
        if not split + whole:
            return 0.0, 0.0
        return (whole + 3 * split) / (whole + split), (whole + 2 * split) / (whole + split)

    def in_flight(self, stage: int) -> int:
        """Most stage inputs held at once on `stage`: from a forward until its last reader."""
        count = most = 0
        for t, row in enumerate(self.table):
            op = row[stage]
            if op is None:
                continue
            count += op.kind == FORWARD
            most = max(most, count)
            count -= self.last_reads[(stage, op.microbatch, op.chunk)] == t
        return most

    def arrivals(self) -> tuple[list[dict], list[dict]]:
        """Per stage, {(microbatch, chunk): (the tick it is stored, its last read)} of its inputs
        and of its output gradients (the last chunk's comes from the loss, right after its F)."""
        inputs, grads = [{} for _ in range(self.pp)], [{} for _ in range(self.pp)]
        place, last = self.placement, self.last_reads
        for t, row in enumerate(self.table):
            for s, op in enumerate(row):
                if op is None or op.kind == WEIGHT:
                    continue
                forward = op.kind == FORWARD
                to = place.next(s, op.chunk) if forward else place.previous(s, op.chunk)
                if forward and to is None and self.trains:
                    grads[s][(op.microbatch, op.chunk)] = (t, last[(s, op.microbatch, op.chunk)])
                elif to is not None:
                    buffers = inputs if forward else grads
                    buffers[to[0]][(op.microbatch, to[1])] = (t, last[(to[0], op.microbatch, to[1])])
        return inputs, grads

    @cached_property
    def slots(self) -> tuple[list[dict], list[dict]]:
        """Per stage, the buffer slot of each (microbatch, chunk)'s stage input and output gradient."""
        inputs, grads = self.arrivals()
        return [assign_slots(a) for a in inputs], ([assign_slots(a) for a in grads] if self.trains else [])

    @property
    def input_slots(self) -> int:
        """Stage inputs a stage holds at once: activation memory is this many microbatches."""
        return max([max(s.values()) + 1 for s in self.slots[0] if s], default=1)

    @property
    def grad_slots(self) -> int:
        return max([max(s.values()) + 1 for s in self.slots[1] if s], default=0)

    def executor_arrays(self) -> dict[str, np.ndarray]:
        """(ticks, pp) int32 arrays: what each stage does at each tick, where its output goes
        (`send`: NOWHERE, DOWN, UP or KEPT), and for what arrives from below, from above and from
        itself, the slot it goes to (NO_SLOT: nothing) and whether it is a gradient."""
        shape = (self.ticks, self.pp)
        names = ["kind", "microbatch", "chunk", "input_slot", "grad_slot", "send"]
        arrays = {name: np.full(shape, IDLE if name == "kind" else 0, np.int32) for name in names}
        for source in SOURCES.values():
            arrays[f"{source}_slot"] = np.full(shape, NO_SLOT, np.int32)
            arrays[f"{source}_grad"] = np.zeros(shape, np.int32)
        input_slots, grad_slots = self.slots
        for t, row in enumerate(self.table):
            for s, op in enumerate(row):
                if op is not None:
                    self._fill(arrays, t, s, op, input_slots, grad_slots)
        return arrays

    def _fill(self, arrays: dict, t: int, s: int, op: Op, input_slots: list, grad_slots: list) -> None:
        key = (op.microbatch, op.chunk)
        arrays["kind"][t, s], arrays["microbatch"][t, s], arrays["chunk"][t, s] = op.kind, *key
        arrays["input_slot"][t, s] = input_slots[s].get(key, 0)
        arrays["grad_slot"][t, s] = grad_slots[s][key] if grad_slots else 0
        forward = op.kind == FORWARD
        direction = NOWHERE if op.kind == WEIGHT or not (forward or self.trains) else (
            self.placement.direction(forward, s, op.chunk))
        arrays["send"][t, s] = direction
        if direction == NOWHERE:  # the last chunk's F stores the loss's gradient in its own grad_slot
            return
        to = self.placement.next(s, op.chunk) if forward else self.placement.previous(s, op.chunk)
        slots = input_slots if forward else grad_slots
        source = SOURCES[direction]
        arrays[f"{source}_slot"][t, to[0]] = slots[to[0]][(op.microbatch, to[1])]
        arrays[f"{source}_grad"][t, to[0]] = int(not forward)

    def grid(self) -> str:
        """The table as text: one row per stage, one column per tick, '.' for idle."""
        chunks = self.virtual > 1
        width = max(len(op.label(chunks)) for row in self.table for op in row if op is not None)
        virtual = f", V={self.virtual}" if chunks else ""
        lines = [(f"{self.name}: pp={self.pp}{virtual}, {self.microbatches} microbatches, {self.ticks} "
                  f"ticks, bubble {self.bubble_fraction:.1%}, {self.bubble_formula}")]
        for s in range(self.pp):
            cells = [(row[s].label(chunks) if row[s] is not None else ".").rjust(width) for row in self.table]
            lines.append(f"stage {s}: " + " ".join(cells))
        return "\n".join(lines)

    def __str__(self) -> str:
        return f"{self.name}(pp={self.pp}, M={self.microbatches}, V={self.virtual})"

"""Pipeline schedules as data: (schedule, pp, M) -> a table of (tick, stage) -> F(k), B(k) or idle.

The executor (jaxpar.parallel.pipeline), the tests, the bubble figure and `python -m
jaxpar.schedule` all read the same table. Each stage's order of work is written down, then placed
on ticks as early as its dependencies allow: F(k) on stage s after F(k) on s-1; B(k) after F(k)
and after B(k) on s+1.
The orders of every schedule, interleaved 1F1B and ZB-H1 among them, are in jaxpar.parallel.orders.
"""

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from jaxpar.parallel.orders import BACKWARD, FORWARD, IDLE, WEIGHT, Op, needs, stage_orders, zb_h1_table

NO_SLOT = -1  # a tick at which a stage stores nothing


def place_on_ticks(orders: list[list[Op]], virtual: int = 1) -> list[list[Op | None]]:
    """Run each stage's next op at the first tick where everything it needs finished earlier."""
    pp = len(orders)
    finished: dict[tuple[int, int, int, int], int] = {}  # (kind, microbatch, chunk, stage) -> tick
    position, table, tick = [0] * pp, [], 0
    while any(position[s] < len(orders[s]) for s in range(pp)):
        row: list[Op | None] = [None] * pp
        for s in range(pp):
            if position[s] == len(orders[s]):
                continue
            op = orders[s][position[s]]
            if all(finished.get(need, tick) < tick for need in needs(op, s, pp, virtual)):
                row[s] = op
        for s, op in enumerate(row):
            if op is not None:
                finished[(op.kind, op.microbatch, op.chunk, s)] = tick
                position[s] += 1
        table.append(row)
        tick += 1
        if tick > 4 * sum(map(len, orders)) + pp:
            raise RuntimeError("schedule deadlocks: a stage waits for work that never runs")
    return table


def assign_slots(intervals: dict[int, tuple[int, int]]) -> dict[int, int]:
    """Buffer slot per microbatch, for values stored at the end of tick a and last read at tick b.

    Two values may share a slot when one's last read is no later than the other's store.
    """
    slot_free_after: list[int] = []  # per slot: tick of its last read
    slots = {}
    for k, (stored, last_read) in sorted(intervals.items(), key=lambda item: item[1]):
        slot = next((i for i, free in enumerate(slot_free_after) if free <= stored), len(slot_free_after))
        if slot == len(slot_free_after):
            slot_free_after.append(last_read)
        slot_free_after[slot] = last_read
        slots[k] = slot
    return slots


@dataclass(frozen=True)
class Schedule:
    name: str
    pp: int
    microbatches: int
    virtual: int = 1  # interleaved: layer chunks per stage

    @cached_property
    def table(self) -> list[list[Op | None]]:
        if self.name == "zb-h1":
            return zb_h1_table(self.pp, self.microbatches)
        return place_on_ticks(stage_orders(self.name, self.pp, self.microbatches, self.virtual), self.virtual)

    @property
    def ticks(self) -> int:
        return len(self.table)

    @cached_property
    def _ticks(self) -> dict[tuple[int, int, int, int], int]:
        return {(op.kind, op.microbatch, op.chunk, s): t for t, row in enumerate(self.table)
                for s, op in enumerate(row) if op is not None}

    def tick_of(self, kind: int, microbatch: int, stage: int, chunk: int = 0) -> int:
        return self._ticks[(kind, microbatch, chunk, stage)]

    @property
    def bubble_fraction(self) -> float:
        """Share of (tick, stage) cells that are idle, with every op counted as one tick."""
        return sum(op is None for row in self.table for op in row) / (self.ticks * self.pp)

    @property
    def bubble_formula(self) -> str:
        return {"interleaved": "(pp-1)/(V*M+pp-1)", "zb-h1": "about (pp-1)/(3M+pp-1)"}.get(
            self.name, "(pp-1)/(M+pp-1)")

    def in_flight(self, stage: int) -> int:
        """Most stage inputs held at once on `stage`: from a forward (of one chunk) until the op
        that last reads it, its backward, or with W split off, its W."""
        release = self.last_reader
        count = most = 0
        for row in self.table:
            op = row[stage]
            count += 0 if op is None else 1 if op.kind == FORWARD else -1 if op.kind == release else 0
            most = max(most, count)
        return most

    @property
    def last_reader(self) -> int:
        """The op that last reads a stage input and its output gradient: the backward, which reruns
        the forward from the input, or with W split off, W."""
        return FORWARD if self.name == "forward" else WEIGHT if self.name == "zb-h1" else BACKWARD

    def next_stage(self, stage: int, chunk: int) -> tuple[int, int] | None:
        """Where a forward's output goes: the next stage, or round the ring to stage 0's next chunk."""
        if stage + 1 < self.pp:
            return stage + 1, chunk
        return (0, chunk + 1) if chunk + 1 < self.virtual else None

    def previous_stage(self, stage: int, chunk: int) -> tuple[int, int] | None:
        """Where a backward's input gradient goes."""
        if stage > 0:
            return stage - 1, chunk
        return (self.pp - 1, chunk - 1) if chunk > 0 else None

    @cached_property
    def slots(self) -> tuple[list[dict], list[dict]]:
        """Per stage, the buffer slot of each (microbatch, chunk)'s stage input and output gradient.

        A stage keeps its input from arrival until its last reader; the gradient of the last chunk
        on the last stage comes from the loss, computed right after its forward.
        """
        pp, V, tick, last = self.pp, self.virtual, self.tick_of, self.last_reader
        keys = [(k, c) for k in range(self.microbatches) for c in range(V)]
        arrivals = [[{} for _ in range(pp)], [{} for _ in range(pp)]]  # (k, c) -> (stored, last read)
        for s in range(pp):
            for k, c in keys:
                sent = self.next_stage(s, c)
                if sent is not None:
                    arrivals[0][sent[0]][(k, sent[1])] = (tick(FORWARD, k, s, c), tick(last, k, *sent))
                if last == FORWARD:
                    continue
                sent = self.previous_stage(s, c)
                if sent is not None:
                    arrivals[1][sent[0]][(k, sent[1])] = (tick(BACKWARD, k, s, c), tick(last, k, *sent))
        if last != FORWARD:  # the last chunk's gradient on the last stage comes from the loss
            for k in range(self.microbatches):
                arrivals[1][pp - 1][(k, V - 1)] = (tick(FORWARD, k, pp - 1, V - 1), tick(last, k, pp - 1, V - 1))
        inputs = [assign_slots(a) for a in arrivals[0]]
        return inputs, ([] if last == FORWARD else [assign_slots(a) for a in arrivals[1]])

    @property
    def input_slots(self) -> int:
        """Stage inputs a stage holds at once: activation memory is this many microbatches."""
        return max([max(s.values()) + 1 for s in self.slots[0] if s], default=1)

    @property
    def grad_slots(self) -> int:
        return max([max(s.values()) + 1 for s in self.slots[1]], default=0)

    def executor_arrays(self) -> dict[str, np.ndarray]:
        """(ticks, pp) int32 arrays: what each stage does at each tick, and where values go."""
        shape = (self.ticks, self.pp)
        arrays = {name: np.full(shape, fill, np.int32) for name, fill in
                  [("kind", IDLE), ("microbatch", 0), ("chunk", 0), ("input_slot", 0), ("grad_slot", 0),
                   ("store_input", NO_SLOT), ("store_grad", NO_SLOT)]}
        input_slots, grad_slots = self.slots
        for t, row in enumerate(self.table):
            for s, op in enumerate(row):
                if op is None:
                    continue
                key = (op.microbatch, op.chunk)
                arrays["kind"][t, s], arrays["microbatch"][t, s], arrays["chunk"][t, s] = op.kind, *key
                arrays["input_slot"][t, s] = input_slots[s].get(key, 0)
                arrays["grad_slot"][t, s] = grad_slots[s][key] if grad_slots else 0
                # What a stage sends this tick arrives at its neighbour at the end of the tick.
                to, store, slots = ((self.next_stage, "store_input", input_slots) if op.kind == FORWARD
                                    else (self.previous_stage, "store_grad", grad_slots))
                sent = to(s, op.chunk) if op.kind != WEIGHT else None
                if sent is not None:
                    arrays[store][t, sent[0]] = slots[sent[0]][(op.microbatch, sent[1])]
        return arrays

    def grid(self) -> str:
        """The table as text: one row per stage, one column per tick, '.' for idle."""
        chunks = self.virtual > 1
        width = max(len(op.label(chunks)) for row in self.table for op in row if op is not None)
        virtual = f", V={self.virtual}" if chunks else ""
        lines = [f"{self.name}: pp={self.pp}{virtual}, {self.microbatches} microbatches, {self.ticks} "
                 f"ticks, bubble {self.bubble_fraction:.1%}, {self.bubble_formula}"]
        for s in range(self.pp):
            cells = [(row[s].label(chunks) if row[s] is not None else ".").rjust(width) for row in self.table]
            lines.append(f"stage {s}: " + " ".join(cells))
        return "\n".join(lines)

"""Pipeline schedules as data: (schedule, pp, M) -> a table of (tick, stage) -> F(k), B(k) or idle.

The executor (jaxpar.pipeline), the tests, the bubble figure and `python -m jaxpar.schedule` all
read the same table. Each stage's order of work is written down, then placed on ticks as early as
its dependencies allow: F(k) on stage s after F(k) on s-1; B(k) after F(k) and after B(k) on s+1.
"""

import sys
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from jaxpar.errors import ArgumentParser, UserError, exit_on_user_error

SCHEDULES = ("gpipe", "1f1b")
IDLE, FORWARD, BACKWARD = 0, 1, 2
NO_SLOT = -1


@dataclass(frozen=True)
class Op:
    kind: int  # FORWARD or BACKWARD
    microbatch: int

    def __str__(self):
        return f"{'F' if self.kind == FORWARD else 'B'}{self.microbatch}"


def stage_orders(schedule: str, pp: int, microbatches: int) -> list[list[Op]]:
    """The order in which each stage runs its forwards and backwards."""
    M = microbatches
    forwards = [Op(FORWARD, k) for k in range(M)]
    backwards = [Op(BACKWARD, k) for k in range(M)]
    if schedule == "forward":  # evaluation: no backwards
        return [forwards for _ in range(pp)]
    if schedule == "gpipe":  # all forwards, then all backwards
        return [forwards + backwards for _ in range(pp)]
    if schedule == "1f1b":  # warm up, then alternate one forward and one backward, then drain
        orders = []
        for stage in range(pp):
            warmup = min(pp - 1 - stage, M)
            steady = [op for k in range(M - warmup) for op in (forwards[warmup + k], backwards[k])]
            orders.append(forwards[:warmup] + steady + backwards[M - warmup:])
        return orders
    raise ValueError(f"unknown schedule '{schedule}'; known: {', '.join(SCHEDULES)}")


def place_on_ticks(orders: list[list[Op]]) -> list[list[Op | None]]:
    """Run each stage's next op at the first tick where everything it needs finished earlier."""
    pp = len(orders)
    finished: dict[tuple[int, int, int], int] = {}  # (kind, microbatch, stage) -> tick
    position, table, tick = [0] * pp, [], 0
    while any(position[s] < len(orders[s]) for s in range(pp)):
        row: list[Op | None] = [None] * pp
        for s in range(pp):
            if position[s] == len(orders[s]):
                continue
            op = orders[s][position[s]]
            needs = ([(FORWARD, op.microbatch, s - 1)] if op.kind == FORWARD and s > 0 else []) + \
                    ([(BACKWARD, op.microbatch, s + 1)] if op.kind == BACKWARD and s < pp - 1 else [])
            if all(finished.get(need, tick) < tick for need in needs):
                row[s] = op
        for s, op in enumerate(row):
            if op is not None:
                finished[(op.kind, op.microbatch, s)] = tick
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

    @cached_property
    def table(self) -> list[list[Op | None]]:
        return place_on_ticks(stage_orders(self.name, self.pp, self.microbatches))

    @property
    def ticks(self) -> int:
        return len(self.table)

    def tick_of(self, kind: int, microbatch: int, stage: int) -> int:
        return next(t for t, row in enumerate(self.table) if row[stage] == Op(kind, microbatch))

    @property
    def bubble_fraction(self) -> float:
        """Share of (tick, stage) cells that are idle, with F and B counted as one tick each."""
        return sum(op is None for row in self.table for op in row) / (self.ticks * self.pp)

    def in_flight(self, stage: int) -> int:
        """Most microbatches whose forward ran on `stage` but whose backward has not yet."""
        count = most = 0
        for row in self.table:
            op = row[stage]
            count += 0 if op is None else 1 if op.kind == FORWARD else -1
            most = max(most, count)
        return most

    @cached_property
    def slots(self) -> tuple[list[dict[int, int]], list[dict[int, int]]]:
        """Per stage, the buffer slot of each microbatch's stage input and output gradient.

        A stage keeps its input from arrival until its backward (which recomputes from it); the
        last stage's gradient comes from the loss, computed right after its forward.
        """
        M, pp = self.microbatches, self.pp
        last_use = BACKWARD if self.name != "forward" else FORWARD
        inputs, grads = [], []
        for s in range(pp):
            inputs.append({} if s == 0 else assign_slots(
                {k: (self.tick_of(FORWARD, k, s - 1), self.tick_of(last_use, k, s)) for k in range(M)}))
            if last_use == FORWARD:
                continue
            grad_source = (FORWARD, s) if s == pp - 1 else (BACKWARD, s + 1)
            grads.append(assign_slots({k: (self.tick_of(grad_source[0], k, grad_source[1]),
                                           self.tick_of(BACKWARD, k, s)) for k in range(M)}))
        return inputs, grads

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
                  [("kind", IDLE), ("microbatch", 0), ("input_slot", 0), ("grad_slot", 0),
                   ("store_input", NO_SLOT), ("store_grad", NO_SLOT)]}
        input_slots, grad_slots = self.slots
        for t, row in enumerate(self.table):
            for s, op in enumerate(row):
                if op is None:
                    continue
                k = op.microbatch
                arrays["kind"][t, s], arrays["microbatch"][t, s] = op.kind, k
                arrays["input_slot"][t, s] = input_slots[s].get(k, 0)
                arrays["grad_slot"][t, s] = grad_slots[s][k] if grad_slots else 0
                # What a stage sends this tick arrives at its neighbour at the end of the tick.
                if op.kind == FORWARD and s + 1 < self.pp:
                    arrays["store_input"][t, s + 1] = input_slots[s + 1][k]
                if op.kind == BACKWARD and s > 0:
                    arrays["store_grad"][t, s - 1] = grad_slots[s - 1][k]
        return arrays

    def grid(self) -> str:
        """The table as text: one row per stage, one column per tick, '.' for idle."""
        width = max(len(str(op)) for row in self.table for op in row if op is not None)
        lines = [f"{self.name}: pp={self.pp}, {self.microbatches} microbatches, {self.ticks} ticks, "
                 f"bubble {self.bubble_fraction:.1%} = (pp-1)/(M+pp-1)"]
        for s in range(self.pp):
            cells = [(str(row[s]) if row[s] is not None else ".").rjust(width) for row in self.table]
            lines.append(f"stage {s}: " + " ".join(cells))
        return "\n".join(lines)

    def draw(self, path: str) -> None:
        """A PNG of the table: stages as rows, ticks as columns, F and B coloured, bubbles blank."""
        from jaxpar.plot import pyplot, save
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(max(6, 0.35 * self.ticks), 0.6 * self.pp + 1.2))
        colours = {FORWARD: "#4c78a8", BACKWARD: "#f58518"}
        for t, row in enumerate(self.table):
            for s, op in enumerate(row):
                if op is not None:
                    ax.add_patch(plt.Rectangle((t, s), 1, 1, facecolor=colours[op.kind], edgecolor="white"))
                    ax.text(t + 0.5, s + 0.5, str(op), ha="center", va="center", fontsize=7, color="white")
        ax.set(xlim=(0, self.ticks), ylim=(self.pp, 0), xlabel="tick", yticks=np.arange(self.pp) + 0.5,
               yticklabels=[f"stage {s}" for s in range(self.pp)],
               title=f"{self.name}, pp={self.pp}, M={self.microbatches}: "
                     f"bubble {self.bubble_fraction:.1%}")
        save(plt, fig, path)


def check_schedule(name: str, pp: int, microbatches: int) -> None:
    """Refuse a schedule that cannot run (its name is checked with the config); name the fix."""
    if microbatches < 1:
        raise UserError(f"pipeline.microbatches must be positive, got {microbatches}")
    if name == "1f1b" and microbatches < pp:
        raise UserError(f"1f1b needs at least pp={pp} microbatches, got {microbatches}; "
                        f"raise pipeline.microbatches or use --pipeline.schedule=gpipe")


def resolve_microbatches(cfg, dp: int, pp: int) -> int:
    """The pipeline's microbatch count M for this config and mesh, after checking it can run."""
    n_layer, rows = cfg.model.n_layer, cfg.train.batch_size // cfg.train.grad_accum
    if n_layer % pp:
        raise UserError(f"pp={pp} does not divide model.n_layer={n_layer}; every stage needs the "
                        f"same number of layers")
    if cfg.train.zero == 3:
        raise UserError("ZeRO stage 3 with pipeline parallelism is not supported; use --zero 1 or 2 "
                        "with pp > 1")
    M = cfg.pipeline.microbatches
    if M == 0:  # the largest multiple of pp up to 4*pp that splits the batch evenly over dp
        M = next((m for m in range(4 * pp, 0, -pp) if rows % (m * dp) == 0), 0)
        if M == 0:
            raise UserError(f"cannot split {rows} sequences per step into dp={dp} x M microbatches "
                            f"with M a multiple of pp={pp}; set --pipeline.microbatches=M or "
                            f"change train.batch_size")
    if rows % (M * dp):
        raise UserError(f"train.batch_size / train.grad_accum = {rows} sequences do not split into "
                        f"dp={dp} x {M} microbatches; change pipeline.microbatches or train.batch_size")
    check_schedule(cfg.pipeline.schedule, pp, M)
    return M


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="jaxpar.schedule", description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    parser.add_argument("--out", help="PNG path (default: schedule_<schedule>_pp<P>_m<M>.png)")
    with exit_on_user_error("jaxpar.schedule"):
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        if args.pp < 1:
            raise UserError(f"--pp must be positive, got {args.pp}")
        check_schedule(args.schedule, args.pp, args.microbatches)
        schedule = Schedule(args.schedule, args.pp, args.microbatches)
        print(schedule.grid())
        out = args.out or f"schedule_{args.schedule}_pp{args.pp}_m{args.microbatches}.png"
        schedule.draw(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

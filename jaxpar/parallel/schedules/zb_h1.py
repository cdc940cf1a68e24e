"""ZB-H1 (Qi et al., 2023, "Zero Bubble Pipeline Parallelism"): each backward split into B, the
input gradient, and W, the weight gradient, which waits to fill the bubble; 1F1B's memory."""

from functools import cached_property

from jaxpar.parallel.schedules.base import PipelineSchedule, event, needs
from jaxpar.parallel.schedules.ops import FORWARD, INPUT_GRAD, WEIGHT, Op


class ZBH1(PipelineSchedule):
    name = "zb-h1"
    about = "1F1B with each backward's weight gradient (W) apart, filling the bubble: 1F1B's memory"
    bubble_formula = "about (pp-1)/(3M+pp-1)"

    def orders(self) -> list[list[Op]]:
        return [[op for op in (row[s] for row in self.table) if op is not None] for s in range(self.pp)]

    @cached_property
    def table(self) -> list[list[Op | None]]:
        """Placed greedily: at each tick a stage runs its next B if it can, else its next F while
        it holds fewer than pp inputs (1F1B's bound: an input is held from F until W), else a
        waiting W."""
        pp, M, place, done, table = self.pp, self.microbatches, self.placement, {}, []
        next_f, next_b, waiting_w, held = [0] * pp, [0] * pp, [[] for _ in range(pp)], [0] * pp
        while any(next_b[s] < M or waiting_w[s] for s in range(pp)):
            tick, row = len(table), [None] * pp
            for s in range(pp):
                ready = lambda o, s=s, tick=tick: all(done.get(n, tick) < tick for n in needs(o, s, place))  # noqa: E731
                if next_b[s] < next_f[s] and ready(Op(INPUT_GRAD, next_b[s])):
                    row[s] = Op(INPUT_GRAD, next_b[s])
                elif next_f[s] < M and held[s] < pp and ready(Op(FORWARD, next_f[s])):
                    row[s] = Op(FORWARD, next_f[s])
                elif waiting_w[s]:
                    row[s] = Op(WEIGHT, waiting_w[s][0])
            for s, op in enumerate(row):
                if op is None:
                    continue
                done[event(op, s, place)] = tick
                if op.kind == FORWARD:
                    next_f[s], held[s] = next_f[s] + 1, held[s] + 1
                elif op.kind == INPUT_GRAD:
                    next_b[s] += 1
                    waiting_w[s].append(op.microbatch)
                else:
                    waiting_w[s].pop(0)
                    held[s] -= 1
            table.append(row)
        return table

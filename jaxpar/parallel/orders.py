"""What each pipeline stage runs, in what order: the ops (F, B, W), what each waits for on other
stages, and the per-stage orders of every schedule. jaxpar.parallel.schedule places them on ticks.

Besides GPipe and 1F1B: interleaved 1F1B (Megatron's virtual stages: stage s holds layer chunks
s, s+pp, ..., and F(k) of chunk c follows chunk c-1 on the last stage) and ZB-H1 (Qi et al., 2023:
each backward split into B, the input gradient, and W, the weight gradient, which waits to fill
the bubble).
"""

from dataclasses import dataclass

from jaxpar.core.config import PIPELINE_SCHEDULES

IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3
LETTERS = {FORWARD: "F", BACKWARD: "B", WEIGHT: "W"}


@dataclass(frozen=True)
class Op:
    kind: int  # FORWARD, BACKWARD (with W split off: the input gradient alone) or WEIGHT
    microbatch: int
    chunk: int = 0  # interleaved: which of the stage's layer chunks (global chunk chunk*pp + stage)

    def label(self, chunks: bool = False) -> str:
        return f"{LETTERS[self.kind]}{self.microbatch}" + (f".{self.chunk}" if chunks else "")

    def __str__(self):
        return self.label()


def needs(op: Op, stage: int, pp: int, virtual: int) -> list[tuple[int, int, int, int]]:
    """(kind, microbatch, chunk, stage) of the ops on other stages that `op` waits for. Ops on its
    own stage are ordered by the stage's order; W(k) follows B(k) there."""
    k, c = op.microbatch, op.chunk
    if op.kind == FORWARD:
        return [(FORWARD, k, c, stage - 1)] if stage > 0 else [(FORWARD, k, c - 1, pp - 1)] if c > 0 else []
    if op.kind == BACKWARD:
        return ([(BACKWARD, k, c, stage + 1)] if stage < pp - 1
                else [(BACKWARD, k, c + 1, 0)] if c < virtual - 1 else [])
    return []


def interleaved_orders(pp: int, microbatches: int, virtual: int) -> list[list[Op]]:
    """Megatron's interleaved 1F1B: microbatches in groups of pp, each group through every chunk
    (backwards in reverse chunk order); a longer warm-up, then one F and one B in turn."""
    def op(kind: int, i: int) -> Op:
        chunk = (i // pp) % virtual
        return Op(kind, (i // (pp * virtual)) * pp + i % pp,
                  chunk if kind == FORWARD else virtual - 1 - chunk)
    total, orders = microbatches * virtual, []
    for stage in range(pp):
        warmup = min(2 * (pp - 1 - stage) + (virtual - 1) * pp, total)
        steady = [o for j in range(total - warmup) for o in (op(FORWARD, warmup + j), op(BACKWARD, j))]
        orders.append([op(FORWARD, i) for i in range(warmup)] + steady +
                      [op(BACKWARD, j) for j in range(total - warmup, total)])
    return orders


def zb_h1_table(pp: int, microbatches: int) -> list[list[Op | None]]:
    """ZB-H1 placed greedily: at each tick a stage runs its next B if it can, else its next F while
    it holds fewer than pp inputs (1F1B's bound: an input is held from F until W), else a waiting W."""
    M, done, table = microbatches, {}, []
    next_f, next_b, waiting_w, held = [0] * pp, [0] * pp, [[] for _ in range(pp)], [0] * pp
    while any(next_b[s] < M or waiting_w[s] for s in range(pp)):
        tick, row = len(table), [None] * pp
        for s in range(pp):
            ready = lambda o: all(done.get(n, tick) < tick for n in needs(o, s, pp, 1))  # noqa: E731
            if next_b[s] < next_f[s] and ready(Op(BACKWARD, next_b[s])):
                row[s] = Op(BACKWARD, next_b[s])
            elif next_f[s] < M and held[s] < pp and ready(Op(FORWARD, next_f[s])):
                row[s] = Op(FORWARD, next_f[s])
            elif waiting_w[s]:
                row[s] = Op(WEIGHT, waiting_w[s][0])
        for s, op in enumerate(row):
            if op is None:
                continue
            done[(op.kind, op.microbatch, 0, s)] = tick
            if op.kind == FORWARD:
                next_f[s], held[s] = next_f[s] + 1, held[s] + 1
            elif op.kind == BACKWARD:
                next_b[s] += 1
                waiting_w[s].append(op.microbatch)
            else:
                waiting_w[s].pop(0)
                held[s] -= 1
        table.append(row)
    return table


def stage_orders(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> list[list[Op]]:
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
    if schedule == "interleaved":
        return interleaved_orders(pp, M, virtual)
    raise ValueError(f"unknown schedule '{schedule}'; known: {', '.join(PIPELINE_SCHEDULES)}")

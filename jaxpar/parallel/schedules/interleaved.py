"""Interleaved 1F1B (Megatron's virtual stages, Narayanan et al., 2021): stage s holds layer
chunks s, s+pp, ..., F(k) of chunk c follows chunk c-1 on the last stage (round the ring), and the
bubble shrinks V-fold for a longer warm-up."""

from jaxpar.core.errors import UserError
from jaxpar.parallel.schedules.base import PipelineSchedule
from jaxpar.parallel.schedules.ops import BACKWARD, FORWARD, Op


class Interleaved(PipelineSchedule):
    name = "interleaved"
    about = "Megatron's virtual stages: V >= 2 layer chunks a stage in a loop, the bubble V times smaller"
    bubble_formula = "(pp-1)/(V*M+pp-1)"

    @classmethod
    def chunks_per_stage(cls, virtual):
        if virtual < 2:
            raise UserError(f"pipeline.virtual={virtual}: {cls.name} needs --pipeline.virtual >= 2 layer "
                            "chunks per stage")
        return virtual

    @classmethod
    def check(cls, pp, microbatches, virtual):
        super().check(pp, microbatches, virtual)
        if microbatches % pp:
            raise UserError(f"{cls.name} needs microbatches in whole groups of pp={pp}, got V={virtual} and "
                            f"{microbatches} microbatches")

    def orders(self) -> list[list[Op]]:
        """Microbatches in groups of pp, each group through every chunk (backwards in reverse
        chunk order); a longer warm-up, then one F and one B in turn."""
        pp, V = self.pp, self.virtual

        def op(kind: int, i: int) -> Op:
            chunk = (i // pp) % V
            return Op(kind, (i // (pp * V)) * pp + i % pp, chunk if kind == FORWARD else V - 1 - chunk)
        total, orders = self.microbatches * V, []
        for stage in range(pp):
            warmup = min(2 * (pp - 1 - stage) + (V - 1) * pp, total)
            steady = [o for j in range(total - warmup) for o in (op(FORWARD, warmup + j), op(BACKWARD, j))]
            orders.append([op(FORWARD, i) for i in range(warmup)] + steady +
                          [op(BACKWARD, j) for j in range(total - warmup, total)])
        return orders

"""1F1B (PipeDream-Flush, Narayanan et al., 2021): a warm-up of forwards, then one forward and one
backward in turn, then the drain; at most pp stage inputs held, GPipe's bubble."""

from jaxpar.core.errors import UserError
from jaxpar.parallel.schedules.base import PipelineSchedule
from jaxpar.parallel.schedules.ops import BACKWARD, FORWARD, Op


class OneFOneB(PipelineSchedule):
    name = "1f1b"
    about = "warm up, then one forward and one backward in turn: at most pp stage inputs held"

    @classmethod
    def check(cls, pp, microbatches, virtual):
        super().check(pp, microbatches, virtual)
        if microbatches < pp:
            raise UserError(f"{cls.name} needs at least pp={pp} microbatches, got {microbatches}; "
                            "raise pipeline.microbatches or use another --pipeline.schedule")

    def orders(self) -> list[list[Op]]:
        M, orders = self.microbatches, []
        forwards, backwards = [Op(FORWARD, k) for k in range(M)], [Op(BACKWARD, k) for k in range(M)]
        for stage in range(self.pp):
            warmup = min(self.pp - 1 - stage, M)
            steady = [op for k in range(M - warmup) for op in (forwards[warmup + k], backwards[k])]
            orders.append(forwards[:warmup] + steady + backwards[M - warmup:])
        return orders

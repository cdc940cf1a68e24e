"""Evaluation's table: every stage runs each microbatch's forward once, in order; no backwards."""

from jaxpar.parallel.schedules.base import PipelineSchedule
from jaxpar.parallel.schedules.ops import FORWARD, Op


class ForwardOnly(PipelineSchedule):
    name = "forward"
    about = "evaluation: the forwards alone, layers in order"

    def orders(self) -> list[list[Op]]:
        return [[Op(FORWARD, k) for k in range(self.microbatches)] for _ in range(self.pp)]

"""GPipe (Huang et al., 2019): every microbatch's forward, then every backward; M inputs held."""

from jaxpar.parallel.schedules.base import PipelineSchedule
from jaxpar.parallel.schedules.ops import BACKWARD, FORWARD, Op


class GPipe(PipelineSchedule):
    name = "gpipe"
    about = "all forwards, then all backwards (GPipe): M stage inputs held"

    def orders(self) -> list[list[Op]]:
        M = self.microbatches
        return [[Op(FORWARD, k) for k in range(M)] + [Op(BACKWARD, k) for k in range(M)] for _ in range(self.pp)]

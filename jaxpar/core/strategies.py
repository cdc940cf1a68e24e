"""What the execution plan and its readers see of the objects it holds, each implemented a layer
above this one: the pipeline schedule (jaxpar.parallel.schedules), the context strategy
(jaxpar.nn.context) and the matmul recipe (jaxpar.nn.recipes); and the plan's modes, as enums.
"""

import enum
from typing import Protocol


class PipelineSchedule(Protocol):
    """A pipeline schedule's table as the plan holds it (jaxpar.parallel.schedules.base)."""
    name: str
    pp: int
    microbatches: int
    virtual: int

    @property
    def ticks(self) -> int:
        """The table's ticks."""

    @property
    def bubble_fraction(self) -> float:
        """The share of (tick, stage) cells that are idle."""


class ContextStrategy(Protocol):
    """How attention runs with the sequence split over 'context' (jaxpar.nn.context.base)."""
    name: str


class MatmulRecipe(Protocol):
    """A recipe as the plan holds it (jaxpar.nn.recipes.base.MatmulRecipe implements it)."""

    @property
    def name(self) -> str:
        """Its name in the registry."""

    @property
    def mfu_dtype(self) -> str:
        """The dtype whose peak FLOP/s MFU divides by (jaxpar.models.flops.peak_flops)."""

    def describe(self) -> dict:
        """What run.json and --dry-run print of it."""

    def note(self, platform: str) -> str:
        """One line where it runs slower than asked on `platform`; empty otherwise."""


class Accumulation(enum.Enum):
    """How a step sums its passes' gradients (jaxpar.training.step.passes); the value is what run.json says."""
    ONE_PASS = "one pass"
    EACH_PASS_REDUCED = "summed over passes, reduced over data after each"
    REDUCED_ONCE = "summed on each data-parallel device, reduced over data once"


class StageGrads(enum.Enum):
    """How a pipeline stage's gradients are reduced over 'data' (jaxpar.parallel.pipeline)."""
    NONE = ""  # no pipeline
    STAGES_REDUCE = "by each stage once a round"
    SHARDINGS_REDUCE = "by the shardings, each microbatch"

"""What the execution plan and its readers see of the objects it holds, each implemented a layer
above this one: the pipeline schedule (jaxpar.parallel.schedules), the context strategy
(jaxpar.nn.context) and the matmul recipe (jaxpar.nn.recipes); the plan's modes, as enums, and
the rules that choose them (and a step's passes) from the config's sections and the mesh
(jaxpar.training.step.execution.plan_execution asks them).
"""

import enum
from typing import Protocol

from jaxpar.core.axes import DATA
from jaxpar.core.sharding import split_ways


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


def passes_within(t, dp: int, micro_batch: int | None = None) -> int:
    """[train] `t`'s grad_accum, times the split that keeps each device's rows per pass <= micro_batch (by
    default train.micro_batch).

    Every split sums the same rows' gradients, so the update is the same for any count.
    """
    limit = t.micro_batch if micro_batch is None else micro_batch
    rows = t.batch_size // t.grad_accum // dp
    split = 1
    if limit:
        split = next(k for k in range(-(-rows // limit), rows + 1) if rows % k == 0)
    return t.grad_accum * split


def passes_a_step(t, dp: int, schedule: PipelineSchedule | None, micro_batch: int) -> int:
    """The passes a step runs: the pipeline's M (its microbatches) per grad_accum round when there
    is one; dp: the ways the rows split."""
    if schedule is not None:
        return t.grad_accum * schedule.microbatches
    return passes_within(t, dp, micro_batch)


def accumulation(m, t, mesh, passes: int, schedule: PipelineSchedule | None, vmappable: bool) -> Accumulation:
    """How a step sums its passes' gradients. Locally, on each data-parallel device, with one
    reduction over 'data' a step, unless dropout draws each pass's masks over the whole batch as
    one device does, another axis splits the rows too (expert parallelism), the family cannot be
    vmapped (not `vmappable`), or a pipeline's rounds reduce their own. `m`, `t`: the [model] and
    [train] sections."""
    if (t.grad_accum if schedule is not None else passes) == 1:
        return Accumulation.ONE_PASS
    dp = mesh.shape[DATA]
    if (dp == 1 or m.dropout > 0 or schedule is not None or split_ways(mesh, "batch") != dp
            or not vmappable):
        return Accumulation.EACH_PASS_REDUCED
    return Accumulation.REDUCED_ONCE


def stage_grads(m, zero: int, mesh, schedule: PipelineSchedule | None) -> StageGrads:
    """How a stage's gradients leave it: reduced over 'data' once a round by each stage, unless
    dropout draws its masks over every row, ZeRO-3 gathers each layer's weights where it runs, or
    another axis splits the rows too (then the shardings reduce each microbatch's)."""
    if schedule is None:
        return StageGrads.NONE
    dp = mesh.shape[DATA]
    local = 1 < dp == split_ways(mesh, "batch") and m.dropout == 0 and zero < 3
    return StageGrads.STAGES_REDUCE if local else StageGrads.SHARDINGS_REDUCE


def ahead_of_stages(k: int) -> str:
    """The dense first layers (jaxpar.models.lead) run ahead of the stages, beside the embedding:
    every stage runs them on every microbatch, so they cost each stage their whole time."""
    return f"the {k} dense first layer{'s' if k > 1 else ''}, on every stage" if k else ""

"""Pipeline schedules, one file each, and their registry: `--pipeline.schedule=NAME` picks one.

A schedule (jaxpar.parallel.schedules.base.PipelineSchedule) owns its per-stage orders, the
placement of its layer chunks, whether a backward's weight gradient runs apart, its checks, its
bubble formula and its FLOPs run again; the executor (jaxpar.parallel.pipeline) reads its table.
A new schedule is a file here and a line in SCHEDULES, the registry of pipeline.schedule
(jaxpar.core.registry), which the config's checks ask as it loads.
"""

from jaxpar.core.axes import Run, check_chunks, pipeline_microbatches
from jaxpar.core.config import PipelineConfig
from jaxpar.core.registry import Registry
from jaxpar.parallel.schedules.base import PipelineSchedule
from jaxpar.parallel.schedules.dualpipev import DualPipeV
from jaxpar.parallel.schedules.forward import ForwardOnly
from jaxpar.parallel.schedules.gpipe import GPipe
from jaxpar.parallel.schedules.interleaved import Interleaved
from jaxpar.parallel.schedules.one_f_one_b import OneFOneB
from jaxpar.parallel.schedules.zb_h1 import ZBH1

# pipeline.schedule's entries ("": 1F1B); the config's checks ask the named one's layer chunks too
SCHEDULES = Registry("pipeline.schedule", {s.name: s for s in (GPipe, OneFOneB, Interleaved, ZBH1, DualPipeV)},
                     default=OneFOneB.name,
                     needs=lambda cfg: SCHEDULES[cfg.pipeline.schedule].chunks_per_stage(cfg.pipeline.virtual))
DEFAULT = OneFOneB  # pipeline.schedule left empty


def make_schedule(name: str, pp: int, microbatches: int, virtual: int = 1) -> PipelineSchedule:
    """The named schedule's table on pp stages, checked: a UserError where it cannot run."""
    cls = SCHEDULES.named(name)
    return table(cls, pp, microbatches, cls.chunks_per_stage(virtual))


def schedule_for(p: PipelineConfig, run: Run, pp: int, dp: int) -> PipelineSchedule | None:
    """The [pipeline] section's schedule on pp stages for `run` (its model and rows, split dp
    ways), its layer chunks, microbatches and table checked; None at pp=1 (where its name and
    pipeline.virtual are checked all the same)."""
    cls = SCHEDULES[p.schedule]
    chunks = cls.chunks_per_stage(p.virtual)
    if pp == 1:
        return None
    M = pipeline_microbatches(run, dp, pp)
    check_chunks(run.model, pp, chunks)
    return table(cls, pp, M, chunks)


def table(cls: type[PipelineSchedule], pp: int, microbatches: int, chunks: int) -> PipelineSchedule:
    """Schedule `cls`'s table on pp stages with `chunks` layer chunks a stage, checked: a UserError
    where it cannot run."""
    cls.check(pp, microbatches, chunks)
    return cls(pp, microbatches, chunks)


def evaluation(pp: int, microbatches: int) -> PipelineSchedule:
    """Evaluation's table: the forwards alone, the layers in order."""
    return ForwardOnly(pp, microbatches)

"""The execution plan of a step (jaxpar.core.execution), made once from the config, the mesh and
the mesh's platform, before anything is traced.

Training, evaluation, sampling, task scoring, `--dry-run` and the planner all make theirs here, so
that each runs what the same config runs in training on that mesh: the planner compiling for a
TPU pod from a CPU host plans for the TPU, and `jaxpar.eval` runs the attention kernel that
training ran.
"""

from jaxpar.core.axes import CONTEXT, DATA, PIPE
from jaxpar.core.config import Config
from jaxpar.core.execution import (
    EACH_PASS_REDUCED,
    ONE_PASS,
    REDUCED_ONCE,
    SHARDINGS_REDUCE,
    STAGES_REDUCE,
    ExecutionPlan,
)
from jaxpar.core.sharding import split_ways
from jaxpar.models.family import family_of
from jaxpar.nn import kernels, moe
from jaxpar.parallel import pipeline
from jaxpar.training.step import microbatches_for


def plan_execution(cfg: Config, mesh, platform: str | None = None, for_training: bool = True) -> ExecutionPlan:
    """The plan for cfg's train (and eval) step on `mesh`; `platform`: the devices' (by default
    the mesh's own, a compile-only TPU's too). Not `for_training` (evaluation, sampling): no
    passes to sum, and no pipeline."""
    platform = platform or kernels.platform_of(mesh)
    m = cfg.model
    device = kernels.device_of(mesh)
    attention, note = kernels.resolve(m, platform, mesh.shape.get(CONTEXT, 1), cfg.data.document_mask,
                                      kernels.cudnn_head_max(device), kernels.cudnn_head_max(device, host=device))
    experts = {}
    if m.n_experts:
        gemm, gemm_note = moe.gemm_of(m, platform)
        experts = {"experts": True, "moe_gemm": gemm, "moe_gemm_note": gemm_note,
                   "moe_dispatch": moe.dispatch_of(m, platform)}
    return ExecutionPlan(
        mesh=mesh, platform=platform, sequence_parallel=m.sequence_parallel, attention=attention,
        attention_note=note, accumulation=accumulation(cfg, mesh) if for_training else ONE_PASS, remat=m.remat,
        regather_weights=cfg.train.zero == 3, pipeline=pipeline_plan(cfg, mesh) if for_training else {}, **experts)


def accumulation(cfg: Config, mesh) -> str:
    """How a step sums its passes' gradients. Locally, on each data-parallel device, with one
    reduction over 'data' a step, unless dropout draws each pass's masks over the whole batch as
    one device does, another axis splits the rows too (expert parallelism), the family cannot be
    vmapped, or a pipeline's rounds reduce their own."""
    passes = cfg.train.grad_accum if mesh.shape[PIPE] > 1 else microbatches_for(cfg, mesh)
    if passes == 1:
        return ONE_PASS
    dp = mesh.shape[DATA]
    if (dp == 1 or cfg.model.dropout > 0 or mesh.shape[PIPE] > 1 or split_ways(mesh, "batch") != dp
            or not family_of(cfg.model).vmappable):
        return EACH_PASS_REDUCED
    return REDUCED_ONCE


def pipeline_plan(cfg: Config, mesh) -> dict:
    """The pipeline's schedule as the executor runs it, and how a stage's gradients leave it:
    reduced over 'data' once a round by each stage, unless dropout draws its masks over every
    row, ZeRO-3 gathers each layer's weights where it runs, or another axis splits the rows too
    (then the shardings reduce each microbatch's)."""
    if mesh.shape[PIPE] == 1:
        return {}
    schedule = pipeline.schedule_for(cfg, mesh)
    dp = mesh.shape[DATA]
    local = 1 < dp == split_ways(mesh, "batch") and cfg.model.dropout == 0 and cfg.train.zero < 3
    return {"schedule": schedule.name, "pp": schedule.pp, "virtual": schedule.virtual,
            "microbatches": schedule.microbatches, "ticks": schedule.ticks,
            "bubble_fraction": schedule.bubble_fraction,
            "gradients_reduced": STAGES_REDUCE if local else SHARDINGS_REDUCE} | ahead_of_stages(cfg.model)


def ahead_of_stages(m) -> dict:
    """The dense first layers (jaxpar.models.lead) run ahead of the stages, beside the embedding:
    every stage runs them on every microbatch, so they cost each stage their whole time."""
    k = m.lead_layers
    return {"ahead_of_stages": f"the {k} dense first layer{'s' if k > 1 else ''}, on every stage"} if k else {}

"""The execution plan of a step (jaxpar.core.execution), made once from the config, the mesh and
the mesh's platform, before anything is traced: its kernels, its passes a step and how their
gradients are summed, and the pipeline's schedule, checked once and held as a `Schedule`.

`jaxpar.training.step.build` makes it for training, evaluation, sampling, task scoring, `--dry-run` and
the planner, so that each runs what the same config runs in training on that mesh: the planner
compiling for a TPU pod from a CPU host plans for the TPU, and `jaxpar.eval` runs the attention
kernel that training ran.
"""

import jax

from jaxpar.core import kernel_registry as registry
from jaxpar.core import remat, xla_options
from jaxpar.core.axes import CONTEXT, DATA, EXPERT, PIPE, Run, check_chunks, pipeline_microbatches
from jaxpar.core.config import MICRO_BATCH_AUTO, Config, ModelConfig, PipelineConfig, TrainConfig
from jaxpar.core.errors import UserError
from jaxpar.core.execution import ExecutionPlan
from jaxpar.core.optimizer_config import OptimizerConfig
from jaxpar.core.platform import GPUS
from jaxpar.core.sharding import split_ways
from jaxpar.core.strategies import Accumulation, StageGrads
from jaxpar.models.registry import family_of
from jaxpar.nn import context, kernel_tuning, kernels, moe, recipes
from jaxpar.nn.recipes import recipe_for
from jaxpar.parallel.schedules import make_schedule, schedule_class
from jaxpar.parallel.schedules.base import PipelineSchedule
from jaxpar.training.optimizers import registry as optimizers


def plan_execution(cfg: Config, mesh, platform: str | None = None, for_training: bool = True,
                   micro_batch: int | None = None) -> ExecutionPlan:
    """The plan for cfg's train (and eval) step on `mesh`; `platform`: the devices' (by default
    the mesh's own, a compile-only TPU's too); `micro_batch`: train.micro_batch resolved (by
    default cfg's, which must then be a number). Not `for_training` (evaluation, sampling): no
    passes to sum, and no pipeline."""
    platform = platform or kernels.platform_of(mesh)
    m, t = cfg.model, cfg.train
    common = computing(m, cfg.data.document_mask, t.zero, mesh, platform)
    if not for_training:
        return ExecutionPlan(**common)
    check_names(cfg.optimizer, cfg.pipeline, m)
    check_host_memory(t.offload, m.remat, mesh, platform)
    device = kernels.device_of(mesh)
    options = xla_options.resolved(t.xla_options, platform)
    xla_options.check(options, device if isinstance(device, jax.Device) else None)
    rows = t.micro_batch if micro_batch is None else micro_batch
    if rows == MICRO_BATCH_AUTO:
        raise ValueError("train.micro_batch=auto is resolved first (jaxpar.training.step.build)")
    schedule = schedule_of(cfg.pipeline, cfg.run, mesh)
    passes = passes_a_step(t, split_ways(mesh, "batch"), schedule, rows)
    if m.n_experts:  # before the compile: on the host's own GPU, tuned for this step's shapes
        common |= tuned_gemm(m, t, mesh, platform, device, common["moe_gemm"], passes)
    return ExecutionPlan(**common, offload=t.offload, xla_options=options,
                         accumulation=accumulation(m, t, mesh, passes, schedule), passes=passes,
                         rows_per_pass=rows, schedule=schedule, stage_grads=stage_grads(m, t.zero, mesh, schedule),
                         ahead_of_stages=ahead_of_stages(m.lead_layers if schedule is not None else 0))


def computing(m: ModelConfig, documents: bool, zero: int, mesh, platform: str) -> dict:
    """What every step on `mesh` computes with, training's or an inference command's: the
    attention kernel (for what the context strategy shows it of the sequence), a mixture's GEMM
    and dispatch, the matmul recipe, and what is recomputed."""
    device = kernels.device_of(mesh)
    strategy = context.strategy_named(m.context_strategy)  # checked at the mesh's cp when it was built
    attention, note = kernels.resolve(m, platform, strategy.kernel_context(mesh.shape.get(CONTEXT, 1)), documents,
                                      kernels.cudnn_head_max(device), kernels.cudnn_head_max(device, host=device))
    experts = {}
    if m.n_experts:
        gemm, gemm_note = moe.gemm_of(m, platform)
        experts = {"experts": True, "moe_gemm": gemm, "moe_gemm_note": gemm_note,
                   "moe_dispatch": registry.chosen(registry.MOE_DISPATCH, m.moe_dispatch, platform)}
    return dict(mesh=mesh, platform=platform, sequence_parallel=m.sequence_parallel, context=strategy,
                attention=attention, attention_note=note, remat=m.remat, regather_weights=zero == 3,
                # the recipe is refused here where it cannot run
                recipe=recipe_for(m, platform, getattr(device, "device_kind", "")), **experts)


def check_names(o: OptimizerConfig, p: PipelineConfig, m: ModelConfig) -> None:
    """Every name a config's sections give a registry, each refused in one line naming the
    choices: the optimizer and its learning-rate schedule, the pipeline schedule and its layer
    chunks, the context strategy, the matmul recipe. plan_execution checks them; a command may
    ask first."""
    optimizers.check(o)
    schedule_class(p.schedule).chunks_per_stage(p.virtual)
    context.strategy_named(m.context_strategy)
    recipes.named(m)


def tuned_gemm(m: ModelConfig, t: TrainConfig, mesh, platform: str, device, gemm: str, passes: int) -> dict:
    """The plan's grouped GEMM tuned at plan time (jaxpar.nn.kernel_tuning.plan_tuning), nothing
    off a GPU, for its rows on one device in one of the step's `passes`: the pass's tokens x
    experts_per_token, times ep where the dispatch gathers every device's (dropless)."""
    if platform not in GPUS:
        return {}
    ep = mesh.shape.get(EXPERT, 1)
    sequences = t.batch_size // passes // split_ways(mesh, "batch")
    rows = sequences * m.block_size * m.experts_per_token * ep
    return kernel_tuning.plan_tuning(m, t.kernel_cache, t.choose_gemm_legs, platform, device, gemm, rows, ep,
                                     interpret=False)


def check_host_memory(offload: str, policy: str, mesh, platform: str) -> None:
    """Offloading (train.offload, or a model.remat policy that offloads) needs the devices' host
    memory kind (pinned_host); a UserError where it is missing."""
    asked = [f"train.offload={offload}"] * (offload != "none")
    asked += [f"model.remat={policy}"] * bool(remat.policy_of(policy).offloads)
    if asked and not remat.has_host_memory(mesh.devices.flat):
        raise UserError(f"{' and '.join(asked)} keeps arrays in host memory ({remat.HOST}), which the {platform} "
                        f"devices here do not have; use train.offload=none and a remat policy without offload")


def passes_within(t: TrainConfig, dp: int, micro_batch: int | None = None) -> int:
    """grad_accum, times the split that keeps each device's rows per pass <= micro_batch (by
    default train.micro_batch).

    Every split sums the same rows' gradients, so the update is the same for any count.
    """
    limit = t.micro_batch if micro_batch is None else micro_batch
    rows = t.batch_size // t.grad_accum // dp
    split = 1
    if limit:
        split = next(k for k in range(-(-rows // limit), rows + 1) if rows % k == 0)
    return t.grad_accum * split


def passes_a_step(t: TrainConfig, dp: int, schedule: PipelineSchedule | None, micro_batch: int) -> int:
    """The passes a step runs: the pipeline's M (its microbatches) per grad_accum round when there
    is one; dp: the ways the rows split."""
    if schedule is not None:
        return t.grad_accum * schedule.microbatches
    return passes_within(t, dp, micro_batch)


def schedule_of(p: PipelineConfig, run: Run, mesh) -> PipelineSchedule | None:
    """The [pipeline] section's schedule on `mesh` for `run` (its model and rows), its layer chunks,
    microbatches and table checked; None at pp=1 (where its name and pipeline.virtual are checked
    all the same)."""
    pp = mesh.shape[PIPE]
    chunks = schedule_class(p.schedule).chunks_per_stage(p.virtual)
    if pp == 1:
        return None
    M = pipeline_microbatches(run, split_ways(mesh, "batch"), pp)
    check_chunks(run.model, pp, chunks)
    return make_schedule(p.schedule, pp, M, p.virtual)


def accumulation(m: ModelConfig, t: TrainConfig, mesh, passes: int, schedule: PipelineSchedule | None) -> Accumulation:
    """How a step sums its passes' gradients. Locally, on each data-parallel device, with one
    reduction over 'data' a step, unless dropout draws each pass's masks over the whole batch as
    one device does, another axis splits the rows too (expert parallelism), the family cannot be
    vmapped, or a pipeline's rounds reduce their own."""
    if (t.grad_accum if schedule is not None else passes) == 1:
        return Accumulation.ONE_PASS
    dp = mesh.shape[DATA]
    if (dp == 1 or m.dropout > 0 or schedule is not None or split_ways(mesh, "batch") != dp
            or not family_of(m).vmappable):
        return Accumulation.EACH_PASS_REDUCED
    return Accumulation.REDUCED_ONCE


def stage_grads(m: ModelConfig, zero: int, mesh, schedule: PipelineSchedule | None) -> StageGrads:
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

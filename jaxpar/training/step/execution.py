"""The execution plan of a step (jaxpar.core.execution), made once from the config, the mesh and
the mesh's platform, before anything is traced: its kernels, its passes a step and how their
gradients are summed, and the pipeline's schedule, checked once and held as a `Schedule`.

`jaxpar.training.step.build` makes it for training, evaluation, sampling, task scoring, `--dry-run` and
the planner, so that each runs what the same config runs in training on that mesh: the planner
compiling for a TPU pod from a CPU host plans for the TPU, and `jaxpar.eval` runs the attention
kernel that training ran.
"""

import dataclasses

import jax

from jaxpar.core import remat, strategies, xla_options
from jaxpar.core.axes import CONTEXT, EXPERT, PIPE, TENSOR
from jaxpar.core.config import MICRO_BATCH_AUTO, Config, ModelConfig
from jaxpar.core.execution import ExecutionPlan
from jaxpar.core.platform import GPUS
from jaxpar.core.sharding import split_ways
from jaxpar.models.registry import family_of
from jaxpar.nn import context, kernel_tuning, kernels, moe
from jaxpar.nn.recipes import recipe_for
from jaxpar.parallel.schedules import schedule_for


def plan_execution(cfg: Config, mesh, platform: str | None = None, for_training: bool = True,
                   micro_batch: int | None = None) -> ExecutionPlan:
    """The plan for cfg's train (and eval) step on `mesh`; `platform`: the devices' (by default
    the mesh's own, a compile-only TPU's too); `micro_batch`: train.micro_batch resolved (by
    default cfg's, which must then be a number). Not `for_training` (evaluation, sampling): no
    passes to sum, and no pipeline. Each registry's name is resolved once, here."""
    platform = platform or kernels.platform_of(mesh)
    m, t = cfg.model, cfg.train
    common = computing(m, cfg.data.document_mask, t.zero, mesh, platform)
    if not for_training:
        return ExecutionPlan(**common)
    rows = t.micro_batch if micro_batch is None else micro_batch
    if rows == MICRO_BATCH_AUTO:
        raise ValueError("train.micro_batch=auto is resolved first (jaxpar.training.step.build)")
    schedule = schedule_for(cfg.pipeline, cfg.run, mesh.shape[PIPE], split_ways(mesh, "batch"))
    remat.check_host_memory(t.offload, m.remat, mesh.devices.flat, platform)
    device = kernels.device_of(mesh)
    options = xla_options.resolved(t.xla_options, platform)
    xla_options.check(options, device if isinstance(device, jax.Device) else None)
    passes = strategies.passes_a_step(t, split_ways(mesh, "batch"), schedule, rows)
    accumulation = strategies.accumulation(m, t, mesh, passes, schedule, family_of(m).vmappable)
    plan = ExecutionPlan(**common, offload=t.offload, xla_options=options, accumulation=accumulation,
                         passes=passes, rows_per_pass=rows, schedule=schedule,
                         stage_grads=strategies.stage_grads(m, t.zero, mesh, schedule),
                         ahead_of_stages=strategies.ahead_of_stages(m.lead_layers if schedule is not None else 0))
    if m.n_experts and platform in GPUS:  # before the compile: on the host's own GPU, for this step's shapes
        # a device's rows in one of the step's passes: its tokens x experts_per_token, times ep
        # where the dispatch gathers every device's (dropless)
        ep = mesh.shape.get(EXPERT, 1)
        rows = t.batch_size // passes // split_ways(mesh, "batch") * m.block_size * m.experts_per_token * ep
        plan = dataclasses.replace(plan, **kernel_tuning.plan_tuning(
            m, t.kernel_cache, t.choose_gemm_legs, platform, device, plan.moe_gemm, rows, ep, interpret=False))
    return plan


def computing(m: ModelConfig, documents: bool, zero: int, mesh, platform: str) -> dict:
    """What every step on `mesh` computes with, training's or an inference command's: the
    context strategy and the attention kernel (for what the strategy shows it of the sequence),
    each checked on this mesh and platform, the matmul recipe, a mixture's GEMM and dispatch, and
    what is recomputed (`documents`: data.document_mask)."""
    device = kernels.device_of(mesh)
    cp = mesh.shape.get(CONTEXT, 1)
    strategy = context.on_mesh(m, cp, mesh.shape.get(TENSOR, 1))
    kernels.check_mesh(m, platform, strategy.kernel_context(cp), kernels.cudnn_head_max(device))
    attention, note = kernels.resolve(m, platform, strategy.kernel_context(cp), documents,
                                      kernels.cudnn_head_max(device), kernels.cudnn_head_max(device, host=device))
    # the recipe is refused here where it cannot run
    recipe = recipe_for(m, platform, getattr(device, "device_kind", ""))
    experts = moe.experts_kernels(m, platform) if m.n_experts else {}
    return dict(mesh=mesh, platform=platform, sequence_parallel=m.sequence_parallel, context=strategy,
                attention=attention, attention_note=note, remat=m.remat, regather_weights=zero == 3,
                recipe=recipe, **experts)


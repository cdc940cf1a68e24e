"""The execution plan: every decision a traced step needs, made once before tracing, and handed to
the code that needs it.

`jaxpar.training.step.execution.plan_execution(cfg, mesh)` makes one from the config, the mesh and the
mesh's platform: the rule table, the attention kernel (and why another was not chosen), the MoE
dispatch and grouped GEMM, how the passes' gradients are summed, what is recomputed, and the
pipeline's schedule. The model, the step, evaluation, sampling and the planner receive it; nothing
inside a trace asks the host what it runs on, and no context variable carries a decision.

The plan also holds what changes within a trace: the mesh axes that are manual there (inside a
`shard_map`) or that split nothing there (vmapped over, or replicated over by an inference
command). `inside` and `unsplit` give the plan for such a region; its rule table leaves those axes
out.
"""

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.core.axes import CONTEXT, EXPERT, rule_table
from jaxpar.core.platform import GPUS
from jaxpar.core.sharding import drop_axes, logical_to_spec, names_of
from jaxpar.core.strategies import Accumulation, ContextStrategy, MatmulRecipe, PipelineSchedule, StageGrads


@dataclass(frozen=True, eq=False)
class ExecutionPlan:
    """The decisions of one step on one mesh (None: one device, no mesh: nothing is constrained)."""

    mesh: Mesh | AbstractMesh | None = None  # the mesh the step runs on (abstract: compiled for devices not here)
    platform: str = "cpu"
    sequence_parallel: bool = False
    context: ContextStrategy | None = None  # how attention runs where 'context' splits the sequence
    attention: str = "xla"  # xla, splash, cudnn or tokamax
    attention_note: str | None = None  # why `auto` kept xla where a fused kernel exists, or planned a stand-in
    moe_gemm: str = "ragged_dot"  # ragged_dot, megablox, blocks or tokamax (jaxpar.nn.moe.gemm_of)
    moe_gemm_note: str | None = None  # why `auto` runs a dearer GEMM than the platform has
    # Each leg's kernel (forward, dlhs, drhs) where measured (jaxpar.nn.kernel_tuning); (): all three moe_gemm
    gemm_legs: tuple = ()
    gemm_tuning: tuple[str, ...] = ()  # tokamax's grouped-GEMM configs tuned for this GPU at plan time, each its JSON
    tuning_note: str | None = None  # the one line of what was tuned at plan time, and what it cost
    moe_dispatch: str = "all_to_all"  # all_to_all or ragged, where experts are split over 'expert'
    accumulation: Accumulation = Accumulation.ONE_PASS
    remat: str = "none"  # model.remat, a policy of jaxpar.core.remat
    offload: str = "none"  # train.offload: "optimizer" keeps the optimizer's state in host memory
    recipe: MatmulRecipe | None = None  # how the matmuls compute (jaxpar.nn.recipes); None: model.dtype's
    xla_options: tuple = ()  # (name, value) XLA compile options of the steps (jaxpar.core.xla_options)
    regather_weights: bool = False  # ZeRO-3: each layer's weights gathered again in the backward
    passes: int = 1  # passes a step: grad_accum x the pipeline's M, or the splits train.micro_batch asks
    rows_per_pass: int = 0  # train.micro_batch resolved (`auto` too): the most rows a device takes a pass; 0: no limit
    schedule: PipelineSchedule | None = None  # the pipeline's table (jaxpar.parallel.schedules), checked once; None: no pipeline
    stage_grads: StageGrads = StageGrads.NONE  # how a pipeline stage's gradients are reduced over 'data'
    ahead_of_stages: str = ""  # what runs ahead of the stages on every stage (jaxpar.models.lead)
    experts: bool = False  # the model has a mixture of experts (its dispatch is worth printing)
    manual: frozenset = frozenset()  # mesh axes that are manual here (inside shard_map)
    unsplit_axes: frozenset = frozenset()  # mesh axes that split nothing here

    @cached_property
    def sizes(self) -> dict[str, int]:
        """Each mesh axis's size; empty without a mesh."""
        return {} if self.mesh is None else dict(self.mesh.shape)

    @cached_property
    def rules(self) -> dict:
        """The rule table here: the model's, less the manual and unsplit axes."""
        table, gone = rule_table(self.sequence_parallel), self.manual | self.unsplit_axes
        return table if not gone else {name: drop_axes(axes, gone) for name, axes in table.items()}

    @property
    def pipeline(self) -> dict:
        """The schedule as run.json and --dry-run print it; empty without a pipeline."""
        s = self.schedule
        if s is None:
            return {}
        ahead = {"ahead_of_stages": self.ahead_of_stages} if self.ahead_of_stages else {}
        return {"schedule": s.name, "pp": s.pp, "virtual": s.virtual, "microbatches": s.microbatches,
                "ticks": s.ticks, "bubble_fraction": s.bubble_fraction, "gradients_reduced": self.stage_grads.value} | ahead

    @property
    def notes(self) -> tuple[str, ...]:
        """One line each where `auto` chose a slower path than the platform has, and why."""
        recipe = self.recipe.note(self.platform) if self.recipe is not None else ""
        return tuple(note for note in (self.attention_note, self.moe_gemm_note, self.tuning_note, recipe) if note)

    @property
    def compiler_options(self) -> dict | None:
        """The steps' `jax.jit(compiler_options=...)`: None without options, as plain jit."""
        return dict(self.xla_options) or None

    @property
    def interpret(self) -> bool:
        """Pallas's TPU kernels (splash, Megablox) run in interpret mode off TPU (the tests)."""
        return self.platform != "tpu"

    @property
    def cpu_matmuls(self) -> bool:
        """The projections' backward shaped for XLA:CPU's bf16 kernels (jaxpar.nn.recipes.model_dtype)."""
        return self.platform == "cpu"

    @property
    def recompute_activations(self) -> bool:
        """The GELU and SwiGLU keep their input alone and run again in the backward: on an
        accelerator, where a step waits on bytes; a CPU waits on arithmetic."""
        return self.platform != "cpu"

    @property
    def one_pass_log_sum_exp(self) -> bool:
        """The chunked loss takes each piece's log-sum-exp in one pass over its float32 logits
        (jaxpar.nn.loss): on GPUs, where XLA reads them once for the max and again for the sum.
        XLA:TPU fuses the max into the head's matmul already; a CPU waits on arithmetic."""
        return self.platform in GPUS

    @property
    def moe_mode(self) -> str:
        """local (one device of 'expert'), replicated (the tokens whole on every device of it:
        each runs its own experts on all of them), or the dispatch."""
        if self.sizes.get(EXPERT, 1) == 1:
            return "local"
        if EXPERT not in names_of(self.rules["batch"]):
            return "replicated"
        return self.moe_dispatch

    def ring(self) -> tuple[str | None, int]:
        """(the mesh axis the sequence is split over here, its size): (None, 1) without one."""
        axis = self.rules["seq"]
        if axis is None or self.mesh is None:
            return None, 1
        return axis, self.sizes[axis]

    def spec(self, axes: tuple[str, ...]) -> P:
        return logical_to_spec(axes, self.rules)

    def constrain(self, x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        """Pin an activation's sharding by logical names; nothing without a mesh. Inside a
        shard_map the spec is the enclosing map's context's; outside, on the plan's mesh."""
        if self.mesh is None:
            return x
        spec = self.spec(axes)
        return jax.lax.with_sharding_constraint(x, spec if self.manual else NamedSharding(self.mesh, spec))

    def inside(self, *axes: str) -> "ExecutionPlan":
        """The plan inside a shard_map manual over `axes`."""
        return dataclasses.replace(self, manual=self.manual | frozenset(axes))

    def unsplit(self, *axes: str) -> "ExecutionPlan":
        """The plan where `axes` split no activation: code vmapped over an axis with
        `spmd_axis_name`, or computing a whole batch or sequence on every device of an axis."""
        return dataclasses.replace(self, unsplit_axes=self.unsplit_axes | frozenset(axes))

    def per_device(self, fn, in_axes: tuple, out_axes: tuple):
        """fn on one device's shards: `jax.shard_map` manual over every mesh axis not manual yet,
        each input and output split as the rule table here splits its logical axes (out_axes: one
        tuple of names, or a tuple of them for several outputs). Under `jax.vmap(spmd_axis_name=...)`
        the vmapped axis is unsplit here, in no spec, so vmap can split the inputs over it."""
        several = isinstance(out_axes[0], tuple)
        return jax.shard_map(fn, mesh=None if self.manual else self.mesh,  # nested: the enclosing map's
                             in_specs=tuple(self.spec(a) for a in in_axes),
                             out_specs=tuple(map(self.spec, out_axes)) if several else self.spec(out_axes),
                             axis_names=frozenset(a for a in self.mesh.axis_names if a not in self.manual),
                             check_vma=False)

    @property
    def grouped_gemm(self) -> str | dict:
        """The grouped GEMM as run.json prints it: the kernel (and why), or, where each leg's
        kernel was chosen, {"forward": ..., "dlhs": ..., "drhs": ...}."""
        if self.gemm_legs:
            return dict(zip(("forward", "dlhs", "drhs"), self.gemm_legs, strict=True))
        return self.moe_gemm + (f" ({self.moe_gemm_note})" if self.moe_gemm_note else "")

    def describe(self) -> dict:
        """What run.json and --dry-run print."""
        kernel = self.attention + (f" ({self.attention_note})" if self.attention_note else "")
        tuned = {"kernel_tuning": self.tuning_note} if self.tuning_note else {}
        split = self.context is not None and self.sizes.get(CONTEXT, 1) > 1
        split = {"context_strategy": self.context.name} if split else {}
        return {"platform": self.platform, "mesh": self.sizes, "attention": kernel, **split,
                **({"moe": {"dispatch": self.moe_mode, "grouped_gemm": self.grouped_gemm, **tuned}}
                   if self.experts else {}),
                **({"matmuls": self.recipe.describe()} if self.recipe is not None else {}),
                "micro_batch": self.rows_per_pass, "passes": self.passes,
                "accumulation": self.accumulation.value, "remat": self.remat, "offload": self.offload,
                **({"xla_options": dict(self.xla_options)} if self.xla_options else {}),
                "activations_recomputed": self.recompute_activations, "weights_regathered": self.regather_weights,
                "rules": {name: axes for name, axes in self.rules.items() if axes is not None},
                **({"pipeline": self.pipeline} if self.pipeline else {})}

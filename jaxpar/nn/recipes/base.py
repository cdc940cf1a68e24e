"""A matmul recipe: how the model's matmuls compute, in one object that owns its code.

The execution plan holds one (jaxpar.training.step.execution.plan_execution picks it); every projection
(`project`: attention's, the MLPs', the lm_head's) and the experts' grouped GEMM (`grouped`)
computes through it, and nothing else in the model names a precision. A recipe also says what it
costs and where it runs: `mfu_dtype`, the dtype whose peak FLOP/s MFU divides by; `platforms`, the
ones it runs on (`check` refuses the others in one line before anything is traced); `describe`,
what run.json and --dry-run print of it, each kind of matmul with the dtype it multiplies in.

A recipe takes its operands as they reach the matmul, in model.dtype (`dtype`), and returns float32.
A new recipe (an FP8 one, say) is a file in this package and a line in its registry: its `project`
quantizes x and w in the forward and the output gradient in its backward (`gradient_specs` gives
the two gradients' einsums), and its `grouped` wraps the kernel call the plan chose, so that one
custom_vjp quantizes the product's operands and each backward leg's (jax.vjp of the kernel gives
them, by the kernel's own backward).
"""

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import jax

from jaxpar.core.errors import UserError

# The kinds of matmul a recipe computes, each of which it may run in its own dtype.
PROJECTIONS = "projections"  # the layers' (attention's, the MLPs', MLA's, the MTP modules')
HEAD = "head"  # the lm_head's
EXPERTS = "experts"  # the experts' grouped GEMM (jaxpar.nn.moe)
MATMULS = (PROJECTIONS, HEAD, EXPERTS)
EVERY_PLATFORM = ("cpu", "gpu", "tpu")

# A grouped GEMM: x (..., K) rows sorted by group, w (G, K, N), and the index arrays it reads (the
# group sizes, say) -> (..., N) float32, with its own backward; a recipe's `grouped` binds the arrays.
GroupedGemm = Callable[[jax.Array, jax.Array, object], jax.Array]
Bound = Callable[[jax.Array, jax.Array], jax.Array]


@dataclass(frozen=True)
class MatmulRecipe(ABC):
    """One way of computing the model's matmuls, for model.dtype `dtype` (the operands' as they
    arrive); `cpu_matmuls`: the plan's, the backward shaped for XLA:CPU where the recipe has such
    a shape (jaxpar.core.execution.ExecutionPlan.cpu_matmuls)."""
    name: ClassVar[str]  # its name in the registry (jaxpar.nn.recipes.RECIPES)
    about: ClassVar[str]  # one line: what it computes in
    platforms: ClassVar[tuple[str, ...]] = EVERY_PLATFORM
    instead: ClassVar[str] = ""  # the fix `check` names where it cannot run
    dtype: str
    cpu_matmuls: bool = False
    whole_over: tuple[str, ...] = ()  # the mesh axes manual where it computes (inside a shard_map)

    @property
    @abstractmethod
    def mfu_dtype(self) -> str:
        """The dtype whose peak FLOP/s MFU divides by (jaxpar.models.flops.peak_flops)."""

    @abstractmethod
    def operand_dtype(self, matmul: str) -> str:
        """The dtype the `matmul` kind's operands multiply in (one of MATMULS)."""

    @abstractmethod
    def project(self, spec: str, x: jax.Array, w: jax.Array, matmul: str = PROJECTIONS) -> jax.Array:
        """einsum(spec, x, w) of activations x and weights w in `dtype`, accumulated in and
        returned as float32, differentiable in both; `matmul`: PROJECTIONS or HEAD."""

    @abstractmethod
    def grouped(self, gemm: GroupedGemm, arrays) -> Bound:
        """The experts' grouped GEMM through the recipe, (x, w) -> float32: `gemm` is the plan's
        kernel call (its forward and backward legs, jaxpar.nn.grouped_gemm), its operands in
        `dtype`, `arrays` the integer arrays it reads (passed, not closed over: a custom_vjp
        may hold no traced value as a static argument)."""

    def check(self, platform: str, chip: str = "") -> None:
        """Refuse, in one UserError line naming the fix, a platform (and its chip, where known)
        the recipe does not run on."""
        if platform not in self.platforms:
            where = f"{platform} ({chip})" if chip else platform
            raise UserError(f"the {self.name} matmul recipe ({self.about}) runs on {', '.join(self.platforms)}, "
                            f"not on {where}; {self.instead}")

    def note(self, platform: str) -> str:
        """One line a run prints at its start where the recipe runs slower than asked on `platform`."""
        return ""

    def within(self, axes) -> "MatmulRecipe":
        """The recipe inside a shard_map manual over `axes` (a recipe that takes amaxes over whole
        tensors takes them over these too)."""
        axes = tuple(sorted(axes))
        return self if axes == self.whole_over else dataclasses.replace(self, whole_over=axes)

    def describe(self) -> dict:
        """What run.json and --dry-run print: the recipe, each kind of matmul's dtype, MFU's."""
        return {"recipe": self.name, **{m: self.operand_dtype(m) for m in MATMULS}, "mfu_dtype": self.mfu_dtype}


def gradient_specs(spec: str) -> tuple[str, str]:
    """The einsums of a projection's two gradients, from its forward's "x,w->y": the input's
    (y, w -> x) and the weights' (x, y -> w)."""
    (xs, ws), out = spec.split("->")[0].split(","), spec.split("->")[1]
    return f"{out},{ws}->{xs}", f"{xs},{out}->{ws}"

"""Matmul recipes, one file each, and their registry: how the model's projections and the experts'
grouped GEMM compute (jaxpar.nn.recipes.base). `model.fp8` names one (none: model.dtype's). The
execution plan holds one, chosen and checked once (`recipe_for`, from
jaxpar.training.step.execution.plan_execution); the model asks the plan's (`of`).
"""

import dataclasses

import jax.numpy as jnp

from jaxpar.core.axes import PIPE
from jaxpar.core.errors import UserError
from jaxpar.core.execution import ExecutionPlan
from jaxpar.core.registry import Registry
from jaxpar.nn.recipes.base import EXPERTS, HEAD, MATMULS, PROJECTIONS, MatmulRecipe  # noqa: F401
from jaxpar.nn.recipes.fp8 import Rowwise, Tensorwise
from jaxpar.nn.recipes.model_dtype import ModelDtype

RECIPES: dict[str, type[MatmulRecipe]] = {r.name: r for r in (ModelDtype, Tensorwise, Rowwise)}
DEFAULT = ModelDtype.name


def check_head(cfg) -> None:
    """model.fp8_head asks for an FP8 recipe: refused in one line under model.fp8=none."""
    if cfg.model.fp8_head and FP8[cfg.model.fp8] == DEFAULT:
        raise UserError("model.fp8_head=true runs the lm_head in FP8 under an FP8 recipe; "
                        f"add --model.fp8={Tensorwise.name} (or {Rowwise.name}), or drop model.fp8_head")


# model.fp8 -> its recipe's name in RECIPES
FP8 = Registry("model.fp8", {"none": DEFAULT, Tensorwise.name: Tensorwise.name, Rowwise.name: Rowwise.name},
               needs=check_head)


def recipe_for(m, platform: str, chip: str = "") -> MatmulRecipe:
    """The recipe the [model] section `m` names on `platform` (its `chip`, where known), refused
    there in one UserError line where it cannot run; shaped for XLA:CPU where the plan's
    cpu_matmuls says so."""
    cls = RECIPES[FP8[m.fp8]]
    extra = {"head": bool(m.fp8_head)} if "head" in {f.name for f in dataclasses.fields(cls)} else {}
    recipe = cls(jnp.dtype(m.dtype).name, ExecutionPlan(platform=platform).cpu_matmuls, **extra)
    recipe.check(platform, chip)
    return recipe


def of(plan, dtype, every_axis: bool = False) -> MatmulRecipe:
    """The plan's recipe, inside the plan's shard_map where it is in one (`every_axis`: in one
    manual over every axis that splits anything here, as ExecutionPlan.per_device's); where a plan
    made by hand holds none (one device, a test's), the default in `dtype` (the model's), shaped as
    the plan's cpu_matmuls says. A pipeline's stages hold other layers and other microbatches, so
    'pipe' is no axis of a tensor there."""
    recipe = plan.recipe if plan.recipe is not None else default(dtype, plan.cpu_matmuls)
    manual = (a for a in plan.sizes if a not in plan.unsplit_axes) if every_axis else plan.manual
    return recipe.within(a for a in manual if a != PIPE)


def default(dtype, cpu_matmuls: bool = False) -> MatmulRecipe:
    """The default recipe in `dtype`: today's matmuls, in model.dtype."""
    return RECIPES[DEFAULT](jnp.dtype(dtype).name, cpu_matmuls)

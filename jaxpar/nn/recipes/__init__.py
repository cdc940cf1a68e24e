"""Matmul recipes, one file each, and their registry: how the model's projections and the experts'
grouped GEMM compute (jaxpar.nn.recipes.base). The execution plan holds one, chosen and checked
once (`recipe_for`, from jaxpar.training.execution.plan_execution); the model asks the plan's (`of`).
"""

import jax.numpy as jnp

from jaxpar.core.execution import ExecutionPlan
from jaxpar.nn.recipes.base import EXPERTS, HEAD, MATMULS, PROJECTIONS, MatmulRecipe  # noqa: F401
from jaxpar.nn.recipes.model_dtype import ModelDtype

RECIPES: dict[str, type[MatmulRecipe]] = {r.name: r for r in (ModelDtype,)}
DEFAULT = ModelDtype.name


def recipe_for(m, platform: str, name: str = DEFAULT) -> MatmulRecipe:
    """The recipe `name` for the [model] section `m` on `platform`, refused there in one UserError
    line where it cannot run; shaped for XLA:CPU where the plan's cpu_matmuls says so."""
    recipe = RECIPES[name](jnp.dtype(m.dtype).name, ExecutionPlan(platform=platform).cpu_matmuls)
    recipe.check(platform)
    return recipe


def of(plan, dtype) -> MatmulRecipe:
    """The plan's recipe; where a plan made by hand holds none (one device, a test's), the default
    in `dtype` (the model's), shaped as the plan's cpu_matmuls says."""
    return plan.recipe if plan.recipe is not None else default(dtype, plan.cpu_matmuls)


def default(dtype, cpu_matmuls: bool = False) -> MatmulRecipe:
    """The default recipe in `dtype`: today's matmuls, in model.dtype."""
    return RECIPES[DEFAULT](jnp.dtype(dtype).name, cpu_matmuls)

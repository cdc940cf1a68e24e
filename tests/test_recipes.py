"""Matmul recipes (jaxpar.nn.recipes): every registered recipe's projection and grouped GEMM equal
float32 einsums within its dtype's tolerance, forward and both gradients; the plan holds one, which
names MFU's dtype, every projection and the grouped GEMM go through it, and a recipe refuses a
platform it does not run on in one line."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from helpers import error_at_scale

from jaxpar.core.errors import UserError
from jaxpar.core.execution import ExecutionPlan
from jaxpar.models.transformer import Transformer
from jaxpar.nn import recipes
from jaxpar.nn.grouped_gemm import blocked_gemm, grouped_gemm
from jaxpar.nn.recipes import EXPERTS, HEAD, PROJECTIONS, RECIPES
from jaxpar.nn.recipes.model_dtype import ModelDtype
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.step.execution import plan_execution

# Of each result's largest magnitude: float32 sums the same products in another order; bfloat16
# rounds each gradient to 8 bits (a wrong transpose or a missing scale is off by order 1); FP8
# rounds each operand to 4 bits (e4m3, 2^-4) and a gradient to 3 (e5m2, 2^-3), so a product of
# two is off by at most their sum. tests/test_fp8.py holds the FP8 recipes to their exact reference.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float8_e4m3fn": 2 ** -4 + 2 ** -3}
MODEL_DTYPES = ("float32", "bfloat16")
SPECS = [("nc,cshd->nshd", (64, 12), (12, 3, 2, 4)), ("nhd,hdc->nc", (64, 2, 4), (2, 4, 12)),
         ("btc,vc->btv", (2, 32, 12), (16, 12)), ("nc,cf->nf", (64, 12), (12, 20))]
ON_CPU = [(cls, dtype) for cls in RECIPES.values() if "cpu" in cls.platforms for dtype in MODEL_DTYPES]


def drawn(shape, dtype, seed):
    """Normal draws that `dtype` holds exactly, so that the float32 reference multiplies the same values."""
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def with_gradients(f, x, w, g, jit=False) -> tuple:
    """(f(x, w), its gradients in x and in w for the output gradient g); `jit`: the backward
    jitted apart (XLA:CPU runs each dot in the form the recipe gives it; jitted with the forward,
    an accelerator's form may be laid out as XLA:CPU's bf16 dots cannot run)."""
    y, back = jax.vjp(f, x, w)
    return y, *(jax.jit(back) if jit else back)(g)


def projection_errors(recipe, spec: str, x_shape, w_shape) -> list[float]:
    """The recipe's projection against the float32 einsum: the output's, the input gradient's and
    the weights' error at scale (jitted: XLA:CPU runs the form the recipe shapes for it)."""
    x, w = drawn(x_shape, recipe.dtype, 0), drawn(w_shape, recipe.dtype, 1)
    out_shape = jax.eval_shape(lambda x, w: jnp.einsum(spec, x, w), x, w).shape
    g = drawn(out_shape, recipe.dtype, 2).astype(jnp.float32)
    got = with_gradients(jax.jit(functools.partial(recipe.project, spec)), x, w, g, jit=True)
    want = with_gradients(functools.partial(jnp.einsum, spec), x.astype(jnp.float32), w.astype(jnp.float32), g)
    assert got[0].dtype == jnp.float32 and got[1].dtype == x.dtype and got[2].dtype == w.dtype
    return [error_at_scale(np.asarray(a, np.float32), np.asarray(b)) for a, b in zip(got, want, strict=True)]


@pytest.mark.parametrize("cpu_matmuls", [True, False])
@pytest.mark.parametrize("cls, dtype", ON_CPU, ids=lambda v: getattr(v, "name", v))
def test_every_recipes_projection_is_the_float32_einsum_within_its_tolerance(cls, dtype, cpu_matmuls):
    recipe = cls(dtype, cpu_matmuls)
    for spec, x_shape, w_shape in SPECS:
        errors = projection_errors(recipe, spec, x_shape, w_shape)
        assert max(errors) <= TOLERANCE[recipe.operand_dtype(PROJECTIONS)], (spec, errors)


@dataclasses.dataclass(frozen=True)
class Scaled(ModelDtype):
    """A wrong recipe, the control: its projections 1/16 too large."""
    name = "scaled"

    def project(self, spec, x, w, matmul=PROJECTIONS):
        return super().project(spec, x, w, matmul) * (1 + 2 ** -4)


def test_the_projection_check_fails_a_wrong_recipe_and_tells_the_dtypes_apart():
    """The control: a recipe 1/16 off fails in either dtype, and bfloat16's rounding does not
    pass float32's tolerance."""
    for dtype in MODEL_DTYPES:
        assert max(projection_errors(Scaled(dtype), *SPECS[0])) > TOLERANCE["bfloat16"]
    assert max(projection_errors(ModelDtype("bfloat16"), *SPECS[0])) > TOLERANCE["float32"]


def grouped_errors(recipe, kernel) -> list[float]:
    """The recipe's grouped GEMM, by `kernel` (x, w, group_sizes), against each row times its
    group's matrix in float32 (rows past the groups zero): the product's and both gradients' errors."""
    G, rows, K, N = 3, 40, 8, 12
    sizes = jnp.asarray([9, 0, 24], jnp.int32)  # an empty group, and 7 rows past the groups
    x, w, g = drawn((rows, K), recipe.dtype, 0), drawn((G, K, N), recipe.dtype, 1), drawn((rows, N), recipe.dtype, 2)
    group = jnp.repeat(jnp.arange(G), sizes, total_repeat_length=rows)
    grouped = jnp.arange(rows) < jnp.sum(sizes)
    reference = lambda x, w: jnp.where(grouped[:, None], jnp.einsum("rk,rkn->rn", x, w[group]), 0)
    gemm = recipe.grouped(kernel, sizes)
    got = with_gradients(jax.jit(gemm), x, w, g.astype(jnp.float32), jit=True)
    want = with_gradients(reference, x.astype(jnp.float32), w.astype(jnp.float32), g.astype(jnp.float32))
    return [error_at_scale(np.asarray(a, np.float32), np.asarray(b)) for a, b in zip(got, want, strict=True)]


@pytest.mark.parametrize("kernel", [functools.partial(grouped_gemm, gemm="ragged_dot"), blocked_gemm],
                         ids=["ragged_dot", "blocks"])
@pytest.mark.parametrize("cls, dtype", ON_CPU, ids=lambda v: getattr(v, "name", v))
def test_every_recipes_grouped_gemm_is_the_float32_product_within_its_tolerance(cls, dtype, kernel):
    recipe = cls(dtype, True)
    errors = grouped_errors(recipe, kernel)
    assert max(errors) <= TOLERANCE[recipe.operand_dtype(EXPERTS)], errors


def test_the_grouped_check_fails_a_gemm_off_by_a_scale():
    """The control: a kernel 1/16 too large fails the same check."""
    off = lambda x, w, sizes: grouped_gemm(x, w, sizes, "ragged_dot") * (1 + 2 ** -4)
    assert max(grouped_errors(ModelDtype("float32"), off)) > TOLERANCE["bfloat16"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_plan_holds_the_recipe_whose_dtype_mfu_divides_by(dtype):
    """plan_execution puts model.dtype's recipe on the training and the inference plans; MFU's
    peak is in its mfu_dtype (jaxpar.training.run.trainer), and run.json names each matmul's dtype."""
    cfg = tiny_config(**{"model.dtype": dtype})
    mesh = build_mesh(cfg, jax.devices()[:1])
    for plan in (plan_execution(cfg, mesh), plan_execution(cfg, mesh, for_training=False)):
        assert plan.recipe == ModelDtype(dtype, cpu_matmuls=True) and plan.recipe.mfu_dtype == dtype
        assert plan.describe()["matmuls"] == {"recipe": "model_dtype", PROJECTIONS: dtype, HEAD: dtype,
                                              EXPERTS: dtype, "mfu_dtype": dtype}
    on_tpu = plan_execution(cfg, mesh, platform="tpu", for_training=False)
    assert on_tpu.recipe == ModelDtype(dtype, cpu_matmuls=False)  # the plan's cpu_matmuls, the recipe's shaping


def test_a_plan_made_by_hand_computes_in_the_models_dtype():
    """A plan without a recipe (a test's, one device) gives the default in the model's dtype,
    shaped as its platform says; a plan's own recipe wins."""
    assert recipes.of(ExecutionPlan(), jnp.bfloat16) == ModelDtype("bfloat16", cpu_matmuls=True)
    assert recipes.of(ExecutionPlan(platform="tpu"), "float32") == ModelDtype("float32", cpu_matmuls=False)
    mine = Scaled("float32")
    assert recipes.of(ExecutionPlan(recipe=mine), jnp.bfloat16) is mine


@dataclasses.dataclass(frozen=True)
class Seen(ModelDtype):
    """Today's recipe, noting the kind of every matmul traced through it."""
    name = "seen"
    kinds: list = dataclasses.field(default_factory=list, compare=False)

    def project(self, spec, x, w, matmul=PROJECTIONS):
        self.kinds.append(matmul)
        return super().project(spec, x, w, matmul)

    def grouped(self, gemm, arrays):
        self.kinds.append(EXPERTS)
        return super().grouped(gemm, arrays)


@pytest.mark.parametrize("config, kinds", [("tiny", {PROJECTIONS, HEAD}), ("tiny_moe", {PROJECTIONS, HEAD, EXPERTS}),
                                           ("tiny_deepseek", {PROJECTIONS, HEAD, EXPERTS})])
def test_the_projections_and_the_grouped_gemm_go_through_the_plans_recipe(config, kinds):
    """Tracing the loss on a plan whose recipe notes its matmuls: the layers' projections, the
    head and the experts' GEMM each reach it (DeepSeek's MTP module and MLA too)."""
    cfg = tiny_config(config)
    seen = Seen(cfg.model.dtype)
    model = Transformer(cfg.model, 65, plan=ExecutionPlan(recipe=seen))
    tokens = jax.ShapeDtypeStruct((2, cfg.model.block_size), jnp.int32)
    jax.eval_shape(model.loss, model.shapes(), tokens, tokens)
    assert set(seen.kinds) == kinds and seen.kinds.count(HEAD) >= 1


@dataclasses.dataclass(frozen=True)
class OnGpusOnly(ModelDtype):
    name = "on_gpus_only"
    about = "a test's"
    platforms = ("gpu",)
    instead = "use the default recipe"


def test_a_recipe_refuses_a_platform_it_does_not_run_on_in_one_line(monkeypatch):
    monkeypatch.setitem(RECIPES, OnGpusOnly.name, OnGpusOnly)
    monkeypatch.setitem(recipes.FP8, OnGpusOnly.name, OnGpusOnly.name)
    m = tiny_config(**{"model.fp8": OnGpusOnly.name}).model
    with pytest.raises(UserError) as refused:
        recipes.recipe_for(m, "cpu")
    message = str(refused.value)
    assert "\n" not in message and "runs on gpu, not on cpu" in message and "use the default recipe" in message
    assert recipes.recipe_for(m, "gpu") == OnGpusOnly("float32")  # the control

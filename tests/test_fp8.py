"""FP8 training (`--model.fp8=tensorwise|rowwise`, jaxpar.nn.recipes.fp8).

- Each recipe's projection equals a quantize-dequantize reference written here in numpy (each
  operand scaled by its amax, rounded to its FP8 format, scaled back, an f32 product), forward and
  both gradients, within 1e-6 of the result's largest magnitude; a reference with a scale off by 2
  fails the same check. So does the grouped GEMM, with an empty group and rows past the groups.
- Against bf16 at Llama-3-8B's MLP shapes (slow; by default at a quarter of each size) each
  recipe's output and gradients keep a signal-to-noise ratio of 20 dB (torchao's test).
- Every layout trains as one device does in FP8: per-step losses within rtol 1e-4 (quantization can
  turn a last-bit difference of an amax into one step of e4m3), a pipeline against one device
  running the same microbatches as passes (a pass's activations are scaled by their own amax). A
  10% larger learning rate fails the same check.
- The plan says which matmuls run in FP8, and that XLA:CPU emulates them; bad keys and a TPU
  without FP8 units are one line. (A run resumes across `none` and a recipe: tests/test_checkpoint.py.)
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_overrides, tiny_config
from helpers import exits_with_one_line, losses, train

from jaxpar.core.axes import batch_ways, pipeline_microbatches
from jaxpar.core.errors import UserError
from jaxpar.nn import recipes
from jaxpar.nn.grouped_gemm import blocked_gemm, grouped_gemm
from jaxpar.nn.recipes import EXPERTS, HEAD, PROJECTIONS
from jaxpar.nn.recipes.fp8 import E4M3, Fp8, Tensorwise
from jaxpar.parallel.mesh import build_mesh
from jaxpar.train import main as train_main
from jaxpar.training.step.execution import plan_execution

FP8_RECIPES = [name for name, cls in recipes.RECIPES.items() if issubclass(cls, Fp8)]
EXACT = 1e-6  # of the largest magnitude: the same products of FP8 values, summed in another order
SPECS = [("nc,cshd->nshd", (64, 12), (12, 3, 2, 4)), ("btc,vc->btv", (2, 32, 12), (16, 12)),
         ("nhd,hdc->nc", (64, 2, 4), (2, 4, 12))]


def qdq(a: np.ndarray, reduced: tuple, fmt, pow2: bool, off: float = 1.0) -> np.ndarray:
    """a quantized to `fmt` by the amax over the `reduced` axes, dequantized (off: the scale times it)."""
    amax = np.max(np.abs(a), axis=reduced, keepdims=True)
    big = float(jnp.finfo(fmt).max)
    scale = big / np.maximum(amax, 1e-12)
    scale = 2.0 ** np.floor(np.log2(scale)) if pow2 else scale
    scale = scale * off
    q = np.asarray(jnp.asarray(np.clip(a * scale, -big, big), jnp.float32).astype(fmt).astype(jnp.float32))
    return q / scale


def reference_gemm(spec, a, b, formats, recipe, off=1.0):
    """np.einsum of the two operands quantize-dequantized: per tensor, or along the contracted dims."""
    (la, lb), out = spec.split("->")[0].split(","), spec.split("->")[1]
    contracted = set(la) & set(lb) - set(out)
    axes = lambda letters: tuple(i for i, c in enumerate(letters) if not recipe.rowwise or c in contracted)
    return np.einsum(spec, qdq(a, axes(la), formats[0], recipe.rowwise, off),
                     qdq(b, axes(lb), formats[1], recipe.rowwise))


def reference_projection(recipe, spec, x, w, g, off=1.0):
    (xs, ws), out = spec.split("->")[0].split(","), spec.split("->")[1]
    grad = recipe.gradient_format
    return (reference_gemm(spec, x, w, (E4M3, E4M3), recipe, off),
            reference_gemm(f"{out},{ws}->{xs}", g, w, (grad, E4M3), recipe, off),
            reference_gemm(f"{xs},{out}->{ws}", x, g, (E4M3, grad), recipe, off))


def drawn(shape, seed, scale=1.0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32) * scale


def close(got, want, tolerance=EXACT) -> bool:
    return all(np.max(np.abs(np.asarray(a) - b)) <= tolerance * np.max(np.abs(b)) for a, b in zip(got, want, strict=True))


def projection_cases(recipe):
    for spec, x_shape, w_shape in SPECS:
        x, w = drawn(x_shape, 0), drawn(w_shape, 1, 0.1)
        y, back = jax.vjp(jax.jit(functools.partial(recipe.project, spec)), x, w)
        g = drawn(y.shape, 2, 1e-3)  # gradients are small: the scale, not the format, takes them in
        yield spec, x, w, g, (y, *back(g))


@pytest.mark.parametrize("name", FP8_RECIPES)
def test_the_projection_is_its_quantize_dequantize_reference(name):
    recipe = recipes.RECIPES[name]("float32")
    for spec, x, w, g, got in projection_cases(recipe):
        assert got[1].dtype == jnp.float32 and got[2].dtype == jnp.float32
        assert close(got, reference_projection(recipe, spec, x, w, g)), spec
        assert not close(got, reference_projection(recipe, spec, x, w, g, off=2.0)), spec  # the control


def reference_grouped(recipe, x, w, g, sizes, off=1.0):
    """Each row times its group's matrix, rows past the groups zero; every operand per tensor."""
    group = np.repeat(np.arange(len(sizes)), sizes)
    rows = len(group)
    per_tensor = lambda a, fmt, o=1.0: qdq(a, tuple(range(a.ndim)), fmt, False, o)
    qx, qw, qg = per_tensor(x, E4M3, off), per_tensor(w, E4M3), per_tensor(g, recipe.gradient_format)
    y, dx, dw = np.zeros_like(g), np.zeros_like(x), np.zeros_like(w)
    y[:rows] = np.einsum("rk,rkn->rn", qx[:rows], qw[group])
    dx[:rows] = np.einsum("rn,rkn->rk", qg[:rows], qw[group])
    np.add.at(dw, group, np.einsum("rk,rn->rkn", qx[:rows], qg[:rows]))
    return y, dx, dw


@pytest.mark.parametrize("kernel", [functools.partial(grouped_gemm, gemm="ragged_dot"), blocked_gemm],
                         ids=["ragged_dot", "blocks"])
@pytest.mark.parametrize("name", FP8_RECIPES)
def test_the_grouped_gemm_is_its_quantize_dequantize_reference(name, kernel):
    recipe = recipes.RECIPES[name]("float32")
    sizes = np.asarray([9, 0, 24], np.int32)  # an empty group, and 7 rows past the groups
    x, w, g = drawn((40, 8), 0), drawn((3, 8, 12), 1, 0.1), drawn((40, 12), 2, 1e-3)
    y, back = jax.vjp(jax.jit(recipe.grouped(kernel, jnp.asarray(sizes))), x, w)
    got = (y, *back(g))
    assert close(got, reference_grouped(recipe, x, w, g, sizes))
    assert not close(got, reference_grouped(recipe, x, w, g, sizes, off=2.0))  # the control


def snr_db(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return 10 * np.log10(np.sum(want ** 2) / np.sum((got - want) ** 2))


@pytest.mark.parametrize("tokens, d, f", [(512, 1024, 3584), pytest.param(2048, 4096, 14336, marks=pytest.mark.slow)],
                         ids=["quarter", "llama3_8b_mlp"])
@pytest.mark.parametrize("name", FP8_RECIPES)
def test_fp8_keeps_20_db_against_bf16(name, tokens, d, f):
    """An MLP up-projection (tokens x d -> f) in FP8 against bf16: output, dX and dW each at 20 dB
    or more (torchao's test_float8_linear). The control: an output a quarter too large (12 dB) fails."""
    x = jnp.asarray(drawn((tokens, d), 0), jnp.bfloat16)
    w = jnp.asarray(drawn((d, f), 1, d ** -0.5), jnp.bfloat16)
    g = jnp.asarray(drawn((tokens, f), 2, 1e-3))

    def results(recipe):
        y, back = jax.vjp(jax.jit(functools.partial(recipe.project, "td,df->tf")), x, w)
        return (y, *back(g))
    want = results(recipes.default("bfloat16"))
    got = results(recipes.RECIPES[name]("bfloat16"))
    assert min(snr_db(a, b) for a, b in zip(got, want, strict=True)) >= 20
    assert snr_db(got[0] * 1.25, want[0]) < 20


# ---- every layout as one device, in FP8 ----

GPT2, MOE, LLAMA, DEEPSEEK = "tiny", "tiny_moe", "tiny_llama", "tiny_deepseek"
SP, ZERO0, ZERO3 = {"model.sequence_parallel": "true"}, {"train.zero": 0}, {"train.zero": 3}
# (config, spec, overrides, default): dp, tp with sequence parallelism, cp and ZeRO 3 composed on
# one mesh, a 1F1B pipeline, and ep, for GPT-2 and the MoE; one layout each for Llama and DeepSeek;
# each axis alone slow.
LAYOUTS = [
    (GPT2, "dp=2,tp=2,cp=2", SP | ZERO3, True), (GPT2, "pp=2", {}, True),
    (MOE, "dp=2,ep=2", ZERO3, True), (MOE, "ep=2,tp=2,cp=2", SP, True), (MOE, "pp=2", {}, True),
    (LLAMA, "dp=2,tp=2", ZERO0, True), (DEEPSEEK, "dp=2,ep=2", {}, True),
    *((GPT2, spec, o, False) for spec, o in (("dp=2", ZERO0), ("tp=2", SP), ("cp=2", {}), ("dp=2", ZERO3))),
    *((MOE, spec, o, False) for spec, o in (("ep=2", {}), ("dp=2", ZERO3), ("tp=2", SP), ("cp=2", {}))),
]
ROWWISE_DEFAULT = {(MOE, "dp=2,ep=2"), (GPT2, "pp=2")}
LOSS_RTOL = 1e-4


def layout_cases():
    for name in FP8_RECIPES:
        for config, spec, overrides, default in LAYOUTS:
            default = default and (name == "tensorwise" or (config, spec) in ROWWISE_DEFAULT)
            yield pytest.param(name, config, spec, overrides, id=f"{name}-{config}-{spec}-{'-'.join(overrides)}",
                               marks=() if default else (pytest.mark.slow,))


def reference(name, config, spec, **overrides):
    """One device on the same model in the recipe; a pipeline's microbatches as its passes."""
    cfg = tiny_config(config, **mesh_overrides(spec))
    passes = {}
    if cfg.mesh.pp > 1:
        passes = {"train.grad_accum": pipeline_microbatches(cfg.run, batch_ways(cfg.mesh.__dict__), cfg.mesh.pp)}
    return train(config=config, **{"model.fp8": name}, **passes, **overrides)


@pytest.mark.parametrize("name, config, spec, overrides", list(layout_cases()))
def test_every_layout_trains_as_one_device_in_fp8(name, config, spec, overrides):
    want = losses(reference(name, config, spec))
    assert want[-1] < want[0]
    np.testing.assert_allclose(losses(train(spec, config=config, **{"model.fp8": name}, **overrides)), want,
                               rtol=LOSS_RTOL)


def test_a_ten_percent_larger_learning_rate_fails_the_fp8_check():
    other = train("dp=2,tp=2", **{"model.fp8": "tensorwise", "optimizer.lr": tiny_config().optimizer.lr * 1.1})
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(losses(other), losses(reference("tensorwise", GPT2, "dp=1")), rtol=LOSS_RTOL)


# ---- the plan, the lines, resuming ----

@pytest.mark.parametrize("head", [False, True])
def test_the_plan_says_which_matmuls_run_in_fp8_and_that_the_cpu_emulates_them(head):
    cfg = tiny_config("tiny_moe", **{"model.fp8": "rowwise", "model.fp8_head": str(head).lower()})
    plan = plan_execution(cfg, build_mesh(cfg, jax.devices()[:1]))
    said = plan.describe()["matmuls"]
    assert said["recipe"] == "rowwise" and said[PROJECTIONS] == said[EXPERTS] == "float8_e4m3fn"
    assert said[HEAD] == ("float8_e4m3fn" if head else "float32") and said["mfu_dtype"] == "float32"
    assert said["fp8_matmuls"] == [PROJECTIONS, *([HEAD] if head else []), EXPERTS]
    assert any("XLA:CPU emulates the FP8 matmuls" in note for note in plan.notes)
    assert not any("FP8" in note for note in plan_execution(tiny_config(), build_mesh(tiny_config(),
                                                                                      jax.devices()[:1])).notes)


def test_a_tpu_without_fp8_units_is_refused_naming_the_chip():
    m = tiny_config(**{"model.fp8": "tensorwise"}).model
    with pytest.raises(UserError, match=r"not on tpu \(TPU v5 lite\); use --model.fp8=none"):
        recipes.recipe_for(m, "tpu", "TPU v5 lite")
    assert recipes.recipe_for(m, "gpu", "NVIDIA H100") == Tensorwise("float32")  # the control


@pytest.mark.parametrize("keys, expected", [
    (["--model.fp8=e4m3"], "model.fp8 must be one of none, tensorwise, rowwise, got 'e4m3'"),
    (["--model.fp8_head=true"], "model.fp8_head=true runs the lm_head in FP8 under an FP8 recipe"),
])
def test_bad_fp8_keys_are_one_line_and_write_nothing(capsys, tmp_path, keys, expected):
    out = tmp_path / "run"
    exits_with_one_line(capsys, "jaxpar.train",
                        lambda: train_main(["--config", "tiny", "--steps", "1", *keys, "--out", str(out)]), expected)
    assert not out.exists()

"""FP8 matmul recipes with current scaling (`--model.fp8=tensorwise|rowwise`), as torchao's Float8
training computes: each operand of a GEMM is scaled into its FP8 format's range from its own
amax this step, cast, multiplied in FP8 with float32 accumulation, and the product scaled back.
Current scaling keeps no state, so a run resumes across `none` and either recipe.

- tensorwise: one scale a tensor. Activations and weights in e4m3, the output gradient in e5m2.
- rowwise: a scale along each GEMM's contracted dims (a row of the activations, a column of the
  weights; in the backward, the output gradient's rows and the weights' rows for dX, the tokens'
  columns for dW), rounded down to a power of two, every operand in e4m3 (torchao's ROWWISE).

Every projection (attention's, the MLPs', MLA's, MTP's) computes through `project`, and the lm_head
too where model.fp8_head asks. The experts' grouped GEMM (`grouped`) scales per tensor under both
recipes: its forward and both backward legs run the plan's kernel on the FP8 values (exact in the
kernel's dtype), the scales applied to its float32 results.

The scales are global: an amax is taken over the whole tensor, wherever a layout splits it. Under
jit the shardings do that; inside a shard_map (`whole_over`, the plan's manual axes there) the
amax is also taken over the manual axes wherever it reduces over the tokens they split. A step's
passes (accumulation, a pipeline's microbatches) each scale their own activations.

On GPUs of compute capability 8.9 and up XLA runs the FP8 dots as FP8 GEMMs (cuBLASLt); XLA:CPU
emulates them, which a run says in one line; TPU v5e and v5p have no FP8 units, and the recipes
are refused there in one line naming the chip.
"""

import functools
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxpar.nn.recipes.base import EXPERTS, HEAD, PROJECTIONS, Bound, GroupedGemm, MatmulRecipe, gradient_specs
from jaxpar.nn.recipes.model_dtype import ModelDtype

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
EPS = 1e-12  # an all-zero tensor's amax, as torchao's: its scale stays finite


def parse(spec: str) -> tuple[str, str, str]:
    (a, b), out = spec.split("->")[0].split(","), spec.split("->")[1]
    return a, b, out


@dataclass(frozen=True)
class Fp8(MatmulRecipe):
    """Current-scaled FP8 matmuls; `head`: the lm_head's too (model.fp8_head)."""
    name: ClassVar[str]
    about: ClassVar[str]
    gradient_format: ClassVar = E5M2
    rowwise: ClassVar[bool] = False
    platforms = ("cpu", "gpu")
    instead = "use --model.fp8=none"
    head: bool = False

    @property
    def mfu_dtype(self) -> str:
        return self.dtype  # MFU divides by model.dtype's peak, whatever the recipe runs

    def operand_dtype(self, matmul: str) -> str:
        return jnp.dtype(E4M3).name if matmul != HEAD or self.head else self.dtype

    def describe(self) -> dict:
        fp8 = [m for m in (PROJECTIONS, HEAD, EXPERTS) if self.operand_dtype(m) != self.dtype]
        return super().describe() | {"gradients": jnp.dtype(self.gradient_format).name,
                                     "scaling": f"{self.name} current scaling; the experts' per tensor",
                                     "fp8_matmuls": fp8}

    def note(self, platform: str) -> str:
        if platform != "cpu":
            return ""
        return (f"model.fp8={self.name}: XLA:CPU emulates the FP8 matmuls (same values, no faster than "
                f"{self.dtype}); FP8 GEMMs run on GPUs of compute capability 8.9 and up")

    def project(self, spec: str, x: jax.Array, w: jax.Array, matmul: str = PROJECTIONS) -> jax.Array:
        if matmul == HEAD and not self.head:
            return ModelDtype(self.dtype, self.cpu_matmuls).project(spec, x, w, matmul)
        return fp8_project(spec, x, w, self)

    def grouped(self, gemm: GroupedGemm, arrays) -> Bound:
        return lambda x, w: fp8_grouped(gemm, self, x, w, arrays)

    def quantize(self, a: jax.Array, letters: str, reduced: str, rows: str, fmt, per_tensor: bool = False):
        """(a in `fmt`, its float32 scale, keeping a's dims but the reduced ones): the scale maps the
        amax over `reduced` (every dim, per tensor) to the format's largest value."""
        axes = tuple(i for i, c in enumerate(letters) if per_tensor or c in reduced)
        amax = jnp.max(jnp.abs(a), axis=axes, keepdims=True).astype(jnp.float32)
        if self.whole_over and (per_tensor or set(reduced) & set(rows)):  # a manual axis splits them
            amax = jax.lax.pmax(amax, self.whole_over)
        scale = jnp.finfo(fmt).max.astype(jnp.float32) / jnp.maximum(amax, EPS)
        if self.rowwise and not per_tensor:
            scale = jnp.exp2(jnp.floor(jnp.log2(scale)))
        big = jnp.finfo(fmt).max.astype(jnp.float32)
        return jnp.clip(a.astype(jnp.float32) * scale, -big, big).astype(fmt), scale

    def product(self, spec: str, a: jax.Array, b: jax.Array, formats, rows: str) -> jax.Array:
        """einsum(spec, a, b) of the two operands quantized to `formats`, float32, scaled back."""
        la, lb, out = parse(spec)
        contracted = "".join(c for c in la if c in lb and c not in out)
        per_tensor = not self.rowwise
        qa, sa = self.quantize(a, la, contracted, rows, formats[0], per_tensor)
        qb, sb = self.quantize(b, lb, contracted, rows, formats[1], per_tensor)
        y = jnp.einsum(spec, qa, qb, preferred_element_type=jnp.float32)
        return y / (on_output(sa, la, out) * on_output(sb, lb, out))


def on_output(scale: jax.Array, letters: str, out: str) -> jax.Array:
    """A scale with a's dims (1 where reduced), laid out to broadcast against the output `out`."""
    kept = "".join(c for c, n in zip(letters, scale.shape, strict=True) if n > 1)
    s = scale.reshape([n for n in scale.shape if n > 1])
    order = "".join(c for c in out if c in kept)
    s = jnp.einsum(f"{kept}->{order}", s) if kept else s
    return s.reshape([s.shape[order.index(c)] if c in order else 1 for c in out])


def rows_of(spec: str) -> str:
    """The token dims of a projection "x,w->y": x's dims that w lacks and y keeps."""
    x, w, out = parse(spec)
    return "".join(c for c in x if c not in w and c in out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def fp8_project(spec: str, x: jax.Array, w: jax.Array, recipe: Fp8) -> jax.Array:
    """einsum(spec, x, w) in FP8 (e4m3 operands), float32; its backward's two GEMMs in FP8 too."""
    return recipe.product(spec, x, w, (E4M3, E4M3), rows_of(spec))


def _project_forward(spec, x, w, recipe):
    return fp8_project(spec, x, w, recipe), (x, w)


def _project_backward(spec, recipe, residuals, g):
    x, w = residuals
    input_spec, weight_spec = gradient_specs(spec)
    rows, grad = rows_of(spec), recipe.gradient_format
    dx = recipe.product(input_spec, g, w, (grad, E4M3), rows)
    dw = recipe.product(weight_spec, x, g, (E4M3, grad), rows)
    return dx.astype(x.dtype), dw.astype(w.dtype)


fp8_project.defvjp(_project_forward, _project_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def fp8_grouped(gemm: GroupedGemm, recipe: Fp8, x: jax.Array, w: jax.Array, arrays) -> jax.Array:
    """gemm(x, w, arrays), the grouped GEMM, of e4m3 operands scaled per tensor, float32."""
    return _grouped_forward(gemm, recipe, x, w, arrays)[0]


def tensor_scaled(recipe: Fp8, a: jax.Array, fmt) -> tuple[jax.Array, jax.Array]:
    """(a's FP8 values in model.dtype, exactly, for the kernel; a's scale), per tensor."""
    letters = "abcdefgh"[:a.ndim]
    q, scale = recipe.quantize(a, letters, letters, "", fmt, per_tensor=True)
    return q.astype(recipe.dtype), scale.reshape(())


def _grouped_forward(gemm, recipe, x, w, arrays):
    (qx, sx), (qw, sw) = tensor_scaled(recipe, x, E4M3), tensor_scaled(recipe, w, E4M3)
    kinds = jnp.zeros((), x.dtype), jnp.zeros((), w.dtype)
    return gemm(qx, qw, arrays) / (sx * sw), (qx, sx, qw, sw, arrays, kinds)


def _grouped_backward(gemm, recipe, residuals, g):
    qx, sx, qw, sw, arrays, (x_kind, w_kind) = residuals
    qg, sg = tensor_scaled(recipe, g, recipe.gradient_format)
    _, vjp = jax.vjp(lambda x, w: gemm(x, w, arrays), qx, qw)
    dx, dw = vjp(qg.astype(g.dtype))  # the kernel's own backward legs, on the FP8 values
    return (dx / (sg * sw)).astype(x_kind.dtype), (dw / (sx * sg)).astype(w_kind.dtype), None


fp8_grouped.defvjp(_grouped_forward, _grouped_backward)


@dataclass(frozen=True)
class Tensorwise(Fp8):
    """One scale a tensor: e4m3 activations and weights, e5m2 output gradients."""
    name = "tensorwise"
    about = "FP8 GEMMs, a scale a tensor: e4m3 forward, e5m2 gradients, float32 accumulation"


@dataclass(frozen=True)
class Rowwise(Fp8):
    """A power-of-two scale along each GEMM's contracted dims, every operand e4m3."""
    name = "rowwise"
    about = "FP8 GEMMs, a scale a row: e4m3 operands, float32 accumulation"
    gradient_format = E4M3
    rowwise = True

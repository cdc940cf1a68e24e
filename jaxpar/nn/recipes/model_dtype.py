"""The matmuls in model.dtype: float32, or bfloat16 shaped so that the bfloat16 units run their
backward too. Every platform runs it; MFU divides by model.dtype's peak.

In float32 every projection is the plain einsum, and so is the grouped GEMM the plan's kernel runs.

In a low-precision dtype a projection accumulates into and returns float32, so its output
gradient arrives in float32; autodiff's transposed dots would then run in float32 (TF32 on an
H100, at half the bf16 rate; on a CPU, in XLA:CPU's float32 kernels). So a projection has its own
backward: the output gradient is cast to the compute dtype and both gradients are
float32-accumulated dots of bf16 operands, as PyTorch autocast's are.

On CPUs (the plan's cpu_matmuls) it also shapes those dots for XLA:CPU, which hands a bf16 x bf16
dot to its bf16 kernels only when the dot returns float32 and its left operand is row-major in the
contracted dims: autodiff's weight gradient x^T g contracts over the leading (token) dim, so its
transposed operand is laid out explicitly (an optimization barrier keeps XLA from folding the
transpose back into the dot), and a 2-D one is split in two. The grouped GEMM's kernels take their
bf16 operands as they are (each kernel's own backward, jaxpar.nn.grouped_gemm).
"""

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxpar.nn.recipes.base import PROJECTIONS, Bound, GroupedGemm, MatmulRecipe, gradient_specs


@dataclass(frozen=True)
class ModelDtype(MatmulRecipe):
    """Every matmul's operands in model.dtype, accumulated in float32."""
    name = "model_dtype"
    about = "every matmul in model.dtype, accumulated in float32"

    @property
    def mfu_dtype(self) -> str:
        return self.dtype

    def operand_dtype(self, matmul: str) -> str:
        return self.dtype

    def project(self, spec: str, x: jax.Array, w: jax.Array, matmul: str = PROJECTIONS) -> jax.Array:
        if jnp.dtype(self.dtype) == jnp.float32:
            return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
        return low_precision_project(spec, x, w, self.cpu_matmuls)

    def grouped(self, gemm: GroupedGemm, arrays) -> Bound:
        return lambda x, w: gemm(x, w, arrays)  # the kernel's own program, float32-accumulated in either dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def low_precision_project(spec: str, x: jax.Array, w: jax.Array, for_cpu: bool) -> jax.Array:
    """einsum(spec, x, w) of bf16 operands into float32, with bf16 dots in its backward too
    (`for_cpu`: shaped for XLA:CPU's bf16 kernels)."""
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)


def _forward(spec, x, w, for_cpu):
    return low_precision_project(spec, x, w, for_cpu), (x, w)


def laid_out(spec: str, a: jax.Array) -> jax.Array:
    """a transposed by an einsum spec, materialised: the dot that reads it sees it row-major."""
    return jax.lax.optimization_barrier(jnp.einsum(spec, a))


def weight_gradient(lhs_spec: str, lhs: jax.Array, rhs_spec: str, rhs: jax.Array, w_shape) -> jax.Array:
    """The weight gradient lhs . rhs, contracting the rows, as a float32 array of w_shape.

    A plain 2-D x 2-D bf16 dot of this kind is converted to float32 by XLA:CPU (about 320 GFLOP/s
    at the MLP's shape here); with the lhs's leading dim split in two it runs in bf16 (about 800).
    """
    if len(w_shape) == 2 and lhs.shape[0] % 2 == 0:
        spare = next(c for c in "zyxwvutsrq" if c not in lhs_spec + rhs_spec)
        lhs, lhs_spec = lhs.reshape(2, lhs.shape[0] // 2, *lhs.shape[1:]), spare + lhs_spec
    out = "".join(c for c in lhs_spec if c not in rhs_spec) + "".join(c for c in rhs_spec if c not in lhs_spec)
    dw = jnp.einsum(f"{lhs_spec},{rhs_spec}->{out}", lhs, rhs, preferred_element_type=jnp.float32)
    return dw.reshape(w_shape)


def _backward(spec, for_cpu, residuals, g):
    x, w = residuals
    (xs, ws), out = spec.split("->")[0].split(","), spec.split("->")[1]
    rows = "".join(c for c in xs if c in out)  # the tokens: contracted in the weight gradient
    w_in = "".join(c for c in ws if c not in out)
    w_out = "".join(c for c in ws if c in out)
    input_spec, weight_spec = gradient_specs(spec)
    g = g.astype(x.dtype)
    dx = jnp.einsum(input_spec, g, w, preferred_element_type=jnp.float32)
    if not for_cpu:  # accelerators run a bf16 dot in any layout
        dw = jnp.einsum(weight_spec, x, g, preferred_element_type=jnp.float32)
    elif ws.startswith(w_in):  # stored (in, out): dw = x^T g
        dw = weight_gradient(f"{w_in}{rows}", laid_out(f"{xs}->{w_in}{rows}", x), out, g, w.shape)
    else:  # stored (out, in): dw = g^T x
        dw = weight_gradient(f"{w_out}{rows}", laid_out(f"{out}->{w_out}{rows}", g), xs, x, w.shape)
    return dx.astype(x.dtype), dw.astype(w.dtype)


low_precision_project.defvjp(_forward, _backward)

"""The residual add and the pre-LayerNorm after it in one Pallas kernel, forward and backward.

`add_layer_norm(x, y, scale, bias)` -> (s, normed): s = x + y, the new float32 residual stream, and
LayerNorm(s) as jaxpar.models.gpt2.model's `layer_norm` has it (float32 statistics, eps 1e-5, then
scale and bias). XLA runs the add, the statistics and the normalisation as separate fusions, and
their backward as more, each reading the (rows, C) stream again (compiled for an H100, the float32
stream's adds and the LayerNorms' backward move about 12 GB a GPT-2 124M step at micro-batch 16).
Here each direction reads and writes each (rows, C) array once:

- forward: one grid step per block of `block_rows` rows, each row whole (C padded to a power of two
  and masked, as Triton's tensors must be); out: s, normed, and each row's mean and 1/std (rows,),
  kept for the backward instead of a second pass over s.
- backward: the same grid. With xhat = (s - mean) * rstd and g = dnormed * scale, the gradient wrt s
  takes both outputs' cotangents: ds = ds_out + rstd * (g - mean(g) - xhat * mean(g * xhat)); it is
  the gradient wrt x and y alike. Each block also writes its column sums of dnormed * xhat and of
  dnormed: (blocks, C) partials of dscale and dbias, summed by XLA after the kernel (one small
  reduction, no atomics, and the same order on every run).

The kernels use only Pallas-Triton operations (masked `plgpu.load`/`store`, a 1-D grid), so they
compile for GPUs; elsewhere they run in Pallas's interpret mode, which is how the suite checks them
against `reference` (tests/test_fused_norm.py).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LN_EPS = 1e-5  # as jaxpar.models.gpt2.model.LN_EPS
BLOCK_ELEMS = 8192  # elements of one (block_rows, C padded) tile: 32 KiB of f32 per operand


def reference(x, y, scale, bias, eps: float = LN_EPS):
    """The plain jnp form: what the kernels compute, and what XLA runs by default."""
    s = x.astype(jnp.float32) + y.astype(jnp.float32)
    mean = s.mean(-1, keepdims=True)
    var = jnp.square(s - mean).mean(-1, keepdims=True)
    return s, (s - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def default_block_rows(C: int) -> int:
    """Rows per grid step: a power of two (Triton's), about BLOCK_ELEMS elements a tile, 1 to 64."""
    return max(1, min(64, BLOCK_ELEMS // pl.next_power_of_2(C)))


def _tile_mask(R: int, C: int, block_rows: int, c_pad: int):
    """(block_rows, c_pad) True where the tile holds a real element: the last block's rows past R
    and the columns past C are padding, which Triton would otherwise read and write out of bounds."""
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
    cols = jnp.arange(c_pad)
    return (rows < R)[:, None] & (cols < C)[None, :], rows < R, cols < C


def _load(ref, mask):
    return plgpu.load(ref, mask=mask, other=0.0).astype(jnp.float32)


def _forward_kernel(x_ref, y_ref, scale_ref, bias_ref, s_ref, out_ref, mean_ref, rstd_ref,
                    *, R, C, eps):
    block_rows, c_pad = x_ref.shape
    mask, row_ok, col_ok = _tile_mask(R, C, block_rows, c_pad)
    s = _load(x_ref, mask) + _load(y_ref, mask)  # zero in the padding, so sums over c_pad are over C
    mean = jnp.sum(s, axis=1) / C
    centred = jnp.where(mask, s - mean[:, None], 0.0)
    rstd = jax.lax.rsqrt(jnp.sum(centred * centred, axis=1) / C + eps)
    out = centred * rstd[:, None] * _load(scale_ref, col_ok)[None, :] + _load(bias_ref, col_ok)[None, :]
    plgpu.store(s_ref, s.astype(s_ref.dtype), mask=mask)
    plgpu.store(out_ref, out.astype(out_ref.dtype), mask=mask)
    plgpu.store(mean_ref, mean, mask=row_ok)
    plgpu.store(rstd_ref, rstd, mask=row_ok)


def _backward_kernel(s_ref, mean_ref, rstd_ref, scale_ref, ds_out_ref, dout_ref,
                     ds_ref, dscale_ref, dbias_ref, *, R, C):
    block_rows, c_pad = s_ref.shape
    mask, row_ok, col_ok = _tile_mask(R, C, block_rows, c_pad)
    mean = plgpu.load(mean_ref, mask=row_ok, other=0.0)[:, None]
    rstd = plgpu.load(rstd_ref, mask=row_ok, other=0.0)[:, None]
    xhat = jnp.where(mask, (_load(s_ref, mask) - mean) * rstd, 0.0)
    dout = _load(dout_ref, mask)
    g = dout * _load(scale_ref, col_ok)[None, :]
    mean_g = jnp.sum(g, axis=1, keepdims=True) / C
    mean_gx = jnp.sum(g * xhat, axis=1, keepdims=True) / C
    ds = _load(ds_out_ref, mask) + rstd * (g - mean_g - xhat * mean_gx)
    plgpu.store(ds_ref, ds.astype(ds_ref.dtype), mask=mask)
    plgpu.store(dscale_ref, jnp.sum(dout * xhat, axis=0), mask=col_ok)
    plgpu.store(dbias_ref, jnp.sum(dout, axis=0), mask=col_ok)


def _specs(block_rows: int, c_pad: int):
    """Block specs of a (rows, C) tile, a (rows,) vector and a (C,) vector, for grid step i."""
    return (pl.BlockSpec((block_rows, c_pad), lambda i: (i, 0)),
            pl.BlockSpec((block_rows,), lambda i: (i,)),
            pl.BlockSpec((c_pad,), lambda i: (0,)))


def _params(block_rows: int, c_pad: int):
    return plgpu.CompilerParams(num_warps=8 if block_rows * c_pad >= 4096 else 4, num_stages=1)


def _forward(x2, y2, scale, bias, eps, block_rows, out_dtype, interpret):
    (R, C), c_pad = x2.shape, pl.next_power_of_2(x2.shape[1])
    tile, row, vec = _specs(block_rows, c_pad)
    return pl.pallas_call(
        functools.partial(_forward_kernel, R=R, C=C, eps=eps),
        grid=(pl.cdiv(R, block_rows),),
        in_specs=[tile, tile, vec, vec],
        out_specs=[tile, tile, row, row],
        out_shape=[jax.ShapeDtypeStruct((R, C), jnp.float32), jax.ShapeDtypeStruct((R, C), out_dtype),
                   jax.ShapeDtypeStruct((R,), jnp.float32), jax.ShapeDtypeStruct((R,), jnp.float32)],
        compiler_params=_params(block_rows, c_pad), interpret=interpret, name="jaxpar_add_ln_fwd",
    )(x2, y2, scale, bias)


def _backward(s, mean, rstd, scale, ds_out, dout, block_rows, interpret):
    (R, C), c_pad = s.shape, pl.next_power_of_2(s.shape[1])
    tile, row, vec = _specs(block_rows, c_pad)
    blocks = pl.cdiv(R, block_rows)
    partial = pl.BlockSpec((None, c_pad), lambda i: (i, 0))  # one row of partial sums per block
    ds, dscale, dbias = pl.pallas_call(
        functools.partial(_backward_kernel, R=R, C=C),
        grid=(blocks,),
        in_specs=[tile, row, row, vec, tile, tile],
        out_specs=[tile, partial, partial],
        out_shape=[jax.ShapeDtypeStruct((R, C), jnp.float32),
                   jax.ShapeDtypeStruct((blocks, C), jnp.float32),
                   jax.ShapeDtypeStruct((blocks, C), jnp.float32)],
        compiler_params=_params(block_rows, c_pad), interpret=interpret, name="jaxpar_add_ln_bwd",
    )(s, mean, rstd, scale, ds_out, dout)
    return ds, dscale.sum(0), dbias.sum(0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _fused(x2, y2, scale, bias, eps, block_rows, out_dtype, interpret):
    s, out, _, _ = _forward(x2, y2, scale, bias, eps, block_rows, out_dtype, interpret)
    return s, out


def _fused_fwd(x2, y2, scale, bias, eps, block_rows, out_dtype, interpret):
    s, out, mean, rstd = _forward(x2, y2, scale, bias, eps, block_rows, out_dtype, interpret)
    # dtypes ride along as 0-size arrays: residuals must be arrays.
    like = tuple(jnp.zeros((0,), a.dtype) for a in (x2, y2, bias))
    return (s, out), (s, mean, rstd, scale, like)


def _fused_bwd(eps, block_rows, out_dtype, interpret, res, cotangents):
    s, mean, rstd, scale, (x_like, y_like, bias_like) = res
    ds_out, dout = cotangents
    ds, dscale, dbias = _backward(s, mean, rstd, scale, ds_out, dout, block_rows, interpret)
    return (ds.astype(x_like.dtype), ds.astype(y_like.dtype), dscale.astype(scale.dtype),
            dbias.astype(bias_like.dtype))


_fused.defvjp(_fused_fwd, _fused_bwd)


def add_layer_norm(x, y, scale, bias=None, *, eps: float = LN_EPS, block_rows: int | None = None,
                   out_dtype=jnp.float32, interpret: bool | None = None):
    """(s, normed) = (x + y, LayerNorm(x + y) * scale + bias) over the last axis, in float32, by
    the kernels above; any leading axes are rows. bias None: no bias (model.bias = false).
    out_dtype: normed's (the next matmul's dtype saves a cast's pass). interpret None: Pallas's
    interpret mode off GPUs."""
    if x.shape != y.shape or scale.shape != x.shape[-1:]:
        raise ValueError(f"add_layer_norm: x {x.shape}, y {y.shape} and scale {scale.shape} do not match")
    block_rows = block_rows or default_block_rows(x.shape[-1])
    if block_rows & (block_rows - 1):
        raise ValueError(f"add_layer_norm: block_rows {block_rows} is not a power of two (Triton's tiles)")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    bias = jnp.zeros_like(scale) if bias is None else bias
    C = x.shape[-1]
    s, out = _fused(x.reshape(-1, C), y.reshape(-1, C), scale, bias, eps, block_rows,
                    jnp.dtype(out_dtype), bool(interpret))
    return s.reshape(x.shape), out.reshape(x.shape)


def bench(rows: int, C: int, block_rows: tuple, iters: int = 20) -> list[str]:
    """Forward + backward of XLA's add + LayerNorm and of the kernel at each block_rows, as gpt2's
    block has them (stream f32, branch, scale and bias bf16, normed out in bf16): one line each,
    the median time and the largest difference from XLA's."""
    import time
    kx, ky = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (rows, C))
    y = jax.random.normal(ky, (rows, C), jnp.bfloat16)
    scale, bias = jnp.ones((C,), jnp.bfloat16), jnp.zeros((C,), jnp.bfloat16)

    def step(fn):
        def loss(*a):
            s, out = fn(*a)
            return jnp.sum(s * s) + jnp.sum(out.astype(jnp.float32) * out.astype(jnp.float32))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))

    def xla(*a):
        s, out = reference(*a)
        return s, out.astype(jnp.bfloat16)
    variants = [("xla", xla)] + [(f"pallas block_rows={b}", functools.partial(
        add_layer_norm, block_rows=b, out_dtype=jnp.bfloat16)) for b in block_rows]
    lines, want = [], None
    for name, fn in variants:
        run = step(fn)
        got = jax.block_until_ready(run(x, y, scale, bias))
        want = got if want is None else want
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            jax.block_until_ready(run(x, y, scale, bias))
            times.append(time.perf_counter() - start)
        diff = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
                   for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
        lines.append(f"{name:24s} {sorted(times)[iters // 2] * 1e3:8.3f} ms  max |diff| vs xla {diff:.3g}")
    return lines


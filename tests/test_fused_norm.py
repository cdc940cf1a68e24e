"""jaxpar's fused residual add + LayerNorm Pallas kernel (jaxpar.nn.fused_norm), in interpret mode on
CPU, against its plain jnp reference: forward and gradients wrt x, y, scale and bias, float32,
rtol 1e-5 (atol 1e-5 for entries near zero), at a row count the block does not divide and a C
padded to a power of two."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.models.gpt2.model import LN_EPS, layer_norm
from jaxpar.nn import fused_norm
from jaxpar.nn.fused_norm import add_layer_norm, reference

RTOL = ATOL = 1e-5


def inputs(R: int, C: int, dtype=jnp.float32):
    kx, ky, ks, kb = jax.random.split(jax.random.key(R * 1000 + C), 4)
    x = jax.random.normal(kx, (R, C)) * 2.0 + 0.5  # an offset mean: the centring matters
    y = jax.random.normal(ky, (R, C), dtype)
    scale = 1.0 + 0.1 * jax.random.normal(ks, (C,))
    bias = 0.1 * jax.random.normal(kb, (C,))
    return x, y, scale, bias


def loss_of(fn):
    """A scalar of both outputs with different weights, so each output's cotangent counts."""
    def loss(x, y, scale, bias):
        s, out = fn(x, y, scale, bias)
        return jnp.sum(jnp.sin(s)) + jnp.sum(out * jnp.cos(out))
    return loss


def values_and_grads(fn, args):
    """Both outputs, the loss and its gradients wrt all four inputs, in one compile."""
    return jax.jit(lambda *a: (fn(*a), jax.value_and_grad(loss_of(fn), argnums=(0, 1, 2, 3))(*a)))(*args)


def assert_close(got, want):
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL), got, want)


# (R, C, block_rows): 48 rows in 32 + 16 padded rows, C 96 padded to 128: the masks at both edges.
# (test_leading_axes_and_no_bias runs the default block: 64 rows for C 96, one block, mostly padding.)
SHAPES = [(48, 96, 32)]


@pytest.mark.parametrize("R,C,block_rows", SHAPES)
def test_kernel_matches_reference_forward_and_gradients(R, C, block_rows):
    args = inputs(R, C)
    kernel = lambda *a: add_layer_norm(*a, block_rows=block_rows, interpret=True)
    assert_close(values_and_grads(kernel, args), values_and_grads(reference, args))


def test_reference_is_the_models_layer_norm():
    x, y, scale, bias = inputs(48, 96)
    s, out = reference(x, y, scale, bias)
    np.testing.assert_array_equal(s, x + y)
    np.testing.assert_array_equal(out, layer_norm(x + y, {"scale": scale, "bias": bias}))


def test_a_wrong_eps_fails_the_comparison():
    """Control: the comparison catches a wrong eps (the forward alone shows it)."""
    args = inputs(48, 96)
    with pytest.raises(AssertionError):
        assert_close(jax.jit(lambda *a: add_layer_norm(*a, eps=1e-3, block_rows=32, interpret=True))(*args),
                     reference(*args))


def test_a_dropped_backward_term_fails_the_comparison(monkeypatch):
    """Control: the comparison catches the backward without the norm's term (the stream's own
    cotangent alone)."""
    real = fused_norm._backward_kernel

    def dropped(s, mean, rstd, scale, ds_out, dout, ds, dscale, dbias, *, R, C):
        real(s, mean, rstd, scale, ds_out, dout, ds, dscale, dbias, R=R, C=C)
        ds[...] = ds_out[...]
    monkeypatch.setattr(fused_norm, "_backward_kernel", dropped)
    args = inputs(48, 96)
    kernel = lambda *a: add_layer_norm(*a, block_rows=32, interpret=True)
    with pytest.raises(AssertionError):
        assert_close(values_and_grads(kernel, args), values_and_grads(reference, args))


def test_bf16_branch_keeps_a_float32_stream():
    """As gpt2's block: the stream x float32, the branch y in the compute dtype; s and the normed
    output float32 (or out_dtype), and y's gradient in y's dtype."""
    x, y, scale, bias = inputs(48, 96, jnp.bfloat16)

    @jax.jit
    def outputs(x, y, scale, bias):
        kernel = lambda *a: add_layer_norm(*a, block_rows=32, interpret=True)
        out16 = add_layer_norm(x, y, scale, bias, block_rows=32, out_dtype=jnp.bfloat16, interpret=True)[1]
        return kernel(x, y, scale, bias), out16, jax.grad(loss_of(kernel), argnums=1)(x, y, scale, bias)
    (s, out), out16, dy = outputs(x, y, scale, bias)
    assert s.dtype == out.dtype == jnp.float32
    assert_close((s, out), reference(x, y, scale, bias))
    assert out16.dtype == dy.dtype == jnp.bfloat16


def test_leading_axes_and_no_bias():
    x, y, scale, _ = inputs(48, 96)
    s, out = add_layer_norm(x.reshape(4, 12, 96), y.reshape(4, 12, 96), scale, interpret=True)
    assert s.shape == out.shape == (4, 12, 96)
    assert_close(out.reshape(48, 96), reference(x, y, scale, jnp.zeros_like(scale))[1])
    with pytest.raises(ValueError, match="power of two"):
        add_layer_norm(x, y, scale, block_rows=24)
    assert LN_EPS == fused_norm.LN_EPS


def test_kernels_lower_to_triton_for_gpus():
    """Off a GPU too, both kernels go through Pallas's Triton lowering (Triton's power-of-two tiles,
    the masked loads and stores): a forward and backward lowered for CUDA holds two Triton calls."""
    x, y = jax.ShapeDtypeStruct((48, 96), jnp.float32), jax.ShapeDtypeStruct((48, 96), jnp.bfloat16)
    vec = jax.ShapeDtypeStruct((96,), jnp.float32)
    grads = jax.grad(loss_of(lambda *a: add_layer_norm(*a, block_rows=32, interpret=False)), argnums=(0, 1, 2, 3))
    text = jax.jit(grads).trace(x, y, vec, vec).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2


def test_gpt2_with_the_fused_norm_trains_as_one_device_with_xlas():
    """model.norm_kernel=pallas in the GPT-2 block, each device on its own rows of the stream (here
    split over 'data', and over 'tensor' along the sequence by sequence parallelism), trains the
    one-device run with XLA's norm at the equivalence tolerances."""
    from helpers import assert_same_training, train
    assert_same_training(train("dp=2,tp=2", **{"model.norm_kernel": "pallas", "model.sequence_parallel": "true"}),
                         train())

"""The attention kernels (jaxpar.nn.kernels): splash, run here in Pallas interpret mode, equals
the xla kernel in value and gradients (rtol 1e-5, float32) for GPT-2's heads and grouped-query
heads, and trains as one device does on dp=2,tp=2; `auto` picks by platform; every refusal is one
line. On TPU and H100 devices the fused kernels are proven by compiling (compile-only devices)."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from helpers import assert_same_training, fails_with, train

from jaxpar.core.config import Config
from jaxpar.core.errors import UserError
from jaxpar.core.model_config import model_config
from jaxpar.core.registry import REGISTRIES, check_registered
from jaxpar.nn.attention import causal_attention
from jaxpar.nn.kernel_entry import ATTENTION, MOE_DISPATCH, MOE_GEMM
from jaxpar.nn.kernels import resolve, splash
from jaxpar.planning import roofline
from jaxpar.planning.hardware import CHIPS

RTOL = 1e-5
SPLASH = {"model.attention": "splash", "model.block_size": 128}


def relative_error(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 2)])
def test_splash_equals_xla_forward_and_gradients(heads, kv_heads):
    keys = jax.random.split(jax.random.key(0), 4)
    B, T, D = 2, 128, 16
    q = jax.random.normal(keys[0], (B, heads, T, D))
    k, v = (jax.random.normal(key, (B, kv_heads, T, D)) for key in keys[1:3])
    weights = jax.random.normal(keys[3], (B, T, heads, D))

    def loss(kernel):
        return lambda q, k, v: jnp.sum(kernel(q, k, v) * weights)
    xla = lambda q, k, v: causal_attention(q, k, v, 0.0, None)
    assert relative_error(splash(q, k, v), xla(q, k, v)) < RTOL
    for got, want in zip(jax.grad(loss(splash), (0, 1, 2))(q, k, v), jax.grad(loss(xla), (0, 1, 2))(q, k, v)):
        assert relative_error(got, want) < RTOL


def test_splash_keeps_documents_apart_as_xla_does():
    """data.document_mask's starts as splash's SegmentIds: value and gradients as xla's mask;
    control: without them splash differs."""
    keys = jax.random.split(jax.random.key(2), 4)
    q = jax.random.normal(keys[0], (2, 4, 128, 8))
    k, v = (jax.random.normal(key, (2, 2, 128, 8)) for key in keys[1:3])
    starts = jnp.array([[0] * 40 + [40] * 50 + [90] * 38, [0] * 100 + [100] * 28], jnp.int32)
    weights = jax.random.normal(keys[3], (2, 128, 4, 8))
    fused = lambda q, k, v: jnp.sum(splash(q, k, v, segments=(starts, starts)) * weights)  # noqa: E731
    xla = lambda q, k, v: jnp.sum(causal_attention(q, k, v, 0.0, None, starts) * weights)  # noqa: E731
    np.testing.assert_allclose(fused(q, k, v), xla(q, k, v), rtol=RTOL)
    for got, want in zip(jax.grad(fused, (0, 1, 2))(q, k, v), jax.grad(xla, (0, 1, 2))(q, k, v)):
        assert relative_error(got, want) < RTOL
    assert relative_error(splash(q, k, v), causal_attention(q, k, v, 0.0, None, starts)) > 0.01


def test_auto_keeps_documents_off_cudnn_on_a_gpu(monkeypatch):
    """`attend` with documents on a GPU under `auto`, tokamax not installed: xla's masked
    attention, not cuDNN (which has no segment ids); control: without documents the same model on
    a GPU asks for cuDNN."""
    from jaxpar.core.execution import ExecutionPlan
    from jaxpar.nn import kernels, layers, tokamax_kernels
    monkeypatch.setattr(tokamax_kernels, "available", lambda: False)
    asked = []
    monkeypatch.setattr(layers, "fused_attention", lambda plan, *args: asked.append(plan.attention))
    q = k = v = jnp.ones((1, 2, 8, 4))
    starts = jnp.array([[0] * 3 + [3] * 5], jnp.int32)
    model = model_config(dtype="bfloat16", block_size=1024)

    def plan_on_a_gpu(documents: bool):
        return ExecutionPlan(platform="gpu", attention=kernels.resolve(model, "gpu", 1, documents)[0])
    np.testing.assert_allclose(layers.attend(plan_on_a_gpu(True), q, k, v, 0.0, None, starts),
                               causal_attention(q, k, v, 0.0, None, starts))
    assert asked == []
    layers.attend(plan_on_a_gpu(False), q, k, v, 0.0, None)
    assert asked == ["cudnn"]


def test_splash_residuals_are_the_log_sum_exp():
    """The residual a ring would combine block pairs with: logsumexp of each query's scaled scores."""
    q, k, v = (jax.random.normal(key, (1, 2, 128, 8)) for key in jax.random.split(jax.random.key(1), 3))
    out, lse = splash(q, k, v, residuals=True)
    scores = jnp.einsum("bhtd,bhsd->bhts", q, k) / np.sqrt(8)
    scores = jnp.where(jnp.tril(jnp.ones((128, 128), bool)), scores, -jnp.inf)
    np.testing.assert_allclose(lse, jax.nn.logsumexp(scores, -1), rtol=RTOL)
    assert relative_error(out, causal_attention(q, k, v, 0.0, None)) < RTOL


def test_splash_trains_as_one_device_on_dp2_tp2():
    """splash (interpreted) on dp=2,tp=2 against the xla kernel on one device, the Llama family's
    grouped-query heads split over tensor."""
    reference = train(config="tiny_llama", **{"model.block_size": 128, "train.steps": 10})
    assert_same_training(train("dp=2,tp=2", config="tiny_llama", **SPLASH), reference)


@pytest.mark.parametrize("platform, overrides, kernel, note", [
    ("tpu", {}, "splash", None),
    ("gpu", {"dtype": "bfloat16"}, "cudnn", None),
    ("cpu", {}, "xla", None),
    ("tpu", {"dropout": 0.1}, "xla", "splash has no attention dropout"),
    ("gpu", {}, "xla", "takes bfloat16 only"),
    ("tpu", {"block_size": 64}, "xla", "tiles are 128 tokens"),
    ("cpu", {"attention": "splash"}, "splash", None),
    ("tpu", {"context": 4}, "splash", None),  # the ring's chunks: 1024 / 8 = 128 tokens
    ("tpu", {"context": 8}, "xla", "chunks are 64 tokens"),
    ("gpu", {"dtype": "bfloat16", "context": 8}, "cudnn", None),
    ("gpu", {"dtype": "bfloat16", "documents": True}, "tokamax", None),  # the test extra installs it
    # latent attention's 192-dim heads: cuDNN's from Hopper on; before, xla (tokamax's kernel measured slower)
    ("gpu", {"family": "llama", "dtype": "bfloat16", "head_dim": 192, "cudnn_heads": 256}, "cudnn", None),
    ("gpu", {"family": "llama", "dtype": "bfloat16", "head_dim": 192}, "xla", "takes heads up to 128 dims"),
    ("gpu", {"family": "llama", "dtype": "bfloat16", "head_dim": 264, "cudnn_heads": 256}, "xla", "up to 256 dims"),
    # a compile-only Hopper planned on a CPU host: jax refuses them here, tokamax's flash attention stands in
    ("gpu", {"family": "llama", "dtype": "bfloat16", "head_dim": 192, "device_heads": 256}, "tokamax", "stands in"),
    ("gpu", {"dtype": "bfloat16", "documents": True, "context": 2}, "xla", "no segment ids"),
    ("tpu", {"documents": True}, "splash", None),
])
def test_auto_picks_by_platform(platform, overrides, kernel, note):
    context, documents = overrides.pop("context", 1), overrides.pop("documents", False)
    heads, device_heads = overrides.pop("cudnn_heads", 128), overrides.pop("device_heads", None)
    got, why = resolve(model_config(**{"block_size": 1024, **overrides}), platform, context, documents, heads,
                       device_heads)
    assert got == kernel and (note is None) == (why is None) and (note is None or note in why)


def test_tokamaxs_triton_kernels_find_pallas_dot_under_its_old_name():
    """tokamax 0.0.12's kernels call `pl.dot`, gone from jax.experimental.pallas in jax 0.11 (an
    AttributeError on an H200 with jax 0.11.2); prepared() puts back the Triton backend's own."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    from jaxpar.nn import tokamax_kernels
    tokamax_kernels.prepared()
    assert vars(pl)["dot"] is plgpu.dot


def test_cudnns_head_width_is_read_off_the_devices():
    """256 dims from compute capability 9.0 (jax's own check), 128 before and off GPUs; jax checks
    the host's device, so a compile-only Hopper on this CPU host gets 128; an explicit cudnn too
    wide for the mesh's GPUs is refused in one line."""
    from types import SimpleNamespace

    from jaxpar.nn.kernels import check_mesh, cudnn_head_max
    gpu = lambda c: SimpleNamespace(compute_capability=c)
    assert [cudnn_head_max(gpu(c), host=gpu(c)) for c in ("9.0", "10.0", "8.9")] == [256, 256, 128]
    assert cudnn_head_max(gpu("9.0")) == cudnn_head_max(jax.devices()[0]) == 128  # this host: a CPU
    wide = model_config(family="llama", dtype="bfloat16", head_dim=192, attention="cudnn")
    check_mesh(wide, "gpu", 1, cudnn_heads=256)
    with pytest.raises(UserError, match="takes heads up to 128 dims here"):
        check_mesh(wide, "gpu", 1, cudnn_heads=128)


@pytest.mark.parametrize("args, expected", [
    (["--model.attention=splash", "--model.dropout=0.1"], ["has no attention dropout", "--model.dropout=0"]),
    (["--model.attention=cudnn"], ["takes bfloat16 only", "--model.dtype=bfloat16"]),
    (["--model.attention=cudnn", "--model.dtype=bfloat16", "--mesh", "dp=8"], ["needs gpu devices", "on cpu"]),
    (["--model.attention=splash"], ["tiles of 128 tokens", "block_size=32"]),
    (["--model.attention=splash", "--model.block_size=128", "--mesh", "dp=4,cp=2"], ["context ring", "cp=2"]),
    (["--model.attention=flash"], ["model.attention must be one of auto, xla, splash, cudnn"]),
    (["--model.attention=cudnn", "--model.dtype=bfloat16", "--data.document_mask=true"], ["no segment ids"]),
])
def test_kernel_refusals_are_one_line(capsys, tmp_path, args, expected):
    fails_with(capsys, tmp_path, ["--config", "tiny", *args], *expected)


@pytest.mark.parametrize("key", [ATTENTION, MOE_GEMM, MOE_DISPATCH])
def test_the_kernel_keys_take_the_registrys_names(key):
    """The config's checks (as it loads) read each kernel key's values off its registry: each of
    its names passes, and another value is refused in one line that lists them all."""
    names, cfg = REGISTRIES[f"model.{key}"].names, Config()
    for name in names:
        cfg.model = model_config("llama", n_experts=4, dtype="bfloat16", block_size=128, **{key: name})
        check_registered(cfg)
    cfg.model = model_config("llama", n_experts=4, **{key: "flash"})
    with pytest.raises(UserError, match=f"model.{key} must be one of {', '.join(names)}, got 'flash'"):
        check_registered(cfg)


def compiled_text(target: str, devices: int = 1, eot_id: int | None = None, **overrides) -> str:
    from jaxpar.data.loader import load_dataset, model_vocab
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.planning.hardware import parse_target, target_devices
    from jaxpar.training.step.build import build
    cfg = tiny_config("tiny", **overrides)
    devices = target_devices(parse_target(target))[:devices]
    vocab = model_vocab(cfg, load_dataset(cfg.data, cfg.model.block_size).tokenizer)
    return build(cfg, build_mesh(cfg, devices), vocab=vocab, eot_id=eot_id).compile_abstract().as_text()


@pytest.mark.skipif(importlib.util.find_spec("jax_cuda12_plugin") is None,
                    reason="JAX's CUDA plugin is not installed (pip install -e '.[gpu]')")
def test_cudnn_compiles_for_an_h100():
    text = compiled_text("gpu:h100-1", **{"model.dtype": "bfloat16", "model.attention": "cudnn",
                                          "model.block_size": 128, "model.n_embd": 128})
    assert "__cudnn$fmhaSoftmax" in text and "__cudnn$fmhaSoftmaxBackward" in text


@pytest.mark.skipif(importlib.util.find_spec("jax_cuda12_plugin") is None or importlib.util.find_spec("tokamax") is None,
                    reason="JAX's CUDA plugin and tokamax are not installed (pip install -e '.[gpu]')")
def test_documents_compile_for_an_h100_as_tokamaxs_kernel():
    """data.document_mask on an H100: `auto` runs tokamax's Triton flash attention with the mask,
    forward and backward; the control without documents runs cuDNN's."""
    gpu = {"model.dtype": "bfloat16", "model.block_size": 128, "model.n_embd": 128}
    text = compiled_text("gpu:h100-1", eot_id=0, **gpu, **{"data.document_mask": True})
    assert "__gpu$xla.gpu.triton" in text and "__cudnn$fmha" not in text
    plain = compiled_text("gpu:h100-1", **gpu)
    assert "__cudnn$fmhaSoftmax" in plain
    # the roofline counts the Triton kernel's FLOPs as it counts cuDNN's: the same causal matmuls
    flops = [roofline.estimate(t, CHIPS["h100"], devices=1)["hlo_flops_per_chip"] for t in (text, plain)]
    assert flops[0] == pytest.approx(flops[1], rel=1e-3), flops


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (the tpu extra)")
def test_splash_compiles_for_a_tpu_as_a_mosaic_kernel():
    text = compiled_text("tpu:v5e-8", **{"model.dtype": "bfloat16", **SPLASH})
    assert "tpu_custom_call" in text and "splash" in text
    plain = compiled_text("tpu:v5e-8", **{"model.dtype": "bfloat16", **SPLASH, "model.attention": "xla"})
    fused, unfused = (roofline.estimate(t, CHIPS["v5e"], devices=1) for t in (text, plain))
    assert fused["step_s"] != unfused["step_s"]  # the planner tells the kernels apart
    # the roofline reads the kernel's FLOPs from its shapes: its backward recomputes the scores
    assert fused["hlo_flops_per_chip"] > unfused["hlo_flops_per_chip"] > 0


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (the tpu extra)")
def test_auto_runs_splash_in_the_context_ring_on_a_tpu():
    """cp=2 at block 512: the ring's zigzag chunks are 128 tokens, so `auto` runs its block pairs
    by splash (the Mosaic kernel in the compiled step) and the ring's permutes go round."""
    text = compiled_text("tpu:v5e-8", devices=2, **{"model.dtype": "bfloat16", "model.block_size": 512,
                                                     "mesh.dp": 1, "mesh.cp": 2})
    assert "tpu_custom_call" in text and "splash" in text and "collective-permute" in text


@pytest.mark.skipif(importlib.util.find_spec("jax_cuda12_plugin") is None,
                    reason="JAX's CUDA plugin is not installed (pip install -e '.[gpu]')")
def test_auto_runs_cudnn_in_the_context_ring_on_an_h100():
    text = compiled_text("gpu:h100-8", devices=2, **{"model.dtype": "bfloat16", "model.block_size": 256,
                                                      "model.n_embd": 128, "mesh.dp": 1, "mesh.cp": 2})
    assert "__cudnn$fmhaSoftmax" in text and "collective-permute" in text

"""The execution plan (jaxpar.core.execution): every decision a trace needs, made once from the
config and the mesh before tracing, and the same plan wherever the config runs: training,
`jaxpar.eval`, the planner's compile for a TPU target from this CPU host.
"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_overrides, tiny_config
from helpers import save_random_gpt2

from jaxpar.core import execution
from jaxpar.core.strategies import Accumulation, StageGrads
from jaxpar.data.loader import load_dataset
from jaxpar.inference import evaluate
from jaxpar.inference.loading import load
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.step.execution import plan_execution

JAXPAR = pathlib.Path(__file__).resolve().parent.parent / "jaxpar"


def plan_of(spec: str, config: str = "tiny", **overrides):
    cfg = tiny_config(config, **mesh_overrides(spec), **overrides)
    return plan_execution(cfg, build_mesh(cfg, jax.devices()[:int(np.prod(list(cfg.mesh.__dict__.values())))]))


@pytest.mark.parametrize("spec, overrides, accumulation", [
    ("dp=2", {"train.micro_batch": 0}, Accumulation.ONE_PASS),
    ("dp=2", {"train.grad_accum": 2}, Accumulation.REDUCED_ONCE),
    ("dp=2", {"train.grad_accum": 2, "model.dropout": 0.1}, Accumulation.EACH_PASS_REDUCED),  # masks over the batch
    ("dp=1", {"train.grad_accum": 2}, Accumulation.EACH_PASS_REDUCED),
    ("dp=2,pp=2", {"train.grad_accum": 2}, Accumulation.EACH_PASS_REDUCED),  # each round reduces its own
])
def test_the_accumulation_path_is_decided_before_tracing(spec, overrides, accumulation):
    assert plan_of(spec, **overrides).accumulation == accumulation


def test_the_plans_xla_options_are_the_platforms_defaults_with_the_users_over_them(monkeypatch):
    """train.xla_options reach the plan typed, over the platform's measured defaults, and
    run.json's execution names them; without any the steps compile as plain jit does."""
    from jaxpar.core import xla_options
    assert plan_of("dp=1").compiler_options is None and "xla_options" not in plan_of("dp=1").describe()
    monkeypatch.setitem(xla_options.PLATFORM_DEFAULTS, "cpu", {"xla_cpu_enable_fast_math": True,
                                                                "xla_gpu_enable_cublaslt": True})
    plan = plan_of("dp=2", **{"train.xla_options": "xla_cpu_enable_fast_math=false, xla_gpu_autotune_level=2"})
    assert plan.describe()["xla_options"] == plan.compiler_options == {
        "xla_cpu_enable_fast_math": False, "xla_gpu_enable_cublaslt": True, "xla_gpu_autotune_level": 2}


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (the tpu extra)")
def test_the_xla_options_are_checked_by_the_meshs_own_compiler():
    """A TPU's own option passes the check on a compile-only TPU device (the planner's target);
    the control: this host's CPU compiler does not know it."""
    from jaxpar.core import xla_options
    from jaxpar.core.errors import UserError
    from jaxpar.planning.hardware import parse_target, target_devices
    tpu_only = (("xla_tpu_enable_latency_hiding_scheduler", True),)
    xla_options.check(tpu_only, target_devices(parse_target("tpu:v5e-8"))[0])
    with pytest.raises(UserError, match="No such compile option: 'xla_tpu_enable_latency_hiding_scheduler'"):
        xla_options.check(tpu_only)


def test_a_step_refuses_a_batch_of_more_passes_than_its_plan_says():
    """A model made without its step's plan (one pass) would take the first of a batch's passes
    alone and leave the others' rows out: its gradient function refuses the batch while tracing.
    The control: the model that build() makes for the same config takes it."""
    from jaxpar.models.transformer import build_model
    from jaxpar.training.step.build import build
    from jaxpar.training.step.passes import make_grad_fn
    cfg = tiny_config(**{"train.grad_accum": 2})
    built = build(cfg, build_mesh(cfg, jax.devices()[:1]), vocab=65)
    assert built.plan.passes == 2
    batch = jax.ShapeDtypeStruct((2, cfg.train.batch_size // 2, cfg.model.block_size), jnp.int32)
    shapes = built.model.shapes()
    grads_of = make_grad_fn(built.model, 0, built.zero.grads)
    with jax.set_mesh(built.mesh):
        jax.eval_shape(grads_of, shapes, batch, batch, 0)
        with pytest.raises(ValueError, match="the plan says one pass and the batch holds 2"):
            jax.eval_shape(make_grad_fn(build_model(cfg, 65), 0, built.zero.grads), shapes, batch, batch, 0)


def test_the_plan_says_what_runs_and_where():
    """The pipeline's schedule and how its gradients leave a stage; the CPU's choices; the rule
    table with sequence parallelism; a mixture's dispatch only where experts are split."""
    piped = plan_of("dp=2,pp=2").describe()
    assert piped["pipeline"]["gradients_reduced"] == StageGrads.STAGES_REDUCE.value
    assert plan_of("dp=2,pp=2", **{"model.dropout": 0.1}).pipeline["gradients_reduced"] == StageGrads.SHARDINGS_REDUCE.value
    assert (piped["platform"], piped["attention"], piped["activations_recomputed"]) == ("cpu", "xla", False)
    assert "moe" not in piped and plan_of("dp=2,tp=2", **{"model.sequence_parallel": "true"}).rules["stream_seq"]
    moe = plan_of("dp=2,ep=2", "tiny_moe")
    assert (moe.moe_mode, moe.unsplit("data", "expert").moe_mode, moe.moe_gemm) == ("all_to_all", "replicated",
                                                                                   "blocks")


def test_no_context_variable_and_no_mesh_read_back_inside_jaxpar():
    """The rules, the kernel and the mesh travel in the plan; the control is the string itself."""
    sources = {path: path.read_text() for path in JAXPAR.rglob("*.py")}
    for needle in ("ContextVar", "get_abstract_mesh"):
        assert [str(p) for p, text in sources.items() if needle in text] == [], needle
    assert any("ExecutionPlan" in text for text in sources.values())


def test_eval_runs_the_attention_kernel_the_run_trained_with(tmp_path):
    """A checkpoint of a model.attention=splash run: jaxpar.eval's loss traces splash (a Pallas
    call, interpreted on this CPU) and equals xla's; on 2755087 eval ran xla whatever the config."""
    cfg = tiny_config(**{"model.attention": "splash", "model.block_size": 128})
    save_random_gpt2(tmp_path, cfg, load_dataset(cfg.data, 128).tokenizer, 1, 0.1)
    model = load(tmp_path)
    assert model.execution.attention == "splash"
    inputs = targets = jnp.zeros((1, 128), jnp.int32)
    row_losses = evaluate.make_row_losses(model)
    assert "pallas_call" in str(jax.make_jaxpr(row_losses)(model.params, inputs, targets))
    as_xla = load(tmp_path)
    as_xla.cfg.model.attention = "xla"
    as_xla.net = as_xla.net.on(plan_execution(as_xla.cfg, as_xla.mesh, for_training=False))
    xla_losses = evaluate.make_row_losses(as_xla)
    assert "pallas_call" not in str(jax.make_jaxpr(xla_losses)(model.params, inputs, targets))
    np.testing.assert_allclose(row_losses(model.params, inputs, targets), xla_losses(model.params, inputs, targets),
                               rtol=1e-5)


def test_the_planner_compiles_a_tpu_targets_mixture_with_the_tpus_dispatch():
    """Compile-only TPU devices from this CPU host: the plan is the TPU's, so expert parallelism
    dispatches its rows by ragged-all-to-all (XLA:CPU has none), not the CPU's all-to-all of
    buffers ep times their size; on 2755087 the planner compiled the CPU's."""
    pytest.importorskip("libtpu")
    from jaxpar.planning import hardware
    from jaxpar.training.step.build import build
    # The MoE quick start's layers (Megablox's tiles need its widths), two of them.
    cfg = tiny_config("shakespeare_moe_cpu", **mesh_overrides("ep=8"), **{
        "model.n_layer": 2, "train.batch_size": 8, "train.micro_batch": 1})
    mesh = build_mesh(cfg, hardware.target_devices(hardware.parse_target("tpu:v5e-8")))
    assert plan_execution(cfg, mesh).moe_mode == "ragged"
    text = build(cfg, mesh, vocab=65).compile_abstract().as_text()
    assert "ragged-all-to-all(" in text  # the rows; the counts that size them go by a small all-to-all
    from jaxpar.parallel import hlo
    from jaxpar.planning.estimate import collective_seconds
    dispatch = hlo.collectives(text)["ragged-all-to-all"]  # counted, with its bytes, as the plan lists them
    assert dispatch["count"] == 8 and dispatch["bytes"] > 0, dispatch  # 2 layers, out and back, forward and backward
    ops = [op for op in hlo.collective_ops(text) if op["kind"] == "ragged-all-to-all"]
    assert collective_seconds(ops, hardware.chip_for(hardware.parse_target("tpu:v5e-8"), mesh.devices.flat, "bfloat16"), 8) > 0


def test_the_plan_runs_tokamax_for_mixtures_on_gpus_and_says_when_it_cannot(monkeypatch):
    """On GPUs `auto` is tokamax's Triton ragged_dot (the routed rows only); without tokamax it
    is XLA's ragged_dot, a dense product over every expert, said in one line. The controls: CPU
    keeps the blocked GEMM with no note, and an explicit tokamax off a GPU is refused."""
    from jaxpar.core.errors import UserError
    from jaxpar.nn import moe, tokamax_kernels
    cfg = tiny_config("tiny_moe")
    for installed, expected in ((True, "tokamax"), (False, "ragged_dot")):
        monkeypatch.setattr(tokamax_kernels, "available", lambda installed=installed: installed)
        gemm, note = moe.gemm_of(cfg.model, "gpu")
        assert gemm == expected and (note is None) == installed
    assert "tokamax is not installed" in note and "E times the routed FLOPs" in note
    monkeypatch.setattr(tokamax_kernels, "available", lambda: True)
    assert moe.gemm_of(cfg.model, "cpu") == ("blocks", None)
    plan = execution.ExecutionPlan(experts=True, moe_gemm="ragged_dot", moe_gemm_note=note)
    assert plan.notes == (note,) and note in plan.describe()["moe"]["grouped_gemm"]
    cfg.model.moe_gemm = "tokamax"
    with pytest.raises(UserError, match="model.moe_gemm=tokamax needs tokamax on an NVIDIA GPU"):
        moe.gemm_of(cfg.model, "cpu")


def test_documents_on_gpus_run_tokamaxs_attention_or_say_why_not(monkeypatch):
    """data.document_mask on GPUs: tokamax's flash attention with the mask (cuDNN's call has no
    segment ids); without tokamax, or under a context ring, xla, said in one line. Controls: no
    documents keeps cuDNN; an explicit tokamax under a ring is refused."""
    from jaxpar.core.errors import UserError
    from jaxpar.nn import kernels, tokamax_kernels
    m = tiny_config(**{"model.dtype": "bfloat16"}).model
    monkeypatch.setattr(tokamax_kernels, "available", lambda: True)
    assert kernels.resolve(m, "gpu", 1, documents=True) == ("tokamax", None)
    assert kernels.resolve(m, "gpu", 1, documents=False) == ("cudnn", None)
    assert "runs no context ring" in kernels.resolve(m, "gpu", 2, documents=True)[1]
    m.attention = "tokamax"
    with pytest.raises(UserError, match="model.attention=tokamax runs no context ring"):
        kernels.check_mesh(m, "gpu", 2)
    m.attention = "auto"
    monkeypatch.setattr(tokamax_kernels, "available", lambda: False)
    kernel, note = kernels.resolve(m, "gpu", 1, documents=True)
    assert kernel == "xla" and "tokamax's kernel, which has, is not installed" in note


@pytest.mark.skipif(importlib.util.find_spec("jax_cuda12_plugin") is None or importlib.util.find_spec("tokamax") is None,
                    reason="JAX's CUDA plugin and tokamax are not installed (pip install -e '.[gpu]', several GB)")
def test_the_h100_step_of_a_mixture_runs_tokamax_at_the_routed_flops():
    """A compile-only H100's MoE train step: its experts' GEMMs are tokamax's Triton kernels, at
    the routed FLOPs; the control, XLA's ragged_dot, multiplies every row by all 4 experts: 4x."""
    from jaxpar.planning import hardware, hlo_ops
    from jaxpar.training.step.build import build
    cfg = tiny_config("tiny_moe", **mesh_overrides("dp=2"))
    mesh = build_mesh(cfg, hardware.target_devices(hardware.parse_target("gpu:h100-2")))
    flops = {}
    for gemm, marks in (("auto", "tokamax:"), ("ragged_dot", "ragged_dot_general")):
        cfg.model.moe_gemm = gemm
        assert plan_execution(cfg, mesh).moe_gemm == ("tokamax" if gemm == "auto" else gemm)
        text = build(cfg, mesh, vocab=65).compile_abstract().as_text()
        assert ("__gpu$xla.gpu.triton" in text) == (gemm == "auto")
        comps, _, _ = hlo_ops.parse(text)
        flops[gemm] = sum(sum(hlo_ops.op_flops(op, comps, {o.name: o.shape for o in ops}).values())
                          for ops in comps.values() for op in ops  # a fusion counts the dots inside it
                          if marks in op.line and op.opcode in ("fusion", "custom-call"))
    assert flops["ragged_dot"] == pytest.approx(4 * flops["auto"], rel=0.01), flops

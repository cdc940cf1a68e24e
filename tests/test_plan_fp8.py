"""jaxpar.plan and FP8 (issue 73): --fp8 searches model.fp8 as one more dimension of the layouts,
a recipe the target cannot run is listed with the trainer's reason, the best layout's command
carries it, and plan.json lists each step's GEMMs by operand dtype. Analytic and hand-made HLO:
nothing compiles here."""

import pytest
from conftest import tiny_config
from helpers import exits_with_one_line

from jaxpar.core.errors import UserError
from jaxpar.nn.recipes import recipe_for
from jaxpar.plan import main, parse_args
from jaxpar.planning.plan import Candidate, enumerate_candidates, layout_config, train_command

RECIPES = ["none", "tensorwise", "rowwise"]


def fp8s(tmp_path, *flags: str) -> list[str]:
    return parse_args(["--config", "tiny", *flags, "--out", str(tmp_path / "plan")])[2].fp8


def test_fp8_takes_a_list_or_auto_and_defaults_to_the_configs(tmp_path):
    """auto: every registered recipe the target's platform runs (a TPU runs none of FP8's)."""
    assert fp8s(tmp_path, "--target", "cpu:8") == ["none"]  # the config's alone: plans as before
    assert fp8s(tmp_path, "--target", "cpu:8", "--model.fp8=rowwise") == ["rowwise"]
    assert fp8s(tmp_path, "--target", "gpu:h100-8", "--fp8", "none,tensorwise") == ["none", "tensorwise"]
    assert fp8s(tmp_path, "--target", "gpu:h100-8", "--fp8", "auto") == RECIPES
    assert fp8s(tmp_path, "--target", "cpu:8", "--fp8", "auto") == RECIPES
    assert fp8s(tmp_path, "--target", "tpu:v5e-8", "--fp8", "auto") == ["none"]


def test_an_unknown_fp8_recipe_is_one_line_before_any_work(capsys, tmp_path):
    exits_with_one_line(capsys, "jaxpar.plan", lambda: main(
        ["--config", "tiny", "--target", "cpu:8", "--fp8", "none,fp16", "--out", str(tmp_path / "plan")]),
        "--fp8 takes values from none, tensorwise, rowwise (or auto), got 'none,fp16'")
    assert not (tmp_path / "plan").exists()


def test_each_layout_is_tried_with_each_recipe_and_a_refused_one_is_skipped_with_the_trainers_reason():
    """On a TPU v5e (no FP8 units) tensorwise is skipped with the line jaxpar.train gives there;
    control: on an H100 both run."""
    cfg = tiny_config()
    weigh = lambda platform, chip: enumerate_candidates(cfg, 8, "dp=8;dp=4,tp=2", (1,), "1", ("none",), None,
                                                       ("none",), ["none", "tensorwise"], platform, chip)
    on_tpu = weigh("tpu", "TPU v5 lite")
    assert sorted((c.mesh_spec(), c.layout["fp8"]) for c in on_tpu) == [
        ("dp=4,tp=2,pp=1", "none"), ("dp=4,tp=2,pp=1", "tensorwise"), ("dp=8,tp=1,pp=1", "none"),
        ("dp=8,tp=1,pp=1", "tensorwise")]
    with pytest.raises(UserError) as trainer:
        recipe_for(tiny_config(**{"model.fp8": "tensorwise"}).model, "tpu", "TPU v5 lite")
    assert "not on tpu (TPU v5 lite)" in str(trainer.value)
    for c in on_tpu:
        assert c.cfg.model.fp8 == c.layout["fp8"]
        assert (c.status, c.reason) == (("skipped", str(trainer.value)) if c.layout["fp8"] == "tensorwise"
                                        else ("pending", ""))
    assert {c.status for c in weigh("gpu", "NVIDIA H100 80GB HBM3")} == {"pending"}


def test_the_train_command_carries_model_fp8_where_it_is_not_none():
    """A tensorwise layout's command says so; a none layout's says nothing, unless the config or an
    override asked for FP8 (then it says none, and the override's value is not repeated)."""
    from jaxpar.planning.plan_report import layout_cell
    cfg = tiny_config()
    layout = {"dp": 8, "tp": 1, "pp": 1, "zero": 1, "micro_batch": 1, "remat": "none", "offload": "none"}
    fp8 = Candidate({**layout, "fp8": "tensorwise"}, layout_config(cfg, {**layout, "fp8": "tensorwise"}))
    plain = Candidate({**layout, "fp8": "none"}, layout_config(cfg, {**layout, "fp8": "none"}))
    assert fp8.cfg.model.fp8 == "tensorwise" and plain.cfg.model.fp8 == "none"
    assert train_command("tiny", {}, fp8).endswith("--train.micro_batch=1 --model.fp8=tensorwise")
    assert "--model.fp8" not in train_command("tiny", {}, plain)
    asked = train_command("tiny", {"model.fp8": "tensorwise"}, plain)
    assert asked.endswith("--model.fp8=none") and "tensorwise" not in asked
    assert layout_cell(fp8).endswith("mb=1 fp8=tensorwise") and "fp8" not in layout_cell(plain)


def test_plan_md_says_where_fp8_gemms_are_timed_and_what_mfu_divides_by():
    from jaxpar.planning.hardware import CHIPS
    from jaxpar.planning.plan_report import fp8_note
    layout = {"dp": 8, "tp": 1, "pp": 1, "zero": 1, "micro_batch": 1, "remat": "none"}
    with_fp8 = [Candidate({**layout, "fp8": "none"}, None), Candidate({**layout, "fp8": "tensorwise"}, None)]
    line = fp8_note(CHIPS["h100"], "bfloat16", with_fp8)[-1]
    assert "timed at the chip's FP8 peak, 1,979 TFLOP/s" in line
    assert "MFU still divides by bfloat16's peak, 989 TFLOP/s" in line
    assert fp8_note(CHIPS["h100"], "bfloat16", with_fp8[:1]) == []  # no FP8 layout: no line


# A step as XLA:GPU compiles it (shortened): inside a layer loop of 3 iterations, a cuBLASLt f8
# call (Triton GEMMs off) and a Triton GEMM fusion of an e5m2 gradient by e4m3 weights (on); outside
# it a bf16 cuBLAS GEMM (the lm_head), a dot in a TPU-style output fusion, and what is no GEMM: a
# cuDNN attention call and a Triton fusion that is not a GEMM.
GEMMS = """HloModule gemms, is_scheduled=true

%gemm_fusion_f8 (p0: f8e5m2[64,128], p1: f8e4m3fn[256,128]) -> f32[64,256] {
  %p0 = f8e5m2[64,128]{1,0} parameter(0)
  %p1 = f8e4m3fn[256,128]{1,0} parameter(1)
  %t = f8e4m3fn[128,256]{0,1} transpose(%p1), dimensions={1,0}
  ROOT %d = f32[64,256]{1,0} dot(%p0, %t), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%cond (p: (s32[], f8e4m3fn[64,128])) -> pred[] {
  %p = (s32[], f8e4m3fn[64,128]) parameter(0)
  %j = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

%body (p: (s32[], f8e4m3fn[64,128])) -> (s32[], f8e4m3fn[64,128]) {
  %p = (s32[], f8e4m3fn[64,128]) parameter(0)
  %j = s32[] get-tuple-element(%p), index=0
  %xq = f8e4m3fn[64,128]{1,0} get-tuple-element(%p), index=1
  %a = f8e4m3fn[128,256]{1,0} constant({...})
  %g = f8e5m2[64,128]{1,0} constant({...})
  %wq = f8e4m3fn[256,128]{1,0} constant({...})
  %s = f32[] constant(1)
  %cublas = (f32[64,256]{1,0}, s8[1024]{0}) custom-call(%xq, %a, %s, %s), custom_call_target="__cublas$lt$matmul$f8"
  %triton = f32[64,256]{1,0} fusion(%g, %wq), kind=kCustom, calls=%gemm_fusion_f8, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  ROOT %t = (s32[], f8e4m3fn[64,128]) tuple(%j, %xq)
}

%fused_dot (p0: f32[64,128], p1: f32[128,256]) -> f32[64,256] {
  %p0 = f32[64,128]{1,0} parameter(0)
  %p1 = f32[128,256]{1,0} parameter(1)
  ROOT %d = f32[64,256]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_norm (p0: f32[64,128]) -> f32[64,128] {
  %p0 = f32[64,128]{1,0} parameter(0)
  ROOT %n = f32[64,128]{1,0} negate(%p0)
}

ENTRY %main (init: (s32[], f8e4m3fn[64,128]), h: bf16[64,128], v: bf16[128,256], x: f32[64,128], w: f32[128,256]) -> f32[64,256] {
  %init = (s32[], f8e4m3fn[64,128]) parameter(0)
  %h = bf16[64,128]{1,0} parameter(1)
  %v = bf16[128,256]{1,0} parameter(2)
  %x = f32[64,128]{1,0} parameter(3)
  %w = f32[128,256]{1,0} parameter(4)
  %loop = (s32[], f8e4m3fn[64,128]) while(%init), condition=%cond, body=%body
  %head = (f32[64,256]{1,0}, s8[1024]{0}) custom-call(%h, %v), custom_call_target="__cublas$gemm"
  %attn = (bf16[1,64,4,32]{3,2,1,0}, u8[0]{0}) custom-call(%h, %h, %h), custom_call_target="__cudnn$fmhaSoftmax"
  %norm = f32[64,128]{1,0} fusion(%x), kind=kCustom, calls=%fused_norm, backend_config={"fusion_backend_config":{"kind":"__triton"}}
  ROOT %out = f32[64,256]{1,0} fusion(%norm, %w), kind=kOutput, calls=%fused_dot
}
"""


def test_the_steps_gemms_are_listed_by_operand_dtype_runs_per_step():
    """Each GEMM once per run of its computation: the loop's two FP8 GEMMs 3 times each, the
    head's bf16 GEMM and the fused f32 dot once; attention and the Triton norm are no GEMMs."""
    from jaxpar.planning.gemms import fp8_gemms, gemm_dtypes
    counts = gemm_dtypes(GEMMS)
    assert counts == {"f8e4m3fn x f8e4m3fn": 3, "f8e5m2 x f8e4m3fn": 3, "bf16 x bf16": 1, "f32 x f32": 1}
    assert fp8_gemms(counts) == 6
    assert fp8_gemms(gemm_dtypes(GEMMS.replace("constant(3)", "constant(5)"))) == 10  # control: per iteration

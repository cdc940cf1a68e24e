"""jaxpar.plan: its enumeration, fit decision, step-time arithmetic and HLO reading, end to end on
the cpu:N target, and on a TPU target where libtpu is installed."""

import importlib.util
import json
import re
import subprocess
import sys

import jax
import pytest
from conftest import tiny_config
from helpers import exits_with_one_line

from jaxpar.core.config import OFFLOADS
from jaxpar.core.errors import UserError
from jaxpar.core.out_lock import RunLock
from jaxpar.core.remat import REMAT_KINDS, kept_widths
from jaxpar.models import flops
from jaxpar.parallel import hlo
from jaxpar.parallel.mesh import resolve_mesh_shape
from jaxpar.parallel.schedules import make_schedule
from jaxpar.plan import main
from jaxpar.planning import estimate, hardware
from jaxpar.planning.hardware import Chip, parse_target
from jaxpar.planning.plan import Candidate, compile_candidate, enumerate_candidates, layout_config

CHIP = Chip("test chip", 1e9, 100e12, 1e12, 50e9, 1, 2, "made up for the test")


def test_enumeration_keeps_valid_layouts_and_gives_the_trainers_reasons():
    cfg = tiny_config()  # 2 layers, 4 heads, batch 8
    found = enumerate_candidates(cfg, 8, zeros=(0, 1, 3), micro="auto", remats=("none",))
    meshes = {(c.layout["dp"], c.layout["tp"], c.layout["pp"]) for c in found}
    assert meshes == {(dp, tp, 8 // (dp * tp)) for dp in (1, 2, 4, 8) for tp in (1, 2, 4, 8)
                      if 8 % (dp * tp) == 0}
    for c in found:
        if c.status == "pending":
            assert resolve_mesh_shape(c.cfg, 8) == {"dp": c.layout["dp"], "tp": c.layout["tp"],
                                                    "pp": c.layout["pp"], "cp": 1, "ep": 1}
    reasons = {(c.mesh_spec(), c.layout["zero"]): c.reason for c in found if c.status == "skipped"}
    with pytest.raises(UserError) as trainer:
        resolve_mesh_shape(tiny_config(**{"mesh.tp": 8}), 8)
    assert reasons[("dp=1,tp=8,pp=1", 0)] == str(trainer.value)
    assert "pp=8 does not divide model.n_layer=2" in reasons[("dp=1,tp=1,pp=8", 0)]
    assert ("dp=2,tp=2,pp=2", 3) not in reasons  # ZeRO 3 beside a pipeline runs
    assert "same program as zero 0" in reasons[("dp=1,tp=4,pp=2", 1)]
    # dp=8 holds 1 row: micro-batch 1 only; dp=2 holds 4 rows: micro-batches 1, 2 and 4.
    assert sorted(c.layout["micro_batch"] for c in found
                  if c.mesh_spec() == "dp=2,tp=4,pp=1" and c.layout["zero"] == 0) == [1, 2, 4]


def test_fit_decision_follows_the_compiled_memory_and_the_capacity():
    cfg = tiny_config()
    layout = {"dp": 2, "tp": 2, "pp": 1, "zero": 1, "micro_batch": 0, "remat": "none"}
    compiled = []
    for capacity in (1e9, 1e3):  # far above, then far below the step's few hundred KiB
        c = Candidate(layout, layout_config(cfg, layout))
        compile_candidate(c, 65, jax.devices()[:4], Chip(**{**CHIP.__dict__, "hbm_bytes": capacity}))
        compiled.append(c)
    big, small = compiled
    assert big.status == small.status == "compiled"
    assert big.compiled["peak_memory_bytes"] == small.compiled["peak_memory_bytes"] > 1e3
    assert big.fits is True and small.fits is False
    r = big.compiled  # the roofline: its ops at least their FLOPs at peak, so never an MFU of 100%
    assert 0 < r["mfu"] < 1 and r["step_s"] >= r["hlo_flops_per_chip"] / CHIP.peak_flops > 0
    assert r["step_s"] == pytest.approx(r["compute_s"] + r["exposed_comm_s"])
    assert set(r["gemms"]) == {"f32 x f32"} and sum(r["gemms"].values()) > 0  # plan.json's GEMMs by dtype


def test_step_time_arithmetic_on_a_hand_made_case():
    ops = [{"kind": "all-reduce", "bytes": 1e9, "group": 4, "count": 2},  # 2 x 1e9 x 1.5 / 100e9
           {"kind": "all-gather", "bytes": 4e8, "group": 8, "count": 1},  # 4e8 x 7/8 / 100e9
           {"kind": "reduce-scatter", "bytes": 1e8, "group": 4, "count": 1},  # 1e8 x 3 / 100e9
           {"kind": "collective-permute", "bytes": 5e8, "group": None, "count": 1},  # 5e8 / 50e9
           {"kind": "all-reduce", "bytes": 1e9, "group": 1, "count": 5}]  # a group of one: free
    comm = estimate.collective_seconds(ops, CHIP, devices=8)
    assert comm == pytest.approx(0.03 + 0.0035 + 0.003 + 0.01)
    layout = {"dp": 2, "tp": 1, "pp": 2, "zero": 0, "micro_batch": 0, "remat": "full"}
    cfg = layout_config(tiny_config(), layout)  # 8 x 32 tokens per step
    reruns = make_schedule("1f1b", 2, 4).rerun_factors  # pp=2's backward reruns its stage once
    t = estimate.step_time(cfg.model, cfg.train.batch_size, 65, layout, CHIP, comm_s=1e-9, bubble=0.25, reruns=reruns)
    per_token = flops.flops_per_token(cfg.model, 65) + 2 * flops.recompute_flops_per_token(cfg.model)
    assert t["flops_per_chip"] == per_token * 256 / 4
    assert t["step_s"] == pytest.approx(t["flops_per_chip"] / 100e12 / 0.75)
    assert t["mfu"] == pytest.approx(flops.flops_per_token(cfg.model, 65) * 256
                                     / t["step_s"] / (4 * 100e12))


HLO = """HloModule test

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%cond (p: (s32[], f32[64])) -> pred[] {
  %c = s32[] constant(12)
  ROOT %lt = pred[] compare(s32[] %i, s32[] %c), direction=LT
}

%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %ar = f32[64]{0} all-reduce(f32[64]{0} %x), replica_groups={{0,1},{2,3}}, to_apply=%add
  %ag = f32[128]{0} all-gather(f32[64]{0} %x), replica_groups=[2,4]<=[8], dimensions={0}
  ROOT %t = (s32[], f32[64]) tuple(%i, %ar)
}

ENTRY %main (x: f32[64]) -> f32[64] {
  %w = (s32[], f32[64]) while((s32[], f32[64]) %init), condition=%cond, body=%body
  %rs = bf16[8]{0} reduce-scatter(bf16[64]{0} %y), replica_groups=mesh['axis_0'=8,'axis_1'=2] {'axis_0'}, to_apply=%add
  ROOT %ar2 = f32[64]{0} all-reduce(f32[64]{0} %x), replica_groups={}, to_apply=%add
}
"""


def test_hlo_counts_loop_bodies_per_iteration_and_reads_replica_groups():
    ops = {(op["kind"], op["group"]): (op["count"], op["bytes"]) for op in hlo.collective_ops(HLO)}
    assert ops == {("all-reduce", 2): (12, 256), ("all-gather", 4): (12, 512),
                   ("reduce-scatter", 8): (1, 16), ("all-reduce", None): (1, 256)}
    assert hlo.collectives(HLO) == {"all-reduce": {"count": 13, "bytes": 13 * 256},
                                    "all-gather": {"count": 12, "bytes": 12 * 512},
                                    "reduce-scatter": {"count": 1, "bytes": 16}}


FUSED = """HloModule fused

%all-reduce-scatter (input: f32[4,512,1024]) -> f32[4,256,1024] {
  %all-reduce.3 = f32[4,512,1024]{2,1,0} all-reduce(%input), channel_id=2, replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %dynamic-slice.11 = f32[4,256,1024]{2,1,0} dynamic-slice(%all-reduce.3, %c0, %o, %c0), dynamic_slice_sizes={4,256,1024}
}

%async_collective_fusion.1 (p: f32[16,64]) -> f32[128,64] {
  ROOT %all-gather.5 = f32[128,64]{1,0} all-gather(%p), channel_id=7, replica_groups=[1,8]<=[8], dimensions={0}
}

%async_collective_fusion.2 (p: f32[16,64]) -> f32[128,64] {
  ROOT %all-gather.6 = f32[128,64]{1,0} all-gather(%p), channel_id=7, replica_groups=[1,8]<=[8], dimensions={0}
}

ENTRY %main (x: f32[4,512,1024]) -> f32[4,256,1024] {
  ROOT %fusion = f32[4,256,1024]{2,1,0} fusion(%x), kind=kCustom, calls=%all-reduce-scatter
  %async-collective-start.1 = f32[128,64]{1,0} fusion(%g), kind=kCustom, calls=%async_collective_fusion.1
  %fusion.2 = f32[128,64]{1,0} fusion(%g), kind=kCustom, calls=%async_collective_fusion.2
  %collective-permute-start = (f32[8,1024]{1,0:T(8,128)S(1)}, f32[8,1024]{1,0:T(8,128)S(1)}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%m), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %collective-permute-done = f32[8,1024]{1,0:T(8,128)S(1)} collective-permute-done(%collective-permute-start)
}
"""


def test_hlo_reads_xla_tpus_fused_reduce_scatters_and_async_permutes():
    """An all-reduce fused with the slice a device keeps is a reduce-scatter of that slice; an
    async collective-permute's bytes are its result's, not its scalar contexts'; an all-gather
    that XLA:TPU runs in pieces over two fusions (one channel) counts once."""
    assert hlo.collective_ops(FUSED) == [
        {"kind": "reduce-scatter", "bytes": 4 * 256 * 1024 * 4, "group": 2, "count": 1},
        {"kind": "all-gather", "bytes": 128 * 64 * 4, "group": 8, "count": 1},
        {"kind": "collective-permute", "bytes": 8 * 1024 * 4, "group": None, "count": 1}]


@pytest.mark.parametrize("name, chips, topology", [("tpu:v5e-256", 256, "v5e:16x16"),
                                                   ("tpu:v5p-128", 64, "v5p:4x4x4"),
                                                   ("tpu:v4-64", 32, "v4:2x4x4"),
                                                   ("tpu:v6e-64", 64, "v6e:8x8"), ("cpu:8", 8, ""),
                                                   ("gpu:h100-8", 8, "1x1x8")])
def test_targets_name_their_slices(name, chips, topology):
    target = parse_target(name)
    assert (target.chips, target.topology) == (chips, topology)


@pytest.mark.parametrize("name", ["tpu:v5e-12", "tpu:v3-8", "gpu:h100", "gpu:h100-16", "cpu:0"])
def test_a_bad_target_is_one_line(name):
    with pytest.raises(UserError, match="target"):
        parse_target(name)


def test_a_tpu_target_without_libtpu_names_the_install(monkeypatch):
    monkeypatch.setattr(hardware.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=re.escape(f"pip install 'jax[tpu]=={jax.__version__}'")):
        hardware.tpu_devices(parse_target("tpu:v5e-16"))


def test_a_gpu_target_without_the_cuda_plugin_names_the_install(monkeypatch):
    monkeypatch.setattr(hardware.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=re.escape(f"pip install 'jax[cuda12]=={jax.__version__}'")):
        hardware.gpu_devices(parse_target("gpu:h100-8"))


def test_cpu_target_end_to_end_matches_the_dry_run(tmp_path):
    out = tmp_path / "plan"
    main(["--config", "tiny", "--target", "cpu:8", "--layouts", "dp=2,tp=2,pp=2;dp=8",
          "--zero", "1", "--remat", "none", "--out", str(out)])
    plan = json.loads((out / "plan.json").read_text())
    statuses = {(json.dumps(c["layout"], sort_keys=True), c["status"]) for c in plan["layouts"]}
    assert {s for _, s in statuses} == {"compiled"}, statuses
    best = min((c for c in plan["layouts"] if c["fits"]), key=lambda c: -c["compiled"]["tokens_per_s"])
    assert (out / "plan.png").stat().st_size > 0
    text = (out / "plan.md").read_text()
    assert best["command"] in text and "## How the estimate is made" in text
    # The train command of the top layout, as a dry run in a fresh process, compiles the same
    # step: its memory is the plan's, to the byte.
    command = best["command"].split()
    assert command[:3] == ["python", "-m", "jaxpar.train"]
    dry = subprocess.run([sys.executable, "-m", "jaxpar.train", *command[3:], "--dry-run"],
                         capture_output=True, text=True, timeout=600)
    assert dry.returncode == 0, dry.stderr
    peak = re.search(r"peak per device: .* \(([\d,]+) bytes\)", dry.stdout)
    assert peak and int(peak.group(1).replace(",", "")) == best["compiled"]["peak_memory_bytes"]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu]')")
def test_tpu_target_compiles_for_a_v5e_slice(tmp_path):
    out = tmp_path / "plan"
    main(["--config", "tiny", "--train.batch_size=32", "--target", "tpu:v5e-16",
          "--layouts", "dp=16;dp=4,tp=4",
          "--zero", "0,3", "--micro-batch", "1", "--remat", "none", "--out", str(out)])
    plan = json.loads((out / "plan.json").read_text())
    assert plan["chip"]["kind"] == "TPU v5e"
    compiled = [c for c in plan["layouts"] if c["status"] == "compiled"]
    assert len(compiled) >= 2 and all(c["fits"] for c in compiled)
    assert all(c["compiled"]["collectives"] for c in compiled)
    assert len(hardware.target_devices(parse_target("tpu:v5e-1"))) == 1  # a slice below one host's 2x2


def test_full_remat_lowers_the_compiled_steps_temporaries():
    """The equivalence tests prove remat changes no number; this proves it changes the program."""
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.training.step.build import build
    temps = {}
    for remat in ("none", "full"):
        cfg = tiny_config(**{"model.n_layer": 4, "model.block_size": 128, "model.remat": remat})
        compiled = build(cfg, build_mesh(cfg, jax.devices()[:1]), vocab=65).compile_abstract()
        temps[remat] = compiled.memory_analysis().temp_size_in_bytes
    assert temps["full"] < 0.7 * temps["none"], temps


@pytest.mark.skipif(importlib.util.find_spec("jax_cuda12_plugin") is None,
                    reason="JAX's CUDA plugin is not installed (pip install -e '.[gpu]', several GB)")
def test_gpu_target_compiles_for_an_h100_node(tmp_path):
    out = tmp_path / "plan"
    main(["--config", "tiny", "--target", "gpu:h100-8", "--layouts", "dp=8;dp=2,tp=4",
          "--zero", "1", "--micro-batch", "1", "--remat", "none", "--out", str(out)])
    plan = json.loads((out / "plan.json").read_text())
    compiled = [c for c in plan["layouts"] if c["status"] == "compiled"]
    assert len(compiled) == 2 and all(c["fits"] and c["compiled"]["collectives"] for c in compiled)


def test_compile_order_puts_guessed_fits_first_and_lets_meshes_take_turns():
    from jaxpar.planning.plan import compile_order

    def candidate(dp, zero, memory, speed):
        c = Candidate({"dp": dp, "tp": 1, "pp": 1, "zero": zero, "micro_batch": 1, "remat": "none"}, None)
        c.guess = {"memory_bytes": memory, "tokens_per_s": speed}
        return c
    found = [candidate(8, 0, 5, 100), candidate(8, 1, 4, 90), candidate(4, 0, 6, 80),
             candidate(2, 0, 50, 200), candidate(4, 1, 60, 300), candidate(8, 2, 3, 70)]
    found.append(Candidate(found[0].layout, None, status="skipped"))
    order = [(c.layout["dp"], c.layout["zero"]) for c in compile_order(found, capacity=10)]
    assert order == [(8, 0), (4, 0), (8, 1), (8, 2), (2, 0), (4, 1)]


def test_explicit_layouts_infer_a_minus_one_axis_from_the_target():
    from jaxpar.planning.layouts import parse_layouts
    def sizes(dp, tp, pp, cp, ep=1):
        return {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}
    assert parse_layouts("dp=-1,tp=2;dp=3;pp=2,dp=-1", 8) == [sizes(4, 2, 1, 1), sizes(3, 1, 1, 1), sizes(4, 1, 2, 1)]
    assert parse_layouts("dp=2,cp=4", 8) == [sizes(2, 1, 1, 4)]
    assert sizes(2, 1, 1, 4) in parse_layouts("auto", 8, {"cp": [1, 4]})
    assert sizes(2, 1, 1, 4) not in parse_layouts("auto", 8)
    found = enumerate_candidates(tiny_config(), 8, layouts="dp=3", zeros=(0,), remats=("none",))
    assert {c.status for c in found} == {"skipped"}
    assert "uses 3 devices but 8 are available" in found[0].reason


def test_micro_batch_auto_takes_the_most_rows_whose_step_fits():
    """`auto` on an accelerator: the most rows a pass whose compiled step fits, found by binary
    search; XLA's memory for each split, against capacities on either side of it. On a CPU it
    is 6; under a pipeline, no limit; a number stays; a word other than auto is refused."""
    from jaxpar.core.errors import UserError
    from jaxpar.parallel.hlo import memory_summary
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.training.step import micro_batch
    from jaxpar.training.step.build import assemble, build
    cfg = tiny_config(**{"train.micro_batch": "auto"})  # 8 rows on one device: 8, 4, 2 or 1 a pass
    mesh = build_mesh(cfg, jax.devices()[:1])
    need = {rows: memory_summary(assemble(cfg, mesh, 65, None, "cpu", rows).compile_abstract())["peak_memory_bytes"]
            for rows in (8, 4, 2, 1)}
    assert need[8] > need[4] > need[2] > need[1], need
    options = micro_batch.rows_per_pass_options(cfg.train, 1)
    for capacity, rows in ((need[8], 8), (need[8] - 1, 4), (need[2], 2), (need[1] - 1, 1)):
        assert micro_batch.largest_fitting(options, lambda r, c=capacity: need[r] <= c)[0] == rows, (capacity, need)
    assert build(cfg, mesh, vocab=65).plan.rows_per_pass == micro_batch.CPU_MICRO_BATCH
    assert cfg.train.micro_batch == "auto"  # the plan holds the choice; the config keeps what was asked
    piped = tiny_config(**{"train.micro_batch": "auto", "mesh.pp": 2})
    assert build(piped, build_mesh(piped, jax.devices()[:2]), vocab=65).plan.rows_per_pass == 0
    assert build(tiny_config(), mesh, vocab=65).plan.rows_per_pass == 0  # tiny's own
    with pytest.raises(UserError, match="train.micro_batch expects int, got 'most'"):
        tiny_config(**{"train.micro_batch": "most"})


def plan_cpu8(out, layouts: str):
    main(["--config", "tiny", "--target", "cpu:8", "--layouts", layouts, "--zero", "0", "--remat", "none",
          "--out", str(out)])


def test_layouts_that_name_no_layout_are_refused(capsys, tmp_path):
    exits_with_one_line(capsys, "jaxpar.plan", lambda: plan_cpu8(tmp_path / "plan", ";;"),
                        "--layouts ';;' names no layout")
    assert not (tmp_path / "plan").exists()


def test_when_every_layout_is_skipped_it_says_none_compiled_and_why(capsys, tmp_path):
    plan_cpu8(tmp_path / "plan", "dp=3")  # 3 of 8 devices: skipped, as train would refuse it
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("none of the 2 layouts compiled: 2 skipped as the trainer would refuse them; "
                           "dp=3,tp=1,pp=1 z0 mb=1: "), last
    assert "uses 3 devices but 8 are available" in last and last.endswith("; see plan.md for each")


def test_a_second_plan_into_a_locked_out_is_refused(capsys, tmp_path):
    with RunLock(tmp_path):  # another plan is writing here
        exits_with_one_line(capsys, "jaxpar.plan", lambda: plan_cpu8(tmp_path, "dp=3"),
                            f"--out '{tmp_path}' is in use by another jaxpar command")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("config, remat, reruns", [
    ("tiny", "none", 0),
    ("tiny", "full", 2 * 2 * 12 * 32 * 32 + 4 * 2 * 32 * 32),  # the blocks' 2N and attention, 2 layers
    ("tiny", "full_offloaded", 2 * 2 * 12 * 32 * 32 + 4 * 2 * 32 * 32),
    ("tiny", "attention", 2 * 2 * 32 * 128),  # GELU MLP's in, C x 4C (its out's output is read by nothing)
    ("tiny", "dots_except_widest", 2 * 2 * 32 * 128),  # its widest: the MLP's in
    ("tiny_moe", "attention", 2 * 2 * (4 * 32 + 2 * 3 * 32 * 32)),  # router, and k=2 SwiGLU experts
    ("tiny_moe", "dots_except_widest", 2 * 2 * 2 * 2 * 32 * 32),  # the k experts' gate and up
])
def test_each_recompute_policy_adds_the_flops_it_reruns(config, remat, reruns):
    m = tiny_config(config, **{"model.remat": remat}).model
    assert flops.hardware_flops_per_token(m, 65) - flops.flops_per_token(m, 65) == reruns
    # A pipeline's backward reruns its stage from the saved input, the policy's reruns within it.
    piped = flops.hardware_flops_per_token(m, 65, make_schedule("1f1b", 2, 2).rerun_factors)
    assert piped - flops.flops_per_token(m, 65) == flops.recompute_flops_per_token(m) + reruns


def test_a_policy_keeps_its_registered_bytes_and_offloading_keeps_the_layer_input_off_the_device():
    from jaxpar.planning.placement import activation_bytes
    m = {r: tiny_config(**{"model.remat": r}).model for r in ("none", "full", "full_offloaded", "attention")}
    rows, s, h, layers, vocab = 4, 32, 32, 2, 65
    logits = activation_bytes(m["none"], vocab, rows, 1, layers=0)
    per_layer = activation_bytes(m["none"], vocab, rows, 1, layers=1) - logits  # none's, all it saves
    assert activation_bytes(m["full"], vocab, rows, 1) == logits + layers * 4 * s * rows * h + per_layer
    assert activation_bytes(m["full_offloaded"], vocab, rows, 1) == logits + per_layer
    kept = sum(kept_widths(m["attention"])[n] for n in ("layer_input", "qkv", "context", "attention_out"))
    assert activation_bytes(m["attention"], vocab, rows, 1) == logits + layers * s * rows * kept + per_layer


def test_remat_and_offload_auto_enumerate_every_registered_choice(tmp_path):
    from jaxpar.plan import parse_args
    from jaxpar.planning.plan import train_command
    cfg, _, args, overrides = parse_args(["--config", "tiny", "--target", "cpu:8", "--remat", "auto",
                                          "--offload", "auto", "--out", str(tmp_path / "plan")])
    assert args.remat == list(REMAT_KINDS) and args.offload == list(OFFLOADS)
    found = enumerate_candidates(cfg, 8, "dp=8", (1,), "1", args.remat, None, args.offload)
    assert {(c.layout["remat"], c.layout["offload"]) for c in found} == {(r, o) for r in REMAT_KINDS for o in OFFLOADS}
    assert {c.status for c in found} == {"pending"}
    c = next(c for c in found if c.layout["remat"] == "attention" and c.layout["offload"] == "optimizer")
    assert (c.cfg.model.remat, c.cfg.train.offload) == ("attention", "optimizer")
    assert train_command("tiny", overrides, c).endswith("--model.remat=attention --train.offload=optimizer")
    _, _, default, _ = parse_args(["--config", "tiny", "--target", "cpu:8", "--out", str(tmp_path / "plan")])
    assert (default.remat, default.offload) == (["none", "full"], ["none"])
    with pytest.raises(UserError, match="--remat takes values from none, full, attention"):
        parse_args(["--config", "tiny", "--target", "cpu:8", "--remat", "selective"])


def test_offload_where_the_devices_have_no_host_memory_is_one_line(capsys, monkeypatch, tmp_path):
    from jaxpar.planning import layouts as planner
    target, devices = parse_target("cpu:8"), jax.devices()[:8]
    assert planner.host_memory_choices(target, devices, ["full_offloaded"], ["optimizer"], set()) == (
        ["full_offloaded"], ["optimizer"])  # CPU devices have pinned_host
    monkeypatch.setattr(planner, "has_host_memory", lambda devices: False)
    # auto leaves the offloading choices out; asked for by name, they are refused.
    assert planner.host_memory_choices(target, devices, list(REMAT_KINDS), list(OFFLOADS), {"remat", "offload"}) == (
        [r for r in REMAT_KINDS if r != "full_offloaded"], ["none"])
    exits_with_one_line(capsys, "jaxpar.plan", lambda: main(
        ["--config", "tiny", "--target", "cpu:8", "--layouts", "dp=8", "--zero", "1", "--remat", "none",
         "--offload", "optimizer", "--out", str(tmp_path / "plan")]),
        "--target cpu:8: its devices have no pinned_host memory kind", "so optimizer cannot run there")
    assert not (tmp_path / "plan").exists()


def test_host_transfers_of_offloaded_state_add_to_the_step():
    """An offloaded optimizer state crosses the host link twice a step (in for the update, out
    again); full_offloaded's layer inputs go out in the forward and back in the backward."""
    host_chip = Chip(**{**CHIP.__dict__, "host_bytes_per_s": 1e9})
    n_params = 10_000
    base = {"dp": 2, "tp": 1, "pp": 1, "zero": 1, "micro_batch": 0, "remat": "none", "offload": "none"}
    for layout, moved in [(base, 0),
                          ({**base, "offload": "optimizer"}, 2 * 2 * 4 * n_params / 2),  # AdamW: 2 copies, / dp
                          ({**base, "remat": "full"}, 0),
                          ({**base, "remat": "full_offloaded"}, 2 * 4 * 32 * 2 * 4 * 32)]:  # rows, seq, layers, 4C
        cfg = layout_config(tiny_config(), layout)  # 8 rows: 4 a device
        state = estimate.optimizer_state_bytes(cfg.optimizer.name, n_params, layout)
        host = estimate.host_transfer_bytes(cfg.model, cfg.train.batch_size, layout, state)
        assert host == moved, layout
        t = estimate.step_time(cfg.model, cfg.train.batch_size, 65, layout, host_chip, comm_s=0.0, bubble=0.0,
                               host_bytes=host)
        assert t["host_s"] == moved / 1e9
        assert t["step_s"] == pytest.approx(t["flops_per_chip"] / CHIP.peak_flops + moved / 1e9)
    cfg = layout_config(tiny_config(), base)
    assert estimate.guess_memory(cfg.model, cfg.optimizer.name, 65, n_params, {**base, "offload": "optimizer"}, 4, 1) == pytest.approx(
        estimate.guess_memory(cfg.model, cfg.optimizer.name, 65, n_params, base, 4, 1) - estimate.optimizer_state_bytes(cfg.optimizer.name, n_params, base))
    with pytest.raises(UserError, match="no host link figure"):
        estimate.host_seconds(1.0, CHIP)

"""scripts/tools/gpu_check.py, the GPU comparison's one command, at tiny shapes on this CPU: every
section runs and writes its table, the measured steps beside the plan's roofline bound (the control:
a device without planning figures gets its reason); its trace reader, on a made-up GPU trace,
counts each kernel once (the control: the same kernels repeated on the trace's "XLA Ops" line and
on the host)."""

import gzip
import importlib.util
import json
import pathlib
import sys

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "tools" / "gpu_check.py"


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_check_runs_every_section_at_tiny_shapes(tmp_path, monkeypatch):
    module = gpu_check()
    found = module.main(["--tiny", "--sweep", "--out", str(tmp_path)])
    assert found["errors"] == {}
    runs = found["speed"] + found["preset"]
    assert [r["run"] for r in runs] == ["tiny, batch 2, one pass", "tiny, batch 4, one pass",
                                        "tiny, as shipped", "tiny, one pass of 8 rows"]
    assert all(r["tokens_per_s_median"] > 0 and r["step_time_ms_median"] > 0 for r in runs)
    # Beside each measured step, the plan's roofline bound on this device's planning chip, the
    # measured host's here (on a CPU the bound may be far off, so only its presence is checked).
    assert all(r["bound_chip"].startswith("host CPU") and r["bound_ms"] > 0 and r["measured_over_bound"] > 0
               and r["bound_compute_bound_ms"] >= 0 and r["bound_exposed_comm_ms"] == 0 for r in found["speed"])
    assert "bound_ms" not in found["preset"][0]
    assert [(r["experts"], r["gemm"]) for r in found["gemm"]] == [  # blocks: the CPU plan's
        (e, g) for e in (8, 64) for g in ("dense", "blocks", "ragged_dot", *sys.modules["gpu_gemm"].RAGGED_ROUTES)]
    assert all(r["forward_backward_ms"] > 0 for r in found["gemm"])
    # ragged_dot's other lowerings are GPU's: on a CPU they compile (their switches) to XLA's own.
    assert all(r["max_rel_diff_vs_ragged_dot"] < 1e-5 for r in found["gemm"] if r["gemm"] != "dense")
    assert found["kernels"]["steps"] == 2  # a CPU trace has no device streams: no kernels
    assert "ENTRY" in (tmp_path / "tiny_b2.hlo.txt").read_text()
    assert (tmp_path / "gpu_check.md").read_text().startswith("device: cpu")
    assert "| tiny, batch 4, one pass | host CPU / 1 |" in (tmp_path / "gpu_check.md").read_text()
    assert json.loads((tmp_path / "gpu_check.json").read_text())["gemm"][0]["rows"] == 256
    assert json.loads((tmp_path / "gpu_check.json").read_text())["speed"][1]["bound_ms"] == found["speed"][1]["bound_ms"]
    # The sweep: a candidate trained beside the default (bf16), its loss within the sweep's tolerance.
    rows = {r["candidate"]: r for r in found["sweep"]["rows"]}
    assert list(rows) == ["default", "bf16 logits"] and all("error" not in r for r in rows.values())
    assert rows["bf16 logits"]["loss_ok"] and rows["bf16 logits"]["speedup"] > 0
    assert "| 2 | bf16 logits |" in (tmp_path / "gpu_check.md").read_text()
    # The control: a device the planner has no figures for gets its reason, not a bound.
    from jaxpar.planning import bound
    monkeypatch.setattr(bound, "chip_of", lambda devices, dtype: None)
    row = {"run": "tiny, batch 2, one pass", **module.bound_of(module.TINY, 2, 1.0)}  # the compile is kept
    assert "bound_ms" not in row and module.bound_table([row]) == [("\ntiny, batch 2, one pass: no bound: "
                                                                    "no planning chip for a cpu")]


def test_the_bound_takes_the_planning_chip_of_the_device_kind():
    """H100 SXM from the planner's table, H200 SXM from its data sheet; other parts get none."""
    from jaxpar.planning.bound import chip_here
    chips = {kind: chip_here("gpu", kind, 1, "bfloat16") for kind in
             ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 PCIe", "NVIDIA H200 NVL", "NVIDIA A100-SXM4-80GB")}
    assert [c and (c.kind, c.hbm_bytes_per_s, c.peak_flops) for c in chips.values()] == [
        ("NVIDIA H100 SXM", 3.35e12, 989e12), ("NVIDIA H200 SXM", 4.8e12, 989e12), None, None, None]


def test_its_trace_reader_counts_each_gpu_kernel_once(tmp_path):
    meta = lambda kind, pid, name, tid=0: {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}
    kernel = lambda name, pid, tid, us: {"ph": "X", "name": name, "pid": pid, "tid": tid, "dur": us}
    events = [meta("process_name", 1, "/device:GPU:0"), meta("thread_name", 1, "Stream #13(Compute)", 7),
              meta("thread_name", 1, "XLA Ops", 8), meta("process_name", 2, "/host:CPU"),
              kernel("gemm_fusion_dot_1", 1, 7, 300), kernel("loop_convert_fusion", 1, 7, 100),
              kernel("gemm_fusion_dot_1", 1, 7, 200), kernel("gemm_fusion_dot_1", 1, 8, 500),
              kernel("loop_convert_fusion", 2, 0, 900)]
    trace = tmp_path / "plugins" / "profile" / "run" / "host.trace.json.gz"
    trace.parent.mkdir(parents=True)
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    module = gpu_check()
    assert module.trace_kernels(tmp_path) == {"gemm_fusion_dot_1": 500, "loop_convert_fusion": 100}
    assert [module.category(k) for k in ("gemm_fusion_dot_1", "loop_convert_fusion", "cudnn_fmha")] == [
        "gemm", "elementwise/fusion", "attention"]


def test_the_deepseek_gpu_check_measures_attention_at_latent_heads(tmp_path):
    """scripts/tools/gpu_deepseek.py's attention section at tiny shapes: xla and tokamax's reference
    within bf16's error of float32, and cuDNN's row holds its error line on a CPU."""
    spec = importlib.util.spec_from_file_location("gpu_deepseek", SCRIPT.parent / "gpu_deepseek.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = module.main(["--tiny", "--sections", "attention", "--out", str(tmp_path)])
    rows = {r["kernel"]: r for r in found["attention"]}
    assert rows["xla"]["auto"] and all(rows[k][f"error_{n}"] < 1e-2 for k in ("xla", "tokamax") for n in ("out", "dq", "dk", "dv"))
    assert "cuDNN" in rows["cudnn"]["error"] and "cudnn" in (tmp_path / "gpu_deepseek.md").read_text()


def test_the_sweep_keeps_the_faster_candidates_within_tolerance_and_its_budget():
    """gpu_sweep.sweep with a stand-in for training: cuBLASLt and cuDNN's LayerNorm measure faster
    and go together; bf16 logits measure faster too, but 3% off the default's loss (the control);
    a failing candidate keeps its error; past the budget nothing runs."""
    import time
    from types import SimpleNamespace
    sweep = gpu_check().gpu_sweep
    calls = []

    def run_once(config, steps, **keys):
        options = keys.get("train.xla_options", "")
        if "command_buffer" in options:
            raise RuntimeError("No such compile option")
        ms = 10 - ("cublaslt" in options) - 0.5 * ("cudnn_layer_norm" in options) - 2 * ("model.logits_dtype" in keys)
        calls.append((keys["train.batch_size"], options))
        return SimpleNamespace(info={"summary": {"step_time_ms_median": ms, "tokens_per_s_median": 1e3 / ms},
                                     "compiled": {"peak_memory_bytes": 2**30}},
                               losses={steps - 1: 3.0 * (1.03 if "model.logits_dtype" in keys else 1)})

    names = ["default", "cuDNN LayerNorm", "cuBLASLt epilogues", "no command buffers", "bf16 logits"]
    found = sweep.sweep(run_once, "gpt2", (16, 64), 20, names, time.monotonic() + 60)
    rows = {(r["batch"], r["candidate"]): r for r in found["rows"]}
    assert found["defaults"] == found["together"] == ["cuDNN LayerNorm", "cuBLASLt epilogues"]
    assert rows[16, "together"]["keys"] == {"train.xla_options": "xla_gpu_enable_cudnn_layer_norm=true,"
                                                                 "xla_gpu_enable_cublaslt=true"}
    assert rows[16, "together"]["speedup"] == 10 / 8.5 and rows[64, "together"]["loss_ok"]
    assert rows[16, "bf16 logits"]["speedup"] == 1.25 and not rows[16, "bf16 logits"]["loss_ok"]
    assert "No such compile option" in rows[64, "no command buffers"]["error"]
    assert [c[0] for c in calls[:5]] == [16] * 5 and calls[5] == (64, "")  # the deciding figures first
    assert "(over tolerance)" in "\n".join(sweep.sweep_table(found))
    late = sweep.sweep(run_once, "gpt2", (16,), 20, names, time.monotonic() - 1)
    assert {r.get("error") for r in late["rows"]} == {"not run: past the budget"} and late["defaults"] == []


def test_the_gpu_session_plans_each_measurement_and_keeps_its_budget(tmp_path):
    """scripts/tools/gpu_session.py, the one prepared GPU command: its steps (PyTorch's left out,
    with its reason, where the reference is missing), and its limits: a step that would eat the
    sweep's floor is not run; the last step runs on what is left and is told it (--budget)."""
    import sys
    spec = importlib.util.spec_from_file_location("gpu_session", SCRIPT.parent / "gpu_session.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    planned = module.main(["--dry-run", "--tiny", "--out", str(tmp_path), "--torch", str(tmp_path / "absent.py")])
    assert [p["step"] for p in planned] == ["gemm legs tuned", "gemm legs reused", "fused norm", "moonlight",
                                            "gpu check and sweep"]
    assert module.torch_reference(str(tmp_path / "absent.py"))[1].startswith("no PyTorch reference at")
    echo = [sys.executable, "-c", "import sys; print('args', sys.argv[1:])"]
    plan = [("first", echo, 30), ("last", echo, None)]
    rows = module.run_steps(plan, module.SWEEP_FLOOR + 40, tmp_path)
    assert [r["status"] for r in rows] == ["ok", "ok"] and "args ['--budget'," in (tmp_path / "session.log").read_text()
    rows = module.run_steps(plan, module.SWEEP_FLOOR + 3, tmp_path)
    assert [r["status"] for r in rows] == ["not run: past the budget", "ok"]
    assert "| first | not run: past the budget | 0.0 |" in (tmp_path / "session.md").read_text()


def test_the_fp8_gpu_measurements_rehearse_at_tiny_shapes(tmp_path, monkeypatch):
    """scripts/tools/gpu_fp8.py, issue 73's GPU command: each recipe's run and grouped GEMM at tiny
    shapes on this CPU (one config, three steps), its table written; FP8's losses within 1% of
    none's here (emulated FP8, the same model); past --budget nothing starts."""
    spec = importlib.util.spec_from_file_location("gpu_fp8", SCRIPT.parent / "gpu_fp8.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "TINY", module.SimpleNamespace(configs=(("tiny", {}),), steps=3, tail=2,
                                                               gemm=(64, 16, 8, 4)))
    text = module.main(["--tiny", "--out", str(tmp_path)])
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| tiny |")]
    assert [r[1] for r in rows] == list(module.RECIPES)
    assert all(abs(float(r[7].rstrip(" |%")) / 100) < 0.01 for r in rows)
    assert text.count("| blocks |") == 3 and (tmp_path / "gpu_fp8.md").read_text() == text
    assert "| tiny |" not in module.main(["--tiny", "--out", str(tmp_path / "none"), "--budget", "0"])

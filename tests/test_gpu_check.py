"""scripts/tools/gpu_check.py, the GPU comparison's one command, at tiny shapes on this CPU: every
section runs and writes its table, the measured steps beside the plan's roofline bound (the control:
a device without planning figures gets its reason); its trace reader, on a made-up GPU trace,
counts each kernel once (the control: the same kernels repeated on the trace's "XLA Ops" line and
on the host)."""

import gzip
import importlib.util
import json
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "tools" / "gpu_check.py"


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_check_runs_every_section_at_tiny_shapes(tmp_path, monkeypatch):
    module = gpu_check()
    found = module.main(["--tiny", "--out", str(tmp_path)])
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
    assert [(r["experts"], r["gemm"]) for r in found["gemm"]] == [
        (e, g) for e in (8, 64) for g in ("dense", "blocks", "ragged_dot")]  # blocks: the CPU plan's
    assert all(r["forward_backward_ms"] > 0 for r in found["gemm"])
    assert all(r["max_rel_diff_vs_ragged_dot"] < 1e-5 for r in found["gemm"] if r["gemm"] != "dense")
    assert found["kernels"]["steps"] == 2  # a CPU trace has no device streams: no kernels
    assert "ENTRY" in (tmp_path / "tiny_b2.hlo.txt").read_text()
    assert (tmp_path / "gpu_check.md").read_text().startswith("device: cpu")
    assert "| tiny, batch 4, one pass | host CPU / 1 |" in (tmp_path / "gpu_check.md").read_text()
    assert json.loads((tmp_path / "gpu_check.json").read_text())["gemm"][0]["rows"] == 256
    assert json.loads((tmp_path / "gpu_check.json").read_text())["speed"][1]["bound_ms"] == found["speed"][1]["bound_ms"]
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

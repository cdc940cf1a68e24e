"""jaxpar.bench: two tiny layouts in fresh processes, up-front validation, and failed layouts.

The layouts train the same model, so their final losses must agree within rtol 1e-5 (as in
test_equivalence.py). No assertion is about speed: only that the ratios are computed consistently.
"""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers import exits_with_one_line

from jaxpar.bench import main as bench_main
from jaxpar.core.out_lock import RunLock
from jaxpar.planning import bench

LOSS_RTOL = 1e-5
ROW_KEYS = {"layout", "devices", "tokens_per_s", "step_time_ms", "compile_s", "mfu", "hfu", "speedup",
            "efficiency", "peak_memory_bytes", "bytes_per_device", "collectives", "final_loss"}


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    bench_main(["--config", "tiny", "--layouts", "dp=1;dp=2", "--steps", "3",
                "--train.eval_every=0", "--out", str(out)])  # no eval: one compile fewer
    return out


def test_bench_rows(bench_out):
    rows = json.loads((bench_out / "bench.json").read_text())
    assert [r["layout"] for r in rows] == ["dp=1", "dp=2"]
    assert [r["devices"] for r in rows] == [1, 2]
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["error"] is None
        assert r["tokens_per_s"] > 0 and r["compile_s"] > 0 and r["peak_memory_bytes"] > 0
        assert r["hfu"] == r["mfu"]  # no activation remat exists
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / rows[0]["tokens_per_s"])
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["devices"])
    for run_dir in ("dp1", "dp2"):  # the steps and the override reached jaxpar.train
        train_cfg = json.loads((bench_out / run_dir / "run.json").read_text())["config"]["train"]
        assert (train_cfg["steps"], train_cfg["eval_every"]) == (3, 0)
    np.testing.assert_allclose(rows[1]["final_loss"], rows[0]["final_loss"], rtol=LOSS_RTOL)
    # One device communicates nothing; dp=2 all-reduces its gradients and (ZeRO-1, the default)
    # holds half the optimizer state.
    assert all(c["count"] == 0 for c in rows[0]["collectives"].values())
    assert rows[1]["collectives"]["all-reduce"]["count"] >= 1
    assert rows[1]["bytes_per_device"]["opt_state"] < rows[0]["bytes_per_device"]["opt_state"]
    markdown = (bench_out / "bench.md").read_text()
    assert "| layout | devices |" in markdown and "| dp=2 | 2 |" in markdown
    assert "Final losses agree" in markdown


def test_bench_and_train_write_pngs(bench_out):
    assert (bench_out / "bench.png").read_bytes().startswith(b"\x89PNG")
    for run_dir in ("dp1", "dp2"):
        assert (bench_out / run_dir / "loss.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("layouts, expected", [
    ("dp=3", "layout 'dp=3': dp=3 does not divide the batch of 8"),
    ("dp=1;xx=2", "layout 'xx=2': bad mesh entry 'xx=2'"),
    ("dp=2;dp=2,tp=1", "layout 'dp=2,tp=1' repeats dp=2"),
])
def test_bad_layout_exits_2_and_writes_nothing(capsys, tmp_path, layouts, expected):
    out = tmp_path / "bench"
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--config", "tiny", "--layouts", layouts, "--steps", "3", "--out", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"jaxpar.bench: error: {err.removeprefix('jaxpar.bench: error: ')}"
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not out.exists()


@pytest.mark.parametrize("override, expected", [
    ("--model.attention=flash", "model.attention must be one of auto, xla, splash, cudnn, tokamax, got 'flash'"),
    ("--optimizer.name=sgd", "optimizer.name must be one of adamw, lion, adafactor, muon, got 'sgd'"),
    ("--pipeline.schedule=dualpipe", "pipeline.schedule must be one of gpipe, 1f1b, interleaved, zb-h1, dualpipev"),
])
def test_a_name_no_registry_holds_exits_2_before_any_layout_runs(capsys, tmp_path, override, expected):
    """A kernel, optimizer or schedule name is refused as jaxpar.train refuses it, before a layout's
    process starts or an output is written (the control: the names each refusal lists)."""
    out = tmp_path / "bench"
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--config", "tiny", "--layouts", "dp=2", "--steps", "3", "--out", str(out), override])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not out.exists()


def test_plan_adds_the_baseline_and_scales_batch_when_weak(capsys):
    strong = bench.plan_layouts("dp=2;tp=2", "tiny", {})
    assert [(lay.spec, lay.devices, lay.cfg.train.batch_size) for lay in strong] == [
        ("dp=1", 1, 8), ("dp=2", 2, 8), ("tp=2", 2, 8)]
    assert "added dp=1" in capsys.readouterr().err
    weak = bench.plan_layouts("dp=4;dp=1;dp=2,tp=2", "tiny", {}, weak=True)
    assert [(lay.spec, lay.cfg.train.batch_size) for lay in weak] == [
        ("dp=1", 8), ("dp=4", 32), ("dp=2,tp=2", 32)]
    assert weak[1].overrides["train.batch_size"] == "32"


def test_failed_layout_is_reported_and_exits_1(bench_out, tmp_path, monkeypatch, capsys):
    rows = json.loads((bench_out / "bench.json").read_text())
    failed = {"layout": "dp=2", "devices": 2, "mesh": {}, "batch_size": 8, "error": "exit 1: boom"}

    def fake_train(layout, config, out_dir, stop):  # the real one is covered by bench_out
        return dict(rows[0]) if layout.devices == 1 else dict(failed)

    monkeypatch.setattr(bench, "train_layout", fake_train)
    out = tmp_path / "bench"
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--config", "tiny", "--layouts", "dp=1;dp=2", "--out", str(out)])
    assert exit_info.value.code == 1
    assert "1 of 2 layouts failed: dp=2" in capsys.readouterr().err
    written = json.loads((out / "bench.json").read_text())
    assert written[1]["error"] == "exit 1: boom" and written[1]["speedup"] is None
    failed_line = next(line for line in (out / "bench.md").read_text().splitlines()
                       if line.startswith("| dp=2"))
    header = (out / "bench.md").read_text().splitlines()[0]
    assert "failed: exit 1: boom" in failed_line and failed_line.count("|") == header.count("|")


def test_failure_line_skips_native_stack_frames():
    stderr = ("100%|###| 3/3\rF1122 rendezvous.cc:161] Termination timeout for all reduce\n"
              "*** Check failure stack trace: ***\n    @     0x7f7cc56a71f5  (unknown)\n")
    assert bench.failure(-6, stderr) == (
        "killed by SIGABRT: F1122 rendezvous.cc:161] Termination timeout for all reduce")
    assert bench.failure(2, "jaxpar.train: error: bad\n") == "exit 2: jaxpar.train: error: bad"


def fake_child(calls: list):
    """bench.run_train for jaxpar.train as bench starts it, without training: like train, it keeps
    (nothing to do) the run.json of a finished run it would resume, unless given --fresh."""
    def run(argv, stop):
        calls.append(argv)
        out = argv[argv.index("--out") + 1]
        run_json = Path(out) / "run.json"
        if "--fresh" not in argv and run_json.exists():
            return subprocess.CompletedProcess(argv, 0, "nothing to do", "")
        remat = next((a.split("=", 1)[1] for a in argv if a.startswith("--model.remat=")), "none")
        summary = {"tokens_per_s_median": 1e3, "step_time_ms_median": 5.0, "mfu_median": 0.1,
                   "final_loss": 4.0, "final_val_loss": None}
        run_json.parent.mkdir(parents=True, exist_ok=True)
        run_json.write_text(json.dumps({
            "config": {"model": {"remat": remat}}, "devices": {"platform": "cpu"}, "zero_stage": 0,
            "summary": summary, "compile_s": 1.0, "pipeline": {}, "bytes_per_device": {"params": 1, "opt_state": 2},
            "compiled": {"peak_memory_bytes": 3, "collectives": {}}}))
        return subprocess.CompletedProcess(argv, 0, "done", "")
    return run


def bench_dp1(out, *extra):
    bench_main(["--config", "tiny", "--layouts", "dp=1", "--steps", "1", "--out", str(out), *extra])


def test_a_bench_again_with_other_settings_measures_again(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(bench, "run_train", fake_child(calls))
    bench_dp1(tmp_path)
    bench_dp1(tmp_path, "--model.remat=full")
    assert len(calls) == 2
    assert json.loads((tmp_path / "dp1" / "run.json").read_text())["config"]["model"]["remat"] == "full"
    err = capsys.readouterr().err
    assert f"measuring again: the earlier run in {tmp_path / 'dp1'} was measured with other settings " \
           "(model.remat none -> full)" in err, err


def test_a_bench_again_with_the_same_settings_says_it_reuses_the_row(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(bench, "run_train", fake_child(calls))
    bench_dp1(tmp_path)
    first = json.loads((tmp_path / "bench.json").read_text())
    capsys.readouterr()
    bench_dp1(tmp_path)
    assert len(calls) == 1 and json.loads((tmp_path / "bench.json").read_text()) == first
    err = capsys.readouterr().err
    assert f"reused {tmp_path / 'dp1'}: measured earlier with these same settings" in err, err


def test_a_second_bench_into_a_locked_out_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "run_train", fake_child([]))
    with RunLock(tmp_path):  # another bench is writing here
        exits_with_one_line(capsys, "jaxpar.bench", lambda: bench_dp1(tmp_path),
                            f"--out '{tmp_path}' is in use by another jaxpar command")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_baseline_leaves_the_other_rows_without_ratios(tmp_path, monkeypatch, capsys):
    """The baseline (dp=1) fails: its row holds its error, the rows that ran have no speedup or
    efficiency ('-', and a note says why), bench.md is written all the same, and the bench exits 1
    (before: a TypeError in the table, and no bench.md). The control: dp=2's own figures are shown."""
    ran = {"layout": "dp=2", "devices": 2, "mesh": {"dp": 2}, "batch_size": 8, "run_dir": "", "error": None,
           "platform": "cpu", "zero_stage": 1, "tokens_per_s": 1234.0, "step_time_ms": 5.0, "compile_s": 1.0,
           "mfu": 0.1, "hfu": 0.1, "peak_memory_bytes": 3, "bytes_per_device": {"params": 1, "opt_state": 2},
           "collectives": {}, "final_loss": 4.0, "final_val_loss": None}
    failed = {"layout": "dp=1", "devices": 1, "mesh": {}, "batch_size": 8, "error": "exit 1: boom"}
    monkeypatch.setattr(bench, "train_layout", lambda layout, *rest: dict(failed if layout.devices == 1 else ran))
    out = tmp_path / "bench"
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--config", "tiny", "--layouts", "dp=1;dp=2", "--out", str(out)])
    assert exit_info.value.code == 1
    assert "1 of 2 layouts failed: dp=1" in capsys.readouterr().err
    written = json.loads((out / "bench.json").read_text())
    assert written[1]["speedup"] is None and written[1]["efficiency"] is None
    markdown = (out / "bench.md").read_text()
    header, _, base_line, dp2_line = markdown.splitlines()[:4]
    assert "failed: exit 1: boom" in base_line and base_line.count("|") == header.count("|")
    cells = [cell.strip() for cell in dp2_line.strip("|").split("|")]
    assert dp2_line.count("|") == header.count("|") and cells[3] == "1,234"  # the control
    assert cells[8:10] == ["-", "-"]  # speedup, efficiency
    assert "the 1-device run (dp=1) failed, so no layout has a speedup or efficiency (-)" in markdown

"""--profile START:END: spec checks, when the trace starts and stops, and a real trace of a tiny run."""

import jax
import pytest
from conftest import tiny_config

from jaxpar.core.errors import UserError
from jaxpar.train import main, run
from jaxpar.training.run import profiling


@pytest.mark.parametrize("spec, expected", [
    ("x:y", "expects START:END with integer steps"),
    ("5", "expects START:END"),
    ("5:3", "traces no steps"),
    ("3:3", "traces no steps"),
    ("-1:2", "traces no steps"),
    ("2:11", "END must be at most train.steps=10"),
])
def test_bad_spec(spec, expected):
    with pytest.raises(UserError, match=expected):
        profiling.parse_spec(spec, total_steps=10)


def test_good_spec_and_no_out_dir():
    assert profiling.parse_spec("2:5", total_steps=10) == (2, 5)
    assert profiling.parse_spec("0:10", total_steps=10) == (0, 10)
    with pytest.raises(UserError, match="needs an output directory"):
        profiling.StepProfiler("1:2", None, total_steps=10)


def test_trace_brackets_the_steps_after_blocking(tmp_path, monkeypatch):
    events = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda d: events.append(("start",)))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: events.append(("stop",)))
    monkeypatch.setattr(jax, "block_until_ready", lambda x: events.append(("block", x)))
    profiler = profiling.StepProfiler("2:4", tmp_path, total_steps=6)
    for step in range(6):
        profiler.before_step(step)
        events.append(("step", step))
        profiler.after_step(step, f"out{step}")
    # Step 1 has finished before the trace starts, and step 3 before it stops.
    assert events == [("step", 0), ("step", 1), ("block", "out1"), ("start",), ("step", 2),
                      ("step", 3), ("block", "out3"), ("stop",), ("step", 4), ("step", 5)]


def test_cli_bad_spec_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", "tiny", "--mesh", "dp=8", "--profile", "5:3", "--out", str(out)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "jaxpar.train: error: --profile 5:3 traces no steps; use 0 <= START < END, e.g. 5:8")
    assert not out.exists()


def test_real_trace_of_a_tiny_run(tmp_path):
    cfg = tiny_config(**{"train.steps": 3, "train.eval_every": 0})
    run(cfg, tmp_path, devices=jax.devices()[:1], progress=False, profile="1:3")
    traces = list((tmp_path / "tensorboard").glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0

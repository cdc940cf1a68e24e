"""The divergence guard: a non-finite loss or gradient norm stops the run with one line, every
checkpoint left holds finite params, training resumes from the last one exactly, and
metrics.jsonl is strict JSON. Exact equality: a resume on the same mesh is bit-identical.
"""

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import tiny_config

from jaxpar.core.errors import UserError
from jaxpar.inference.sample import load
from jaxpar.train import run
from jaxpar.training.checkpoints import checkpoint
from jaxpar.training.checkpoints.checkpoint import Checkpoints
from jaxpar.training.run import metrics

DIVERGING = ["--train.lr=50", "--train.grad_clip=0", "--train.warmup_steps=0", "--ckpt.every=2",
             "--train.eval_every=0", "--train.log_every=3"]
ERROR = re.compile(r"jaxpar\.train: error: (loss|grad norm) is (nan|inf|-inf) at step (\d+) "
                   r"\([^)]*\); the last good checkpoint is (\S+); lower train\.lr or enable "
                   r"train\.grad_clip")


def strict_records(path: Path) -> list[dict]:
    def reject(constant):
        raise ValueError(f"{constant} is not JSON")
    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def test_a_diverging_run_stops_at_once_and_keeps_only_finite_checkpoints(tmp_path):
    out = tmp_path / "run"
    overrides = dict(arg[2:].split("=") for arg in DIVERGING)
    cfg = tiny_config(**{"train.steps": 60, **overrides})
    with pytest.raises(UserError) as error:  # the CLI prints it as one line, with exit code 2
        run(cfg, out, jax.devices()[:1], progress=False)
    found = ERROR.fullmatch(f"jaxpar.train: error: {error.value}")
    assert found, str(error.value)
    bad_step, last_good = int(found.group(3)), Path(found.group(4))
    assert bad_step < 59  # it stopped at once, not at the end of the run

    records = strict_records(out / "metrics.jsonl")
    assert records[-1]["step"] == bad_step  # logged although log_every=3 would skip most steps
    assert records[-1]["loss"] is None or records[-1]["grad_norm"] is None
    assert all(r["step"] % 3 == 0 for r in records[:-1])
    assert json.loads((out / "run.json").read_text())["diverged"]["step"] == bad_step

    saved = Checkpoints(out / "checkpoints").steps()
    assert saved and max(saved) <= bad_step and last_good == out / "checkpoints" / str(max(saved))
    model = load(out)  # the newest checkpoint
    assert model.step == max(saved)
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(model.params))



def test_a_run_resumes_from_the_last_verified_checkpoint_as_if_nothing_happened(tmp_path,
                                                                                monkeypatch):
    """A NaN loss reported at step 7 (the params stay good): the save of step 8 never happens.
    Checkpoint 6's params were written with a wrong checksum, as a bad write would leave them, so
    the last good checkpoint named is 4, the one that reads back intact; the run resumed from it
    keeps 6 aside and gives the losses of a run that never saw a NaN.

    The NaN goes in where the loop hands each step's metrics to the logger, so the step itself
    needs no second compile."""
    cfg = tiny_config(**{"train.steps": 12, "train.eval_every": 0, "ckpt.every": 2})
    straight = run(cfg, None, jax.devices()[:1], progress=False)
    real_add, real_checksums, sums = metrics.StepLogger.add, checkpoint.item_checksums, []

    def add_poisoned(logger, step, m):
        real_add(logger, step, {**m, "loss": np.float32("nan")} if step == 7 else m)

    def checksums_miswritten(items):  # one call a save: the 3rd is step 6's; its params' are wrong
        sums.append(real_checksums(items))
        if len(sums) == 3:
            sums[-1]["params"] = {path: "0" * 16 for path in sums[-1]["params"]}
        return sums[-1]

    monkeypatch.setattr(metrics.StepLogger, "add", add_poisoned)
    monkeypatch.setattr(checkpoint, "item_checksums", checksums_miswritten)
    with pytest.raises(UserError, match=r"^loss is nan at step 7 \(grad norm [0-9.]+\); the last "
                       r"good checkpoint is .*checkpoints/4; lower train.lr$"):
        run(cfg, tmp_path, jax.devices()[:1], progress=False)
    assert Checkpoints(tmp_path / "checkpoints").steps() == [2, 4, 6]
    monkeypatch.undo()
    resumed = run(cfg, tmp_path, jax.devices()[:1], progress=False)
    assert resumed.info["resumed_from"] == 4
    assert (tmp_path / "checkpoints" / "6.damaged").is_dir()
    assert {s: straight.losses[s] for s in range(4, 12)} == resumed.losses
    logged = strict_records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in logged] == list(range(12))
    assert [r["loss"] for r in logged] == [straight.losses[s] for s in range(12)]


def fake_metrics(losses: list[float]) -> list[dict]:
    return [{"loss": np.float32(v), "grad_norm": np.float32(1.0)} for v in losses]


def test_the_guard_checks_every_step_but_records_only_the_logged_ones():
    recorded = []
    logger = metrics.StepLogger(recorded.append, lambda s: s % 4 == 0, lambda s: 1e-3, 100, 10,
                                1e9, {})
    logger.restart_clock(-1)
    for step, m in enumerate(fake_metrics([3.0, 2.9, 2.8, 2.7, 2.6, float("nan"), 2.5])):
        logger.add(step, m)
    with pytest.raises(metrics.Diverged) as diverged:
        logger.flush()
    assert [r["step"] for r in recorded] == [0, 4, 5]
    assert diverged.value.record["step"] == 5
    assert diverged.value.explain("ckpt/4", grad_clip=1.0) == (
        "loss is nan at step 5 (grad norm 1.0); the last good checkpoint is ckpt/4; lower train.lr")
    assert diverged.value.explain(None, grad_clip=0).endswith(
        "no checkpoint was written before it; lower train.lr or enable train.grad_clip")


def test_metrics_lines_are_strict_json():
    line = metrics.strict_json({"step": 3, "loss": float("nan"), "grad_norm": float("inf"),
                                "lr": 1e-3})
    assert json.loads(line) == {"step": 3, "loss": None, "grad_norm": None, "lr": 1e-3}

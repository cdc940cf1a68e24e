"""TensorBoard and W&B scalars: read back with TensorBoard's own reader, a resume that repeats
steps leaves each step once, and W&B (a stand-in module, no network) gets the same scalars."""

import importlib.machinery
import math
import shutil
import sys
import types

import jax
import pytest
from conftest import tiny_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxpar.train import main, run

STEPS, EVERY = 12, 6


def scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(logdir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_scalars_match_the_run_and_a_resume_never_duplicates_a_step(tmp_path):
    cfg = tiny_config(**{"train.steps": STEPS, "train.eval_every": EVERY, "ckpt.every": EVERY})
    first = run(cfg, tmp_path, jax.devices()[:1], progress=False)
    # As if the process died after logging step 11 but before saving checkpoint 12.
    shutil.rmtree(tmp_path / "checkpoints" / str(STEPS))
    second = run(cfg, tmp_path, jax.devices()[:1], progress=False)
    assert second.info["resumed_from"] == EVERY

    found = scalars(tmp_path / "tensorboard")
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mfu",
            "val/loss"} <= set(found)
    train = found["train/loss"]
    assert [step for step, _ in train] == list(range(STEPS))
    losses = {**first.losses, **second.losses}
    assert all(math.isclose(value, losses[step], rel_tol=1e-6) for step, value in train)  # float32
    assert [step for step, _ in found["val/loss"]] == [0, EVERY, STEPS]
    assert math.isclose(found["val/loss"][-1][1], second.val_losses[STEPS], rel_tol=1e-6)


def test_tensorboard_can_be_turned_off(tmp_path):
    cfg = tiny_config(**{"train.steps": 2, "train.eval_every": 0, "log.tensorboard": "false"})
    run(cfg, tmp_path, jax.devices()[:1], progress=False)
    assert not (tmp_path / "tensorboard").exists() and (tmp_path / "metrics.jsonl").is_file()


class FakeWandb(types.ModuleType):
    """The few calls jaxpar makes of wandb, recorded."""

    def __init__(self):
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.inits, self.logged, self.finished = [], [], 0
        self.util = types.SimpleNamespace(generate_id=lambda: "run123")

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, values: dict, step: int):
        self.logged.append((step, values))

    def finish(self):
        self.finished += 1


def test_wandb_gets_the_same_scalars_and_a_resume_reuses_its_run(tmp_path, monkeypatch):
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    cfg = tiny_config(**{"train.steps": 4, "train.eval_every": 4, "log.wandb": "my-project"})
    run(cfg, tmp_path, jax.devices()[:1], progress=False, stop_at=2)
    run(cfg, tmp_path, jax.devices()[:1], progress=False)
    assert [i["id"] for i in wandb.inits] == ["run123", "run123"] and wandb.finished == 2
    assert wandb.inits[0]["project"] == "my-project" and wandb.inits[0]["resume"] == "allow"
    assert [step for step, values in wandb.logged if "train/loss" in values] == [0, 1, 2, 3]
    assert [step for step, values in wandb.logged if "val/loss" in values] == [0, 4]


def test_wandb_missing_is_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", "tiny", "--steps", "2", "--out", str(out), "--log.wandb=p"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "jaxpar.train: error: --log.wandb=p needs W&B: pip install wandb (or pip install "
        "'jaxpar[wandb]'), or drop --log.wandb")
    assert not out.exists()

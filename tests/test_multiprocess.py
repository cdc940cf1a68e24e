"""Multi-process training on jax.distributed, on CPU: 2 processes x 2 devices via launch_local.sh.

Tolerance: per-step losses and val losses within rtol 1e-5 of one device's run. Every process
listens on 127.0.0.1 only, and every launch is bounded by a timeout.
"""

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import fresh_process_env, mesh_overrides, tiny_config
from helpers import LAUNCH_TIMEOUT_S, LOSS_RTOL, STEPS, launch, logged_losses, logged_values, train

from jaxpar.train import run


def one_process(spec: str, out: Path | None = None, stop_at: int | None = None):
    cfg = tiny_config(**mesh_overrides(spec), **{"train.steps": STEPS, "ckpt.every": 3})
    return run(cfg, out, jax.devices()[:math.prod(cfg.mesh.__dict__.values())], progress=False,
               stop_at=stop_at)


def assert_close(losses: dict, reference: dict, steps):
    np.testing.assert_allclose([losses[s] for s in steps], [reference[s] for s in steps],
                               rtol=LOSS_RTOL)


@pytest.fixture(scope="module")
def reference():
    """One device's run, with evaluation every 5 steps as the tiny config has it."""
    return train(evaluate=True)


@pytest.fixture(scope="module")
def resumed_in_two(tmp_path_factory):
    """Steps 0-3 in one process on dp=2,tp=2 (a checkpoint at 4), then 4-9 in two processes, which
    save checkpoints at 6, 9 and 10."""
    out = tmp_path_factory.mktemp("two") / "run"
    one_process("dp=2,tp=2", out=out, stop_at=4)
    launch(out, "--mesh", "dp=2,tp=2", "--steps", str(STEPS), "--ckpt.every=3")
    return out


def test_a_one_process_checkpoint_resumes_in_two_and_they_match_one(resumed_in_two, reference):
    assert_close(logged_losses(resumed_in_two), reference.losses, range(STEPS))
    assert_close(logged_values(resumed_in_two, "val_loss"), reference.val_losses, [5, 10])
    info = json.loads((resumed_in_two / "run.json").read_text())
    assert info["resumed_from"] == 4
    assert info["devices"] == {**info["devices"], "count": 4, "processes": 2}


def test_two_processes_with_a_pipeline_match_one(reference, tmp_path):
    out = tmp_path / "run"
    launch(out, "--mesh", "dp=2,pp=2", "--steps", str(STEPS))
    assert_close(logged_losses(out), reference.losses, range(STEPS))
    assert_close(logged_values(out, "val_loss"), reference.val_losses, [0, 5, 10])


# Each optimizer's layouts in one process: tests/test_optimizers.py; two processes: the default
# AdamW above. Each launch is ~25 s: marked slow.
@pytest.mark.slow
@pytest.mark.parametrize("name, lr", [("muon", 0.02), ("lion", 3e-4), ("adafactor", 3e-3)])
def test_each_optimizer_in_two_processes_matches_one_device(tmp_path, name, lr):
    """dp=2,tp=2 with ZeRO 3 over 2 processes: Muon's Newton-Schulz work split over all 4 devices
    and gathered across the processes."""
    chosen = {"optimizer.name": name, "optimizer.lr": lr}
    reference = train(evaluate=True, **chosen)
    out = tmp_path / "run"
    launch(out, "--mesh", "dp=2,tp=2", "--steps", str(STEPS), "--train.zero=3",
           *(f"--{key}={value}" for key, value in chosen.items()))
    assert_close(logged_losses(out), reference.losses, range(STEPS))
    assert_close(logged_values(out, "val_loss"), reference.val_losses, [0, 5, 10])


def test_tensor_groups_stay_inside_a_process(tmp_path):
    """2 processes x 4 devices, dp=2,tp=4: each tp=4 group is one process's devices, dp crosses."""
    out = tmp_path / "run"
    launch(out, "--mesh", "dp=2,tp=4", "--steps", "2", "--train.eval_every=0", devices_per_process=4)
    info = json.loads((out / "run.json").read_text())
    assert info["devices"]["processes"] == 2 and info["mesh_axes_crossing_processes"] == ["dp"]


def test_a_two_process_checkpoint_resumes_in_one_process(resumed_in_two, reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(resumed_in_two, out)
    for step in (9, STEPS):  # keep step 6, saved by two processes
        shutil.rmtree(out / "checkpoints" / str(step))
    resumed = one_process("dp=2,tp=2", out=out)
    assert resumed.info["resumed_from"] == 6
    assert_close(resumed.losses, reference.losses, range(6, STEPS))


def test_a_dead_process_stops_the_launch_within_a_minute(tmp_path):
    out = tmp_path / "run"
    launcher = launch(out, "--mesh", "dp=2,tp=2", "--steps", "1000000", "--train.eval_every=0",
                      background=True)
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size):
            assert launcher.poll() is None and time.monotonic() < deadline, "training never started"
            time.sleep(0.5)
        rank_1 = subprocess.run(["pgrep", "-f", f"process_id=1 .*{out}"], capture_output=True,
                                text=True).stdout.split()
        assert len(rank_1) == 1, rank_1
        os.kill(int(rank_1[0]), signal.SIGKILL)
        killed = time.monotonic()
        status = launcher.wait(timeout=60)
        assert status != 0 and time.monotonic() - killed < 60
        assert "exited with status" in launcher.stdout.read()
        leftover = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout
        assert not leftover, f"processes left behind: {leftover}"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


def test_a_peer_that_never_starts_is_one_line_and_exit_2(tmp_path):
    """Process 0 of 2 alone: after dist.init_timeout it says which processes to start, instead of
    XLA's native abort (exit 134) a minute later."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "run"
    alone = subprocess.run([sys.executable, "-m", "jaxpar.train", "--config", "tiny", "--mesh", "dp=2", "--out",
                            str(out), "--dist.num_processes=2", "--dist.process_id=0", "--dist.init_timeout=2",
                            f"--dist.coordinator=127.0.0.1:{port}"],
                           capture_output=True, text=True, timeout=120, env=fresh_process_env())
    assert alone.returncode == 2, alone.stderr[-2000:]
    last = alone.stderr.strip().splitlines()[-1]
    assert last == (f"jaxpar.train: error: not every process joined within 2 s (process 0 waits at "
                    f"127.0.0.1:{port} for dist.num_processes=2); start the others with the same "
                    "--dist.coordinator and their own --dist.process_id, or raise --dist.init_timeout")
    assert not out.exists()

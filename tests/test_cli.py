"""The command line in a fresh process: host devices are forced for the mesh, outputs are complete."""

import json
import re
import subprocess
import sys

from conftest import fresh_process_env


def test_train_forces_host_devices_and_writes_outputs(tmp_path):
    """Also: where libtpu is installed (the tpu extra) and no TPU is, the command starts the CPU
    alone and its stderr holds none of libtpu's start-up errors. (JAX_PLATFORMS=cpu, which the
    rest of the suite runs under, is what it sets; tests/test_plan.py compiles for a TPU slice
    under it.)"""
    env = {k: v for k, v in fresh_process_env().items() if k != "JAX_PLATFORMS"}
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "jaxpar.train", "--config", "tiny",
                           "--mesh", "dp=2,tp=2", "--steps", "4", "--train.eval_every=2",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert not re.search("tpu|E0000|InitGoogle", proc.stderr, re.IGNORECASE), proc.stderr
    info = json.loads((out / "run.json").read_text())
    assert info["mesh"] == {"dp": 2, "tp": 2, "pp": 1, "cp": 1, "ep": 1}
    assert info["devices"]["count"] == 4
    assert info["config"]["train"]["steps"] == 4
    assert {"jax", "flax", "optax"} <= set(info["versions"])
    # TP splits the weights in two; the default ZeRO-1 also splits the moments over dp=2.
    per_device, total = info["bytes_per_device"], info["bytes_total"]
    assert info["zero_stage"] == 1
    assert total["params"] / 2 <= per_device["params"] < total["params"]
    assert total["opt_state"] / 4 <= per_device["opt_state"] < total["opt_state"] / 4 * 1.1
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_lines = [r for r in lines if "loss" in r]
    assert [r["step"] for r in train_lines] == [0, 1, 2, 3]
    for r in train_lines:
        assert {"lr", "grad_norm", "step_time_ms", "tokens_per_s", "mfu"} <= set(r)
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
    assert [r["step"] for r in lines if "val_loss" in r] == [0, 2, 4]

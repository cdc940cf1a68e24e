"""Every registry (jaxpar.core.registry) is asked as the config loads: each command that takes
config keys refuses a name that no registry entry holds in one line, exit 2, before any output is
written, as it refuses a bad number."""

import pytest
from helpers import exits_with_one_line

from jaxpar.bench import main as bench_main
from jaxpar.core.registry import REGISTRIES
from jaxpar.plan import main as plan_main
from jaxpar.train import main as train_main

# A config whose family declares the key (a mixture's kernels are Llama's and DeepSeek's keys)
CONFIG = {"model.moe_gemm": "tiny_llama", "model.moe_dispatch": "tiny_llama"}
COMMANDS = {
    "jaxpar.train": lambda out, args: train_main(["--out", str(out), *args]),
    "jaxpar.bench": lambda out, args: bench_main(["--layouts", "dp=2", "--steps", "3", "--out", str(out), *args]),
    "jaxpar.plan": lambda out, args: plan_main(["--target", "cpu:8", "--out", str(out), *args]),
}


def test_every_registry_files_itself_by_its_key():
    """The config's checks see every registry the issue names: none is left to a command."""
    assert {"model.family", "model.remat", "model.context_strategy", "model.fp8", "model.attention",
            "model.moe_gemm", "model.moe_dispatch", "pipeline.schedule", "optimizer.name",
            "optimizer.schedule"} <= set(REGISTRIES)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("key", sorted(REGISTRIES))
def test_an_unknown_name_is_refused_in_one_line_before_any_output(capsys, tmp_path, command, key):
    registry = REGISTRIES[key]
    args = ["--config", CONFIG.get(key, "tiny"), f"--{key}=nonesuch"]
    out = tmp_path / "out"
    expected = f"{key} must be one of {', '.join(registry.names)}, got 'nonesuch'"
    exits_with_one_line(capsys, command, lambda: COMMANDS[command](out, args), expected)
    assert not out.exists(), "a refused command must write nothing"

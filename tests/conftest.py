"""Force 8 host CPU devices before JAX initialises, so every mesh layout can run on one machine."""

import atexit
import math
import os
import shutil
import tempfile

# The suite runs on host CPU devices. Where libtpu is installed (the tpu extra) but no TPU is, its
# start-up errors would reach every subprocess's stderr; jaxpar.plan's TPU targets compile through
# libtpu's topologies, which this does not turn off.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# LLVM's optimizations off: XLA's HLO passes (SPMD partitioning, fusion, collectives, buffer
# assignment) run as always and give the same optimized HLO and temporaries, but the machine code
# of the suite's tiny programs takes half as long to compile. Subprocesses inherit it.
OPT_FLAG = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {OPT_FLAG}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# XLA compiles take most of the suite's time, and many tests compile the same steps (the one-device
# reference above all). A compilation cache that lives for this session only compiles each once;
# it starts empty, so no result can come from an earlier session's code. The session's first
# process (pytest-xdist's controller) makes it, and its worker processes, the CLI and the
# multi-process tests' subprocesses inherit it through the environment: a program one worker
# compiled, the other finds.
SESSION_CACHE = "JAXPAR_TEST_COMPILE_CACHE"
COMPILE_CACHE = os.environ.get(SESSION_CACHE, "")
if not COMPILE_CACHE:
    COMPILE_CACHE = os.environ[SESSION_CACHE] = tempfile.mkdtemp(prefix="jaxpar-test-xla-cache-")
    atexit.register(shutil.rmtree, COMPILE_CACHE, ignore_errors=True)
for name, value in [("jax_compilation_cache_dir", COMPILE_CACHE),
                    ("jax_persistent_cache_min_compile_time_secs", 0),
                    ("jax_persistent_cache_min_entry_size_bytes", -1)]:
    jax.config.update(name, value)
    os.environ[name.upper()] = str(value)

from jaxpar.core.config import load_config  # noqa: E402
from jaxpar.parallel.mesh import parse_mesh_spec  # noqa: E402


def tiny_config(config: str = "tiny", **overrides):
    """configs/tiny.toml (or another named config) with `section.field` overrides (values as
    strings or numbers)."""
    return load_config(config, {k: str(v) for k, v in overrides.items()})


def mesh_overrides(spec: str) -> dict:
    return parse_mesh_spec(spec)


def fresh_process_env() -> dict:
    """The environment for a command in a fresh process that forces its own host devices: this
    one's, less any forced device count, with the suite's compilation cache and XLA flags."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env["XLA_FLAGS"] = " ".join(flag for flag in env.get("XLA_FLAGS", "").split()
                                if not flag.startswith("--xla_force_host_platform_device_count"))
    return env


@pytest.fixture(scope="session", autouse=True)
def eight_host_devices():
    """Each test process (pytest-xdist starts one per worker) has its own 8 forced host devices."""
    assert jax.device_count() == 8 and jax.devices()[0].platform == "cpu", jax.devices()


# The runs that tests read back (export, sample, decoding), by name: (config, mesh, overrides). A
# module names its run with TRAINED; each is trained once per test process, where first asked for.
TRAINED_RUNS = {
    "tiny": ("tiny", "dp=1", {"train.steps": 3, "model.gelu": "tanh"}),  # test_hf's, test_export_faults'
    "tiny_30_steps": ("tiny", "dp=2", {"train.steps": 30}),  # far enough from uniform to sample text from
    "tiny_llama": ("tiny_llama", "dp=1", {"train.steps": 2}),
    "tiny_moe": ("tiny_moe", "dp=1", {"train.steps": 2}),
    "tiny_moe_expert_parallel": ("tiny_moe", "dp=2,ep=2", {}),  # the config's 10 steps
}


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory):
    """name -> the run directory, alone in its parent, with TRAINED_RUNS[name]'s checkpoint."""
    from jaxpar.train import run
    done = {}

    def trained_run(name: str):
        if name not in done:
            config, spec, overrides = TRAINED_RUNS[name]
            cfg = tiny_config(config, **mesh_overrides(spec), **{"train.eval_every": 0, **overrides})
            done[name] = tmp_path_factory.mktemp("runs") / "run"
            run(cfg, done[name], jax.devices()[:math.prod(cfg.mesh.__dict__.values())], progress=False)
        return done[name]
    return trained_run


@pytest.fixture(scope="module")
def trained(request, trained_runs):
    """The run directory of the module's TRAINED run (a name in TRAINED_RUNS)."""
    return trained_runs(request.module.TRAINED)

"""XLA's compile options for the train and eval steps: part of the execution plan, so a user never
sets XLA_FLAGS for speed.

An option is an XLA DebugOptions field (`xla_gpu_enable_cublaslt`, ...) given per compile, as
`jax.jit(..., compiler_options=...)` takes it, so it reaches the step's program alone, whatever
else the process compiles, and needs no restart. The plan's options are the platform's defaults
(`PLATFORM_DEFAULTS`) with `train.xla_options` over them; run.json and `--dry-run` print them.

A platform's default enters `PLATFORM_DEFAULTS` only when `scripts/tools/gpu_check.py --sweep`
measured it faster on that platform, with the loss after 20 steps within SWEEP_LOSS_RTOL of the
step without it (docs/benchmarks.md, "XLA options and fused kernels"). None has been measured
yet, so every platform's defaults are empty, and the step compiles as plain `jax.jit` does.
"""

import json
import os
import signal
import subprocess
import sys

from jaxpar.core.errors import UserError
from jaxpar.core.platform import GPUS

# {platform: {option: value}}: measured faster on that platform (the module's docstring); "gpu"
# holds an NVIDIA GPU's under either of the names JAX gives its platform (GPUS).
PLATFORM_DEFAULTS: dict[str, dict] = {"gpu": {}, "tpu": {}, "cpu": {}}
# The sweep's tolerance on the loss after 20 steps, relative to the default's: bfloat16 keeps 8
# significant bits (2^-7 = 0.8%), so an option that only reorders bf16 arithmetic stays within it.
SWEEP_LOSS_RTOL = 1e-2


def value_of(text: str):
    """'true'/'false' as a bool, an integer as an int, a number as a float, anything else as text."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse(text: str) -> dict:
    """'NAME=VALUE,NAME=VALUE' (train.xla_options) -> {NAME: value}; a UserError on another form."""
    options = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = item.partition("=")
        if not eq or not name.strip().startswith("xla_"):
            raise UserError(f"train.xla_options takes NAME=VALUE pairs of XLA options (xla_...), comma-separated, "
                            f"got '{item}'; e.g. train.xla_options=xla_gpu_enable_cublaslt=true")
        options[name.strip()] = value_of(value)
    return options


def resolved(text: str, platform: str) -> tuple:
    """The plan's options on `platform`: its defaults, train.xla_options over them, as sorted
    (name, value) pairs (hashable, printed in order)."""
    defaults = PLATFORM_DEFAULTS.get("gpu" if platform in GPUS else platform, {})
    return tuple(sorted({**defaults, **parse(text)}.items()))


def check(options: tuple, device=None) -> None:
    """Compile a one-line function with `options` for `device` (the mesh's: a compile-only TPU's
    compiler knows its own options; None: the default one), so that an option XLA does not know,
    or a value it cannot take, is one UserError before the run writes anything. The compile runs
    in a child process first: a value that XLA does not refuse but aborts on (a native crash) ends
    the child, not this process."""
    if not options:
        return
    import jax
    checked_apart(options, device if device is not None else jax.devices()[0])
    try:
        placed = {} if device is None else {"in_shardings": jax.sharding.SingleDeviceSharding(device)}
        scalar = jax.ShapeDtypeStruct((), "float32")
        jax.jit(lambda x: x + 1, compiler_options=dict(options), **placed).lower(scalar).compile()
    except Exception as error:  # noqa: BLE001 (XLA's own error type, by version)
        raise refused(str(error).splitlines()[0]) from None


def refused(reason: str, fix: str = "name an XLA DebugOptions field and a value of its type (true/false, "
                                         "a number or text)") -> UserError:
    return UserError(f"train.xla_options: {reason.removeprefix('INVALID_ARGUMENT: ')}; {fix}")


# The child of checked_apart: the same one-line compile on a device of the same platform (a
# compile-only one where the parent's is: any topology's compiler knows the platform's options).
# Exit REFUSED: XLA refused the options (its first line on stdout); killed by one of CRASHES: XLA
# crashed; else (compiled, no such device here, stopped) the parent's own compile decides.
CHILD = """
import json, sys
options, platform, compile_only = json.loads(sys.argv[1])
import jax
try:
    jax.config.update("jax_platforms", "cpu" if compile_only else platform)
    if compile_only:
        from jax.experimental import topologies
        device = topologies.get_topology_desc(platform=platform).devices[0]
    else:
        device = jax.devices()[0]
except Exception:
    sys.exit(0)
try:
    jax.jit(lambda x: x + 1, compiler_options=options, in_shardings=jax.sharding.SingleDeviceSharding(device)
            ).lower(jax.ShapeDtypeStruct((), "float32")).compile()
except Exception as error:
    print((str(error).strip() or type(error).__name__).splitlines()[0])
    sys.exit(%d)
"""
REFUSED = 3
# The signals a native fault ends a process with (an abort, a bad memory access ...): not the
# user's Ctrl-C or SIGTERM, which reach the child too.
CRASHES = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGTRAP)


def checked_apart(options: tuple, device) -> None:
    """The one-line compile in a fresh process (a second or two; only when there are options):
    a UserError where XLA refuses the options there or crashes on them. A child that fails
    otherwise (no such device here, say) leaves the decision to this process's own compile."""
    # A TPU's chips are this process's alone: the child compiles for a compile-only TPU, which
    # claims none, as it does for a compile-only device of any platform.
    compile_only = device.client.runtime_type == "compile_only_runtime" or device.platform == "tpu"
    # The child compiles only: a GPU's memory stays this process's (no preallocation).
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD % REFUSED,
                           json.dumps([dict(options), device.platform, compile_only])],
                          capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, check=False)
    if done.returncode == REFUSED:
        raise refused((done.stdout.strip() or "XLA refused them").splitlines()[-1])
    if -done.returncode in CRASHES:
        how = f"XLA crashed ({signal.Signals(-done.returncode).name})"
        said = [" ".join(line.split()) for line in done.stderr.splitlines()
                if line.strip() and not line.strip().startswith(("@", "***"))]  # native stack frames
        raise refused(f"{how} compiling a one-line function with them" + (f" ({said[-1][:200]})" if said else ""),
                      "drop the option that crashed it, or give it a value in its range")

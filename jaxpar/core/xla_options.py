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
    or a value it cannot take, is one UserError before the run writes anything."""
    if not options:
        return
    import jax
    try:
        placed = {} if device is None else {"in_shardings": jax.sharding.SingleDeviceSharding(device)}
        scalar = jax.ShapeDtypeStruct((), "float32")
        jax.jit(lambda x: x + 1, compiler_options=dict(options), **placed).lower(scalar).compile()
    except Exception as error:  # noqa: BLE001 (XLA's own error type, by version)
        reason = str(error).splitlines()[0].removeprefix("INVALID_ARGUMENT: ")
        raise UserError(f"train.xla_options: {reason}; name an XLA DebugOptions field and a value of "
                        f"its type (true/false, a number or text)") from None

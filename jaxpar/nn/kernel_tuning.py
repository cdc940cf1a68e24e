"""Kernels tuned for the GPU at hand, once: a cache of tuned kernel configurations, and the
grouped GEMM's legs chosen by measurement.

The cache is one JSON file, `kernel_tuning.json` in train.kernel_cache's folder (empty: the user's
cache folder, $XDG_CACHE_HOME/jaxpar or ~/.cache/jaxpar). Each entry is keyed by the device kind,
the kernel, the leg (forward, dlhs, drhs), the shapes and the dtypes, and holds the chosen config
and what finding it cost. A lookup that misses calls a tuner, stores what it found (a temporary
file renamed over the cache: a reader never sees half of it) and says in one line what it tuned
and what that cost, or that it reused N entries and tuned nothing. A file that does not parse, or
that another jaxpar version or cache format wrote, is ignored with one line and rewritten.

Tuning runs at plan time (jaxpar.training.execution.plan_execution), before anything is traced:
on a GPU whose grouped GEMM is tokamax's, where tokamax ships no configs for that device kind
(`tokamax_tuner`, tokamax's own autotuner on the step's shapes), and, where train.choose_gemm_legs
asks, to measure each leg's candidate kernels (`choose_legs`). On a CPU nothing is tuned and
nothing is written.
"""

import contextlib
import functools
import json
import os
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.core import kernel_registry as registry
from jaxpar.core.platform import GPUS
from jaxpar.nn import grouped_gemm


def installed_version() -> str:
    """jaxpar's installed version (the package's metadata: nn may not import jaxpar's top)."""
    try:
        return metadata.version("jaxpar")
    except metadata.PackageNotFoundError:
        return "unknown"


VERSION = installed_version()

FORMAT = 1  # the cache file's layout; a file of another is rewritten
CACHE_FILE = "kernel_tuning.json"
SHIPPED = ("nvidia_h100_80gb_hbm3", "nvidia_b200")  # tokamax 0.0.12's data/autotuning (its GPU entries)
LEG_RTOL = 1e-5  # a candidate leg against jax.lax.ragged_dot's, float32
CHECK_GROUPS = (5, 0, 17, 3, 0)  # uneven and empty groups, and rows past them, for the correctness check


def cache_folder(folder: str = "") -> Path:
    """`folder`, or the user's cache folder's jaxpar/."""
    if folder:
        return Path(folder)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxpar"


def device_kind(device) -> str:
    """A device's kind as tokamax names its data folders: 'NVIDIA H100 80GB HBM3' -> nvidia_h100_80gb_hbm3."""
    return "_".join(device.device_kind.lower().replace("-", " ").split())


@dataclass(frozen=True)
class Request:
    """One thing to tune: a kernel's leg at the step's shapes and dtypes."""
    kernel: str
    leg: str
    shapes: tuple  # e.g. ((rows, K), (G, K, N))
    dtypes: tuple  # e.g. ("bfloat16", "bfloat16")

    def key(self, device: str) -> str:
        shapes = ",".join("x".join(map(str, s)) for s in self.shapes)
        return f"{device}|{self.kernel}|{self.leg}|{shapes}|{','.join(self.dtypes)}"


class TuningCache:
    """The cache file's entries, read once; `note`: the one line saying why a file was ignored."""

    def __init__(self, folder: str = ""):
        self.path = cache_folder(folder) / CACHE_FILE
        self.entries, self.note = read(self.path)

    def save(self) -> None:
        """Written whole to a temporary file beside it, then renamed over it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = {"jaxpar": VERSION, "format": FORMAT, "entries": self.entries}
        fd, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=CACHE_FILE + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(body, f, indent=1, sort_keys=True)
            os.replace(temporary, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise


def read(path: Path) -> tuple[dict, str | None]:
    """(the entries of the cache file at `path`, None), or ({}, the one line why it is ignored)."""
    if not path.exists():
        return {}, None
    try:
        body = json.loads(path.read_text())
        entries = body["entries"]
        if not isinstance(entries, dict):
            raise TypeError("entries is not a table")
    except (OSError, ValueError, KeyError, TypeError) as error:
        return {}, f"kernel tuning: ignored {path}, which does not parse ({type(error).__name__}); it is rewritten"
    if body.get("jaxpar") != VERSION or body.get("format") != FORMAT:
        return {}, (f"kernel tuning: ignored {path}, written by jaxpar {body.get('jaxpar')} (format "
                    f"{body.get('format')}), not {VERSION} ({FORMAT}); it is rewritten")
    return entries, None


def tune(cache: TuningCache, device: str, requests, tuner) -> tuple[dict, str]:
    """Each request's config from the cache, or from tuner(request) -> (config, seconds it cost),
    stored as soon as it is found (a run stopped while tuning keeps what it tuned); returns
    ({request: config}, the one line of what was tuned and what it cost)."""
    configs, tuned, cost = {}, [], 0.0
    for request in requests:
        key = request.key(device)
        if key not in cache.entries:
            config, seconds = tuner(request)
            cache.entries[key] = {"config": config, "cost_s": round(seconds, 6)}
            cache.save()
            tuned.append(f"{request.kernel} {request.leg} {'/'.join('x'.join(map(str, s)) for s in request.shapes)}")
            cost += seconds
        configs[request] = cache.entries[key]["config"]
    if tuned:
        line = (f"kernel tuning on {device}: tuned {len(tuned)} ({'; '.join(tuned)}) in {cost:.2f} s, reused "
                f"{len(configs) - len(tuned)}; kept in {cache.path}")
    else:
        line = f"kernel tuning on {device}: reused {len(configs)} entries from {cache.path}, tuned nothing"
    return configs, line if cache.note is None else f"{cache.note}; {line}"


def gemm_requests(cfg, kernel: str, rows: int, ep: int, legs=grouped_gemm.LEGS) -> list[Request]:
    """The step's two grouped GEMMs, each leg: (rows, C) x (E_l, C, 2F) and (rows, F) x (E_l, F, C),
    where `rows` are the GEMM's rows a device a pass (dropless: tokens x experts_per_token, times
    ep where a dispatch gathers every device's)."""
    m, dtype = cfg.model, cfg.model.dtype
    E_l, C, F = m.n_experts // ep, m.n_embd, m.expert_width
    return [Request(kernel, leg, ((rows, k), (E_l, k, n)), (dtype, dtype))
            for k, n in ((C, 2 * F), (F, C)) for leg in legs]


def leg_inputs(request: Request, group_sizes=None, key=0):
    """(x, w, group_sizes, dy) of a request's shapes: random, the groups even unless given."""
    (M, K), (G, _, N) = request.shapes
    rng, dtype = np.random.default_rng(key), jnp.dtype(request.dtypes[0])
    x, w, dy = (rng.standard_normal(shape, np.float32) for shape in ((M, K), (G, K, N), (M, N)))
    if group_sizes is None:
        group_sizes = np.diff(np.linspace(0, M, G + 1).astype(int))
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(group_sizes, jnp.int32), jnp.asarray(dy)


@functools.cache
def leg_fn(kernel: str, leg: str, interpret: bool = True, tuning: str = ""):
    """The jitted leg of a kernel: (x, w, group_sizes, dy) -> that leg's result (tokamax's with
    its `tuning`, jaxpar.nn.grouped_gemm.gemm_leg)."""
    return jax.jit(lambda x, w, gs, dy: grouped_gemm.gemm_leg(x, w, gs, dy, kernel, leg, interpret, tuning))


def correct(kernel: str, leg: str, interpret: bool = True, fn=None) -> bool:
    """Whether a kernel's leg equals jax.lax.ragged_dot's at LEG_RTOL in float32, with uneven and
    empty groups and rows past them (`fn`: a candidate of its own, for the tests' control)."""
    M = sum(CHECK_GROUPS) + 7
    x, w, gs, dy = leg_inputs(Request(kernel, leg, ((M, 24), (len(CHECK_GROUPS), 24, 40)), ("float32",) * 2),
                              CHECK_GROUPS)
    with jax.default_matmul_precision("highest"):  # float32 as float32 on GPUs too, not TF32
        got = (fn or leg_fn(kernel, leg, interpret))(x, w, gs, dy)
        want = leg_fn(registry.RAGGED_DOT, leg)(x, w, gs, dy)
    return bool(np.allclose(got, want, rtol=LEG_RTOL, atol=LEG_RTOL * float(jnp.max(jnp.abs(want)))))


def device_timer(fn, args, repeats: int = 5) -> float:
    """The median seconds of a jitted call on the device, after one call to compile."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def candidates(platform: str) -> tuple[str, ...]:
    """The grouped GEMM's kernels that can run each leg on `platform`: ragged_dot and the blocks
    everywhere, tokamax's Triton kernels on GPUs where installed, Megablox on TPU (and interpreted
    on CPU, for the tests; interpreted on a GPU it would only lose)."""
    from jaxpar.nn import tokamax_kernels
    names = [registry.RAGGED_DOT, registry.BLOCKS]
    names += [registry.MEGABLOX] * (platform in ("tpu", "cpu"))
    tokamax = registry.KERNELS[registry.MOE_GEMM][registry.TOKAMAX]
    names += [registry.TOKAMAX] * (platform in tokamax.platforms and tokamax_kernels.installed(tokamax))
    return tuple(names)


def leg_tuner(kernels, timer=device_timer, interpret: bool = True, fns=None, tuning: str = ""):
    """A tuner (for `tune`) of a grouped GEMM leg: each kernel checked against ragged_dot, then
    timed on the request's shapes; its config names the fastest, each one's seconds, and those
    dropped. `fns`: {kernel: leg function} of the tests' own (a wrong one, the control);
    `tuning`: tokamax's configs tuned for this GPU, which its legs are timed with."""
    def tuner(request: Request):
        start, args = time.perf_counter(), leg_inputs(request)
        seconds, dropped = {}, []
        for kernel in kernels:
            fn = (fns or {}).get(kernel) or leg_fn(kernel, request.leg, interpret, tuning)
            if correct(kernel, request.leg, interpret, fn):
                seconds[kernel] = timer(fn, args)
            else:
                dropped.append(kernel)
        if not seconds:
            raise RuntimeError(f"no grouped GEMM kernel's {request.leg} equals ragged_dot's here")
        fastest = min(seconds, key=seconds.get)
        return {"kernel": fastest, "seconds": seconds, "dropped": dropped}, time.perf_counter() - start
    return tuner


def choose_legs(cache: TuningCache, device: str, requests, tuner) -> tuple[tuple, list[str]]:
    """Each leg's kernel (forward, dlhs, drhs): the least seconds summed over the step's GEMMs
    (`requests`: each GEMM's three legs) among the kernels every GEMM kept; and the lines to say:
    each dropped kernel's, then the cache's one line."""
    configs, line = tune(cache, device, requests, tuner)
    legs, lines = [], []
    for leg in grouped_gemm.LEGS:
        chosen = [c for r, c in configs.items() if r.leg == leg]
        kept = set.intersection(*(set(c["seconds"]) for c in chosen))
        legs.append(min(sorted(kept), key=lambda k: sum(c["seconds"][k] for c in chosen)))
        dropped = sorted({k for c in chosen for k in c["dropped"]})
        lines += [f"kernel tuning: {k}'s {leg} differs from ragged_dot's at rtol {LEG_RTOL}; dropped" for k in dropped]
    return tuple(legs), [*lines, line]


def tokamax_tuner(request: Request):
    """tokamax's autotuner on one leg of its Triton grouped GEMM at the request's shapes, on this
    host's GPU: (its AutotuningResult as JSON, the seconds it took). Plan time only: it compiles
    and runs every config it tries."""
    import tokamax

    from jaxpar.nn import tokamax_kernels
    tokamax_kernels.prepared()
    start = time.perf_counter()
    x, w, group_sizes, dy = leg_inputs(request)
    result = tokamax.autotune(leg_fn(registry.TOKAMAX, request.leg, interpret=False), x, w, group_sizes, dy,
                              progress_bar=False)
    return result.dumps(), time.perf_counter() - start


def plan_tuning(cfg, platform: str, device, gemm: str, rows: int, ep: int, interpret: bool,
                timer=device_timer, tuner=tokamax_tuner) -> dict:
    """The plan's tuned fields, at plan time, on the host's own GPU only (a compile-only
    device is not measured; on a CPU nothing is tuned or written): `gemm_legs` where
    train.choose_gemm_legs asks, `gemm_tuning` (tokamax's configs, JSON) where the grouped GEMM is
    tokamax's and tokamax ships none for this device kind (a JSON list of tokamax's results), and
    the `tuning_note`: a line for each dropped kernel, then the cache's one line."""
    if platform not in GPUS or device is None or jax.default_backend() not in GPUS:
        return {}
    kind, cache, fields, lines = device_kind(device), TuningCache(cfg.train.kernel_cache), {}, []
    kernels = candidates(platform) if cfg.train.choose_gemm_legs else (gemm,)
    tuning = ""
    if registry.TOKAMAX in kernels and kind not in SHIPPED:  # tuned first: its legs are timed tuned
        configs, line = tune(cache, kind, gemm_requests(cfg, registry.TOKAMAX, rows, ep), tuner)
        tuning, lines = json.dumps(list(configs.values())), [line]
    if cfg.train.choose_gemm_legs:
        requests = gemm_requests(cfg, "grouped_gemm", rows, ep)
        legs, chosen = choose_legs(cache, kind, requests, leg_tuner(kernels, timer, interpret, tuning=tuning))
        fields["gemm_legs"], lines = legs, [*lines, *chosen]
    if tuning and registry.TOKAMAX in (fields.get("gemm_legs") or (gemm,)):
        fields["gemm_tuning"] = tuning
    return {**fields, "tuning_note": "\n".join(lines)} if lines else fields

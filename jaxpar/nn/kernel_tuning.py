"""Kernels tuned for the GPU at hand, once, kept in the cache of jaxpar.nn.tuning_cache: tokamax's
grouped-GEMM configs, and the grouped GEMM's legs chosen by measurement. A cached leg choice is used
only where it times registered candidates that passed the check against ragged_dot.

Tuning runs at plan time (jaxpar.training.step.execution.plan_execution), before anything is traced:
on a GPU whose grouped GEMM is tokamax's, where tokamax ships no configs for that device kind
(`tokamax_tuner`, tokamax's own autotuner on the step's shapes), and, where train.choose_gemm_legs
asks, to measure each leg's candidate kernels (`choose_legs`). On a CPU nothing is tuned and
nothing is written.
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.core.platform import GPUS
from jaxpar.nn import grouped_gemm
from jaxpar.nn.grouped_gemm import GEMM_KERNELS
from jaxpar.nn.kernel_entry import BLOCKS, MEGABLOX, RAGGED_DOT, TOKAMAX
from jaxpar.nn.tuning_cache import Request, TuningCache, device_kind, seconds_number, tune

SHIPPED = ("nvidia_h100_80gb_hbm3", "nvidia_b200")  # tokamax 0.0.12's data/autotuning (its GPU entries)
LEG_RTOL = 1e-5  # a candidate leg against jax.lax.ragged_dot's, float32
CHECK_GROUPS = (5, 0, 17, 3, 0)  # uneven and empty groups, and rows past them, for the correctness check


def gemm_requests(m, kernel: str, rows: int, ep: int, legs=grouped_gemm.LEGS) -> list[Request]:
    """The step's two grouped GEMMs, each leg: (rows, C) x (E_l, C, 2F) and (rows, F) x (E_l, F, C),
    where `rows` are the GEMM's rows a device a pass (dropless: tokens x experts_per_token, times
    ep where a dispatch gathers every device's)."""
    dtype = m.dtype
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
def leg_fn(kernel: str, leg: str, interpret: bool = True, tuning: tuple[str, ...] = ()):
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
        want = leg_fn(RAGGED_DOT, leg)(x, w, gs, dy)
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
    names = [RAGGED_DOT, BLOCKS]
    names += [MEGABLOX] * (platform in ("tpu", "cpu"))
    tokamax = GEMM_KERNELS[TOKAMAX]
    names += [TOKAMAX] * (platform in tokamax.platforms and tokamax_kernels.installed(tokamax))
    return tuple(names)


def leg_tuner(kernels, timer=device_timer, interpret: bool = True, fns=None, tuning: tuple[str, ...] = ()):
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


def leg_problem(config, kernels=None) -> str | None:
    """Why a cached leg choice (leg_tuner's config) cannot be used, or None. The kernels it timed
    are those that passed the check against ragged_dot: each must be a registered grouped GEMM,
    one of `kernels` (the candidates here; None: any), not one it dropped, and its time a number."""
    timed = config.get("seconds") if isinstance(config, dict) else None
    if not timed or not isinstance(timed, dict) or not isinstance(config.get("dropped"), list):
        return "not a leg's timings (seconds, dropped)"
    known = set(GEMM_KERNELS).intersection(kernels or GEMM_KERNELS)
    for kernel, seconds in timed.items():
        if kernel not in known:
            return f"it times {kernel}, which is not a grouped GEMM kernel here"
        if kernel in config["dropped"]:
            return f"it times {kernel}, which failed the check against ragged_dot"
        if not seconds_number(seconds):
            return f"its time of {kernel} is not a number of seconds"
    return None if config.get("kernel") in timed else f"its choice {config.get('kernel')!r} is not a kernel it timed"



def choose_legs(cache: TuningCache, device: str, requests, tuner, kernels=None) -> tuple[tuple, list[str]]:
    """Each leg's kernel (forward, dlhs, drhs): the least seconds summed over the step's GEMMs
    (`requests`: each GEMM's three legs) among the kernels every GEMM kept; and the lines to say:
    each dropped kernel's, then the cache's one line. A cached choice is used only where
    leg_problem finds nothing wrong with it (`kernels`: the candidates here)."""
    configs, line = tune(cache, device, requests, tuner, lambda config: leg_problem(config, kernels))
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
    result = tokamax.autotune(leg_fn(TOKAMAX, request.leg, interpret=False), x, w, group_sizes, dy,
                              progress_bar=False)
    return result.dumps(), time.perf_counter() - start


def plan_tuning(m, kernel_cache: str, choose: bool, platform: str, device, gemm: str, rows: int, ep: int,
                interpret: bool, timer=device_timer, tuner=tokamax_tuner) -> dict:
    """The plan's tuned fields, at plan time, on the host's own GPU only (a compile-only
    device is not measured; on a CPU nothing is tuned or written): `gemm_legs` where `choose`
    (train.choose_gemm_legs) asks, `gemm_tuning` (tokamax's configs, each its JSON) where the
    grouped GEMM is tokamax's and tokamax ships none for this device kind, and the `tuning_note`:
    a line for each dropped kernel, then the cache's one line. `m`: the [model] section;
    `kernel_cache`: train.kernel_cache, the cache's folder."""
    if platform not in GPUS or device is None or jax.default_backend() not in GPUS:
        return {}
    kind, cache, fields, lines = device_kind(device), TuningCache(kernel_cache), {}, []
    kernels = candidates(platform) if choose else (gemm,)
    tuned_first = TOKAMAX in kernels and kind not in SHIPPED  # its legs are timed tuned
    tokamax_requests = gemm_requests(m, TOKAMAX, rows, ep) if tuned_first else ()
    leg_requests = gemm_requests(m, "grouped_gemm", rows, ep) if choose else ()
    tuning = ()
    if tuned_first:
        configs, line = tune(cache, kind, tokamax_requests, tuner,
                             lambda config: None if isinstance(config, str) else "not tokamax's tuned configs (text)")
        tuning, lines = tuple(configs.values()), [line]
    if choose:
        legs, chosen = choose_legs(cache, kind, leg_requests, leg_tuner(kernels, timer, interpret, tuning=tuning),
                                   kernels)
        fields["gemm_legs"], lines = legs, [*lines, *chosen]
    if tuning and TOKAMAX in (fields.get("gemm_legs") or (gemm,)):
        fields["gemm_tuning"] = tuning
    return {**fields, "tuning_note": "\n".join(lines)} if lines else fields

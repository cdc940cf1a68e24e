"""jaxpar's side of the GPU comparison with PyTorch, in one command (about 5 minutes on one GPU).

    python scripts/tools/gpu_check.py --out DIR                          # on an NVIDIA GPU
    JAX_PLATFORMS=cpu python scripts/tools/gpu_check.py --tiny --out DIR  # tiny shapes: the suite's smoke test

It prints its tables, and writes them to DIR/gpu_check.md and DIR/gpu_check.json:
1. GPT-2 124M (the `gpt2` preset: block 1024, bfloat16) at batch 16 and 64 in one pass a step:
   the median step, tokens/s, MFU and the device's peak memory so far; and beside each step the
   plan's roofline bound (jaxpar.planning.roofline over the same step compiled, with this device's
   planning chip: H100 or H200 SXM on a GPU, the measured host on a CPU), measured / bound, and
   the bound's compute-bound and exposed-communication parts.
2. The small GPU recipe (`shakespeare_char`) as shipped, and in one pass of its 64 rows.
3. The experts' grouped GEMM that the execution plan runs here, the blocked GEMM, XLA's
   `ragged_dot` and its other lowerings (jax's Pallas-Triton, XLA's cuDNN grouped GEMM), and on
   Hopper jax's Mosaic-GPU kernels (gpu_gemm.py), against one dense dot of the same rows, at 8
   and 64 experts, forward and forward + backward; each one's largest difference from
   `ragged_dot`'s output, or its error.
4. GPT-2's kernel time a step at batch 16, by category, from a `--profile` trace.
5. `--sweep`: GPT-2 under each candidate XLA option and fused kernel against the default
   (gpu_sweep.py), in what `--budget` (seconds from the start) leaves; past it nothing starts.
The compiled GPT-2 step's optimized HLO (batch 16) is saved beside them: DIR/gpt2_b16.hlo.txt.
`--sections speed,preset,gemm,kernels,hlo` picks some (`--batches 16` GPT-2's batches); the
files are rewritten as each section ends, and a section that fails gives its error's line.
PyTorch's side is `../shared/gpu/torch_gpt2_cuda.py`; jaxpar never imports torch.
"""

import argparse
import collections
import functools
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_sweep.py, imported as a script or by path
import gpu_sweep
from gpu_gemm import gemm_rows, timed  # noqa: F401 (gpu_deepseek imports timed from here)
from gpu_trace import category, trace_kernels

FULL = SimpleNamespace(config="gpt2", batches=(16, 64), steps={16: 30, 64: 20}, preset="shakespeare_char",
                       preset_steps=120, preset_rows=64, gemm=(32768, 768, 3072), experts=(8, 64), profile=(10, 13),
                       sweep_steps=20, sweep_batches=(16, 64),
                       candidates=tuple(gpu_sweep.CANDIDATES), sweep_keys={})
TINY = SimpleNamespace(config="tiny", batches=(2, 4), steps={2: 4, 4: 4}, preset="tiny", preset_steps=4,
                       preset_rows=8, gemm=(256, 32, 64), experts=(8, 64), profile=(2, 4),
                       sweep_steps=3, sweep_batches=(2,), candidates=gpu_sweep.TINY_CANDIDATES,
                       sweep_keys={"model.dtype": "bfloat16"})


def peak_memory_gib() -> float | None:
    """The first device's peak memory in use so far (None where the platform keeps no count)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None


def run_once(config: str, steps: int, out_dir=None, profile=None, **overrides):
    """One run on one device, nothing evaluated: its RunResult (losses, info)."""
    from jaxpar.core.config import load_config
    from jaxpar.train import run
    keys = {"mesh.dp": "1", "train.steps": str(steps), "train.eval_every": "0", "ckpt.every": "0",
            **{k: str(v) for k, v in overrides.items()}}
    return run(load_config(config, keys), out_dir=out_dir, devices=jax.devices()[:1], progress=False, profile=profile)


def train(config: str, steps: int, out_dir=None, profile=None, **overrides) -> dict:
    """One run's summary (median step, tokens/s, MFU)."""
    return run_once(config, steps, out_dir, profile, **overrides).info["summary"]


@functools.cache
def compiled_step(config: str, batch: int, steps: int):
    """(config, the train step compiled from shapes) as run_once trains it at `batch` rows in one
    pass: the same config, mesh and batch sharding, so the same program."""
    from jaxpar.core.config import load_config
    from jaxpar.data.loader import load_dataset
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.training.step.build import build
    keys = {"mesh.dp": "1", "train.steps": str(steps), "train.eval_every": "0", "ckpt.every": "0",
            "train.batch_size": str(batch), "train.micro_batch": str(batch)}
    cfg = load_config(config, keys)
    tokenizer = load_dataset(cfg.data, cfg.model.block_size).tokenizer
    return cfg, build(cfg, build_mesh(cfg, jax.devices()[:1]), tokenizer).compile_abstract()


def bound_of(shape, batch: int, measured_ms: float) -> dict:
    """The plan's roofline bound for the step measured at `batch` (jaxpar.planning.bound), beside
    it; where there is none (a device the planner has no figures for), the reason."""
    from jaxpar.planning.bound import chip_of, step_bound
    cfg, compiled = compiled_step(shape.config, batch, shape.steps[batch])
    devices = jax.devices()[:1]
    chip = chip_of(devices, cfg.model.dtype)
    if chip is None:
        return {"bound_error": f"no planning chip for a {devices[0].device_kind}"}
    found = step_bound(compiled.as_text(), chip, len(devices))
    return {**found, "measured_over_bound": measured_ms / found["bound_ms"] if found["bound_ms"] else None}


def speed_rows(shape) -> list[dict]:
    rows = []
    for batch in shape.batches:
        summary = train(shape.config, shape.steps[batch], **{"train.batch_size": batch, "train.micro_batch": batch})
        row = {"run": f"{shape.config}, batch {batch}, one pass", **summary, "peak_gib": peak_memory_gib()}
        try:  # a bound that fails keeps the measurement
            row.update(bound_of(shape, batch, summary["step_time_ms_median"]))
        except Exception as error:  # noqa: BLE001
            row["bound_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        rows.append(row)
    return rows


def preset_rows(shape) -> list[dict]:
    rows = []
    for name, keys in (("as shipped", {}), (f"one pass of {shape.preset_rows} rows",
                                            {"train.batch_size": shape.preset_rows,
                                             "train.micro_batch": shape.preset_rows})):
        summary = train(shape.preset, shape.preset_steps, **keys)
        rows.append({"run": f"{shape.preset}, {name}", **summary, "peak_gib": None})
    return rows


def kernel_rows(shape, work: Path) -> dict:
    """GPT-2's kernel milliseconds a step by category, and its dearest kernels, from a trace."""
    start, end = shape.profile
    batch = shape.batches[0]
    train(shape.config, end + 1, out_dir=work / "profiled", profile=f"{start}:{end}",
          **{"train.batch_size": batch, "train.micro_batch": batch})
    kernels, steps = trace_kernels(work / "profiled" / "tensorboard"), end - start
    by = collections.Counter()
    for name, us in kernels.items():
        by[category(name)] += us / steps / 1e3
    return {"steps": steps, "kernels": len(kernels), "total_ms": sum(by.values()), "by_category_ms": dict(by),
            "dearest_ms": {name: us / steps / 1e3 for name, us in kernels.most_common(10)}}


def save_hlo(shape, path: Path) -> None:
    """The compiled step's optimized HLO, as XLA hands it to the device, at the first batch (the
    step that the speed section measured and bounded: one compile serves both)."""
    batch = shape.batches[0]
    path.write_text(compiled_step(shape.config, batch, shape.steps[batch])[1].as_text())


def bound_table(rows: list[dict]) -> list[str]:
    """The measured steps beside the plan's bound, as markdown lines; a row without a bound gives
    its reason below the table."""
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    bounded = [r for r in rows if "bound_ms" in r]
    lines = ["", "| run | chip | measured ms | bound ms | measured / bound | compute-bound ms | exposed comm ms |",
             "|---|---|---|---|---|---|---|"] if bounded else []
    lines += [f"| {r['run']} | {r['bound_chip']} | {r['step_time_ms_median']:,.2f} | {r['bound_ms']:,.2f} | "
              f"{fmt(r['measured_over_bound'], '.2f')}x | {r['bound_compute_bound_ms']:,.2f} | "
              f"{r['bound_exposed_comm_ms']:,.2f} |" for r in bounded]
    return lines + [f"\n{r['run']}: no bound: {r['bound_error']}" for r in rows if "bound_error" in r]


def table(found: dict) -> str:
    """The sections found so far, as markdown; a section that failed gives its error's line."""
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    lines = [f"device: {found['device']}, jax {found['jax']}, {found['date']}"]
    lines += [f"\n{name} failed: {error}" for name, error in found["errors"].items()]
    runs = found.get("speed", []) + found.get("preset", [])
    if runs:
        lines += ["", "| run | step ms | tokens/s | MFU | peak GiB |", "|---|---|---|---|---|"]
        lines += [f"| {r['run']} | {r['step_time_ms_median']:,.2f} | {r['tokens_per_s_median']:,.0f} | "
                  f"{r['mfu_median']:.1%} | {fmt(r['peak_gib'], '.2f')} |" for r in runs]
        lines += bound_table(found.get("speed", []))
    if "gemm" in found:
        lines += ["", "| experts | GEMM | forward ms | forward + backward ms | max rel. diff from ragged_dot |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['experts']} | {r['gemm']}{' (' + r['note'] + ')' if r['note'] else ''} | " + (
                  f"{r['forward_ms']:.3f} | {r['forward_backward_ms']:.3f} | "
                  f"{fmt(r['max_rel_diff_vs_ragged_dot'], '.1e')} |" if "error" not in r else f"{r['error']} | | |")
                  for r in found["gemm"]]
    if "kernels" in found:
        k = found["kernels"]
        lines += ["", f"kernels a step ({k['kernels']} names, {k['total_ms']:.2f} ms):"]
        lines += [f"  {name:20s} {ms:8.2f} ms" for name, ms in sorted(k["by_category_ms"].items(), key=lambda i: -i[1])]
        lines += [f"  {ms:8.3f} ms  {name[:100]}" for name, ms in k["dearest_ms"].items()]
    if "sweep" in found:
        lines += gpu_sweep.sweep_table(found["sweep"])
    return "\n".join(lines)


SECTIONS = ("speed", "preset", "gemm", "kernels", "hlo")


def run_sections(measure: dict, table, stem: Path, deadline: float = float("inf")) -> dict:
    """Each section's figures, by name; a section that fails, or would start past `deadline`
    (time.monotonic()), gives its line and the others go on. stem.md and stem.json are rewritten
    as each section ends."""
    found = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
             "errors": {}}
    for name, fn in measure.items():
        try:  # one section's failure (a kernel this jax lacks, say) keeps the others' figures
            if time.monotonic() > deadline:
                raise TimeoutError("not run: past the budget")
            found[name] = fn()
        except Exception as error:  # noqa: BLE001
            found["errors"][name] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        stem.with_suffix(".md").write_text(table(found) + "\n")
        stem.with_suffix(".json").write_text(json.dumps(found, indent=1, default=str))
    return found


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU smoke test)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"some of {','.join(SECTIONS)}")
    parser.add_argument("--batches", help="GPT-2's batches, comma-separated (default: 16,64)")
    parser.add_argument("--sweep", action="store_true", help="and GPT-2 under each candidate (section 5)")
    parser.add_argument("--candidates", help="the sweep's, comma-separated names (default: all; the default's is kept)")
    parser.add_argument("--budget", type=float, default=float("inf"), help="seconds for everything (default: no limit)")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.budget
    shape = TINY if args.tiny else FULL
    if args.candidates:
        asked = [n for n in args.candidates.split(",") if n != gpu_sweep.DEFAULT]
        if unknown := set(asked) - set(gpu_sweep.CANDIDATES):
            parser.error(f"--candidates: no {', '.join(sorted(unknown))}; the sweep's are {', '.join(gpu_sweep.CANDIDATES)}")
        shape = SimpleNamespace(**{**vars(shape), "candidates": (gpu_sweep.DEFAULT, *asked)})
    if args.batches:
        shape = SimpleNamespace(**{**vars(shape), "batches": tuple(int(b) for b in args.batches.split(","))})
    args.out.mkdir(parents=True, exist_ok=True)
    if not jax.config.jax_compilation_cache_dir:  # the profiled run reuses the first run's compile
        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="gpu_check_cache_"))
    with tempfile.TemporaryDirectory() as work:
        measure = {"speed": lambda: speed_rows(shape), "preset": lambda: preset_rows(shape), "gemm": lambda: gemm_rows(shape),
                   "kernels": lambda: kernel_rows(shape, Path(work)),
                   "hlo": lambda: save_hlo(shape, args.out / f"{shape.config}_b{shape.batches[0]}.hlo.txt"),
                   "sweep": lambda: gpu_sweep.sweep(functools.partial(run_once, **shape.sweep_keys), shape.config,
                                                    shape.sweep_batches, shape.sweep_steps, list(shape.candidates),
                                                    deadline)}
        names = [n for n in args.sections.split(",") if n] + ["sweep"] * args.sweep
        found = run_sections({name: measure[name] for name in names}, table, args.out / "gpu_check", deadline)
    print(table(found))
    return found


if __name__ == "__main__":
    main(sys.argv[1:])

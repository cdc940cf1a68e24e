"""Every GPU measurement of the tuned-kernel work, in one command that ends within `--budget`
seconds (default 480: a lent GPU's 15 minutes less its start and a rerun), jaxpar and PyTorch back
to back on the same GPU.

    python scripts/tools/gpu_session.py --out DIR [--torch PATH]       # on one NVIDIA GPU (gpu_carry.sh first)
    JAX_PLATFORMS=cpu python scripts/tools/gpu_session.py --tiny --out DIR  # the rehearsal on a CPU
    python scripts/tools/gpu_session.py --dry-run --out DIR             # the steps and their seconds

The steps, each a subprocess with its own time limit (its share, or what the budget has left,
keeping the sweep's floor), its output appended to DIR/session.log, its end to DIR/session.md:
1. PyTorch's GPT-2 124M (nanoGPT's `torch.compile`, `--torch`: ../shared/gpu/torch_gpt2_cuda.py
   copied into the repository where the GPU machine cannot see beside it) at batch 16 and 64;
   skipped with its reason where torch or the file is missing.
2. `gemm_legs.py` twice on one cache folder: the first tunes the grouped GEMM for this GPU and
   times each leg's kernels; the second must reuse the cache and tune nothing.
3. `python scripts/experiments/fused_norm_timing.py`: the fused residual add + LayerNorm against XLA's.
4. `gpu_deepseek.py --sections moonlight`: Moonlight cut to 4 layers, 4 rows a pass (MFU).
5. `gpu_check.py --sections gemm --sweep`: the grouped GEMM against a dense dot, then GPT-2 at
   batch 16 and 64 under the default (jaxpar's side of step 1) and each XLA option and fused
   kernel of the sweep, in whatever time is left (gpu_check's own `--budget`; the sweep runs its
   deciding figures first).
FP8's measurements (issue 73) are their own command, for the time a lent GPU has left after this
one: `python scripts/tools/gpu_fp8.py --out DIR --budget SECONDS`.
"""

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SWEEP_FLOOR = 180  # seconds kept for step 5 whatever the earlier steps take


def steps(out: Path, torch: Path | None, tiny: bool) -> list[tuple[str, list[str], float]]:
    """(name, argv, seconds allowed) of each step, in order; on a CPU (`tiny`) their small shapes."""
    py, cache = sys.executable, out / "kernel_cache"
    legs = ["--rows", "256", "--embd", "32", "--width", "64"] if tiny else []
    torch_args = ["--device", "cpu", "--no-compile", "--layers", "1", "--d", "64", "--heads", "2", "--block", "64",
                  "--vocab", "512", "--steps", "3", "--warmup", "1"] if tiny else []
    plan = []
    if torch is not None:
        plan += [(f"torch batch {b}", [py, str(torch), "--batch", str(b if not tiny else 2), *torch_args]
                  + ([] if tiny else ["--steps", str(s)]), 75) for b, s in ((16, 30), (64, 20))]
    plan += [(f"gemm legs {n}", [py, str(HERE / "gemm_legs.py"), "--cache", str(cache), *legs], share)
             for n, share in (("tuned", 150), ("reused", 45))]  # a tuning cut short is kept: the second goes on
    plan += [("fused norm", [py, str(HERE.parent / "experiments" / "fused_norm_timing.py"),
                             *(["--rows", "512", "--embd", "64", "--iters", "2"] if tiny else [])], 30),
             ("moonlight", [py, str(HERE / "gpu_deepseek.py"), "--sections", "moonlight", "--out", str(out),
                            *(["--tiny"] if tiny else [])], 100),
             ("gpu check and sweep", [py, str(HERE / "gpu_check.py"), "--sections", "gemm", "--sweep",
                                      "--out", str(out), *(["--tiny"] if tiny else [])], float("inf"))]
    return plan


def torch_reference(path: str | None) -> tuple[Path | None, str]:
    """(the PyTorch reference's file, or None, and why not): torch must import, the file exist."""
    candidates = [Path(path)] if path else [Path(".gpu/torch_gpt2_cuda.py"), HERE.parents[2] / "shared/gpu/torch_gpt2_cuda.py"]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        return None, f"no PyTorch reference at {', '.join(map(str, candidates))}"
    try:
        import torch  # noqa: F401  (the reference's, never jaxpar's)
    except ImportError:
        return None, "torch is not installed here"
    return found, ""


def run_steps(plan, budget: float, out: Path) -> list[dict]:
    """Each step with its time limit; the last gets the rest of the budget (its own --budget)."""
    end, rows = time.monotonic() + budget, []
    with (out / "session.log").open("a") as log:
        for i, (name, argv, share) in enumerate(plan):
            rows.append(run_step(name, argv, share if i < len(plan) - 1 else None, end, log))
            (out / "session.md").write_text(session_table(rows))
    return rows


def run_step(name: str, argv: list[str], share: float | None, end: float, log) -> dict:
    """One step under its limit: its share, keeping SWEEP_FLOOR for the last step (share None),
    which takes what is left and is told so (its --budget)."""
    left = end - time.monotonic()
    limit = left if share is None else min(share, left - SWEEP_FLOOR)
    if limit <= 5:
        return {"step": name, "status": "not run: past the budget", "seconds": 0.0}
    argv = argv + (["--budget", str(int(limit - 15))] if share is None else [])
    log.write(f"\n$ {' '.join(argv)}\n")
    log.flush()
    start = time.monotonic()
    try:
        done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=limit, check=False)
        status = "ok" if done.returncode == 0 else f"exit {done.returncode}"
    except subprocess.TimeoutExpired:
        status = f"stopped at its limit, {limit:.0f} s"
    return {"step": name, "status": status, "seconds": round(time.monotonic() - start, 1)}


def session_table(rows: list[dict]) -> str:
    lines = ["| step | status | seconds |", "|---|---|---|"]
    return "\n".join(lines + [f"| {r['step']} | {r['status']} | {r['seconds']} |" for r in rows]) + "\n"


def main(argv: list[str]) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for every step together")
    parser.add_argument("--torch", help="nanoGPT's step in PyTorch (default: .gpu/ or ../shared/gpu/)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: the rehearsal on a CPU")
    parser.add_argument("--dry-run", action="store_true", help="print the steps and their limits, run nothing")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch, why = torch_reference(args.torch)
    plan = steps(args.out, torch, args.tiny)
    if args.dry_run:
        limit = lambda share: "the rest of --budget" if share == float("inf") else f"up to {share} s"
        print("\n".join(f"{name}: {' '.join(argv)}  [{limit(share)}]" for name, argv, share in plan)
              + (f"\n(torch: {why})" if why else ""))
        return [{"step": name, "argv": argv, "seconds": share} for name, argv, share in plan]
    shutil.rmtree(args.out / "kernel_cache", ignore_errors=True)  # the first gemm_legs must tune
    rows = ([{"step": "torch", "status": f"skipped: {why}", "seconds": 0.0}] if why else []) + run_steps(
        plan, args.budget, args.out)
    (args.out / "session.md").write_text(session_table(rows))
    print(session_table(rows))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])

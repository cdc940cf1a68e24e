"""`python -m jaxpar.bench`: train one config on several mesh layouts, each in a fresh process,
and compare throughput, memory, collectives and final loss. Writes bench.json, bench.md, bench.png.

Speedup is tokens/s over the 1-device baseline's; efficiency is speedup / (devices / baseline's
devices), i.e. tokens/s per device over the baseline's, in both strong and weak (--weak) mode.

Each layout's folder keeps the settings its row was measured under (bench_layout.json): a later
bench into the same --out reuses that row, saying so, only when the layout's resolved config and
--weak are the same and it did not fail; otherwise it trains the layout again from scratch.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from jaxpar.core.axes import KEYS
from jaxpar.core.config import DEFAULT_CONFIG_NAME, Config, load_config
from jaxpar.core.errors import UserError, check_output_dir, exit_on_user_error
from jaxpar.core.out_lock import RunLock
from jaxpar.parallel.hlo import KINDS
from jaxpar.parallel.mesh import parse_mesh_spec, resolve_mesh_shape
from jaxpar.planning.bench_record import RECORD, earlier_row, settings
from jaxpar.training.loss_plots import mesh_label, plot_bench

DEFAULT_LAYOUTS = "dp=1;dp=2;tp=2;pp=2;dp=2,tp=2;dp=2,pp=2;dp=4;dp=4,tp=2;dp=2,tp=2,pp=2"  # valid for the default batch of 12
DEFAULT_STEPS = 50
BASELINE = "dp=1"
LOSS_RTOL = 1e-5  # the equivalence tests' tolerance for the same model on any layout
HFU_NOTE = ("HFU = MFU x about 8/6 with pp > 1 (each pipeline backward recomputes its stage's forward; "
            "12/6 with zb-h1, whose B and W each rerun it); "
            "otherwise HFU = MFU: ZeRO-3's remat only re-gathers weights, which is communication, "
            "not FLOPs")


@dataclass
class Layout:
    spec: str  # canonical, e.g. 'dp=2,tp=2'
    sizes: dict[str, int]  # {'dp': 2, 'tp': 2, 'pp': 1}
    cfg: Config  # as the layout's subprocess will resolve it
    overrides: dict[str, str]  # passed to jaxpar.train, besides --mesh

    @property
    def devices(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def slug(self) -> str:
        """A directory name: 'dp=2,tp=2' -> 'dp2-tp2'."""
        return self.spec.replace("=", "").replace(",", "-")


def parse_layout(entry: str, config: str | None, overrides: dict[str, str], weak: bool) -> Layout:
    """One --layouts entry, validated as jaxpar.train would on that many devices."""
    try:
        mesh = parse_mesh_spec(entry)
        sizes = {axis: int(mesh[f"mesh.{axis}"]) for axis in KEYS}
        if -1 in sizes.values():
            raise UserError("a bench layout needs every axis size; -1 (inferred) is not allowed")
        overrides = dict(overrides)
        if weak:
            batch = load_config(config, overrides).train.batch_size
            overrides["train.batch_size"] = str(batch * math.prod(sizes.values()))
        cfg = load_config(config, overrides | mesh)
        resolve_mesh_shape(cfg, math.prod(sizes.values()))
    except UserError as e:
        raise UserError(f"layout '{entry}': {e}") from None
    return Layout(mesh_label(sizes), sizes, cfg, overrides)


def plan_layouts(spec: str, config: str | None, overrides: dict[str, str],
                 weak: bool = False) -> list[Layout]:
    """Parse and validate every layout before anything runs; the 1-device baseline comes first.

    A baseline is added if the list lacks one. In weak mode a layout's global batch is the
    configured batch times its device count (the baseline's count is 1).
    """
    if any(key.startswith("mesh.") for key in overrides):
        raise UserError("set the mesh with --layouts, not --mesh.* overrides")
    entries = [entry.strip() for entry in spec.split(";") if entry.strip()]
    if not entries:
        raise UserError(f"--layouts {spec!r} names no layout; e.g. --layouts 'dp=1;dp=2'")
    layouts: list[Layout] = []
    for entry in entries:
        layout = parse_layout(entry, config, overrides, weak)
        if any(other.spec == layout.spec for other in layouts):
            raise UserError(f"layout '{entry}' repeats {layout.spec}")
        layouts.append(layout)
    baseline = next((layout for layout in layouts if layout.devices == 1), None)
    if baseline is None:
        baseline = parse_layout(BASELINE, config, overrides, weak)
        print(f"note: added {BASELINE} as the 1-device baseline for speedup and efficiency",
              file=sys.stderr)
    return [baseline] + [layout for layout in layouts if layout is not baseline]


def child_env() -> dict[str, str]:
    """This environment, without a forced host-device count: each layout needs its own."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    if "XLA_FLAGS" in env:
        env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env["XLA_FLAGS"])
    return env


def failure(returncode: int, stderr: str) -> str:
    """One line: how the process ended and its last message, skipping native stack frames."""
    how = f"killed by {signal.Signals(-returncode).name}" if returncode < 0 else f"exit {returncode}"
    messages = [line.strip() for line in stderr.splitlines()
                if line.strip() and not line.strip().startswith(("@", "***"))]
    return f"{how}: {messages[-1][:300] if messages else 'no output'}"


def train_layout(layout: Layout, config: str | None, out_dir: Path) -> dict:
    """Run jaxpar.train for one layout in a fresh process, from scratch (--fresh: a checkpoint
    left in its folder would otherwise be resumed, or taken as done); its run.json as a bench row."""
    run_dir = out_dir / layout.slug
    argv = [sys.executable, "-m", "jaxpar.train", *(["--config", config] if config else []),
            "--mesh", layout.spec, "--out", str(run_dir), "--fresh",
            *(f"--{key}={value}" for key, value in layout.overrides.items())]
    proc = subprocess.run(argv, capture_output=True, text=True, env=child_env())
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "train.log").write_text(proc.stdout + proc.stderr)
    row = {"layout": layout.spec, "devices": layout.devices, "mesh": layout.sizes,
           "batch_size": layout.cfg.train.batch_size, "run_dir": str(run_dir), "error": None}
    if proc.returncode != 0:
        row["error"] = failure(proc.returncode, proc.stderr)
        return row
    info = json.loads((run_dir / "run.json").read_text())
    summary, compiled = info["summary"], info["compiled"]
    return row | {
        "platform": info["devices"]["platform"],
        "zero_stage": info["zero_stage"],
        "tokens_per_s": summary["tokens_per_s_median"],
        "step_time_ms": summary["step_time_ms_median"],
        "compile_s": info["compile_s"],
        "mfu": summary["mfu_median"],
        "hfu": summary["mfu_median"] * info["pipeline"].get("hardware_flops_factor", 1.0),
        "peak_memory_bytes": compiled.get("peak_memory_bytes"),
        "bytes_per_device": info["bytes_per_device"],
        "collectives": {kind: compiled["collectives"].get(kind, {"count": 0, "bytes": 0})
                        for kind in KINDS},
        "final_loss": summary["final_loss"],
        "final_val_loss": summary["final_val_loss"],
    }


def measure(layout: Layout, config: str | None, weak: bool, out_dir: Path) -> dict:
    """The layout's row: reused, saying so, from an earlier run with the same settings; else
    measured again, replacing that run."""
    run_dir = out_dir / layout.slug
    now = settings(layout.cfg.to_dict(), weak)
    row, why_not = earlier_row(now, run_dir)
    if row is not None:
        print(f"    reused {run_dir}: measured earlier with these same settings (delete it to "
              "measure again)", file=sys.stderr)
        return row
    if why_not:
        print(f"    measuring again: the earlier run in {run_dir} {why_not}", file=sys.stderr)
    (run_dir / RECORD).unlink(missing_ok=True)  # gone until this run's row replaces it
    start = time.perf_counter()
    row = train_layout(layout, config, out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RECORD).write_text(json.dumps({"settings": now, "row": row}, indent=1))
    status = f"failed ({row['error']})" if row["error"] else "done"
    print(f"    {status} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return row


def add_scaling(rows: list[dict]) -> None:
    """Speedup and efficiency against rows[0], the baseline; None where either run failed."""
    base = rows[0]
    for row in rows:
        ok = row.get("tokens_per_s") and base.get("tokens_per_s")
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"] if ok else None
        row["efficiency"] = (row["speedup"] * base["devices"] / row["devices"]) if ok else None


def loss_spread(rows: list[dict]) -> float | None:
    """Largest relative difference of a final loss from the baseline's, over the rows that ran."""
    losses = [row["final_loss"] for row in rows if row.get("final_loss") is not None]
    if rows[0].get("final_loss") is None or len(losses) < 2:
        return None
    return max(abs(loss - losses[0]) / abs(losses[0]) for loss in losses)


def size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def collectives_cell(collectives: dict) -> str:
    return "; ".join(f"{kind} {c['count']}× {size(c['bytes'])}" for kind, c in collectives.items()
                     if c["count"]) or "none"


def table(rows: list[dict]) -> str:
    """The Markdown table: one row per layout; a failed layout shows its error."""
    header = ["layout", "devices", "batch", "tokens/s", "step (ms)", "compile (s)", "MFU", "HFU",
              "speedup", "efficiency", "params + opt state / device", "peak memory / device",
              "collectives (count, bytes)", "final loss"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        if r["error"]:
            cells = [r["layout"], r["devices"], r["batch_size"], "failed: " + r["error"]]
            lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells)
                         + " |" * (len(header) - len(cells) + 1))
            continue
        per_device = r["bytes_per_device"]["params"] + r["bytes_per_device"]["opt_state"]
        cells = [r["layout"], r["devices"], r["batch_size"], f"{r['tokens_per_s']:,.0f}",
                 f"{r['step_time_ms']:.1f}", f"{r['compile_s']:.1f}", f"{100 * r['mfu']:.2f}%",
                 f"{100 * r['hfu']:.2f}%", f"{r['speedup']:.2f}", f"{r['efficiency']:.2f}",
                 size(per_device), size(r["peak_memory_bytes"]), collectives_cell(r["collectives"]),
                 f"{r['final_loss']:.5f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def notes(rows: list[dict], weak: bool) -> list[str]:
    mode = ("weak scaling: the global batch grows with the device count" if weak
            else "strong scaling: the same global batch on every layout")
    found = [f"{mode}; speedup and efficiency are against the 1-device run ({rows[0]['layout']}).",
             "Step time and tokens/s are medians with compile time excluded (reported apart).",
             HFU_NOTE + "."]
    spread = loss_spread(rows)
    if spread is not None and not weak:
        verdict = "agree" if spread <= LOSS_RTOL else "DIFFER"
        found.append(f"Final losses {verdict}: largest relative difference from the baseline "
                     f"{spread:.1e} (rtol {LOSS_RTOL:g}).")
    if any(r.get("platform") == "cpu" and r["devices"] > 1 for r in rows):
        found.append("On a CPU, forced host devices share the same cores, so speedups measure "
                     "overheads, not a cluster's scaling; and each run measures its own CPU peak "
                     "FLOP/s, so MFU moves with that measurement.")
    return found


def write_outputs(rows: list[dict], out_dir: Path, weak: bool) -> str:
    """bench.json, bench.md and bench.png; returns the Markdown."""
    (out_dir / "bench.json").write_text(json.dumps(rows, indent=2))
    markdown = table(rows) + "\n\n" + "\n".join(f"- {note}" for note in notes(rows, weak)) + "\n"
    (out_dir / "bench.md").write_text(markdown)
    plot_bench(rows, out_dir / "bench.png")
    return markdown


def parse_args(argv: list[str]):
    from jaxpar.core.config import parse_overrides
    from jaxpar.core.errors import ArgumentParser
    parser = ArgumentParser(prog="jaxpar.bench", description="Train one config on several mesh layouts "
                     "and compare speed, memory, collectives and final loss.",
                     epilog="Any other --section.field=value is passed to jaxpar.train.")
    parser.add_argument("--config", help="TOML file or a name in configs/ (as jaxpar.train)")
    parser.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                        help=f"mesh specs separated by ';' (default: {DEFAULT_LAYOUTS!r})")
    parser.add_argument("--steps", type=int, help=f"steps per layout (default: {DEFAULT_STEPS})")
    parser.add_argument("--weak", action="store_true",
                        help="weak scaling: global batch = train.batch_size x devices")
    parser.add_argument("--out", help="output directory (default: out/bench_<config name>); a layout "
                        "measured there before under the same settings is reused, saying so")
    args, rest = parser.parse_known_args(argv)
    overrides = parse_overrides(rest)
    if args.steps is not None or "train.steps" not in overrides:
        overrides["train.steps"] = str(DEFAULT_STEPS if args.steps is None else args.steps)
    name = Path(args.config).stem if args.config else DEFAULT_CONFIG_NAME
    out_dir = Path(args.out) if args.out else Path("out") / f"bench_{name}"
    check_output_dir(out_dir)
    return args, overrides, out_dir


def main(argv: list[str] | None = None) -> None:
    with exit_on_user_error("jaxpar.bench"):
        args, overrides, out_dir = parse_args(sys.argv[1:] if argv is None else argv)
        layouts = plan_layouts(args.layouts, args.config, overrides, args.weak)
        from jaxpar.data.loader import load_dataset  # a bad data file fails here, not in every layout
        load_dataset(layouts[0].cfg.data, layouts[0].cfg.model.block_size)
        with RunLock(out_dir):  # one bench per --out: two would train into the same layout folders
            rows = []
            for i, layout in enumerate(layouts, 1):
                print(f"[{i}/{len(layouts)}] {layout.spec}: {layout.cfg.train.steps} steps on "
                      f"{layout.devices} device(s), batch {layout.cfg.train.batch_size}", file=sys.stderr)
                rows.append(measure(layout, args.config, args.weak, out_dir))
            add_scaling(rows)
            markdown = write_outputs(rows, out_dir, args.weak)
    print(markdown)
    print(f"wrote {out_dir}/bench.json, bench.md" + (", bench.png" if (out_dir / "bench.png").exists()
                                                      else ""))
    failed = [row["layout"] for row in rows if row["error"]]
    if failed:
        print(f"jaxpar.bench: error: {len(failed)} of {len(rows)} layouts failed: "
              f"{', '.join(failed)}; see their train.log", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

"""`python -m jaxpar.bench`: train one config on several mesh layouts, each in a fresh process,
and compare throughput, memory, collectives and final loss. Writes bench.json, bench.md, bench.png.

Speedup is tokens/s over the 1-device baseline's; efficiency is speedup / (devices / baseline's
devices), i.e. tokens/s per device over the baseline's, in both strong and weak (--weak) mode.

Each layout's folder keeps the settings its row was measured under (bench_layout.json): a later
bench into the same --out reuses that row, saying so, only when the layout's resolved config and
--weak are the same and it did not fail; otherwise it trains the layout again from scratch.

SIGTERM or SIGINT is passed on to the running jaxpar.train (a first stops it at its next safe
point, a second at once), which the bench waits for; it then stops, exit 128 + the signal's
number, keeping the rows measured before (StopSignals).
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from jaxpar.core.axes import CONTEXT_AXIS, KEYS, TENSOR_AXIS
from jaxpar.core.config import Config, load_config
from jaxpar.core.errors import UserError
from jaxpar.core.out_lock import RunLock
from jaxpar.nn.context import on_mesh
from jaxpar.parallel.hlo import KINDS
from jaxpar.parallel.mesh import parse_mesh_spec, resolve_mesh_shape
from jaxpar.planning.bench_record import RECORD, add_scaling, bench_outputs, earlier_row, settings, write_outputs
from jaxpar.training.run.loss_plots import mesh_label

DEFAULT_LAYOUTS = "dp=1;dp=2;tp=2;pp=2;dp=2,tp=2;dp=2,pp=2;dp=4;dp=4,tp=2;dp=2,tp=2,pp=2"  # valid for the default batch of 12
DEFAULT_STEPS = 50
BASELINE = "dp=1"


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
        shape = resolve_mesh_shape(cfg, math.prod(sizes.values()))
        on_mesh(cfg.model, shape[CONTEXT_AXIS.key], shape[TENSOR_AXIS.key])  # before any layout runs
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


class Stopped(Exception):
    """A signal stopped the bench (StopSignals): args (signum, where), its child ended and waited for."""


class StopSignals:
    """SIGTERM and SIGINT to the bench. Each is passed on to the layout's jaxpar.train where one
    runs (its first stops the run at its next safe point, a second at once), and the bench waits
    for it; then, as between runs, the bench stops, keeping no row of an unfinished layout."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self.child: subprocess.Popen | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # handlers only install there
            self._previous = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _on_signal(self, signum: int, frame) -> None:
        self.signum = self.signum or signum
        self.pass_on(signum)

    def pass_on(self, signum: int) -> None:
        """`signum` to the running child, if one runs, saying so (send_signal skips a child
        already waited for)."""
        if self.child is not None and self.child.returncode is None:
            self.child.send_signal(signum)
            print(f"jaxpar.bench: {signal.Signals(signum).name}: passed on to the running jaxpar.train, and "
                  "waiting for it (it stops at its next safe point; send it again to stop it at once)",
                  file=sys.stderr, flush=True)

    def check(self, where: str) -> None:
        if self.signum is not None:
            raise Stopped(self.signum, where)


def run_train(argv: list[str], stop: StopSignals) -> subprocess.CompletedProcess:
    """argv run and waited for, its output kept; in a process group of its own, so that Ctrl-C in a
    terminal reaches the bench alone, which passes it on once. Killed if this ends otherwise."""
    stop.check("before its run")
    with subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=child_env(), process_group=0) as proc:
        stop.child = proc
        try:
            if stop.signum is not None:  # it came while the child started
                stop.pass_on(stop.signum)
            stdout, stderr = proc.communicate()
        finally:
            stop.child = None
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def train_argv(layout: Layout, config: str | None, run_dir: Path) -> list[str]:
    """jaxpar.train for one layout, from scratch (--fresh: a checkpoint left in its folder would
    otherwise be resumed, or taken as done)."""
    return [sys.executable, "-m", "jaxpar.train", *(["--config", config] if config else []),
            "--mesh", layout.spec, "--out", str(run_dir), "--fresh",
            *(f"--{key}={value}" for key, value in layout.overrides.items())]


def train_layout(layout: Layout, config: str | None, out_dir: Path, stop: StopSignals) -> dict:
    """Run jaxpar.train for one layout in a fresh process; its run.json as a bench row, or
    Stopped where a signal came meanwhile."""
    run_dir = out_dir / layout.slug
    proc = run_train(train_argv(layout, config, run_dir), stop)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "train.log").write_text(proc.stdout + proc.stderr)
    stop.check(f"during layout {layout.spec} (its jaxpar.train stopped and was waited for, its row not kept; "
               "see its train.log)")
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


def measure(layout: Layout, config: str | None, weak: bool, out_dir: Path, stop: StopSignals) -> dict:
    """The layout's row: reused, saying so, from an earlier run with the same settings; else
    measured again, replacing that run (none recorded where a signal stopped it: Stopped)."""
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
    row = train_layout(layout, config, out_dir, stop)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RECORD).write_text(json.dumps({"settings": now, "row": row}, indent=1))
    status = f"failed ({row['error']})" if row["error"] else "done"
    print(f"    {status} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return row


def bench_layouts(layouts: list[Layout], config: str | None, weak: bool, out_dir: Path) -> tuple[list[dict], str]:
    """Each layout's row, in turn, under --out's lock and the signals' handlers; the outputs."""
    with StopSignals() as stop, RunLock(out_dir):  # one bench per --out: two would train into the same folders
        outputs = bench_outputs(out_dir, [layout.slug for layout in layouts])
        outputs.check()  # a user's file or folder in the way is refused before any layout trains
        outputs.claim(*(layout.slug for layout in layouts))
        rows = []
        for i, layout in enumerate(layouts, 1):
            stop.check(f"before layout {layout.spec}")
            print(f"[{i}/{len(layouts)}] {layout.spec}: {layout.cfg.train.steps} steps on "
                  f"{layout.devices} device(s), batch {layout.cfg.train.batch_size}", file=sys.stderr)
            rows.append(measure(layout, config, weak, out_dir, stop))
        stop.check("after the last layout")
        add_scaling(rows)
        return rows, write_outputs(rows, out_dir, weak)


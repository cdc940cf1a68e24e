"""Plots: loss curves of runs (`python -m jaxpar.plot RUN_DIR ... [--out FILE]`) and the bench bars.

Every figure is drawn on matplotlib's file-only Agg backend, so no display is needed.
"""

import json
import sys
from pathlib import Path

from jaxpar.core.errors import UserError, exit_on_user_error


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(plt, fig, out_png) -> Path:
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)  # pyplot keeps every open figure alive otherwise
    return Path(out_png)


def read_metrics(run_dir: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(train [(step, loss)], val [(step, val_loss)]) from run_dir/metrics.jsonl; a diverged step's
    null loss is left out."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"'{run_dir}' has no metrics.jsonl; pass a jaxpar.train output directory")
    train, val = [], []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("loss") is not None:
            train.append((record["step"], record["loss"]))
        elif record.get("val_loss") is not None:
            val.append((record["step"], record["val_loss"]))
    return train, val


def mesh_label(mesh: dict) -> str:
    """{'dp': 2, 'tp': 1, 'pp': 1} -> 'dp=2'; all ones -> 'dp=1'."""
    return ",".join(f"{axis}={size}" for axis, size in mesh.items() if size != 1) or "dp=1"


def run_label(run_dir: Path) -> str:
    """The directory's name, with its mesh from run.json when there is one."""
    info_file = Path(run_dir) / "run.json"
    if not info_file.is_file():
        return Path(run_dir).name
    return f"{Path(run_dir).name} ({mesh_label(json.loads(info_file.read_text())['mesh'])})"


def plot_runs(run_dirs: list, out_png) -> Path:
    """Overlay runs' losses in one PNG: train solid, val dashed with markers, a colour per run."""
    runs = [(run_label(d), *read_metrics(d)) for d in run_dirs]  # a bad dir fails before drawing
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (label, train, val) in enumerate(runs):
        colour = f"C{i % 10}"
        if train:
            ax.plot(*zip(*train), color=colour, label=f"{label} train")
        if val:
            ax.plot(*zip(*val), color=colour, linestyle="--", marker="o", label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return save(plt, fig, out_png)


def plot_after_training(out_dir: Path) -> None:
    """loss.png in a finished run's directory; a process that wrote no metrics (not the main one)
    plots nothing."""
    if not (Path(out_dir) / "metrics.jsonl").is_file():
        return
    plot_runs([out_dir], Path(out_dir) / "loss.png")


def plot_bench(rows: list[dict], out_png) -> Path:
    """Two bar panels, one bar per layout: tokens/s, and the compiled peak memory per device."""
    plt = pyplot()
    labels = [row["layout"] for row in rows]
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows)), 4))
    # A failed layout keeps its place, with an empty bar, so the panels line up with the table.
    tokens = [row.get("tokens_per_s") or 0 for row in rows]
    bars = speed.bar(labels, tokens, color="C0")
    speed.bar_label(bars, [f"{t:,.0f}" if t else "failed" for t in tokens])
    speed.set_ylabel("tokens/s")
    speed.set_title("throughput")
    mib = [(row.get("peak_memory_bytes") or 0) / 2**20 for row in rows]
    bars = memory.bar(labels, mib, color="C1")
    memory.bar_label(bars, [f"{m:.1f}" if m else "-" for m in mib])
    memory.set_ylabel("MiB per device")
    memory.set_title("compiled peak memory")
    for ax in (speed, memory):
        ax.tick_params(axis="x", labelrotation=30)
        ax.grid(axis="y", alpha=0.3)
    return save(plt, fig, out_png)


def main(argv: list[str] | None = None) -> None:
    with exit_on_user_error("jaxpar.plot"):
        from jaxpar.core.errors import ArgumentParser
        parser = ArgumentParser(prog="jaxpar.plot", description="Overlay the loss curves of jaxpar runs.")
        parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="jaxpar.train --out dirs")
        parser.add_argument("--out", default="loss.png", help="PNG to write (default: loss.png)")
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        print(f"wrote {plot_runs(args.run_dirs, args.out)}")


if __name__ == "__main__":
    main()

"""Plots: loss curves of runs (`python -m jaxpar.plot RUN_DIR ... [--out FILE]`) and the bench bars.

Every figure is drawn on matplotlib's file-only Agg backend, so no display is needed.
"""

import json
import sys
from pathlib import Path

from jaxpar.core.errors import UserError, exit_on_user_error
from jaxpar.training import metrics

EMA_WEIGHT = 0.9  # the train curve's smoothing, as TensorBoard's slider sets it
CHANCE = {"hellaswag": 0.25, "piqa": 0.5, "winogrande": 0.5}  # ARC's items have 3 to 5 choices


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


def read_metrics(run_dir: Path) -> tuple[list, list, dict]:
    """(train [(step, loss)], val [(step, val_loss)], {"<task>/<acc|acc_norm>": [(step, value)]})
    from run_dir/metrics.jsonl; a diverged step's null loss is left out, and so is a line that
    does not read (a warning counts them)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"'{run_dir}' has no metrics.jsonl; pass a jaxpar.train output directory")
    train, val, tasks = [], [], {}
    for record in metrics.read_metrics(path)[0]:
        if record.get("loss") is not None:
            train.append((record["step"], record["loss"]))
        elif record.get("val_loss") is not None:
            val.append((record["step"], record["val_loss"]))
        for key, value in record.items():
            if key.endswith(("/acc", "/acc_norm")):
                tasks.setdefault(key, []).append((record["step"], value))
    return train, val, tasks


def ema(values: list[float], weight: float = EMA_WEIGHT) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start."""
    out, mean = [], 0.0
    for i, value in enumerate(values, 1):
        mean = weight * mean + (1 - weight) * value
        out.append(mean / (1 - weight ** i))
    return out


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
    """Overlay runs' losses in one PNG: train faint with its EMA over it, a colour per run; val
    with markers, in a colour of its own for one run; the tasks' accuracies in a second panel."""
    runs = [(run_label(d), *read_metrics(d)) for d in run_dirs]  # a bad dir fails before drawing
    plt = pyplot()
    with_tasks = any(tasks for *_, tasks in runs)
    fig, axes = plt.subplots(1, 2 if with_tasks else 1, figsize=(14 if with_tasks else 8, 5), squeeze=False)
    ax, acc_ax = axes[0][0], axes[0][-1]
    for i, (label, train, val, tasks) in enumerate(runs):
        colour = f"C{(2 * i) % 10}"
        val_colour = f"C{(2 * i + 1) % 10}" if len(runs) == 1 else colour
        if train:
            steps, losses = zip(*train)
            ax.plot(steps, losses, color=colour, alpha=0.25, linewidth=0.8)
            ax.plot(steps, ema(losses), color=colour, label=f"{label} train (EMA {EMA_WEIGHT})")
        if val:
            ax.plot(*zip(*val), color=val_colour, linestyle="--", marker="o", markeredgecolor="black",
                    zorder=3, label=f"{label} val")
        for j, (key, points) in enumerate(sorted(tasks.items())):
            acc_ax.plot(*zip(*points), marker="o", linestyle="-" if key.endswith("/acc") else ":",
                        color=f"C{j % 10}", label=f"{label} {key}" if len(runs) > 1 else key)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    if with_tasks:
        for task in sorted({key.split("/")[0] for *_, tasks in runs for key in tasks} & set(CHANCE)):
            acc_ax.axhline(CHANCE[task], color="grey", linestyle="--", linewidth=0.8)
            acc_ax.annotate(f"{task} chance", (0, CHANCE[task]), xycoords=("axes fraction", "data"),
                            fontsize=8, color="grey", va="bottom")
        acc_ax.set_xlabel("step")
        acc_ax.set_ylabel("accuracy")
        acc_ax.set_title("downstream tasks")
        acc_ax.grid(alpha=0.3)
        acc_ax.legend()
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

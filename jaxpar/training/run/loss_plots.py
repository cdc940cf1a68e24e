"""Plots: loss curves of runs (`python -m jaxpar.plot RUN_DIR ... [--out FILE]`) and the bench bars.

Every figure is drawn on matplotlib's file-only Agg backend, so no display is needed.
"""

import json
from pathlib import Path

from jaxpar.core.errors import UserError
from jaxpar.core.paths import check_writable, checked
from jaxpar.training.run import metrics

EMA_WEIGHT = 0.9  # the train curve's smoothing, as TensorBoard's slider sets it
CHANCE = {"hellaswag": 0.25, "piqa": 0.5, "winogrande": 0.5}  # ARC's items have 3 to 5 choices


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


PARTIAL = ".partial"  # the suffix of a picture being drawn, before its rename
WRITER = "jaxpar"  # the picture's Software or Creator field: marks one jaxpar drew, which it may draw again
# Where each kind of picture keeps that mark (PDF's near its end). Other kinds (JPEG, TIFF ...) keep
# none, so an existing one is never taken for jaxpar's and is never overwritten.
MARKS = {"png": b"Software\x00" + WRITER.encode(), "pdf": b"/Creator (" + WRITER.encode() + b")",
         "svg": b"<dc:title>" + WRITER.encode() + b"</dc:title>", "ps": b"%%Creator: " + WRITER.encode(),
         "eps": b"%%Creator: " + WRITER.encode()}


def save(plt, fig, out_png) -> Path:
    """The figure into `out_png`, under a temporary name first: a failed write leaves no half a picture."""
    out_png = Path(out_png)
    kind = out_png.suffix.lstrip(".").lower() or "png"
    partial = out_png.with_name(out_png.name + PARTIAL)
    fig.tight_layout()
    mark = ({"Software": WRITER} if kind == "png" else {"Creator": WRITER}) if kind in MARKS else None
    try:
        fig.savefig(partial, dpi=100, format=kind, metadata=mark)
        partial.replace(out_png)
    finally:
        plt.close(fig)  # pyplot keeps every open figure alive otherwise
        partial.unlink(missing_ok=True)  # gone already, unless the write failed
    return out_png


def drawn_by_jaxpar(path: Path) -> bool:
    """Whether a picture says jaxpar drew it: the mark `save` writes, near its start or its end."""
    mark = MARKS.get(path.suffix.lstrip(".").lower())
    try:
        with open(path, "rb") as f:
            head = f.read(65536)
            f.seek(max(0, f.seek(0, 2) - 8192))
            tail = f.read()
    except OSError:
        return False
    if path.suffix.lower() == ".png" and not head.startswith(b"\x89PNG\r\n\x1a\n"):
        return False
    return mark is not None and (mark in head or mark in tail)


def picture_path(out: str | None, default: str, flag: str = "--out") -> Path:
    """Where a picture goes, checked before any work: `out` (in it, when a folder, as `default`'s
    name), or `default`; neither may replace a file jaxpar did not draw. Its name says its kind
    (.png, .pdf, .svg ...), and its folder must exist."""
    from matplotlib.backend_bases import FigureCanvasBase
    path = Path(out or default)
    if path.is_dir():
        path = path / Path(default).name
    checked(path, flag, spare=len(PARTIAL))  # `save` writes the picture beside it first
    kinds = FigureCanvasBase.get_supported_filetypes()
    kind = path.suffix.lstrip(".").lower()
    if kind not in kinds:
        raise UserError(f"{flag} '{path}': a picture's name must end in one of .{', .'.join(sorted(kinds))} "
                        "(its kind); pass a file name such as loss.png")
    if not path.parent.is_dir():
        raise UserError(f"{flag} '{path}': the folder '{path.parent}' does not exist; make it, or pass another path")
    check_writable(path.parent, path, flag)
    if path.is_symlink() or path.exists() and not path.is_file():
        raise UserError(f"{flag} '{path}' is not a plain file; pass a path for the picture")
    if path.exists() and not drawn_by_jaxpar(path):  # given or by default: what jaxpar did not draw is kept
        raise UserError(f"'{path}' was not drawn by jaxpar, which would overwrite it; pass {flag} to name "
                        "another picture to write, or move it away")
    return path


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

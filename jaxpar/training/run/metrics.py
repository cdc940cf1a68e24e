"""Per-step metrics: fetched from the device in batches, checked for divergence, and written out.

Every step's loss and gradient norm are fetched every FETCH_EVERY steps (and before each
checkpoint), so a non-finite value stops the run without a host sync per step. The logged steps go
to metrics.jsonl (strict JSON: non-finite values as null), TensorBoard and, if asked, W&B.
"""

import errno
import json
import math
import platform
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

FETCH_EVERY = 10  # steps between metric fetches: each wakes the host thread, which takes a core
TENSORBOARD = "tensorboard"  # the folder inside a run's --out: scalars, and --profile's trace
SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
           "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "val_loss": "val/loss"}


class Diverged(Exception):
    """A step's loss or gradient norm is not finite; `record` is that step's metrics."""

    def __init__(self, record: dict):
        super().__init__(f"non-finite metrics at step {record['step']}")
        self.record = record

    def explain(self, last_good: str | None, grad_clip: float) -> str:
        step, loss, norm = self.record["step"], self.record["loss"], self.record["grad_norm"]
        what = f"loss is {loss}" if not math.isfinite(loss) else f"grad norm is {norm}"
        detail = f"grad norm {norm}" if not math.isfinite(loss) else f"loss {loss:.4f}"
        found = (f"the last good checkpoint is {last_good}" if last_good
                 else "no checkpoint was written before it")
        fix = "lower train.lr" + ("" if grad_clip > 0 else " or enable train.grad_clip")
        return f"{what} at step {step} ({detail}); {found}; {fix}"


def is_finite(record: dict) -> bool:
    return math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])


class StepLogger:
    """Holds every step's metrics on device and fetches them in one go every FETCH_EVERY steps.

    Every step is checked for divergence; only the steps that `should_log` are recorded. A step's
    time is the average over the fetch window it belongs to (compile time excluded).
    """

    def __init__(self, on_record, should_log, lr_at, tokens_per_step: int, flops_per_token: int,
                 peak: float, constants: dict):
        self.on_record, self.should_log, self.lr_at = on_record, should_log, lr_at
        self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak
        self.constants = constants
        self.pending: list = []
        self.step_times: list[float] = []

    def restart_clock(self, completed_step: int):
        """Time from now on; `completed_step` has already finished."""
        self.clock, self.clock_step = time.perf_counter(), completed_step

    def add(self, step: int, metrics):
        self.pending.append((step, metrics))

    def flush(self, last_step: int | None = None):
        """Fetch pending metrics; `last_step` (default: the newest pending) ends the window.

        Raises Diverged at the first non-finite step, after recording the steps up to it.
        """
        import jax
        if not self.pending:
            return
        fetched = jax.device_get([m for _, m in self.pending])  # waits for the newest step
        last_step = self.pending[-1][0] if last_step is None else last_step
        now = time.perf_counter()
        step_time = (now - self.clock) / max(last_step - self.clock_step, 1)
        self.restart_clock(last_step)
        tokens_per_s = self.tokens_per_step / step_time
        steps, self.pending = [step for step, _ in self.pending], []
        for step, metrics in zip(steps, fetched):
            aux = {name: float(value) for name, value in metrics.items() if name not in ("loss", "grad_norm")}
            record = {"step": step, "loss": float(metrics["loss"]), "lr": self.lr_at(step),
                      "grad_norm": float(metrics["grad_norm"]), **aux,
                      "step_time_ms": round(1e3 * step_time, 3),
                      "tokens_per_s": round(tokens_per_s, 1),
                      "mfu": tokens_per_s * self.flops_per_token / self.peak, **self.constants}
            finite = is_finite(record)
            if self.should_log(step) or not finite:
                self.step_times.append(step_time)
                self.on_record(record)
            if not finite:
                raise Diverged(record)


def strict_json(record: dict) -> str:
    """One JSON line that any strict parser reads: NaN and infinities become null."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v
             for k, v in record.items()}
    return json.dumps(clean, allow_nan=False)


def read_metrics(path: Path) -> tuple[list[dict], list[int]]:
    """metrics.jsonl's records, and the numbers of the lines skipped: torn, not UTF-8, not JSON,
    or not a record with an integer step. Skipped lines get one warning on stderr that counts them
    and says where. An interrupted write tears only the last line; one before it means something
    else damaged the file, which the warning says, but the run's other records are kept either way."""
    records, skipped, last = [], [], 0
    for number, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        last = number
        try:
            record = json.loads(raw.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError and JSONDecodeError alike
            record = None
        if isinstance(record, dict) and type(record.get("step")) is int:
            records.append(record)
        else:
            skipped.append(number)
    if skipped:
        print(f"jaxpar: warning: {path}: {skipped_lines(skipped, last)}", file=sys.stderr)
    return records, skipped


def skipped_lines(skipped: list[int], last: int) -> str:
    """'skipped N torn or undecodable lines (lines ...: why)'; `last` is the last line's number."""
    plural = "s" * (len(skipped) > 1)
    where = ", ".join(map(str, skipped[:5])) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
    why = ("the last, what a write cut short leaves" if skipped == [last] else
           f"line {skipped[0]} is not the last, so more than a write cut short damaged the file")
    return f"skipped {len(skipped)} torn or undecodable line{plural} (line{plural} {where}: {why})"


def open_metrics(path: Path, resume_step: int):
    """metrics.jsonl opened for appending, holding only lines for steps before `resume_step`.

    A resumed run repeats the steps after its checkpoint, so their old lines (train steps >= the
    checkpoint's and val losses at or after it) would otherwise appear twice. Lines that do not
    read (read_metrics) are dropped with the rest.
    """
    kept = []
    if resume_step > 0 and path.exists():
        # strict_json gives back the very line it wrote for a record read from it.
        kept = [strict_json(record) for record in read_metrics(path)[0] if record["step"] < resume_step]
    partial = path.with_name(path.name + ".tmp")
    partial.write_text("".join(line + "\n" for line in kept))
    partial.replace(path)  # never a half-rewritten file
    return open(path, "a")


TENSORBOARD_QUEUE = 1000  # events: a record's few scalars never fill it before its writer is checked


def keep_tensorboard_errors() -> None:
    """An error in tensorboardX's writer thread is kept on the thread for check_tensorboard, which
    reports it as one line, instead of printed as a traceback."""
    if getattr(threading.excepthook, "keeps_tensorboard_errors", False):
        return
    previous = threading.excepthook

    def hook(args) -> None:
        if type(args.thread).__name__ == "_EventLoggerThread":
            args.thread.error = args.exc_value
        else:
            previous(args)
    hook.keeps_tensorboard_errors = True
    threading.excepthook = hook


class MetricsWriters:
    """Where the records go: metrics.jsonl, TensorBoard and W&B (the last two as configured).

    A resumed run starts at `resume_step`: metrics.jsonl drops the lines from there on, and
    TensorBoard purges its events from there on (a SessionLog START at that step), so no step is
    ever recorded twice.
    """

    def __init__(self, out_dir: Path, resume_step: int, cfg, aux: tuple = (), tasks: tuple = (),
                 sources: tuple = ()):
        """`aux`: the model's auxiliary losses, `tasks`: --eval.tasks' names, `sources`: a
        mixture's; each one's values are scalars too (train/, eval/ and val/ ones)."""
        self.scalars = (SCALARS | {name: f"train/{name}" for name in aux}
                        | {f"{task}/{m}": f"eval/{task}/{m}" for task in tasks for m in ("acc", "acc_norm")}
                        | {f"val_loss/{name}": f"val/loss/{name}" for name in sources})
        self.jsonl = open_metrics(out_dir / "metrics.jsonl", resume_step)
        self.tensorboard = self.wandb = None
        self.tensorboard_dir = out_dir / TENSORBOARD
        if cfg.log.tensorboard:
            from tensorboardX import SummaryWriter
            # The event file's name holds the time in whole seconds: a run resumed within the same
            # second would overwrite its predecessor's file without a suffix of its own.
            self.tensorboard = SummaryWriter(str(self.tensorboard_dir), purge_step=resume_step,
                                             flush_secs=10, filename_suffix=f".{uuid.uuid4().hex[:8]}",
                                             max_queue=TENSORBOARD_QUEUE)
            keep_tensorboard_errors()
        if cfg.log.wandb:
            self.wandb = start_wandb(cfg, out_dir)

    def write(self, record: dict) -> None:
        self.jsonl.write(strict_json(record) + "\n")
        self.jsonl.flush()
        # A diverged step's non-finite values stay out of the curves (metrics.jsonl has them).
        scalars = {self.scalars[k]: v for k, v in record.items() if k in self.scalars and math.isfinite(v)}
        if self.tensorboard is not None:
            self.check_tensorboard()
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])

    def check_tensorboard(self, worker=None, closed: bool = False) -> None:
        """Raise what stopped tensorboardX's writer thread (a full disk, say): its queue would
        fill, and the next event would wait for it forever."""
        if worker is None:  # tensorboardX's own thread: it has no public handle
            worker = getattr(getattr(self.tensorboard.file_writer, "event_writer", None), "_worker", None)
        error = getattr(worker, "error", None)
        if worker is None or (error is None and (closed or worker.is_alive())):
            return
        self.tensorboard = None  # closing it would wait for the thread too
        if isinstance(error, OSError):
            raise OSError(error.errno, error.strerror, error.filename or str(self.tensorboard_dir))
        raise OSError(errno.EIO, f"TensorBoard's writer stopped ({error!r})", str(self.tensorboard_dir))

    def close(self) -> None:
        self.jsonl.close()
        if self.tensorboard is not None:
            worker = getattr(getattr(self.tensorboard.file_writer, "event_writer", None), "_worker", None)
            self.check_tensorboard(worker)
            self.tensorboard.close()  # its thread writes the last events, then ends
            self.check_tensorboard(worker, closed=True)
        if self.wandb is not None:
            self.wandb.finish()


def record(writers: MetricsWriters | None, bar, values: dict, line: str) -> None:
    """An evaluation's `values` into the writers, and its `line` above the progress bar."""
    if writers:
        writers.write(values)
    if not bar.disable:
        bar.write(f"step {values['step']}: {line}")


def start_wandb(cfg, out_dir: Path):
    """A W&B run whose id is kept in <out>/wandb_id, so a resumed training run logs to it again.

    W&B ignores steps it has already seen; WANDB_MODE=offline works without a network.
    """
    import wandb
    id_file = out_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
    id_file.write_text(run_id + "\n")
    return wandb.init(project=cfg.log.wandb, id=run_id, resume="allow", dir=str(out_dir),
                      config=cfg.to_dict(), name=out_dir.name)


def summarise(info: dict, losses: dict, val_losses: dict, step_times: list[float]) -> dict:
    """A run's summary for run.json (medians, as the first interval can include one-off work)."""
    median = statistics.median(step_times) if step_times else float("nan")
    tokens_per_s = info["tokens_per_step"] / median
    return {
        "final_loss": losses[max(losses)] if losses else None,
        "final_val_loss": val_losses[max(val_losses)] if val_losses else None,
        "step_time_ms_median": round(1e3 * median, 3),
        "tokens_per_s_median": round(tokens_per_s, 1),
        "mfu_median": tokens_per_s * info["flops_per_token"] / info["peak_flops"],
    }


def versions() -> dict:
    """The library versions run.json records."""
    import flax
    import jax
    import optax

    import jaxpar
    return {"jaxpar": jaxpar.__version__, "jax": jax.__version__, "jaxlib": jax.lib.__version__,
            "flax": flax.__version__, "optax": optax.__version__,
            "python": platform.python_version()}

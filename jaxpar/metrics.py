"""Per-step metrics: fetched from the device in batches, written to metrics.jsonl (kept on resume)."""

import json
import time
from pathlib import Path

FETCH_EVERY = 10  # steps between metric fetches: each wakes the host thread, which takes a core


class StepLogger:
    """Holds logged steps' metrics on device and fetches them in one go every FETCH_EVERY steps.

    A step's time is the average over the fetch window it belongs to (compile time excluded).
    """

    def __init__(self, on_record, lr_at, tokens_per_step: int, flops_per_token: int, peak: float,
                 constants: dict):
        self.on_record, self.lr_at, self.constants = on_record, lr_at, constants
        self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak
        self.pending: list = []
        self.step_times: list[float] = []

    def restart_clock(self, completed_step: int):
        """Time from now on; `completed_step` has already finished."""
        self.clock, self.clock_step = time.perf_counter(), completed_step

    def add(self, step: int, metrics):
        self.pending.append((step, metrics))

    def flush(self, last_step: int | None = None):
        """Fetch pending metrics; `last_step` (default: the newest pending) ends the window."""
        import jax
        if not self.pending:
            return
        fetched = jax.device_get([m for _, m in self.pending])  # waits for the newest step
        last_step = self.pending[-1][0] if last_step is None else last_step
        now = time.perf_counter()
        step_time = (now - self.clock) / max(last_step - self.clock_step, 1)
        self.restart_clock(last_step)
        tokens_per_s = self.tokens_per_step / step_time
        for (step, _), metrics in zip(self.pending, fetched):
            self.step_times.append(step_time)
            self.on_record({"step": step, "loss": float(metrics["loss"]), "lr": self.lr_at(step),
                            "grad_norm": float(metrics["grad_norm"]),
                            "step_time_ms": round(1e3 * step_time, 3),
                            "tokens_per_s": round(tokens_per_s, 1),
                            "mfu": tokens_per_s * self.flops_per_token / self.peak, **self.constants})
        self.pending = []


def open_metrics(path: Path, resume_step: int):
    """metrics.jsonl opened for appending, holding only lines for steps before `resume_step`.

    A resumed run repeats the steps after its checkpoint, so their old lines (train steps >= the
    checkpoint's and val losses at or after it) would otherwise appear twice.
    """
    kept = []
    if resume_step > 0 and path.exists():
        kept = [line for line in path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] < resume_step]
    partial = path.with_name(path.name + ".tmp")
    partial.write_text("".join(line + "\n" for line in kept))
    partial.replace(path)  # never a half-rewritten file
    return open(path, "a")

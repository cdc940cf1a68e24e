"""`--profile START:END`: a jax.profiler trace of training steps START..END-1 in <out>/tensorboard.

The trace lies beside the run's TensorBoard scalars (under plugins/profile), so
`tensorboard --logdir <out>/tensorboard` shows both; the *.trace.json.gz file opens in Perfetto.
"""

from pathlib import Path

import jax
from tqdm import tqdm

from jaxpar.core.errors import UserError
from jaxpar.training.run.metrics import TENSORBOARD


def parse_spec(spec: str, total_steps: int) -> tuple[int, int]:
    """'5:8' -> (5, 8): the steps 5, 6 and 7, as a Python range; must lie within the run."""
    start, colon, end = spec.partition(":")
    try:
        if not colon:
            raise ValueError
        start, end = int(start), int(end)
    except ValueError:
        raise UserError(f"--profile expects START:END with integer steps, e.g. 5:8 traces steps "
                        f"5 to 7, got {spec!r}") from None
    if not 0 <= start < end:
        raise UserError(f"--profile {spec} traces no steps; use 0 <= START < END, e.g. 5:8")
    if end > total_steps:
        raise UserError(f"--profile {spec} ends after the run's last step; END must be at most "
                        f"train.steps={total_steps}")
    return start, end


class StepProfiler:
    """Starts the trace before step START and stops it after step END-1 has finished.

    Steps are dispatched asynchronously, so a step's call returns before it runs: both edges block
    on a step's outputs, or the trace would hold earlier steps and miss the last one's work.
    A spec of None makes every call a no-op, so the training loop needs no branches.
    """

    def __init__(self, spec: str | None, out_dir: Path | None, total_steps: int):
        self.steps = None if spec is None else parse_spec(spec, total_steps)
        if self.steps is not None and out_dir is None:
            raise UserError("--profile needs an output directory (--out) to write the trace to")
        self.trace_dir = None if out_dir is None else Path(out_dir) / TENSORBOARD

    def before_step(self, step: int) -> None:
        if self.steps is not None and step == self.steps[0]:
            jax.profiler.start_trace(self.trace_dir)

    def after_step(self, step: int, outputs) -> None:
        """`outputs`: anything the step returned, e.g. (state, metrics); blocked on at the edges."""
        if self.steps is None:
            return
        start, end = self.steps
        if step in (start - 1, end - 1):
            jax.block_until_ready(outputs)
        if step == end - 1:
            jax.profiler.stop_trace()
            tqdm.write(f"profile: steps {start} to {end - 1} traced into {self.trace_dir}")

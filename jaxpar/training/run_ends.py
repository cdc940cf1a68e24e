"""How a run's outputs start, and how a run ends other than by finishing: stopped by a signal
before its first step (nothing new left behind), or stopped by a non-finite step (one line that
names the newest checkpoint that verifies)."""

import errno
import json
import shutil
from pathlib import Path

from jaxpar.core.errors import UserError
from jaxpar.parallel.distributed import is_main_process
from jaxpar.training.metrics import Diverged, MetricsWriters, strict_json
from jaxpar.training.resume import restore_train_state
from jaxpar.training.run_state import Compiled, RunResult, Setup
from jaxpar.training.save_faults import newest_step, reason

OUTPUTS = ("run.json", "metrics.jsonl", "tensorboard", "wandb", "wandb_id")  # what open_outputs may make


def open_outputs(p: Setup, c: Compiled, out_dir: Path | None, fresh: bool) -> tuple[MetricsWriters | None, list]:
    """Clear what a fresh start leaves, set damaged checkpoints aside; run.json; the metrics
    writers, and the outputs that did not exist before."""
    if p.ckpt is not None and is_main_process():
        if fresh:
            p.ckpt.remove_all()
        p.ckpt.set_aside(p.damaged)  # newer than the restored step: a new save needs the name
    if out_dir is None or not is_main_process():
        return None, []
    created = [out_dir / name for name in OUTPUTS if not (out_dir / name).exists()]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "run.json").write_text(json.dumps(c.info, indent=2))
    tasks = tuple(task.name for task, _ in c.tasks.loaded) if c.tasks else ()
    return MetricsWriters(out_dir, p.start, p.cfg, tuple(p.model.family.loss_weights()), tasks,
                          tuple(c.source_val)), created


def remove_outputs(paths: list[Path]) -> None:
    """Undo open_outputs' new files: a run stopped before its first step leaves nothing new."""
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def last_verified(p: Setup) -> str | None:
    """The newest checkpoint whose arrays read back and match their checksums (None: there is none)."""
    if p.ckpt is None:
        return None
    try:
        restored = restore_train_state(p.ckpt, p.built, p.dataset.tokenizer)
    except UserError:  # none is intact
        return None
    if restored is None:
        return None
    found = restored[1]
    unverified = "" if found.verified else " (saved without checksums: not verified)"
    return f"{p.ckpt.directory / str(found.step)}{unverified}"


def stop_diverged(p: Setup, info: dict, out_dir: Path | None, diverged: Diverged) -> UserError:
    """The one-line error for a diverged run, after recording it in run.json."""
    info["diverged"] = json.loads(strict_json({k: diverged.record[k]
                                               for k in ("step", "loss", "grad_norm")}))
    if out_dir is not None and is_main_process():
        (out_dir / "run.json").write_text(json.dumps(info, indent=2))
    return UserError(diverged.explain(last_verified(p), p.cfg.optimizer.grad_clip))


def write_failed(p: Setup, out_dir: Path | None, error: OSError) -> Exception:
    """A metrics or TensorBoard write that failed for want of room or permission, as one line that
    names the checkpoint that resumes; other OSErrors pass unchanged."""
    if error.errno not in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EPERM):
        return error
    last = newest_step(p.ckpt.directory) if p.ckpt is not None else None
    kept = f"the last good checkpoint is {p.ckpt.directory / str(last)}" if last is not None else "no checkpoint was saved"
    where = f" '{error.filename}'" if error.filename else f" in '{out_dir}'"
    return UserError(f"cannot write{where} ({reason(error)}); {kept}; free space on that disk or make the "
                     "folder writable, then run the same command to resume")


def stopped_early(p: Setup, signal_name: str) -> RunResult:
    """A run stopped by a signal before its first step: it trained and saved nothing."""
    where = str(p.ckpt.directory) if p.ckpt else None
    return RunResult(params=p.state.params, info={"resumed_from": p.start, "checkpoints": where, "summary": None,
                                                  "interrupted": {"step": p.start, "signal": signal_name,
                                                                  "before_first_step": True}})



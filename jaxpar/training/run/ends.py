"""How a run's outputs start, and how a run ends other than by finishing: stopped by a signal
before its first step (nothing new left behind), or stopped by a non-finite step (one line that
names the newest checkpoint that verifies).

The outputs in --out are checked before anything is compiled (`run_outputs`): each path holds
nothing, or what jaxpar wrote there (jaxpar.core.written's record), of the kind it writes. A run
writes and removes only those; `--fresh` removes only the checkpoints jaxpar saved.
"""

import errno
import json
import sys
from pathlib import Path

from jaxpar.core.errors import UserError
from jaxpar.core.written import FILE, FOLDER, Outputs, kind_of
from jaxpar.parallel.distributed import is_main_process
from jaxpar.training.checkpoints.checkpoint import CHECKPOINTS
from jaxpar.training.checkpoints.resume import restore_train_state
from jaxpar.training.checkpoints.save_faults import newest_step, reason
from jaxpar.training.run.metrics import Diverged, MetricsWriters, strict_json
from jaxpar.training.run.state import Compiled, RunResult, Setup

# What a run may write in --out, besides jaxpar.lock and checkpoints/ (metrics.jsonl.tmp: its rewrite)
OUTPUTS = {"run.json": FILE, "metrics.jsonl": FILE, "metrics.jsonl.tmp": FILE, "loss.png": FILE,
           "tensorboard": FOLDER, "wandb": FOLDER, "wandb_id": FILE}


def is_run_json(path: Path) -> bool:
    """Whether `path` is a run.json that jaxpar.train wrote: it marks a run from before the record."""
    try:
        return "jaxpar" in json.loads(path.read_text())["versions"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def run_outputs(cfg, out_dir: Path, profile: str | None) -> Outputs:
    """The run's outputs in out_dir, checked: a UserError, before any work, for a path that holds what
    jaxpar did not write there, or the wrong kind of thing (jaxpar.core.written)."""
    skip = set() if cfg.log.tensorboard or profile else {"tensorboard"}
    skip |= set() if cfg.log.wandb else {"wandb", "wandb_id"}
    outputs = Outputs(out_dir, {n: k for n, k in OUTPUTS.items() if n not in skip},
                      legacy=("run.json", is_run_json))
    outputs.check()
    found = kind_of(out_dir / CHECKPOINTS)
    if found not in (None, FOLDER) and not (out_dir / CHECKPOINTS).is_dir():  # a link to a folder is one
        raise UserError(f"'{out_dir / CHECKPOINTS}' is a {found}, where jaxpar keeps the run's checkpoints "
                        "in a folder; move it away, or pass another --out")
    return outputs


def check_wandb(cfg) -> None:
    """Before anything is written: --log.wandb needs the wandb package."""
    import importlib.util
    if cfg.log.wandb and importlib.util.find_spec("wandb") is None:
        raise UserError(f"--log.wandb={cfg.log.wandb} needs W&B: pip install wandb (or "
                        "pip install 'jaxpar[wandb]'), or drop --log.wandb")


def open_outputs(p: Setup, c: Compiled, outputs: Outputs | None, fresh: bool) -> tuple[MetricsWriters | None, list]:
    """Clear the checkpoints a fresh start leaves, set damaged ones aside; run.json; the metrics
    writers, and the outputs that did not exist before."""
    if p.ckpt is not None and is_main_process():
        p.ckpt.set_aside(p.damaged)  # newer than the restored step: a new save needs the name
        if fresh:  # (nothing was restored, so nothing was set aside)
            kept = p.ckpt.remove_own()
            if kept:
                print(f"jaxpar.train: --fresh removed only the checkpoints jaxpar saved in '{p.ckpt.directory}' "
                      f"and kept what it did not write: {', '.join(kept)}", file=sys.stderr)
    if outputs is None or not is_main_process():
        return None, []
    out_dir = outputs.folder
    created = [name for name in outputs.names if kind_of(out_dir / name) is None]
    outputs.claim(*outputs.names)
    (out_dir / "run.json").write_text(json.dumps(c.info, indent=2))
    tasks = tuple(task.name for task, _ in c.tasks.loaded) if c.tasks else ()
    return MetricsWriters(out_dir, p.start, p.cfg, tuple(p.model.family.loss_weights()), tasks,
                          tuple(c.source_val)), created


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
    last = last_verified(p)
    info["diverged"] = json.loads(strict_json({k: diverged.record[k]
                                               for k in ("step", "loss", "grad_norm")}))
    if out_dir is not None and is_main_process():
        (out_dir / "run.json").write_text(json.dumps(info, indent=2))
    return UserError(diverged.explain(last, p.cfg.optimizer.grad_clip))


def write_failed(p: Setup, out_dir: Path | None, error: OSError) -> Exception:
    """A metrics or TensorBoard write that failed for want of room or permission, as one line that
    names the checkpoint that resumes; other OSErrors pass unchanged."""
    if error.errno not in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EPERM):
        return error
    last = newest_step(p.ckpt.directory) if p.ckpt is not None else None
    kept = (f"the last good checkpoint is {p.ckpt.directory / str(last)}" if last is not None
            else "no checkpoint was saved")
    where = f" '{error.filename}'" if error.filename else f" in '{out_dir}'"
    return UserError(f"cannot write{where} ({reason(error)}); {kept}; free space on that disk or make the "
                     "folder writable, then run the same command to resume")


def stopped_early(p: Setup, signal_name: str) -> RunResult:
    """A run stopped by a signal before its first step: it trained and saved nothing."""
    where = str(p.ckpt.directory) if p.ckpt else None
    return RunResult(params=p.state.params, info={"resumed_from": p.start, "checkpoints": where, "summary": None,
                                                  "interrupted": {"step": p.start, "signal": signal_name,
                                                                  "before_first_step": True}})



"""A run's first phase: the train state it starts from, restored from --out's newest checkpoint
(jaxpar.training.checkpoints.resume) or new, and what the restore found (its step, the damaged
checkpoints to set aside, a data.mix changed since it was saved).
"""

from pathlib import Path

from jaxpar.core.errors import UserError
from jaxpar.data.loader import Dataset
from jaxpar.data.mixture import mix_change
from jaxpar.training.checkpoints.checkpoint import CHECKPOINTS, Checkpoints
from jaxpar.training.checkpoints.resume import restore_train_state
from jaxpar.training.run.state import Setup
from jaxpar.training.step.build import Built


def set_up(built: Built, dataset: Dataset, out_dir: Path | None, fresh: bool) -> Setup:
    """Phase 1: the train state, restored from out_dir's newest checkpoint unless `fresh`. Call
    under `jax.set_mesh(built.mesh)`."""
    cfg = built.cfg
    ckpt = Checkpoints(out_dir / CHECKPOINTS, cfg.ckpt.keep) if out_dir is not None else None
    restored = None if ckpt is None or fresh else restore_train_state(ckpt, built, dataset.tokenizer)
    state, found = restored or (built.init_state(cfg.train.init_from), None)
    meta, damaged = (found.meta, found.damaged) if found else (None, {})
    start = meta["step"] if meta else 0
    if start > cfg.train.steps:
        raise UserError(f"the checkpoint in '{ckpt.directory}' is at step {start}, past --steps "
                        f"{cfg.train.steps}; pass --steps {start} or more, or start over with --fresh")
    changed = mix_change(meta["config"]["data"], cfg.data, start) if meta else None
    return Setup(built, dataset, ckpt, state, start, damaged, changed)

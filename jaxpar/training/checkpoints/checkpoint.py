"""Orbax checkpoints in `<out>/checkpoints`: async saves, verified restores onto any mesh and ZeRO stage.

Each checkpoint holds three items: `params`, `opt_state`, and `meta` (JSON: the step, the RNG
state, the resolved config, the tokenizer, the optimizer's name and a checksum of every array,
jaxpar.training.checkpoints.checksums), so sampling reads only `params` and `meta`. `opt_state` is the
optimizer's own state: gradient clipping, which keeps none, is not in it.

A restore tells two failures apart. A checkpoint that does not fit the run (another model,
optimizer state, tokenizer: its saved shapes against the run's) is the user's to settle: a
UserError, and nothing is touched. A checkpoint proven damaged (unreadable, or an array whose
checksum differs) is skipped for the one before it; the run that then trains sets it aside under
`<step>.damaged`, never deletes it.
"""

import contextlib
import dataclasses
import logging
import re
import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxpar.core.config import Config
from jaxpar.core.errors import UserError
from jaxpar.core.removal import remove_tree
from jaxpar.training.checkpoints.checksums import item_checksums, mismatches
from jaxpar.training.checkpoints.save_faults import (
    TEMPORARY,
    SaveFailed,
    check_room,
    quiet_orbax_errors,
    reason,
    room_message,
    save_failed,
)
from jaxpar.training.checkpoints.saved_trees import first_difference

CHECKPOINTS = "checkpoints"  # the folder inside a run's --out
DAMAGED = "damaged"  # the suffix of a checkpoint set aside: <step>.damaged
# Bumped whenever a param's shape or axis order changes, so that an older checkpoint is named as
# such rather than reported as damaged. 2: mlp_out's kernel is (layers, embed, mlp). 3: dense first
# layers stacked apart, under lead_blocks (jaxpar.models.lead); a model without them reads layout 2.
PARAM_LAYOUT = 3
ARRAY_ITEMS = ("params", "opt_state")
ORBAX_METADATA = "_CHECKPOINT_METADATA"  # in every step folder orbax commits


def find_checkpoints(path) -> Path:
    """The checkpoints folder of a run directory, or `path` itself if it is one."""
    path = Path(path)
    for candidate in (path / CHECKPOINTS, path):
        if candidate.is_dir() and any(child.name.isdigit() for child in candidate.iterdir()):
            return candidate
    raise UserError(f"no checkpoints in '{path}'; pass a training run's --out directory "
                    f"or its {CHECKPOINTS} folder")


def checkpoint_bytes(params, opt_state) -> int:
    """A checkpoint's size on disk, at least: its arrays' bytes, and 64 KiB of metadata."""
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves((params, opt_state))) + 2**16


def make_meta(cfg, tokenizer, step: int) -> dict:
    # Data order and dropout keys are pure functions of (seed, step): that is the whole RNG state.
    return {"step": step, "rng": {"seed": cfg.train.seed, "step": step}, "config": cfg.to_dict(),
            "tokenizer": tokenizer.to_meta(), "param_layout": PARAM_LAYOUT, "optimizer": cfg.optimizer.name}


def check_layout(meta: dict, where: Path) -> None:
    layout = meta.get("param_layout", 1)  # checkpoints from before the field have layout 1
    if layout == 2 and not Config.from_dict(meta["config"]).model.lead_layers:
        return  # layout 3 changed only models with dense first layers
    if layout != PARAM_LAYOUT:
        age = "an older" if layout < PARAM_LAYOUT else "a newer"
        raise UserError(f"the checkpoint '{where}' was written by {age} jaxpar (param layout "
                        f"{layout}; this one reads {PARAM_LAYOUT}); train it again with --fresh, or "
                        "use the jaxpar that wrote it")


def abstract_tree(shapes, shardings):
    """ShapeDtypeStructs that carry the target shardings: orbax restores each shard in place."""
    return jax.tree.map(lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where),
                        shapes, shardings)


@dataclasses.dataclass
class Restored:
    step: int
    meta: dict
    items: dict  # item name -> its restored tree
    damaged: dict[int, str]  # newer checkpoints skipped as damaged: step -> why
    verified: bool  # every restored array matched its checksum (False: saved without checksums)


class Damaged(Exception):
    """A checkpoint's bytes are not what was saved."""


def generic_mismatch(meta: dict, item: str, difference: str, saved_tree) -> str:
    return (f"its {item} differ from this run's ({difference}); resume with the settings it was "
            "trained with, or train in another --out (--fresh would delete these checkpoints)")


class Checkpoints:
    """A run's checkpoints folder. Nothing is created on disk before the first save.

    `keep`: how many of the newest checkpoints saving keeps. Reads go through a read-only
    manager that is closed at once, so only a run that saves holds one open (until `close`).
    """

    def __init__(self, directory, keep: int | None = None):
        self.directory, self.keep = Path(directory), keep
        self._writer, self._saving = None, None  # the step of the save in flight

    @contextlib.contextmanager
    def _reader(self):
        absl_logger = logging.getLogger("absl")
        level = absl_logger.level  # orbax warns that a read-only manager is read-only
        absl_logger.setLevel(logging.ERROR)
        handlers = {name: ocp.StandardCheckpointHandler() for name in ARRAY_ITEMS}
        try:
            options = ocp.CheckpointManagerOptions(read_only=True, create=False)
            manager = ocp.CheckpointManager(self.directory.absolute(), options=options,
                                            item_handlers={**handlers, "meta": ocp.JsonCheckpointHandler()})
        finally:
            absl_logger.setLevel(level)
        try:
            yield manager
        finally:
            manager.close()

    @property
    def writer(self) -> ocp.CheckpointManager:
        if self._writer is None:
            options = ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=False,
                                                   enable_async_checkpointing=True)
            self._writer = ocp.CheckpointManager(self.directory.absolute(), options=options)
            quiet_orbax_errors()  # a failed save is said once, as a SaveFailed
        return self._writer

    def steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        with self._reader() as manager:
            return sorted(manager.all_steps())

    def save(self, step: int, params, opt_state, meta: dict) -> None:
        """Start an async save and return. It waits for the previous save first, and copies the
        arrays to host memory before returning, so the train step may donate them afterwards.

        The arrays' checksums go into meta, in the same atomic commit as the arrays. A save that
        cannot be made (jaxpar.training.checkpoints.save_faults) raises SaveFailed, the newest complete
        checkpoint kept.
        """
        self.wait()
        try:
            check_room(self.directory, checkpoint_bytes(params, opt_state))
        except OSError as e:
            raise save_failed(self.directory, step, room_message(e)) from None
        meta = {**meta, "checksums": item_checksums({"params": params, "opt_state": opt_state})}
        self.directory.mkdir(parents=True, exist_ok=True)
        self._saving = step
        try:
            self.writer.save(step, args=ocp.args.Composite(
                params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
                meta=ocp.args.JsonSave(meta)))
        except Exception as e:  # noqa: BLE001 (orbax and tensorstore raise many kinds)
            raise self._failed(e) from None

    def check_room(self, params, opt_state) -> None:
        """Before the compile: a UserError unless a checkpoint of these arrays can be saved here."""
        size = checkpoint_bytes(params, opt_state)
        try:
            check_room(self.directory, size)
        except OSError as e:
            raise UserError(f"cannot save checkpoints in '{self.directory}' ({room_message(e)}); free space "
                            "on that disk, make the folder writable, or pass another --out") from None

    def _failed(self, error: Exception) -> SaveFailed:
        """The save in flight failed: its writer is dropped (its threads may wait on, stuck)."""
        self._writer, step, self._saving = None, self._saving, None
        return save_failed(self.directory, step, reason(error), stuck=True)

    def wait(self) -> None:
        if self._writer is not None:
            try:
                self._writer.wait_until_finished()
            except Exception as e:  # noqa: BLE001 (a save failed in orbax's threads, of any kind)
                raise self._failed(e) from None
        self._saving = None

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def restore_latest(self, targets_for, explain_mismatch=generic_mismatch) -> Restored | None:
        """The newest checkpoint that reads and verifies, restored; None when there is none.

        `targets_for(meta)` returns the abstract tree of each item to restore; it raises
        UserError when the checkpoint cannot fit this run. So does a saved tree whose shapes
        differ from the targets': `explain_mismatch(meta, item, difference, saved_tree)` says
        why and how to go on. A damaged checkpoint gets a one-line warning, and the previous one
        is tried.
        """
        if not self.directory.is_dir():
            return None
        damaged = {}
        with self._reader() as manager:
            for step in sorted(manager.all_steps(), reverse=True):
                try:
                    return dataclasses.replace(self._restore(manager, step, targets_for, explain_mismatch),
                                               damaged=damaged)
                except Damaged as why:
                    print(f"jaxpar: warning: checkpoint {self.directory / str(step)} is damaged ({why}); "
                          "trying the previous one", file=sys.stderr)
                    damaged[step] = str(why)
        if damaged:
            steps = ", ".join(map(str, damaged))
            what = f"step {steps} is" if len(damaged) == 1 else f"steps {steps} are"
            raise UserError(f"no intact checkpoint in '{self.directory}' ({what} damaged); train again with "
                            "another --out (--fresh would delete them)")
        return None

    def _restore(self, manager, step: int, targets_for, explain_mismatch) -> Restored:
        where = self.directory / str(step)
        with as_damage("its meta item does not read"):
            meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        check_layout(meta, where)
        targets = targets_for(meta)
        with as_damage("its array metadata does not read"):
            saved = manager.item_metadata(step)
            saved = {name: saved[name].tree for name in targets}
        for name, target in targets.items():
            difference = first_difference(saved[name], target)
            if difference:
                raise UserError(f"the checkpoint '{where}' does not fit this run: "
                                + explain_mismatch(meta, name, difference, saved[name]))
        with as_damage("its arrays do not read"):
            items = manager.restore(step, args=ocp.args.Composite(
                **{name: ocp.args.StandardRestore(tree) for name, tree in targets.items()}))
            items = {name: items[name] for name in targets}
        checksums = meta.get("checksums")
        bad = mismatches(items, checksums) if checksums else []
        if bad:
            more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
            raise Damaged(f"{bad[0]}{more} does not match its checksum")
        return Restored(step, meta, items, {}, verified=checksums is not None)

    def set_aside(self, damaged: dict[int, str]) -> None:
        """Move each damaged checkpoint out of the steps' way, to `<step>.damaged` (or
        `.damaged.2`, ...), and say where: a new save of that step must not meet it."""
        for step, why in damaged.items():
            source = self.directory / str(step)
            target, n = self.directory / f"{step}.{DAMAGED}", 1
            while target.exists():
                n += 1
                target = self.directory / f"{step}.{DAMAGED}.{n}"
            source.rename(target)
            print(f"jaxpar: the damaged checkpoint {source} is kept as {target} ({why})", file=sys.stderr)

    def remove_own(self) -> list[str]:
        """--fresh: remove every checkpoint jaxpar saved here (a linked folder is used as a folder), and
        nothing else; returns the names kept. A removal that fails is a UserError: a step left behind
        would keep the new run's save of that step from being written."""
        self.close()
        if not self.directory.is_dir():
            return []
        kept = []
        for entry in sorted(self.directory.iterdir()):
            if is_saved_by_jaxpar(entry):
                remove_tree(entry)
            else:
                kept.append(entry.name + "/" * entry.is_dir())
        return kept


def is_saved_by_jaxpar(entry: Path) -> bool:
    """Whether an entry of a checkpoints folder is jaxpar's: a step's folder as orbax commits it, one
    set aside as damaged, or a save's temporary folder. A link is never one: jaxpar makes none."""
    if entry.is_symlink() or not entry.is_dir():
        return False
    if re.fullmatch(r"\d+", entry.name):
        return (entry / ORBAX_METADATA).is_file() or (entry / "meta").is_dir()
    return bool(re.fullmatch(rf"\d+\.{DAMAGED}(\.\d+)?|\d+{re.escape(TEMPORARY)}.*", entry.name))


@contextlib.contextmanager
def as_damage(what: str):
    """Orbax's and tensorstore's many errors for bad bytes, as Damaged; running out of memory is
    not damage, and passes."""
    try:
        yield
    except (UserError, MemoryError):
        raise
    except Exception as e:
        text = " ".join(str(e).split())
        if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
            raise
        text = text.split(" See full TensorStore details")[0]  # the rest is a bound method's repr
        raise Damaged(f"{what}: {type(e).__name__}: {text[:150]}") from None

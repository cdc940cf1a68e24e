"""Orbax checkpoints in `<out>/checkpoints`: async saves, and restores onto any mesh and ZeRO stage.

Each checkpoint holds three items: `params`, `opt_state`, and `meta` (JSON: the step, the RNG
state, the resolved config, the tokenizer and the optimizer's name), so sampling reads only
`params` and `meta`. `opt_state` is the optimizer's own state: gradient clipping, which keeps
none, is not in it. A checkpoint from before the optimizer registry holds optax's chain of
clipping and AdamW; it restores into the same AdamW state. Another optimizer's checkpoint resumes
only with `optimizer.reset_state`: its weights, and a new state.
"""

import contextlib
import dataclasses
import logging
import shutil
import signal
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp

from jaxpar.core.config import Config, ModelConfig
from jaxpar.core.errors import UserError
from jaxpar.data.loader import model_vocab
from jaxpar.data.tokenizer import from_meta, same_mapping
from jaxpar.models.family import build_model, family_of

CHECKPOINTS = "checkpoints"  # the folder inside a run's --out
# Bumped whenever a param's shape or axis order changes, so that an older checkpoint is named as
# such rather than reported as damaged. 2: mlp_out's kernel is (layers, embed, mlp).
PARAM_LAYOUT = 2


def find_checkpoints(path) -> Path:
    """The checkpoints folder of a run directory, or `path` itself if it is one."""
    path = Path(path)
    for candidate in (path / CHECKPOINTS, path):
        if candidate.is_dir() and any(child.name.isdigit() for child in candidate.iterdir()):
            return candidate
    raise UserError(f"no checkpoints in '{path}'; pass a training run's --out directory "
                    f"or its {CHECKPOINTS} folder")


def make_meta(cfg: Config, tokenizer, step: int) -> dict:
    # Data order and dropout keys are pure functions of (seed, step): that is the whole RNG state.
    return {"step": step, "rng": {"seed": cfg.train.seed, "step": step}, "config": cfg.to_dict(),
            "tokenizer": tokenizer.to_meta(), "param_layout": PARAM_LAYOUT, "optimizer": cfg.optimizer.name}


def check_layout(meta: dict, where: Path) -> None:
    layout = meta.get("param_layout", 1)  # checkpoints from before the field have layout 1
    if layout != PARAM_LAYOUT:
        age = "an older" if layout < PARAM_LAYOUT else "a newer"
        raise UserError(f"the checkpoint '{where}' was written by {age} jaxpar (param layout "
                        f"{layout}; this one reads {PARAM_LAYOUT}); train it again with --fresh, or "
                        "use the jaxpar that wrote it")


def abstract_tree(shapes, shardings):
    """ShapeDtypeStructs that carry the target shardings: orbax restores each shard in place."""
    return jax.tree.map(lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where),
                        shapes, shardings)


class Checkpoints:
    """A run's checkpoints folder. Nothing is created on disk before the first save.

    `keep`: how many of the newest checkpoints saving keeps. Reads go through a read-only
    manager that is closed at once, so only a run that saves holds one open (until `close`).
    """

    def __init__(self, directory, keep: int | None = None):
        self.directory, self.keep = Path(directory), keep
        self._writer = None

    @contextlib.contextmanager
    def _reader(self):
        absl_logger = logging.getLogger("absl")
        level = absl_logger.level  # orbax warns that a read-only manager is read-only
        absl_logger.setLevel(logging.ERROR)
        try:
            options = ocp.CheckpointManagerOptions(read_only=True, create=False)
            manager = ocp.CheckpointManager(self.directory.absolute(), options=options)
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
        return self._writer

    def steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        with self._reader() as manager:
            return sorted(manager.all_steps())

    def save(self, step: int, params, opt_state, meta: dict) -> None:
        """Start an async save and return. It waits for the previous save first, and copies the
        arrays to host memory before returning, so the train step may donate them afterwards."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.writer.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta)))

    def wait(self) -> None:
        if self._writer is not None:
            self._writer.wait_until_finished()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def restore_latest(self, targets_for):
        """(step, meta, restored items, skipped steps) from the newest checkpoint that reads, or
        None when there is none.

        `targets_for(meta)` returns the abstract tree of each item to restore; it raises
        UserError when the checkpoint cannot fit this run, which is a mistake to report, not
        damage. A checkpoint that fails to read (damaged or incomplete) gets a one-line
        warning, and the previous one is tried.
        """
        skipped = []
        if not self.directory.is_dir():
            return None
        with self._reader() as manager:
            for step in sorted(manager.all_steps(), reverse=True):
                try:
                    meta = manager.restore(step, args=ocp.args.Composite(
                        meta=ocp.args.JsonRestore())).meta
                    check_layout(meta, self.directory / str(step))
                    targets = targets_for(meta)
                    items = manager.restore(step, args=ocp.args.Composite(
                        **{name: ocp.args.StandardRestore(tree) for name, tree in targets.items()}))
                except UserError:
                    raise
                except Exception as e:  # orbax and tensorstore raise many types for a bad file
                    reason = f"{type(e).__name__}: {' '.join(str(e).split())[:150]}"
                    print(f"jaxpar: warning: checkpoint {self.directory / str(step)} is damaged or "
                          f"incomplete ({reason}); trying the previous one", file=sys.stderr)
                    skipped.append(step)
                    continue
                return step, meta, items, skipped
        if skipped:
            raise UserError(f"no readable checkpoint in '{self.directory}' (tried steps "
                            f"{', '.join(map(str, skipped))}); start over with --fresh")
        return None

    def delete(self, steps: list[int]) -> None:
        for step in steps:
            self.writer.delete(step)

    def remove_all(self) -> None:
        self.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def model_shape(model: dict, vocab_size: int) -> str:
    """The model config fields its family's params' shapes follow, as 'n_layer=2, ...' (a
    checkpoint from before a field has its default)."""
    defaults = dataclasses.asdict(ModelConfig())
    fields = family_of(ModelConfig(family=model.get("family", "gpt2"))).shape_fields
    return ", ".join(f"{k}={model.get(k, defaults[k])}" for k in fields) + f", vocab_size={vocab_size}"


def saved_vocab(meta: dict) -> tuple[object, int]:
    """(the checkpoint's tokenizer, its model's vocabulary size)."""
    tokenizer = from_meta(meta["tokenizer"])
    return tokenizer, meta["config"]["model"].get("vocab_size") or tokenizer.vocab_size


def check_fits(meta: dict, cfg: Config, tokenizer, directory: Path) -> None:
    """A checkpoint resumes this run only with the same model, tokenizer and seed."""
    saved = meta["config"]
    fresh = "or start over with --fresh"
    saved_tokenizer, vocab = saved_vocab(meta)
    if not same_mapping(saved_tokenizer, tokenizer):
        raise UserError(f"the checkpoint in '{directory}' was trained with another tokenizer "
                        f"({saved_tokenizer.spec}, {saved_tokenizer.vocab_size} tokens) than this "
                        f"data's ({tokenizer.spec}, {tokenizer.vocab_size} tokens); use the same "
                        f"data, {fresh}")
    family = saved["model"].get("family", "gpt2")  # checkpoints from before the field: GPT-2
    if family != cfg.model.family:
        raise UserError(f"the checkpoint in '{directory}' holds a model.family={family} model, and this "
                        f"run asks for {cfg.model.family}; resume with the checkpoint's config "
                        f"(--model.family={family}), {fresh}")
    have = model_shape(saved["model"], vocab)
    want = model_shape(dataclasses.asdict(cfg.model), model_vocab(cfg, tokenizer))
    saved_shapes = build_model(Config.from_dict(saved), vocab).shapes()
    if have != want or saved_shapes != build_model(cfg, model_vocab(cfg, tokenizer)).shapes():
        raise UserError(f"the checkpoint in '{directory}' has model shape ({have}) but the config "
                        f"and data ask for ({want}); use the checkpoint's model settings and "
                        f"data, {fresh}")
    gelu = saved["model"].get("gelu", "exact")  # checkpoints from before the field: exact
    if gelu != cfg.model.gelu:
        raise UserError(f"the checkpoint in '{directory}' was trained with model.gelu={gelu}, not "
                        f"{cfg.model.gelu}; resume with --model.gelu={gelu}, {fresh}")
    saved_optimizer = meta.get("optimizer", "adamw")
    if saved_optimizer != cfg.optimizer.name and not cfg.optimizer.reset_state:
        raise UserError(f"the checkpoint in '{directory}' was trained with optimizer.name={saved_optimizer}, not "
                        f"{cfg.optimizer.name}; resume with --optimizer.name={saved_optimizer}, or keep its weights "
                        f"with a new optimizer state: --optimizer.reset_state=true, {fresh}")
    if meta["rng"]["seed"] != cfg.train.seed:
        raise UserError(f"the checkpoint in '{directory}' was trained with train.seed="
                        f"{meta['rng']['seed']}, not {cfg.train.seed}; resume with --seed "
                        f"{meta['rng']['seed']}, {fresh}")


def restore_train_state(ckpt: Checkpoints, cfg: Config, tokenizer, tx, shardings):
    """(TrainState on the mesh and ZeRO stage of `shardings`, meta, skipped steps), or None."""
    from jaxpar.training import step as steps
    shapes = build_model(cfg, model_vocab(cfg, tokenizer)).shapes()
    targets = {"params": abstract_tree(shapes, shardings.params),
               "opt_state": abstract_tree(jax.eval_shape(tx.init, shapes), shardings.opt_state)}

    def targets_for(meta: dict) -> dict:
        check_fits(meta, cfg, tokenizer, ckpt.directory)
        if cfg.optimizer.reset_state:  # the weights alone
            return {"params": targets["params"]}
        return {**targets, "opt_state": as_saved(targets["opt_state"], meta)}

    found = ckpt.restore_latest(targets_for)
    if found is None:
        return None
    step, meta, items, skipped = found
    counter = jax.device_put(np.int32(meta["step"]), shardings.step)
    if cfg.optimizer.reset_state:
        opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(items.params)
    else:
        opt_state = items.opt_state if "optimizer" in meta else items.opt_state[-1]
    return steps.TrainState(counter, items.params, opt_state), meta, skipped


def as_saved(opt_state, meta: dict):
    """The optimizer state's tree as the checkpoint holds it. One from before the optimizer
    registry holds optax's chain: clipping's stateless entry (when it clipped), then AdamW's."""
    if "optimizer" in meta:
        return opt_state
    clipped = meta["config"]["train"]["grad_clip"] > 0
    return (optax.EmptyState(), opt_state) if clipped else (opt_state,)


SYNC_EVERY = 10  # steps between the processes' comparisons of their stop flags


class StopRequest:
    """SIGTERM and SIGINT ask the training loop to save and stop after the current step.

    The first signal restores the previous handlers, so a second one acts at once (Ctrl-C twice).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # handlers only install there
            self._previous = {s: signal.signal(s, self.request) for s in self.SIGNALS}
        return self

    def request(self, signum: int = signal.SIGTERM, frame=None) -> None:
        self.signal_name = signal.Signals(signum).name
        self._restore_handlers()

    def agreed(self, updates: int) -> str | None:
        """The signal to stop on after `updates` steps, or None to go on.

        A save is collective, so every process must stop at the same step: with several, they
        compare their flags every SYNC_EVERY steps (a small all-gather), and stop if any has one.
        """
        if jax.process_count() == 1:
            return self.signal_name
        if updates % SYNC_EVERY:
            return None
        from jax.experimental import multihost_utils
        if not multihost_utils.process_allgather(np.int32(self.signal_name is not None)).any():
            return None
        return self.signal_name or "SIGTERM (on another process)"

    def _restore_handlers(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore_handlers()

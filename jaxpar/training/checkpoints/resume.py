"""Resuming a run from its checkpoints: does the newest one fit this run, and the train state
restored from it onto this run's mesh and ZeRO stage.

A checkpoint fits when the model, tokenizer, seed and optimizer state agree with the run's; each
disagreement is a UserError that names it and how to go on, and touches nothing.
"""

import dataclasses
from pathlib import Path

import jax
import numpy as np
import optax

from jaxpar.core.errors import UserError
from jaxpar.core.model_config import ModelConfig
from jaxpar.core.optimizer_config import OptimizerConfig
from jaxpar.data.tokenizer import check_same_tokenizer, from_meta
from jaxpar.models.registry import family_of
from jaxpar.models.transformer import Transformer
from jaxpar.training.checkpoints.checkpoint import Checkpoints, Restored, abstract_tree, generic_mismatch
from jaxpar.training.checkpoints.saved_trees import first_difference
from jaxpar.training.optimizers.registry import make_optimizer
from jaxpar.training.step.build import Built
from jaxpar.training.step.step import TrainState

# Never advise --fresh alone: it deletes the checkpoints that do not fit.
ELSEWHERE = "or train in another --out (--fresh would delete these checkpoints)"


def model_shape(m: ModelConfig, vocab_size: int) -> str:
    """The model config fields its family's params' shapes follow, as 'n_layer=2, ...'."""
    return ", ".join(f"{k}={getattr(m, k)}" for k in family_of(m).shape_fields) + f", vocab_size={vocab_size}"


def saved_model(model: dict, family: type[ModelConfig]) -> ModelConfig:
    """The checkpoint's [model] as a config of its `family`: a field from before its time has its
    default, and a key the family does not declare (configs saved before each family had its own
    keys hold every family's) is passed over."""
    declared = {f.name for f in dataclasses.fields(family)}
    return family(**{k: v for k, v in model.items() if k in declared})


def saved_vocab(meta: dict) -> tuple[object, int]:
    """(the checkpoint's tokenizer, its model's vocabulary size)."""
    tokenizer = from_meta(meta["tokenizer"])
    return tokenizer, meta["config"]["model"].get("vocab_size") or tokenizer.vocab_size


def check_fits(meta: dict, built: Built, tokenizer, directory: Path) -> None:
    """A checkpoint resumes this run only with the same model, tokenizer, seed and optimizer."""
    saved, cfg = meta["config"], built.cfg
    saved_tokenizer, vocab = saved_vocab(meta)
    check_same_tokenizer(saved_tokenizer, tokenizer, f"the checkpoint in '{directory}'",
                         f"resume on the data it was trained on, {ELSEWHERE}")
    family = saved["model"].get("family", "gpt2")  # checkpoints from before the field: GPT-2
    if family != cfg.model.family:
        raise UserError(f"the checkpoint in '{directory}' holds a model.family={family} model, and this "
                        f"run asks for {cfg.model.family}; resume with the checkpoint's config "
                        f"(--model.family={family}), {ELSEWHERE}")
    saved_m = saved_model(saved["model"], type(cfg.model))
    have, want = model_shape(saved_m, vocab), model_shape(cfg.model, built.model.vocab_size)
    if have != want or Transformer(saved_m, vocab).shapes() != built.model.shapes():
        raise UserError(f"the checkpoint in '{directory}' has model shape ({have}) but the config "
                        f"and data ask for ({want}); use the checkpoint's model settings and "
                        f"data, {ELSEWHERE}")
    gelu = saved["model"].get("gelu", "exact")  # checkpoints from before the field: exact
    if getattr(cfg.model, "gelu", gelu) != gelu:  # GPT-2's
        raise UserError(f"the checkpoint in '{directory}' was trained with model.gelu={gelu}, not "
                        f"{cfg.model.gelu}; resume with --model.gelu={gelu}, {ELSEWHERE}")
    saved_optimizer = meta.get("optimizer", "adamw")
    if saved_optimizer != cfg.optimizer.name and not cfg.optimizer.reset_state:
        raise UserError(f"the checkpoint in '{directory}' was trained with optimizer.name={saved_optimizer}, not "
                        f"{cfg.optimizer.name}; resume with --optimizer.name={saved_optimizer}, or keep its weights "
                        f"with a new optimizer state: --optimizer.reset_state=true, {ELSEWHERE}")
    if meta["rng"]["seed"] != cfg.train.seed:
        raise UserError(f"the checkpoint in '{directory}' was trained with train.seed="
                        f"{meta['rng']['seed']}, not {cfg.train.seed}; resume with --seed "
                        f"{meta['rng']['seed']}, {ELSEWHERE}")


def optimizer_mismatch(o: OptimizerConfig, model):
    """explain_mismatch for Checkpoints.restore_latest: an optimizer state of other shapes names
    the [optimizer] keys whose saved values give the saved shapes, and the ways on."""
    shapes = model.shapes()

    def state_of(o: OptimizerConfig):
        return jax.eval_shape(make_optimizer(o, model.roles(), model.matrices()).init, shapes)

    def explain(meta: dict, item: str, difference: str, saved_tree) -> str:
        if item != "opt_state":
            return generic_mismatch(meta, item, difference, saved_tree)
        saved = {k: v for k, v in meta["config"].get("optimizer", {}).items()
                 if k != "reset_state" and hasattr(o, k) and getattr(o, k) != v}
        causes = [k for k, v in saved.items()
                  if not first_difference(saved_tree, state_of(dataclasses.replace(o, **{k: v})))]
        named = causes or list(saved)
        setting = ", ".join(f"optimizer.{k}={saved[k]} there, {getattr(o, k)} here" for k in named)
        why = f"{setting} changes" if named else "this jaxpar lays out"
        back = " ".join(f"--optimizer.{k}={saved[k]}" for k in named)
        return (f"{why} the optimizer state's shapes ({difference}); resume with "
                + (f"{back}, or " if named else "")
                + f"keep its weights with a new optimizer state: --optimizer.reset_state=true, {ELSEWHERE}")
    return explain


def restore_train_state(ckpt: Checkpoints, built: Built, tokenizer):
    """(TrainState on the built run's mesh and ZeRO stage, Restored), or None."""
    cfg, tx, shardings, shapes = built.cfg, built.tx, built.shardings, built.model.shapes()
    targets = {"params": abstract_tree(shapes, shardings.params),
               "opt_state": abstract_tree(jax.eval_shape(tx.init, shapes), shardings.opt_state)}

    def targets_for(meta: dict) -> dict:
        check_fits(meta, built, tokenizer, ckpt.directory)
        if cfg.optimizer.reset_state:  # the weights alone
            return {"params": targets["params"]}
        return {**targets, "opt_state": as_saved(targets["opt_state"], meta)}

    explain = optimizer_mismatch(cfg.optimizer, built.model)
    found: Restored | None = ckpt.restore_latest(targets_for, explain)
    if found is None:
        return None
    meta, items = found.meta, found.items
    counter = jax.device_put(np.int32(meta["step"]), shardings.step)
    if cfg.optimizer.reset_state:
        opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(items["params"])
    else:
        opt_state = items["opt_state"] if "optimizer" in meta else items["opt_state"][-1]
    return TrainState(counter, items["params"], opt_state), found


def as_saved(opt_state, meta: dict):
    """The optimizer state's tree as the checkpoint holds it. One from before the optimizer
    registry holds optax's chain: clipping's stateless entry (when it clipped), then AdamW's."""
    if "optimizer" in meta:
        return opt_state
    clipped = meta["config"]["train"]["grad_clip"] > 0
    return (optax.EmptyState(), opt_state) if clipped else (opt_state,)

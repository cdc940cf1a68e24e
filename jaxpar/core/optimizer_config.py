"""The [optimizer] section: which optimizer runs (jaxpar.training.optimizers.registry), its learning-rate
schedule and clipping, and its own hyper-parameters; and the keys' older names under [train].

A key that only one optimizer reads is declared `only_for_optimizer(name, default)`.
"""

from dataclasses import dataclass, field, fields

from jaxpar.core.errors import UserError
from jaxpar.core.registry import one_of

# optimizer.name and optimizer.schedule name entries of jaxpar.training.optimizers.registry's
# registries, which the config's checks ask (jaxpar.core.registry); this section holds their keys.
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")  # wsd's decay
# Older names of the section's keys, kept working in config files and on the command line.
ALIASES = {"train.lr": "optimizer.lr", "train.min_lr": "optimizer.min_lr",
           "train.warmup_steps": "optimizer.warmup_steps", "train.decay_steps": "optimizer.decay_steps",
           "train.weight_decay": "optimizer.weight_decay", "train.beta1": "optimizer.beta1",
           "train.beta2": "optimizer.beta2", "train.adam_eps": "optimizer.eps",
           "train.grad_clip": "optimizer.grad_clip"}


def only_for_optimizer(names: str | tuple[str, ...], default):
    """An optimizer field that only the optimizers `names` read."""
    return field(default=default, metadata={"optimizer": (names,) if isinstance(names, str) else names})


@dataclass
class OptimizerConfig:
    name: str = "adamw"  # adamw, lion, adafactor or muon
    # Every schedule warms up linearly to lr over warmup_steps. `cosine` (nanoGPT's): a cosine
    # decay to min_lr at decay_steps (nanoGPT's lr_decay_iters; 0: the run's steps), then flat.
    # `wsd` (warmup-stable-decay): lr until the decay, which reaches min_lr at decay_steps; it
    # starts decay_fraction of decay_steps before, or at step decay_from if set (a branch from a
    # checkpoint of the stable phase), and is linear, cosine or 1-sqrt (decay_shape).
    # `constant`: lr after the warmup.
    schedule: str = "cosine"
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    decay_steps: int = 0
    decay_fraction: float = 0.2
    decay_from: int = 0
    decay_shape: str = "linear"
    # On resume: keep the checkpoint's weights and start the optimizer's state anew (the way to
    # resume with another optimizer; the step count, data order and schedule go on).
    reset_state: bool = False
    # Decoupled weight decay, on the params whose role is matrix or embedding (jaxpar.nn.params);
    # norm scales and biases are not decayed.
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # the gradients' global norm is clipped to this; 0 disables clipping
    # AdamW's (and Muon's AdamW group's); Lion: its update's interpolation and its momentum's decay.
    beta1: float = only_for_optimizer(("adamw", "lion", "muon"), 0.9)
    beta2: float = only_for_optimizer(("adamw", "lion", "muon"), 0.99)
    eps: float = only_for_optimizer(("adamw", "muon"), 1e-8)  # torch's and nanoGPT's
    # Muon on the matrices (jaxpar.training.optimizers.registry.muon): its momentum, its Newton-Schulz
    # iterations, and the lr of the params it leaves to AdamW (embeddings, lm_head, norms, biases;
    # 0: lr). ns_split: each device orthogonalises its share of the matrices and the results are
    # gathered (jaxpar.training.optimizers.muon); false: every device orthogonalises every matrix.
    momentum: float = only_for_optimizer("muon", 0.95)
    ns_steps: int = only_for_optimizer("muon", 5)
    adam_lr: float = only_for_optimizer("muon", 0.0)
    ns_split: bool = only_for_optimizer("muon", True)
    # Adafactor (Shazeer & Stern, 2018; optax.adafactor) with an absolute step size, the schedule's
    # lr: the second moment factored into row and column means for dims of at least
    # factored_min_dim, decay_rate its decay exponent, updates clipped to RMS clip_threshold.
    decay_rate: float = only_for_optimizer("adafactor", 0.8)
    factored_min_dim: int = only_for_optimizer("adafactor", 128)
    clip_threshold: float = only_for_optimizer("adafactor", 1.0)


def validate_optimizer(o: OptimizerConfig, key_name) -> None:
    """`key_name(canonical key)`: the key as the user spelled it (an alias or the canonical name)."""
    # lr = 0 is a frozen run: Hugging Face weights into a checkpoint, or a step timed without
    # changing the weights.
    for name in ("lr", "min_lr", "warmup_steps", "decay_steps", "weight_decay", "grad_clip", "decay_from",
                 "factored_min_dim", "ns_steps", "adam_lr"):
        if getattr(o, name) < 0:
            raise UserError(f"{key_name(f'optimizer.{name}')} must be >= 0, got {getattr(o, name)}")
    check_ranges(o, key_name)
    one_of("optimizer.decay_shape", o.decay_shape, DECAY_SHAPES)
    if not 0 <= o.decay_fraction <= 1:
        raise UserError(f"optimizer.decay_fraction must be in [0, 1], got {o.decay_fraction}")


def check_ranges(o: OptimizerConfig, key_name) -> None:
    """The hyper-parameters bounded on both sides, or away from 0."""
    ranges = {
        # A moving average's decay: 1 would never take in a new gradient.
        "beta1": (0 <= o.beta1 < 1, "in [0, 1)"), "beta2": (0 <= o.beta2 < 1, "in [0, 1)"),
        "momentum": (0 <= o.momentum < 1, "in [0, 1)"),
        # AdamW divides by sqrt(v) + eps, and v is 0 where a gradient always is (the vocabulary's padding rows).
        "eps": (o.eps > 0, "> 0"),
        # Adafactor's second moment decays by 1 - t^-decay_rate (Shazeer & Stern, 2018): 1 is a plain mean.
        "decay_rate": (0 <= o.decay_rate <= 1, "in [0, 1]"),
        # optax.adafactor's clipping_threshold "must be >= 1", or None (0 here) for no clipping.
        "clip_threshold": (o.clip_threshold == 0 or o.clip_threshold >= 1, "0 (no clipping) or >= 1"),
    }
    for name, (within, needed) in ranges.items():
        if not within:
            raise UserError(f"{key_name(f'optimizer.{name}')} must be {needed}, got {getattr(o, name)}")


def check_optimizer_keys(o: OptimizerConfig, command_line: set[str], file: set[str]) -> None:
    """Refuse a key that this optimizer never reads: on the command line, or in the config file
    unless the command line chose the optimizer (a file's AdamW keys stay behind when a run is
    switched to Lion with --optimizer.name)."""
    checked = command_line | (set() if "optimizer.name" in command_line else file)
    for f in fields(OptimizerConfig):
        readers = f.metadata.get("optimizer")
        spelled = [key for key in checked if ALIASES.get(key, key) == f"optimizer.{f.name}"]
        if readers and o.name not in readers and spelled:
            raise UserError(f"{spelled[0]} is a setting of {' and '.join(readers)}, and this run uses optimizer.name="
                            f"{o.name}; drop it, or set --optimizer.name={readers[0]}")


def check_aliases(keys: set[str], where: str) -> None:
    """Refuse a key and its older name both set in one source (one file, or the command line),
    where which one wins would be an accident of order; the command line overriding a file's
    value, under either name, is ordinary layering."""
    for old, key in ALIASES.items():
        if old in keys and key in keys:
            raise UserError(f"{old} and {key} are the same key ({old} is its older name) and both are set "
                            f"{where}; keep one")


def check_wsd(o: OptimizerConfig, steps: int) -> None:
    """WSD's decay fits in the run, and starts after the warmup. o.decay_steps is resolved."""
    if o.schedule != "wsd":
        return
    start = decay_start(o)
    if not o.warmup_steps <= start <= o.decay_steps <= steps:
        raise UserError(f"optimizer.schedule=wsd decays from step {start} to optimizer.decay_steps={o.decay_steps}, "
                        f"which must lie between the warmup's end (optimizer.warmup_steps={o.warmup_steps}) and "
                        f"the run's end (train.steps={steps}); shorten the decay or lengthen the run")


def decay_start(o: OptimizerConfig) -> int:
    """The step where WSD's decay starts: decay_from, or decay_fraction of decay_steps before its end."""
    return o.decay_from or o.decay_steps - round(o.decay_fraction * o.decay_steps)

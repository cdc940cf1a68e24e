"""The [optimizer] section: which optimizer runs (jaxpar.training.optimizers), its learning-rate
schedule and clipping, and its own hyper-parameters; and the keys' older names under [train].

A key that only one optimizer reads is declared `only_for_optimizer(name, default)`.
"""

from dataclasses import dataclass, field

from jaxpar.core.errors import UserError

OPTIMIZERS = ("adamw",)  # optimizer.name: an entry each in jaxpar.training.optimizers
# Older names of the section's keys, kept working in config files and on the command line.
ALIASES = {"train.lr": "optimizer.lr", "train.min_lr": "optimizer.min_lr",
           "train.warmup_steps": "optimizer.warmup_steps", "train.decay_steps": "optimizer.decay_steps",
           "train.weight_decay": "optimizer.weight_decay", "train.beta1": "optimizer.beta1",
           "train.beta2": "optimizer.beta2", "train.adam_eps": "optimizer.eps",
           "train.grad_clip": "optimizer.grad_clip"}


def only_for_optimizer(name: str, default):
    """An optimizer field that only optimizer `name` reads."""
    return field(default=default, metadata={"optimizer": name})


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    # nanoGPT's schedule: linear warmup to lr over warmup_steps, cosine decay to min_lr at
    # decay_steps (nanoGPT's lr_decay_iters; 0: the run's steps), then flat.
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    decay_steps: int = 0
    # Decoupled weight decay, on the params whose role is matrix or embedding (jaxpar.models.params);
    # norm scales and biases are not decayed.
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # the gradients' global norm is clipped to this; 0 disables clipping
    beta1: float = only_for_optimizer("adamw", 0.9)
    beta2: float = only_for_optimizer("adamw", 0.99)
    eps: float = only_for_optimizer("adamw", 1e-8)  # torch's and nanoGPT's


def validate_optimizer(o: OptimizerConfig, key_name) -> None:
    """`key_name(canonical key)`: the key as the user spelled it (an alias or the canonical name)."""
    if o.name not in OPTIMIZERS:
        raise UserError(f"optimizer.name must be one of {', '.join(OPTIMIZERS)}, got '{o.name}'")
    # lr = 0 is a frozen run: Hugging Face weights into a checkpoint, or a step timed without
    # changing the weights.
    for name in ("lr", "min_lr", "warmup_steps", "decay_steps", "weight_decay", "eps", "grad_clip"):
        if getattr(o, name) < 0:
            raise UserError(f"{key_name(f'optimizer.{name}')} must be >= 0, got {getattr(o, name)}")

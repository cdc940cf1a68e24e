"""What a run's phases hand each other (jaxpar.training.run.trainer): the set-up state, the compiled
step, and the result."""

from dataclasses import dataclass, field

import jax

from jaxpar.core.config import Config
from jaxpar.data.loader import BatchLoader, Dataset
from jaxpar.models.transformer import Transformer
from jaxpar.training.checkpoints.checkpoint import Checkpoints
from jaxpar.training.run.task_scoring import TaskEval
from jaxpar.training.step.build import Built
from jaxpar.training.step.step import TrainState


@dataclass
class RunResult:
    losses: dict[int, float] = field(default_factory=dict)  # step -> train loss before its update
    val_losses: dict[int, float] = field(default_factory=dict)  # updates applied -> val loss
    aux: dict[int, dict] = field(default_factory=dict)  # step -> {auxiliary loss: its value}
    params: dict | None = None
    info: dict = field(default_factory=dict)


@dataclass
class Setup:
    """What phase 1 builds: the run's pieces (jaxpar.training.step.build), the data and the train state
    to start from."""
    built: Built
    dataset: Dataset
    ckpt: Checkpoints | None
    state: TrainState
    start: int  # the step the state is at
    damaged: dict[int, str]  # damaged checkpoints newer than `start`: step -> why
    mix_changed: dict | None = None  # data.mix against the checkpoint's: {step, before, after}

    @property
    def cfg(self) -> Config:
        return self.built.cfg

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.built.mesh

    @property
    def model(self) -> Transformer:
        return self.built.model


@dataclass
class Compiled:
    """What phase 2 builds: the batches, the compiled steps and the run's description."""
    step: object  # the compiled train step
    eval_step: object
    train_batches: BatchLoader
    val_batches: list
    info: dict
    tasks: TaskEval | None = None  # --eval.tasks, scored during training
    source_val: dict = field(default_factory=dict)  # a mixture's source name -> its val batches



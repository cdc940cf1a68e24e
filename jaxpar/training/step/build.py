"""A run's pieces, built once: `build(cfg, mesh, tokenizer)` makes the model (which holds its
vocabulary, its end-of-text id and its execution plan, with the pipeline's `Schedule` and the
step's micro-batches), the ZeRO plan, the optimizer and the train state's shardings, and hands
them on as one `Built`.

Training, resume, evaluation, `--dry-run`, the planner, `jaxpar.bench` and the scripts build here,
so each compiles the step that `jaxpar.train` runs. `Built.compile_abstract` compiles that step from
shapes alone (nothing allocated, so the devices may be compile-only: a TPU pod or an H100 node
planned from a CPU host); the planner, `--dry-run` and `train.micro_batch=auto` read its memory.
"""

from dataclasses import dataclass, replace

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from jaxpar.core.config import Config
from jaxpar.core.execution import ExecutionPlan
from jaxpar.core.sharding import batch_sharding, shardings_for
from jaxpar.data.loader import model_ids
from jaxpar.data.tokenizer import check_same_tokenizer
from jaxpar.models.transformer import Transformer, build_model
from jaxpar.nn.kernels import platform_of
from jaxpar.parallel import zero
from jaxpar.training.optimizers import registry as optimizers
from jaxpar.training.step import micro_batch
from jaxpar.training.step import step as steps
from jaxpar.training.step.execution import plan_execution


@dataclass(frozen=True, eq=False)
class Built:
    """What a run trains with, on one mesh: each piece made once, from one config."""
    cfg: Config
    mesh: Mesh
    model: Transformer  # its vocabulary, end-of-text id and execution plan
    tx: optax.GradientTransformation
    shardings: steps.TrainState  # the train state's NamedShardings
    zero: zero.ZeroPlan
    note: str | None = None  # train.micro_batch=auto's choice, in one line

    @property
    def plan(self) -> ExecutionPlan:
        return self.model.plan

    @property
    def offload(self) -> bool:
        """The optimizer's state kept in host memory (train.offload=optimizer)."""
        return self.cfg.train.offload == "optimizer"

    def train_step(self, rows=None):
        """The jitted train step (jaxpar.training.step.step); `rows`: the batch's sharding."""
        rows = rows or batch_sharding(self.mesh)
        return steps.make_train_step(self.model, self.tx, self.shardings, self.zero, rows,
                                     self.cfg.optimizer, self.cfg.train.seed, self.offload)

    def eval_step(self, rows=None):
        return steps.make_eval_step(self.model, self.shardings.params, rows or batch_sharding(self.mesh))

    def init_state(self, init_from: str = "") -> steps.TrainState:
        """A new train state, each array made in its shards: random params (train.seed), or
        `init_from`'s Hugging Face weights, and a new optimizer state."""
        if not init_from:
            return steps.init_state(self.model, self.tx, self.shardings, self.cfg.train.seed)
        from jaxpar.models.hf import load_hf_params
        params = load_hf_params(init_from, self.cfg.model, self.model.vocab_size, self.shardings.params)
        opt_state = jax.jit(self.tx.init, out_shardings=self.shardings.opt_state)(params)
        return steps.TrainState(jax.device_put(np.int32(0), self.shardings.step), params, opt_state)

    def abstract_state(self) -> steps.TrainState:
        """The train state as ShapeDtypeStructs on its shardings."""
        shapes = self.model.shapes()
        abstract = steps.TrainState(jax.ShapeDtypeStruct((), "int32"), shapes, jax.eval_shape(self.tx.init, shapes))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            abstract, self.shardings)

    def compile_abstract(self):
        """The train step compiled for the mesh from ShapeDtypeStructs, under the plan's platform."""
        micro, rows = self.plan.passes, batch_sharding(self.mesh)
        batch = jax.ShapeDtypeStruct((micro, self.cfg.train.batch_size // micro, self.cfg.model.block_size),
                                     "int32", sharding=rows)
        with jax.set_mesh(self.mesh):
            return self.train_step(rows).lower(self.abstract_state(), (batch, batch)).compile()


def build(cfg: Config, mesh: Mesh, tokenizer=None, *, vocab: int | None = None, eot_id: int | None = None,
          platform: str | None = None, capacity: int | None = None) -> Built:
    """cfg's pieces on `mesh`: the vocabulary and end-of-text id from `tokenizer` (or `vocab` and
    `eot_id` as given), for `platform` (default: the mesh's own), with train.micro_batch=auto
    chosen against `capacity` bytes a device (default: the device's). The config is not changed."""
    if tokenizer is not None:
        vocab, eot_id = token_ids(cfg, tokenizer)
    platform = platform or platform_of(mesh)
    at = lambda rows: assemble(cfg, mesh, vocab, eot_id, platform, rows)
    rows, note = micro_batch.choose(cfg.train, mesh, platform, lambda rows: at(rows).compile_abstract(), capacity)
    return replace(at(rows), note=note)


def assemble(cfg: Config, mesh: Mesh, vocab: int, eot_id: int | None, platform: str, rows: int) -> Built:
    """The pieces at `rows` a pass (train.micro_batch resolved)."""
    model = model_on(cfg, mesh, vocab, eot_id, platform, rows)
    shapes = model.shapes()
    zero_plan = zero.zero_plan(cfg.train.zero, shardings_for(model.axes(), shapes, mesh), shapes, mesh)
    tx = optimizers.optimizer_for(cfg.optimizer, model, mesh, zero_plan)
    shardings = steps.state_shardings(zero_plan, tx, shapes, mesh, cfg.train.offload == "optimizer")
    return Built(cfg, mesh, model, tx, shardings, zero_plan)


def build_inference(cfg: Config, mesh: Mesh, vocab: int, tokenizer) -> Transformer:
    """The model that evaluation, sampling, task scoring and export run on `mesh`: the plan that
    cfg gets there without passes or a pipeline (its attention kernel as in training), and the
    end-of-text id that opens documents where it trained with data.document_mask."""
    return model_on(cfg, mesh, vocab, tokenizer.eot_id if tokenizer is not None else None)


def model_on(cfg: Config, mesh: Mesh, vocab: int, eot_id: int | None, platform: str | None = None,
             rows: int | None = None) -> Transformer:
    """cfg's model under the plan it gets on `mesh`: a train step's at `rows` a pass, or with no
    `rows` an inference command's (no passes, no pipeline)."""
    plan = plan_execution(cfg, mesh, platform, for_training=rows is not None, micro_batch=rows)
    return build_model(cfg, vocab, eot_id, plan)


def token_ids(cfg: Config, tokenizer) -> tuple[int, int | None]:
    """(the model's vocabulary, the end-of-text id that opens its documents or None), from the
    data's tokenizer, checked against train.init_from's first (the vocabulary's own check would
    mislead). Needs no mesh: the trainer asks before it builds one."""
    check_init_tokenizer(cfg.train.init_from, tokenizer)
    return model_ids(cfg, tokenizer)


def check_init_tokenizer(init_from: str, tokenizer) -> None:
    """train.init_from's tokenizer, where its directory names one, must be the data's."""
    if not init_from:
        return
    from jaxpar.models.hf import hf_tokenizer
    saved = hf_tokenizer(init_from)
    spec = saved.spec if saved is not None and saved.kind == "tiktoken" else init_from
    check_same_tokenizer(saved, tokenizer, f"--init-from '{init_from}'",
                         f"train on data prepared with it (python -m jaxpar.prepare TEXT --out DIR "
                         f"--tokenizer {spec}, then --data.path=DIR), or --init-from a model of the "
                         "data's tokenizer")

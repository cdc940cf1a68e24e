"""The train step `jaxpar.train` runs, compiled from shapes alone: nothing is allocated, so the
devices may be compile-only (a TPU pod or an H100 node planned from a CPU host). The planner,
`--dry-run` and `train.micro_batch=auto` (jaxpar.training.micro_batch) read its memory and HLO."""

import jax

from jaxpar.core.config import Config
from jaxpar.core.sharding import batch_sharding
from jaxpar.models.family import build_model
from jaxpar.training import step as steps
from jaxpar.training.execution import plan_execution


def compile_abstract_step(cfg: Config, vocab: int, mesh, eot_id: int | None = None):
    """The train step compiled for `mesh` from ShapeDtypeStructs, under the execution plan of the
    mesh's platform (a TPU target's, from a CPU host); `eot_id`: the documents' token, as build_model."""
    model = build_model(cfg, vocab, eot_id, plan_execution(cfg, mesh))
    tx = steps.make_optimizer(cfg, model, mesh)
    shardings, zero_plan = steps.state_shardings(cfg, model, mesh, tx)  # eager work: outside the mesh
    micro = steps.microbatches_for(cfg, mesh)
    rows = batch_sharding(mesh)
    batch = jax.ShapeDtypeStruct((micro, cfg.train.batch_size // micro, cfg.model.block_size),
                                 "int32", sharding=rows)
    shapes = model.shapes()
    abstract = steps.TrainState(jax.ShapeDtypeStruct((), "int32"), shapes,
                                jax.eval_shape(tx.init, shapes))
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            abstract, shardings)
    step = steps.make_train_step(cfg, model, tx, shardings, zero_plan, rows)
    with jax.set_mesh(mesh):
        return step.lower(abstract, (batch, batch)).compile()

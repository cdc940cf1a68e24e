"""A run's second phase: the batch loaders, the train step compiled and checked to fit in memory
before anything is written, the downstream tasks loaded, and run.json's account of the run.
"""

import time

import jax

from jaxpar.data.loader import BatchLoader
from jaxpar.models import flops
from jaxpar.parallel import hlo, pipeline, zero
from jaxpar.parallel.mesh import axes_crossing_processes, mesh_shape
from jaxpar.training.run.metrics import versions
from jaxpar.training.run.state import Compiled, Setup
from jaxpar.training.run.task_scoring import task_eval_for
from jaxpar.training.step import step as steps


def compile_run(p: Setup, peak: tuple[float, str]) -> Compiled:
    """Phase 2: batch loaders, the train step compiled (and checked to fit), and run.json's info.

    `peak`: the devices' peak FLOP/s and its source, measured outside the mesh context.
    """
    cfg, t, mesh, built, model = p.cfg, p.cfg.train, p.mesh, p.built, p.model
    tasks = task_eval_for(cfg, model, mesh, p.dataset.tokenizer)  # a bad task fails before writing
    params, opt_state = p.state.params, p.state.opt_state
    held = {"bytes_per_device": {"params": steps.bytes_per_device(params),
                                 "opt_state": steps.bytes_per_device(opt_state)},
            "bytes_total": {"params": steps.bytes_total(params), "opt_state": steps.bytes_total(opt_state)}}
    zero.check_state(p.state, built.shardings)
    schedule = pipeline.summary(model)
    vocab = model.vocab_size
    n_params, flops_per_token = flops.matmul_params(model.cfg, vocab), flops.flops_per_token(model.cfg, vocab)
    loader = lambda data, split: BatchLoader(data, split, t.seed, t.batch_size,
                                             model.plan.passes, cfg.model.block_size, mesh)
    train_batches, val_loader = loader(p.dataset, "train"), loader(p.dataset, "val")
    fixed = lambda val: [val(i) for i in range(t.eval_batches)] if t.eval_every else []
    val_batches = fixed(val_loader)
    # A mixture's val loss is also taken per source, each over its own val split.
    source_val = {source.name: fixed(loader(part, "val")) for source, part in
                  zip(p.dataset.mixture.sources, p.dataset.parts)} if p.dataset.mixture else {}
    train_step, eval_step = built.train_step(train_batches.sharding), built.eval_step(val_loader.sharding)

    compile_start = time.perf_counter()
    compiled = train_step.lower(p.state, train_batches(0)).compile()
    compile_s = time.perf_counter() - compile_start
    compiled_summary = hlo.compiled_summary(compiled)
    hlo.check_fits_in_memory(compiled_summary, mesh.local_devices)  # before writing anything
    execution = model.plan.describe()
    info = {
        "config": cfg.to_dict(), "mesh": mesh_shape(mesh),
        "attention": execution["attention"], "execution": execution,
        "mesh_axes_crossing_processes": axes_crossing_processes(mesh),
        "devices": {"count": mesh.size, "platform": mesh.devices.flat[0].platform,
                    "kind": mesh.devices.flat[0].device_kind, "processes": jax.process_count()},
        "versions": versions(), "vocab_size": vocab, "zero_stage": built.zero.stage,
        "zero_unsharded": built.zero.unsharded, "n_params": n_params,
        "n_params_stored": sum(int(a.size) for a in jax.tree.leaves(params)), **held,
        "tokens_per_step": t.batch_size * cfg.model.block_size,
        "flops_per_token": flops_per_token, "peak_flops": peak[0],
        "peak_flops_source": peak[1], "compile_s": round(compile_s, 3),
        "compiled": compiled_summary, "pipeline": schedule,
        "resumed_from": p.start, "checkpoints": str(p.ckpt.directory) if p.ckpt else None,
        **({"mix_changed": p.mix_changed} if p.mix_changed else {}),
    }
    return Compiled(compiled, eval_step, train_batches, val_batches, info, tasks, source_val)

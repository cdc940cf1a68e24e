"""One training run, in four phases: `set_up` the data, mesh and state (new or restored);
`compile_run` and describe it; `train_loop`; `summarise` (jaxpar.training.run.metrics). `run` strings them together.

A run holds --out's lock throughout (jaxpar.training.run.lock). Nothing is written before the
compiled step is known to fit in memory. A non-finite loss or gradient norm stops the run with a
UserError naming the newest checkpoint that verifies. SIGTERM or SIGINT stops it at the next safe
point (jaxpar.training.run.stopping): before the first step with nothing new written, after it with
that step saved.
"""

import contextlib
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from jaxpar.core.config import Config
from jaxpar.core.errors import UserError
from jaxpar.core.written import Outputs
from jaxpar.data.loader import BatchLoader, Dataset, Prefetcher, load_dataset
from jaxpar.data.mixture import mix_change
from jaxpar.models import flops
from jaxpar.parallel import hlo, pipeline, zero
from jaxpar.parallel.distributed import is_main_process
from jaxpar.parallel.mesh import axes_crossing_processes, build_mesh, mesh_shape
from jaxpar.training.checkpoints.checkpoint import CHECKPOINTS, Checkpoints, make_meta
from jaxpar.training.checkpoints.resume import restore_train_state
from jaxpar.training.optimizers.registry import learning_rate
from jaxpar.training.run.ends import open_outputs, run_outputs, stop_diverged, stopped_early, write_failed
from jaxpar.training.run.evals import make_evaluate
from jaxpar.training.run.lock import locked
from jaxpar.training.run.metrics import (
    FETCH_EVERY,
    Diverged,
    MetricsWriters,
    StepLogger,
    check_wandb,
    summarise,
    versions,
)
from jaxpar.training.run.profiling import StepProfiler
from jaxpar.training.run.state import Compiled, RunResult, Setup
from jaxpar.training.run.stopping import StopRequest
from jaxpar.training.run.task_scoring import task_eval_for
from jaxpar.training.step import step as steps
from jaxpar.training.step.build import Built, build, token_ids


def set_up(built: Built, dataset: Dataset, out_dir: Path | None, fresh: bool) -> Setup:
    """Phase 1: the train state, restored from out_dir's newest checkpoint unless `fresh`. Call
    under `jax.set_mesh(built.mesh)`."""
    cfg = built.cfg
    ckpt = Checkpoints(out_dir / CHECKPOINTS, cfg.ckpt.keep) if out_dir is not None else None
    restored = None if ckpt is None or fresh else restore_train_state(ckpt, built, dataset.tokenizer)
    state, found = restored or (initial_state(built, cfg.train.init_from), None)
    meta, damaged = (found.meta, found.damaged) if found else (None, {})
    start = meta["step"] if meta else 0
    if start > cfg.train.steps:
        raise UserError(f"the checkpoint in '{ckpt.directory}' is at step {start}, past --steps "
                        f"{cfg.train.steps}; pass --steps {start} or more, or start over with --fresh")
    changed = mix_change(meta["config"]["data"], cfg.data, start) if meta else None
    return Setup(built, dataset, ckpt, state, start, damaged, changed)


def initial_state(built: Built, init_from: str) -> steps.TrainState:
    """A new state: random params, or init_from's Hugging Face weights, each placed straight into
    its shards."""
    if not init_from:
        return built.init_state()
    from jaxpar.models.hf import load_hf_params
    shardings = built.shardings
    params = load_hf_params(init_from, built.cfg.model, built.model.vocab_size, shardings.params)
    opt_state = jax.jit(built.tx.init, out_shardings=shardings.opt_state)(params)
    return steps.TrainState(jax.device_put(np.int32(0), shardings.step), params, opt_state)


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


def make_logger(p: Setup, c: Compiled, writers: MetricsWriters | None, result: RunResult, bar) -> StepLogger:
    """The step logger: each record into result.losses, the writers and the progress bar."""
    t, info = p.cfg.train, c.info
    aux_names = p.model.family.loss_weights()

    def on_record(record: dict):
        result.losses[record["step"]] = record["loss"]
        if aux_names:
            result.aux[record["step"]] = {name: record[name] for name in aux_names}
        if writers:
            writers.write(record)
        # No redraw here: a fetch delivers 10 records at once, and the bar shows the newest.
        bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                        refresh=False)

    return StepLogger(on_record, lambda s: s % t.log_every == 0 or s == t.steps - 1,
                      lambda s: float(learning_rate(s, p.cfg.optimizer, xp=np)), info["tokens_per_step"],
                      info["flops_per_token"], info["peak_flops"],
                      {"bubble": info["pipeline"]["bubble_fraction"]})


def train_loop(p: Setup, c: Compiled, writers: MetricsWriters | None, result: RunResult,
               profiler: StepProfiler, progress: bool, stop_at: int | None, stop: StopRequest):
    """Phase 3: steps from p.start to train.steps, with logs, evals and checkpoints; returns the
    state and the logged steps' times (a state of None: stopped before the first step).

    Raises Diverged at a non-finite step; checkpoint saves check every step before them, so none
    holds non-finite params.
    """
    cfg, t, ckpt = p.cfg, p.cfg.train, p.ckpt
    bar = tqdm(total=t.steps, initial=p.start, disable=not (progress and is_main_process()),
               dynamic_ncols=True, mininterval=0.5)
    logger, (due, evaluate) = make_logger(p, c, writers, result, bar), make_evaluate(c, t, writers, result, bar)
    state = p.state
    if due(p.start, at_start=True):  # a resumed run repeats its eval
        evaluate(p.start, state.params, at_start=True)
    if stop.now():
        bar.close()
        return None, []
    batches = Prefetcher(c.train_batches, p.start)
    logger.restart_clock(p.start - 1)
    try:
        for step in range(p.start, t.steps):
            profiler.before_step(step)
            state, metrics = c.step(state, batches(step))
            profiler.after_step(step, (state, metrics))
            logger.add(step, metrics)
            if (step + 1) % FETCH_EVERY == 0:
                logger.flush()
            bar.update(1)
            updates = step + 1
            if due(updates):
                logger.flush(step)
                evaluate(updates, state.params)
                logger.restart_clock(step)
            if updates == stop_at:
                stop.ask()
            stopping = stop.agreed(updates)
            if ckpt is not None and (cfg.ckpt.every and updates % cfg.ckpt.every == 0
                                     or updates == t.steps or stopping):
                logger.flush()  # the divergence guard sees every step before it is saved
                # Training goes on while it writes; the next save waits for this one.
                ckpt.save(updates, state.params, state.opt_state, make_meta(cfg, p.dataset.tokenizer, updates))
            if stopping:
                c.info["interrupted"] = {"step": updates, "signal": stopping}
                break
        logger.flush(step)
    finally:
        batches.close()
        bar.close()
        if ckpt is not None:
            ckpt.wait()  # a first signal now cannot cut the last write short; a second one does
            ckpt.close()
    return state, logger.step_times


def run(cfg: Config, out_dir: Path | None = None, devices=None, progress: bool = True, *,
        fresh: bool = False, stop_at: int | None = None, profile: str | None = None,
        stop: StopRequest | None = None) -> RunResult:
    """Train per cfg on a mesh over `devices` (default: all). Validates everything before writing.

    With `out_dir`, it locks out_dir, checkpoints to out_dir/checkpoints and resumes from the
    newest checkpoint there, unless `fresh`. `stop_at` stops after that step as SIGTERM would
    (tests use it). `stop`: the signals' flag, if the caller installed it earlier.
    """
    with contextlib.ExitStack() as held:
        stop = stop or held.enter_context(StopRequest())
        if out_dir is not None:
            lock = held.enter_context(locked(out_dir))
            if lock is not None:
                stop.before_forced_exit.append(lock.release)
        return train(cfg, out_dir, devices, progress, fresh, stop_at, profile, stop)


def train(cfg: Config, out_dir: Path | None, devices, progress: bool, fresh: bool, stop_at: int | None,
          profile: str | None, stop: StopRequest) -> RunResult:
    """`run`'s phases, under the lock and the signal handlers."""
    profiler = StepProfiler(profile, out_dir, cfg.train.steps)
    outputs = run_outputs(cfg, out_dir, profile) if out_dir is not None and is_main_process() else None
    check_wandb(cfg)
    dataset = load_dataset(cfg.data, cfg.model.block_size)
    vocab, eot_id = token_ids(cfg, dataset.tokenizer)  # a wrong tokenizer or vocabulary fails before the mesh
    mesh = build_mesh(cfg, devices)
    built = build(cfg, mesh, vocab=vocab, eot_id=eot_id)  # every decision the step's trace needs, made here
    if built.note and progress and is_main_process():
        print(built.note, file=sys.stderr)
    peak = flops.peak_flops(mesh.devices.flatten().tolist(), built.plan.recipe.mfu_dtype)
    result = RunResult()
    with jax.set_mesh(mesh):
        p = set_up(built, dataset, out_dir, fresh)
        if p.start == cfg.train.steps:  # already trained this far: nothing to do or write
            result.params = p.state.params
            result.info = {"resumed_from": p.start, "checkpoints": str(p.ckpt.directory),
                           "summary": None}
            return result
        if p.ckpt is not None:
            p.ckpt.check_room(p.state.params, p.state.opt_state)  # a full or read-only disk, before the compile
        stopping = stop.now()
        c = None if stopping else compile_run(p, peak)
        stopping = stopping or stop.now()
        if stopping:
            return stopped_early(p, stopping)
        try:
            return train_compiled(p, c, outputs, fresh, result, profiler, progress, stop_at, stop)
        except OSError as e:  # a full or read-only disk under the metrics: one line
            raise write_failed(p, out_dir, e) from None


def train_compiled(p: Setup, c: Compiled, outputs: Outputs | None, fresh: bool, result: RunResult,
                   profiler: StepProfiler, progress: bool, stop_at: int | None, stop: StopRequest) -> RunResult:
    """Phases 3 and 4, once compiled: the outputs opened, the loop, the summary. The writers are
    closed however the loop ends; after a failure, quietly (a full disk takes their last lines too)."""
    out_dir = outputs.folder if outputs is not None else None
    writers, created = open_outputs(p, c, outputs, fresh)
    if p.start and progress and is_main_process():
        print(f"resuming from step {p.start} in {p.ckpt.directory}", file=sys.stderr)
    for note in p.model.plan.notes if is_main_process() else ():  # auto chose a slower path
        print(note, file=sys.stderr)
    try:
        state, step_times = train_loop(p, c, writers, result, profiler, progress, stop_at, stop)
    except BaseException as error:
        if writers:
            with contextlib.suppress(OSError):
                writers.close()
        if isinstance(error, Diverged):
            raise stop_diverged(p, c.info, out_dir, error) from None
        raise
    if writers:
        writers.close()
    if state is None:
        if outputs is not None:
            outputs.release(*(created if p.start == 0 else []))
        return stopped_early(p, stop.now())
    c.info["summary"] = summarise(c.info, result.losses, result.val_losses, step_times)
    zero.check_state(state, p.built.shardings)  # out_shardings pin them; this proves it after training
    if writers:
        (out_dir / "run.json").write_text(json.dumps(c.info, indent=2))
    result.params, result.info = state.params, c.info
    return result

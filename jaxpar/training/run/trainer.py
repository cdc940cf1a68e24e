"""One training run: the data, the mesh and the built pieces (jaxpar.training.step.build), then four
phases: `set_up` the state, new or restored (jaxpar.training.run.setup); `compile_run` and describe
it (jaxpar.training.run.compiled); `train_loop`; `summarise` (jaxpar.training.run.metrics). `run`
strings them together.

A run holds --out's lock throughout (jaxpar.training.run.lock). Nothing is written before the
compiled step is known to fit in memory. A non-finite loss or gradient norm stops the run with a
UserError naming the newest checkpoint that verifies. SIGTERM or SIGINT stops it at the next safe
point (jaxpar.training.run.stopping): before the first step with nothing new written, after it with
that step saved.
"""

import contextlib
import json
import sys
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from jaxpar.core.config import Config
from jaxpar.core.written import Outputs
from jaxpar.data.loader import Prefetcher, load_dataset
from jaxpar.models import flops
from jaxpar.parallel import zero
from jaxpar.parallel.distributed import is_main_process
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.checkpoints.checkpoint import make_meta
from jaxpar.training.optimizers.registry import learning_rate
from jaxpar.training.run.compiled import compile_run
from jaxpar.training.run.ends import check_wandb, open_outputs, run_outputs, stop_diverged, stopped_early, write_failed
from jaxpar.training.run.evals import make_evaluate
from jaxpar.training.run.lock import locked
from jaxpar.training.run.metrics import FETCH_EVERY, Diverged, MetricsWriters, StepLogger, summarise
from jaxpar.training.run.profiling import StepProfiler
from jaxpar.training.run.setup import set_up
from jaxpar.training.run.state import Compiled, RunResult, Setup
from jaxpar.training.run.stopping import StopRequest
from jaxpar.training.step.build import build, token_ids


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
        c = None if stop.now() else compile_run(p, peak)
        try:
            return train_compiled(p, c, outputs, fresh, result, profiler, progress, stop_at, stop)
        except OSError as e:  # a full or read-only disk under the metrics: one line
            raise write_failed(p, out_dir, e) from None


def train_compiled(p: Setup, c: Compiled | None, outputs: Outputs | None, fresh: bool, result: RunResult,
                   profiler: StepProfiler, progress: bool, stop_at: int | None, stop: StopRequest) -> RunResult:
    """Phases 3 and 4, once compiled: the outputs opened, the loop, the summary. A signal before
    the compile (`c` None) or during it stops the run here, with nothing written. The writers are
    closed however the loop ends; after a failure, quietly (a full disk takes their last lines too)."""
    stopping = stop.now()
    if c is None or stopping:
        return stopped_early(p, stopping)
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
    if state is not None:  # out_shardings pin them; this proves it after training
        zero.check_state(state, p.built.shardings)
    elif outputs is not None:  # stopped before its first step: the outputs it created go
        outputs.release(*(created if p.start == 0 else []))
    if state is None:
        return stopped_early(p, stop.now())
    c.info["summary"] = summarise(c.info, result.losses, result.val_losses, step_times)
    if writers:
        (out_dir / "run.json").write_text(json.dumps(c.info, indent=2))
    result.params, result.info = state.params, c.info
    return result

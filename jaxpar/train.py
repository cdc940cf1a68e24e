"""`python -m jaxpar.train`: train a GPT on a device mesh; write metrics.jsonl and run.json.

Usable as a library too: `run(cfg, out_dir, devices)` returns the losses and the final params.
"""

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from jaxpar.config import DEFAULT_CONFIG_NAME, Config, load_config, valid_keys
from jaxpar.errors import ArgumentParser, UserError, check_output_dir, exit_on_user_error
from jaxpar.mesh import parse_mesh_spec
from jaxpar.plot import plot_after_training
from jaxpar.profiling import StepProfiler


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog, epilog="Any config field can be set as "
                            f"--section.field=value, with keys: {', '.join(valid_keys(Config()))}.")
    parser.add_argument("--config", help=f"TOML file, or a name in configs/ (default: "
                        f"{DEFAULT_CONFIG_NAME}, which equals the built-in defaults)")
    parser.add_argument("--mesh", help="e.g. dp=2,tp=2; axes dp, tp, pp; omitted axes are 1, "
                        "one axis may be -1 (inferred)")
    parser.add_argument("--steps", help="total optimizer steps (train.steps)")
    parser.add_argument("--seed", help="seed for init and data order (train.seed)")
    parser.add_argument("--log-every", help="log every K steps (train.log_every)")
    parser.add_argument("--zero", help="ZeRO stage 0-3 over the data axis (train.zero; default 1)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print where every tensor lives and the memory per device; no training")
    parser.add_argument("--out", help="output directory (default: out/<config name>); a run "
                        "started again with the same --out resumes from its latest checkpoint")
    parser.add_argument("--fresh", action="store_true",
                        help="start over: delete the checkpoints in --out instead of resuming")
    parser.add_argument("--profile", metavar="START:END",
                        help="jax.profiler trace of steps START..END-1 into <out>/profile")
    return parser


def parse_overrides(tokens: list[str]) -> dict[str, str]:
    """['--model.n_layer=6', '--train.lr', '3e-4'] -> {'model.n_layer': '6', 'train.lr': '3e-4'}."""
    overrides, i = {}, 0
    while i < len(tokens):
        token = tokens[i]
        key, eq, value = token[2:].partition("=")
        if not token.startswith("--") or "." not in key:
            raise UserError(f"unrecognised argument '{token}'; see --help")
        if not eq:
            if i + 1 >= len(tokens):
                raise UserError(f"{token} needs a value, e.g. {token}=VALUE")
            value, i = tokens[i + 1], i + 1
        overrides[key] = value
        i += 1
    return overrides


def parse_args(argv: list[str], prog: str = "jaxpar.train"):
    """(Config, out_dir, the parsed named flags); touches no JAX backend."""
    args, rest = build_parser(prog).parse_known_args(argv)
    overrides = parse_mesh_spec(args.mesh) if args.mesh else {}
    overrides |= parse_overrides(rest)
    named = {"train.steps": args.steps, "train.seed": args.seed, "train.log_every": args.log_every,
             "train.zero": args.zero}
    overrides |= {k: v for k, v in named.items() if v is not None}
    cfg = load_config(args.config, overrides)
    name = Path(args.config).stem if args.config else DEFAULT_CONFIG_NAME
    out_dir = Path(args.out) if args.out else Path("out") / name
    if not args.dry_run:  # which writes nothing
        check_output_dir(out_dir)
    return cfg, out_dir, args


@dataclass
class RunResult:
    losses: dict[int, float] = field(default_factory=dict)  # step -> train loss before its update
    val_losses: dict[int, float] = field(default_factory=dict)  # updates applied -> val loss
    params: dict | None = None
    info: dict = field(default_factory=dict)


def versions() -> dict:
    import flax
    import jax
    import optax

    import jaxpar
    return {"jaxpar": jaxpar.__version__, "jax": jax.__version__, "jaxlib": jax.lib.__version__,
            "flax": flax.__version__, "optax": optax.__version__,
            "python": platform.python_version()}


def run(cfg: Config, out_dir: Path | None = None, devices=None, progress: bool = True, *,
        fresh: bool = False, stop_at: int | None = None, profile: str | None = None) -> RunResult:
    """Train per cfg on a mesh over `devices` (default: all). Validates everything before writing.

    With `out_dir`, it checkpoints to out_dir/checkpoints and resumes from the newest checkpoint
    there, unless `fresh`. `stop_at` stops after that step as SIGTERM would (tests use it).
    """
    import jax
    import numpy as np
    from tqdm import tqdm

    from jaxpar import flops, hlo, pipeline, step as steps, zero
    from jaxpar.checkpoint import (CHECKPOINTS, Checkpoints, StopRequest, make_meta,
                                   restore_train_state)
    from jaxpar.data import BatchLoader, load_dataset
    from jaxpar.distributed import is_main_process
    from jaxpar.mesh import build_mesh, mesh_shape
    from jaxpar.metrics import FETCH_EVERY, StepLogger, open_metrics

    profiler = StepProfiler(profile, out_dir, cfg.train.steps)
    dataset = load_dataset(cfg.data, cfg.model.block_size)
    mesh = build_mesh(cfg, devices)
    t, chars, vocab = cfg.train, dataset.tokenizer.chars, dataset.tokenizer.vocab_size
    is_main = is_main_process()
    writing = out_dir is not None and is_main
    ckpt = Checkpoints(out_dir / CHECKPOINTS, cfg.ckpt.keep) if out_dir is not None else None
    result = RunResult()
    peak, peak_source = flops.peak_flops(mesh.devices.flatten().tolist(), cfg.model.dtype)

    with jax.set_mesh(mesh):
        tx = steps.make_optimizer(t)
        graphdef, _, _ = steps.abstract_model(cfg, vocab)
        shardings, plan = steps.state_shardings(cfg, vocab, mesh, tx)
        restored = None if ckpt is None or fresh else restore_train_state(ckpt, cfg, chars, tx,
                                                                           shardings)
        state, meta, damaged = restored or (steps.init_state(cfg, vocab, tx, shardings), None, [])
        start = meta["step"] if meta else 0
        if start > t.steps:
            raise UserError(f"the checkpoint in '{ckpt.directory}' is at step {start}, past "
                            f"--steps {t.steps}; pass --steps {start} or more, or start over "
                            "with --fresh")
        if start == t.steps:  # already trained this far: nothing to do or write
            result.params = state.params
            result.info = {"resumed_from": start, "checkpoints": str(ckpt.directory),
                           "summary": None}
            return result
        zero.check_state(state, shardings)
        microbatches = steps.microbatches_for(cfg, mesh)
        train_batches = BatchLoader(dataset.train, "train", t.seed, t.batch_size, microbatches,
                                    cfg.model.block_size, mesh)
        val_loader = BatchLoader(dataset.val, "val", t.seed, t.batch_size, microbatches,
                                 cfg.model.block_size, mesh)
        val_batches = [val_loader(i) for i in range(t.eval_batches)] if t.eval_every else []
        train_step = steps.make_train_step(cfg, graphdef, tx, shardings, plan,
                                           train_batches.sharding)
        eval_step = steps.make_eval_step(cfg, graphdef, shardings.params, val_loader.sharding)

        compile_start = time.perf_counter()
        compiled = train_step.lower(state, train_batches(0)).compile()
        compile_s = time.perf_counter() - compile_start
        compiled_summary = hlo.compiled_summary(compiled)
        hlo.check_fits_in_memory(compiled_summary, mesh.local_devices)  # before writing anything
        tokens_per_step = t.batch_size * cfg.model.block_size
        flops_per_token = flops.flops_per_token(cfg.model, vocab)

        info = {
            "config": cfg.to_dict(), "mesh": mesh_shape(mesh),
            "devices": {"count": mesh.size, "platform": mesh.devices.flat[0].platform,
                        "kind": mesh.devices.flat[0].device_kind,
                        "processes": jax.process_count()},
            "versions": versions(), "vocab_size": vocab, "zero_stage": plan.stage,
            "zero_unsharded": plan.unsharded,
            "n_params": flops.matmul_params(cfg.model, vocab),
            "n_params_stored": sum(int(a.size) for a in jax.tree.leaves(state.params)),
            "bytes_per_device": {"params": steps.bytes_per_device(state.params),
                                 "opt_state": steps.bytes_per_device(state.opt_state)},
            "bytes_total": {"params": steps.bytes_total(state.params),
                            "opt_state": steps.bytes_total(state.opt_state)},
            "flops_per_token": flops_per_token, "peak_flops": peak, "peak_flops_source": peak_source,
            "compile_s": round(compile_s, 3), "compiled": compiled_summary,
            "pipeline": pipeline.summary(cfg, mesh, vocab), "resumed_from": start,
            "checkpoints": str(ckpt.directory) if ckpt else None,
        }
        if ckpt is not None:
            if fresh and is_main:
                ckpt.remove_all()
            ckpt.delete(damaged)  # newer than the restored step: a new save may need the name
        if writing:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "run.json").write_text(json.dumps(info, indent=2))
            metrics_file = open_metrics(out_dir / "metrics.jsonl", start)
        if start and progress and is_main:
            print(f"resuming from step {start} in {ckpt.directory}", file=sys.stderr)

        def write(record: dict):
            if writing:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()

        def evaluate(updates: int):
            # One eval in flight at a time: many multi-device evals queued at once deadlocked
            # XLA:CPU's collectives (rendezvous timeout, abort) on dp=2.
            val = sum(float(eval_step(state.params, b)) for b in val_batches) / len(val_batches)
            result.val_losses[updates] = val
            write({"step": updates, "val_loss": val})
            if not bar.disable:
                bar.write(f"step {updates}: val loss {val:.4f}")

        bar = tqdm(total=t.steps, initial=start, disable=not (progress and is_main),
                   dynamic_ncols=True, mininterval=0.5)

        def on_record(record: dict):
            result.losses[record["step"]] = record["loss"]
            write(record)
            # No redraw here: a fetch delivers 10 records at once, and the bar shows the newest.
            bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                            refresh=False)

        logger = StepLogger(on_record, lambda s: float(steps.learning_rate(s, t, xp=np)),
                            tokens_per_step, flops_per_token, peak,
                            {"bubble": info["pipeline"]["bubble_fraction"]})
        if val_batches and start % t.eval_every == 0:  # a resumed run repeats its eval
            evaluate(start)
        logger.restart_clock(start - 1)
        with StopRequest() as stop:
            for step in range(start, t.steps):
                profiler.before_step(step)
                state, metrics = compiled(state, train_batches(step))
                profiler.after_step(step, (state, metrics))
                if step % t.log_every == 0 or step == t.steps - 1:
                    logger.add(step, metrics)
                if (step + 1) % FETCH_EVERY == 0:
                    logger.flush()
                bar.update(1)
                updates = step + 1
                if val_batches and (updates % t.eval_every == 0 or updates == t.steps):
                    logger.flush(step)
                    evaluate(updates)
                    logger.restart_clock(step)
                if updates == stop_at:
                    stop.request()
                stopping = stop.agreed(updates)
                every = cfg.ckpt.every and updates % cfg.ckpt.every == 0
                if ckpt is not None and (every or updates == t.steps or stopping):
                    # Training goes on while it writes; the next save waits for this one.
                    ckpt.save(updates, state.params, state.opt_state, make_meta(cfg, chars, updates))
                if stopping:
                    info["interrupted"] = {"step": updates, "signal": stopping}
                    break
            logger.flush(step)
            bar.close()
            if ckpt is not None:
                ckpt.wait()  # inside the handlers: a signal now cannot cut the last write short
                ckpt.close()
        step_times = logger.step_times

        # The first logged interval can include one-off work (allocation, caches): use the median.
        median = statistics.median(step_times) if step_times else float("nan")
        info["summary"] = {
            "final_loss": result.losses[max(result.losses)] if result.losses else None,
            "final_val_loss": result.val_losses[max(result.val_losses)] if result.val_losses else None,
            "step_time_ms_median": round(1e3 * median, 3),
            "tokens_per_s_median": round(tokens_per_step / median, 1),
            "mfu_median": tokens_per_step / median * flops_per_token / peak,
        }
        zero.check_state(state, shardings)  # out_shardings pin them; this proves it after training
        if writing:
            metrics_file.close()
            (out_dir / "run.json").write_text(json.dumps(info, indent=2))
        result.params, result.info = state.params, info
    return result


def main(argv: list[str] | None = None) -> None:
    with exit_on_user_error("jaxpar.train"):
        cfg, out_dir, args = parse_args(sys.argv[1:] if argv is None else argv)
        from jaxpar.distributed import exit_if_a_peer_fails, initialize, is_main_process
        initialize(cfg)
        if args.dry_run:
            from jaxpar.placement import dry_run
            print(dry_run(cfg))
            return
        with exit_if_a_peer_fails("jaxpar.train"):
            result = run(cfg, out_dir, fresh=args.fresh, profile=args.profile)
        if not is_main_process():
            return
        plot_after_training(out_dir)
    info, s = result.info, result.info["summary"]
    if s is None:
        print(f"nothing to do: {info['checkpoints']} already holds step {cfg.train.steps}; pass a "
              "larger --steps to train on, or --fresh to start over")
    elif "interrupted" in info:
        stop = info["interrupted"]
        print(f"interrupted by {stop['signal']} at step {stop['step']}; saved "
              f"{info['checkpoints']}/{stop['step']}; run the same command again to resume")
    else:
        print(f"done: {cfg.train.steps} steps, final train loss {s['final_loss']:.4f}"
              + (f", val loss {s['final_val_loss']:.4f}" if s["final_val_loss"] is not None else "")
              + f", {s['tokens_per_s_median']:,.0f} tok/s (median), MFU {100 * s['mfu_median']:.1f}%"
              + f"; wrote {out_dir}/metrics.jsonl, run.json and checkpoints/{cfg.train.steps}")


if __name__ == "__main__":
    main()

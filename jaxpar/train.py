"""`python -m jaxpar.train`: the command line of a training run (jaxpar.training.run.trainer runs it).

Usable as a library too: `run(cfg, out_dir, devices)` returns the losses and the final params.
"""

import argparse
import contextlib
import os
import sys
from pathlib import Path

from jaxpar.core.config import DEFAULT_CONFIG_NAME, load_config, parse_overrides, valid_keys
from jaxpar.core.errors import ArgumentParser, UserError, exit_on_user_error
from jaxpar.core.paths import given, output_folder
from jaxpar.parallel.mesh import mesh_help, parse_mesh_spec
from jaxpar.training.run.loss_plots import plot_after_training
from jaxpar.training.run.trainer import run


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog, epilog="Any config field can be set as "
                            f"--section.field=value, with keys: {', '.join(valid_keys())}.")
    parser.add_argument("--config", type=given("--config"), help=f"TOML file, or a name in configs/ (default: "
                        f"{DEFAULT_CONFIG_NAME}, which equals the built-in defaults)")
    parser.add_argument("--mesh", help=mesh_help())
    parser.add_argument("--steps", help="total optimizer steps (train.steps)")
    parser.add_argument("--seed", help="seed for init and data order (train.seed)")
    parser.add_argument("--log-every", help="log every K steps (train.log_every)")
    parser.add_argument("--zero", help="ZeRO stage 0-3 over the data axis (train.zero; default 1)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print where every tensor lives and the memory per device; no training")
    parser.add_argument("--out", type=given("--out"), help="output directory (default: out/<config name>); a run "
                        "started again with the same --out resumes from its latest checkpoint")
    parser.add_argument("--fresh", action="store_true",
                        help="start over: delete the checkpoints in --out instead of resuming")
    parser.add_argument("--init-from", metavar="HF_DIR", type=given("--init-from"),
                        help="start from a Hugging Face GPT-2 or Llama directory (config.json and "
                        "safetensors); the model's shape comes from it (train.init_from)")
    parser.add_argument("--profile", metavar="START:END",
                        help="jax.profiler trace of steps START..END-1 into <out>/tensorboard")
    return parser


def parse_args(argv: list[str], prog: str = "jaxpar.train"):
    """(Config, out_dir, the parsed named flags); touches no JAX backend."""
    args, rest = build_parser(prog).parse_known_args(argv)
    overrides = parse_mesh_spec(args.mesh) if args.mesh else {}
    overrides |= parse_overrides(rest)
    named = {"train.steps": args.steps, "train.seed": args.seed, "train.log_every": args.log_every,
             "train.zero": args.zero, "train.init_from": args.init_from}
    overrides |= {k: v for k, v in named.items() if v is not None}
    cfg = load_config(args.config, overrides)
    if cfg.train.init_from:
        from jaxpar.models.hf import apply_hf_config
        explicit = {k: v for k, v in overrides.items() if k.startswith("model.")}
        vocab = apply_hf_config(cfg, cfg.train.init_from, explicit)
        asked = explicit.get("model.vocab_size")
        if asked is not None and cfg.model.vocab_size not in (0, vocab):
            raise UserError(f"model.vocab_size={asked} conflicts with vocab_size={vocab} of the "
                            f"model in {cfg.train.init_from}; drop the override")
        cfg.model.vocab_size = vocab
    name = Path(args.config).stem if args.config else DEFAULT_CONFIG_NAME
    out_dir = Path(args.out) if args.out else Path("out") / name
    if not args.dry_run:  # which writes nothing
        out_dir = output_folder(out_dir)  # through a symbolic link, which stays
    return cfg, out_dir, args


def main(argv: list[str] | None = None) -> None:
    from jaxpar.training.run.stopping import StopRequest
    with StopRequest("jaxpar.train") as stop:  # from the start: a signal at any moment is a request
        train_command(sys.argv[1:] if argv is None else argv, stop)


def train_command(argv: list[str], stop) -> None:
    with exit_on_user_error("jaxpar.train"):
        cfg, out_dir, args = parse_args(argv)
        from jaxpar.parallel.distributed import exit_if_a_peer_fails, initialize, is_main_process
        initialize(cfg)
        if args.dry_run:
            from jaxpar.planning.placement import dry_run
            print(dry_run(cfg))
            return
        with exit_if_a_peer_fails("jaxpar.train"), exit_at_once_if_stuck("jaxpar.train"):
            result = run(cfg, out_dir, fresh=args.fresh, profile=args.profile, stop=stop)
        if not is_main_process():
            return
        if result.info["summary"] is not None:
            plot_after_training(out_dir)
    print(outcome(cfg, out_dir, result.info))


@contextlib.contextmanager
def exit_at_once_if_stuck(prog: str):
    """A save that failed in orbax's background threads leaves others waiting minutes for it: its
    one line, then exit 2 without waiting for them (the run's lock is released by then)."""
    from jaxpar.training.checkpoints.save_faults import SaveFailed
    try:
        yield
    except SaveFailed as e:
        if not e.stuck:
            raise
        e.settle()
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)


def outcome(cfg, out_dir: Path, info: dict) -> str:
    """The run's last line: how it ended, and what to do next."""
    s, stop = info["summary"], info.get("interrupted")
    if stop and stop.get("before_first_step"):
        kept = (f"{info['checkpoints']}/{stop['step']} is as it was; run the same command again to resume"
                if stop["step"] else "nothing was written; run the same command again to start")
        return f"interrupted by {stop['signal']} before the first step; {kept}"
    if stop:
        return (f"interrupted by {stop['signal']} at step {stop['step']}; saved "
                f"{info['checkpoints']}/{stop['step']}; run the same command again to resume")
    if s is None:
        return (f"nothing to do: {info['checkpoints']} already holds step {cfg.train.steps}; pass a "
                "larger --steps to train on, or --fresh to start over")
    return (f"done: {cfg.train.steps} steps, final train loss {s['final_loss']:.4f}"
            + (f", val loss {s['final_val_loss']:.4f}" if s["final_val_loss"] is not None else "")
            + f", {s['tokens_per_s_median']:,.0f} tok/s (median), MFU {100 * s['mfu_median']:.1f}%"
            + f"; wrote {out_dir}/metrics.jsonl, run.json, loss.png, tensorboard/ and "
            f"checkpoints/{cfg.train.steps}")


if __name__ == "__main__":
    main()

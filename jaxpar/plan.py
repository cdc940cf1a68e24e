"""`python -m jaxpar.plan --target tpu:v5e-256`: every layout of a target compiled, checked and ranked
(jaxpar.planning.plan does the work). Its flags, and every check of them made before any work: a
bad value is one line and exit 2, with nothing written."""

import os
import sys
from pathlib import Path

from jaxpar.core.axes import AXES
from jaxpar.core.config import OFFLOADS, load_config, valid_keys
from jaxpar.core.errors import ArgumentParser, UserError, exit_on_user_error
from jaxpar.core.out_lock import RunLock
from jaxpar.core.paths import given, output_folder
from jaxpar.core.remat import HOST, REMAT_KINDS
from jaxpar.planning.hardware import parse_target, target_devices
from jaxpar.planning.layouts import (
    AUTO_SIZES,
    choices,
    fixed_sizes,
    fp8_choices,
    host_memory_choices,
    int_list,
    parse_layouts,
)
from jaxpar.planning.plan import DEFAULT_MAX_COMPILES, DEFAULT_REMATS, plan
from jaxpar.planning.plan_report import plan_outputs

DESCRIPTION = ("compile the real train step for every layout of a target you may not have, and rank "
               "the layouts by estimated speed among those that fit")


def build_parser() -> ArgumentParser:
    from jaxpar.nn.recipes import FP8
    parser = ArgumentParser(prog="jaxpar.plan", description=DESCRIPTION,
                            epilog="Any config field can be set as --section.field=value, with keys: "
                            f"{', '.join(valid_keys())}.")
    parser.add_argument("--config", type=given("--config"), help="TOML file, or a name in configs/ (e.g. gpt2-xl)")
    parser.add_argument("--target", required=True, help="tpu:v5e-256, tpu:v5p-128, tpu:v4-64, "
                        "tpu:v6e-64 (Cloud TPU accelerator types), gpu:h100-8 (one node of 1, 2, 4 "
                        "or 8 H100s), or cpu:N (N host devices)")
    searched = " x ".join(a.key for a in AXES if a.planned)
    others = ", ".join(f"--{a.key}" for a in AXES if not a.planned)
    parser.add_argument("--layouts", default="auto", help=f'"auto" (every {searched} of the target, '
                        f'for each size of {others}), or meshes separated by ";", e.g. '
                        '"dp=8,tp=4;dp=16,tp=2;dp=4,cp=4"')
    for axis in AXES:
        if not axis.planned:
            default = "auto" if axis.key in AUTO_SIZES else "1"
            parser.add_argument(f"--{axis.key}", default=default, help=f"{axis.about}: the {axis.key} sizes "
                                f"to try with --layouts auto (default {default}), e.g. 1,2,4,8"
                                + ("; auto: for a mixture of experts every size dividing its expert count "
                                   "and the devices, else 1" if default == "auto" else ""))
    parser.add_argument("--zero", default="0,1,2,3", help="ZeRO stages to try (default 0,1,2,3)")
    parser.add_argument("--micro-batch", default="auto", help="train.micro_batch values to try; "
                        "auto: powers of two up to the rows each device holds")
    parser.add_argument("--remat", default=",".join(DEFAULT_REMATS), help="model.remat policies to try, "
                        f"from {', '.join(REMAT_KINDS)}, or auto: all of them (default "
                        f"{','.join(DEFAULT_REMATS)}: each policy is another compile of every layout)")
    parser.add_argument("--offload", default="none", help=f"train.offload values to try, from {', '.join(OFFLOADS)}, "
                        f"or auto: all of them (default none). Offloading (and full_offloaded) needs a {HOST} "
                        "memory kind on the target's devices: auto leaves it out where they have none")
    parser.add_argument("--fp8", help=f"model.fp8 recipes to try, from {', '.join(FP8)}, or auto: every one "
                        "the target's platform runs (default: the config's model.fp8 alone). One the target "
                        "cannot run (a TPU) is listed as skipped, with the trainer's reason")
    parser.add_argument("--max-compiles", type=int, default=DEFAULT_MAX_COMPILES,
                        help=f"compile at most this many layouts, the most promising first "
                        f"(default {DEFAULT_MAX_COMPILES})")
    parser.add_argument("--top", type=int, default=10, help="rows of the ranked table to print")
    parser.add_argument("--out", type=given("--out"), help="output directory (default: out/plan-<target>)")
    return parser


def parse_args(argv: list[str]):
    """(Config, Target, the flags with --zero, --remat, --offload and --fp8 as lists and --out a
    Path, the --section.field overrides); every check is made here, before any work."""
    from jaxpar.core.config import parse_overrides
    args, rest = build_parser().parse_known_args(argv)
    overrides = parse_overrides(rest)
    cfg = load_config(args.config, overrides)
    target = parse_target(args.target)
    remats = choices(args.remat, REMAT_KINDS, "--remat")
    offloads = choices(args.offload, OFFLOADS, "--offload")
    fp8s = fp8_choices(args.fp8, cfg.model.fp8, target.platform)
    zeros = int_list(args.zero, "--zero")
    if not zeros or set(zeros) - {0, 1, 2, 3}:
        raise UserError(f"--zero takes stages from 0,1,2,3, got {args.zero!r}")
    if args.max_compiles < 1:
        raise UserError("--max-compiles must be at least 1")
    if args.micro_batch != "auto" and min(int_list(args.micro_batch, "--micro-batch")) < 1:
        raise UserError("--micro-batch values must be positive")
    fixed = fixed_sizes({a.key: getattr(args, a.key) for a in AXES if not a.planned}, cfg.model, target.chips)
    if not parse_layouts(args.layouts, target.chips, fixed):  # a bad --layouts fails before any work
        if args.layouts != "auto":
            raise UserError(f"--layouts {args.layouts!r} names no layout; pass meshes separated by "
                            '";", e.g. "dp=2,tp=2;dp=4", or auto')
        flags = " ".join(f"--{key} {getattr(args, key)}" for key in fixed)
        raise UserError(f"--layouts auto with {flags} leaves no layout of {target.chips} devices; pass "
                        f"sizes whose product divides {target.chips}")
    out = Path(args.out) if args.out else Path("out") / f"plan-{args.target.replace(':', '-')}"
    out = output_folder(out)  # through a symbolic link, which stays
    args.auto = {flag for flag in ("remat", "offload") if getattr(args, flag) == "auto"}
    args.zero, args.remat, args.offload, args.fp8, args.out, args.fixed = zeros, remats, offloads, fp8s, out, fixed
    return cfg, target, args, overrides


def main(argv: list[str] | None = None) -> None:
    with exit_on_user_error("jaxpar.plan"):
        cfg, target, args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        if target.platform != "cpu" and not os.environ.get("JAX_PLATFORMS"):
            # Nothing runs here: keep JAX off any local accelerator (and libtpu's or CUDA's
            # start-up noise off a machine without one). Compiling for a topology does not need it.
            import jax
            try:
                jax.config.update("jax_platforms", "cpu")
            except RuntimeError:
                pass
        devices = target_devices(target)  # before the lock: a refused offload leaves no --out behind
        args.remat, args.offload = host_memory_choices(target, devices, args.remat, args.offload, args.auto)
        try:
            with RunLock(args.out):  # one writer per --out
                plan_outputs(args.out).check()  # a file jaxpar did not write is refused before any compile
                plan(cfg, target, args, overrides, devices)
        except KeyboardInterrupt:  # the lock released by now; each report file is written whole or not at all
            print(f"jaxpar.plan: interrupted; nothing new written in {args.out} (an earlier plan there is "
                  "as it was)", file=sys.stderr, flush=True)
            os._exit(130)  # not sys.exit: the interpreter's teardown while XLA compiles can segfault


if __name__ == "__main__":
    main()

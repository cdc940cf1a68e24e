"""`python -m jaxpar.bench [--config F] [--layouts 'dp=1;dp=2']`: one config trained on several mesh
layouts and compared: speed, memory, collectives and final loss (jaxpar.planning.bench runs them)."""

import signal
import sys
from pathlib import Path

from jaxpar.core.config import DEFAULT_CONFIG_NAME, parse_overrides
from jaxpar.core.errors import ArgumentParser, exit_on_user_error
from jaxpar.core.paths import given, output_folder
from jaxpar.planning.bench import DEFAULT_LAYOUTS, DEFAULT_STEPS, Stopped, bench_layouts, plan_layouts


def parse_args(argv: list[str]):
    parser = ArgumentParser(prog="jaxpar.bench", description="Train one config on several mesh layouts "
                     "and compare speed, memory, collectives and final loss.",
                     epilog="Any other --section.field=value is passed to jaxpar.train.")
    parser.add_argument("--config", type=given("--config"), help="TOML file or a name in configs/ (as jaxpar.train)")
    parser.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                        help=f"mesh specs separated by ';' (default: {DEFAULT_LAYOUTS!r})")
    parser.add_argument("--steps", type=int, help=f"steps per layout (default: {DEFAULT_STEPS})")
    parser.add_argument("--weak", action="store_true",
                        help="weak scaling: global batch = train.batch_size x devices")
    parser.add_argument("--out", type=given("--out"), help="output directory (default: out/bench_<config name>); a layout "
                        "measured there before under the same settings is reused, saying so")
    args, rest = parser.parse_known_args(argv)
    overrides = parse_overrides(rest)
    if args.steps is not None or "train.steps" not in overrides:
        overrides["train.steps"] = str(DEFAULT_STEPS if args.steps is None else args.steps)
    name = Path(args.config).stem if args.config else DEFAULT_CONFIG_NAME
    out_dir = Path(args.out) if args.out else Path("out") / f"bench_{name}"
    out_dir = output_folder(out_dir)  # through a symbolic link, which stays
    return args, overrides, out_dir


def main(argv: list[str] | None = None) -> None:
    with exit_on_user_error("jaxpar.bench"):
        args, overrides, out_dir = parse_args(sys.argv[1:] if argv is None else argv)
        layouts = plan_layouts(args.layouts, args.config, overrides, args.weak)
        from jaxpar.data.loader import load_dataset  # a bad data file fails here, not in every layout
        load_dataset(layouts[0].cfg.data, layouts[0].cfg.model.block_size)
        try:
            rows, markdown = bench_layouts(layouts, args.config, args.weak, out_dir)
        except Stopped as stopped:
            signum, where = stopped.args
            print(f"jaxpar.bench: stopped by {signal.Signals(signum).name} {where}; bench.md not written; the same "
                  "command again reuses the layouts measured and measures the rest", file=sys.stderr)
            sys.exit(128 + signum)
    print(markdown)
    print(f"wrote {out_dir}/bench.json, bench.md" + (", bench.png" if (out_dir / "bench.png").exists()
                                                      else ""))
    failed = [row["layout"] for row in rows if row["error"]]
    if failed:
        print(f"jaxpar.bench: error: {len(failed)} of {len(rows)} layouts failed: "
              f"{', '.join(failed)}; see their train.log", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

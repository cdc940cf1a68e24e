"""`python -m jaxpar.plot RUN_DIR ... [--out FILE]`: the loss curves of runs, overlaid in one picture
(jaxpar.training.run.loss_plots draws them)."""

import sys

from jaxpar.core.errors import ArgumentParser, exit_on_user_error
from jaxpar.core.paths import given
from jaxpar.training.run.loss_plots import picture_path, plot_runs


def main(argv: list[str] | None = None) -> None:
    with exit_on_user_error("jaxpar.plot"):
        parser = ArgumentParser(prog="jaxpar.plot", description="Overlay the loss curves of jaxpar runs.")
        parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", type=given("RUN_DIR"), help="jaxpar.train --out dirs")
        parser.add_argument("--out", type=given("--out"), help="the picture to write, or a folder for loss.png (default: "
                            "loss.png); its name gives its kind: .png, .pdf, .svg ...")
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        out = picture_path(args.out, "loss.png")
        print(f"wrote {plot_runs(args.run_dirs, out)}")


if __name__ == "__main__":
    main()

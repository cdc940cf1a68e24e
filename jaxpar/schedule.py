"""`python -m jaxpar.schedule --schedule NAME --pp 4 --microbatches 8`: a pipeline schedule's table,
printed as a grid and drawn as a PNG (stages as rows, ticks as columns, bubbles blank)."""

import sys

import numpy as np

from jaxpar.core.errors import ArgumentParser, UserError, exit_on_user_error
from jaxpar.core.paths import given
from jaxpar.parallel.schedules import DEFAULT, SCHEDULES, make_schedule
from jaxpar.parallel.schedules.base import PipelineSchedule
from jaxpar.parallel.schedules.ops import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT
from jaxpar.training.run.loss_plots import picture_path, pyplot, save

COLOURS = {FORWARD: "#4c78a8", BACKWARD: "#f58518", INPUT_GRAD: "#f58518", WEIGHT: "#54a24b"}
MAX_PASSES = 2**17  # forward passes (stages x microbatches x chunks) a table may hold: built in seconds
LABELLED = 512  # up to this many, each operation is a labelled box; past it, one pixel block each
PRINTED = 20_000  # the grid is printed up to this many cells (stages x ticks)


def check_size(pp: int, microbatches: int, virtual: int) -> None:
    """Size the table before building it: past MAX_PASSES, one line instead of minutes of work."""
    passes = pp * microbatches * virtual
    if passes > MAX_PASSES:
        chunks = f" (x {virtual} layer chunks)" if virtual > 1 else ""
        raise UserError(f"--pp {pp} --microbatches {microbatches}{chunks} make a table of "
                        f"{passes:,} forward passes, past the {MAX_PASSES:,} jaxpar.schedule builds and draws; "
                        "pass smaller ones (the schedule's shape shows at a few stages)")


def shade(colour: str, chunk: int, virtual: int) -> np.ndarray:
    """The op's colour as RGB, later layer chunks lighter (as if drawn at a lower alpha on white)."""
    alpha = 1.0 - 0.45 * chunk / max(virtual - 1, 1)
    rgb = np.array([int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return alpha * rgb + (1 - alpha)


def draw(schedule: PipelineSchedule, path: str) -> None:
    """A PNG of the table: stages as rows, ticks as columns, F, B and W coloured (later layer
    chunks lighter), bubbles blank; each op labelled while the table is small enough to read."""
    plt = pyplot()
    small = schedule.pp * schedule.microbatches * schedule.virtual <= LABELLED
    width = max(6, 0.35 * schedule.ticks) if small else min(40, max(6, 0.05 * schedule.ticks))
    fig, ax = plt.subplots(figsize=(width, min(40, 0.6 * schedule.pp + 1.2)))
    image = np.ones((schedule.pp, schedule.ticks, 3))
    for t, row in enumerate(schedule.table):
        for s, op in enumerate(row):
            if op is None:
                continue
            image[s, t] = shade(COLOURS[op.kind], op.chunk, schedule.virtual)
            if small:
                ax.add_patch(plt.Rectangle((t, s), 1, 1, facecolor=image[s, t], edgecolor="white"))
                ax.text(t + 0.5, s + 0.5, op.label(schedule.virtual > 1), ha="center", va="center",
                        fontsize=6 if schedule.virtual > 1 else 7, color="black" if op.chunk else "white")
    if not small:
        ax.imshow(image, aspect="auto", interpolation="nearest", extent=(0, schedule.ticks, schedule.pp, 0))
    virtual = f", V={schedule.virtual}" if schedule.virtual > 1 else ""
    ticks = np.arange(schedule.pp) if small or schedule.pp <= 32 else np.linspace(0, schedule.pp - 1, 9).astype(int)
    ax.set(xlim=(0, schedule.ticks), ylim=(schedule.pp, 0), xlabel="tick", yticks=ticks + 0.5,
           yticklabels=[f"stage {s}" for s in ticks],
           title=f"{schedule.name}, pp={schedule.pp}{virtual}, M={schedule.microbatches}: "
                 f"bubble {schedule.bubble_fraction:.1%}")
    save(plt, fig, path)


def least_chunks(cls) -> int:
    """The fewest layer chunks a stage that the schedule runs (pipeline.virtual 1, else 2)."""
    try:
        return cls.chunks_per_stage(1) and 1
    except UserError:
        return 2


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="jaxpar.schedule", description=__doc__.splitlines()[0],
                            epilog="Schedules: " + "; ".join(f"{name}: {cls.about}" for name, cls in SCHEDULES.items()))
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", default=DEFAULT.name, choices=tuple(SCHEDULES))
    parser.add_argument("--virtual", type=int, default=None,
                        help="layer chunks per stage, for a schedule that takes several (default: its least)")
    parser.add_argument("--out", type=given("--out"), help="PNG path (default: schedule_<schedule>_pp<P>_m<M>[_v<V>].png)")
    with exit_on_user_error("jaxpar.schedule"):
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        if args.pp < 1:
            raise UserError(f"--pp must be positive, got {args.pp}")
        virtual = args.virtual or least_chunks(SCHEDULES[args.schedule])
        check_size(args.pp, args.microbatches, virtual)
        suffix = f"_v{virtual}" if args.virtual and virtual > 1 else ""
        out = picture_path(args.out, f"schedule_{args.schedule}_pp{args.pp}_m{args.microbatches}{suffix}.png")
        schedule = make_schedule(args.schedule, args.pp, args.microbatches, virtual)
        cells = schedule.pp * schedule.ticks
        print(schedule.grid() if cells <= PRINTED else f"{schedule.name}: {schedule.pp} stages x "
              f"{schedule.ticks} ticks ({cells:,} cells, too many to print); bubble {schedule.bubble_fraction:.1%}")
        draw(schedule, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

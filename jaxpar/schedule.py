"""`python -m jaxpar.schedule --schedule NAME --pp 4 --microbatches 8`: a pipeline schedule's table,
printed as a grid and drawn as a PNG (stages as rows, ticks as columns, bubbles blank)."""

import sys

import numpy as np

from jaxpar.core.errors import ArgumentParser, UserError, exit_on_user_error
from jaxpar.parallel.schedules import DEFAULT, SCHEDULES, make_schedule, schedule_class
from jaxpar.parallel.schedules.base import PipelineSchedule
from jaxpar.parallel.schedules.ops import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT
from jaxpar.training.run.loss_plots import picture_path, pyplot, save


def draw(schedule: PipelineSchedule, path: str) -> None:
    """A PNG of the table: stages as rows, ticks as columns, F, B and W coloured (later layer
    chunks lighter), bubbles blank."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * schedule.ticks), 0.6 * schedule.pp + 1.2))
    colours = {FORWARD: "#4c78a8", BACKWARD: "#f58518", INPUT_GRAD: "#f58518", WEIGHT: "#54a24b"}
    for t, row in enumerate(schedule.table):
        for s, op in enumerate(row):
            if op is not None:
                alpha = 1.0 - 0.45 * op.chunk / max(schedule.virtual - 1, 1)
                ax.add_patch(plt.Rectangle((t, s), 1, 1, facecolor=colours[op.kind], alpha=alpha,
                                           edgecolor="white"))
                ax.text(t + 0.5, s + 0.5, op.label(schedule.virtual > 1), ha="center", va="center",
                        fontsize=6 if schedule.virtual > 1 else 7, color="black" if op.chunk else "white")
    virtual = f", V={schedule.virtual}" if schedule.virtual > 1 else ""
    ax.set(xlim=(0, schedule.ticks), ylim=(schedule.pp, 0), xlabel="tick", yticks=np.arange(schedule.pp) + 0.5,
           yticklabels=[f"stage {s}" for s in range(schedule.pp)],
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
    parser.add_argument("--out", help="PNG path (default: schedule_<schedule>_pp<P>_m<M>[_v<V>].png)")
    with exit_on_user_error("jaxpar.schedule"):
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        if args.pp < 1:
            raise UserError(f"--pp must be positive, got {args.pp}")
        virtual = args.virtual or least_chunks(schedule_class(args.schedule))
        schedule = make_schedule(args.schedule, args.pp, args.microbatches, virtual)
        suffix = f"_v{virtual}" if args.virtual and virtual > 1 else ""
        out = picture_path(args.out, f"schedule_{args.schedule}_pp{args.pp}_m{args.microbatches}{suffix}.png")
        print(schedule.grid())
        draw(schedule, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

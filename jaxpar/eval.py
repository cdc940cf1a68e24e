"""`python -m jaxpar.eval --ckpt RUN_DIR [--data DIR] [--mesh SPEC]`: a checkpoint's loss over the whole
val split, or with `--tasks hellaswag,arc_easy --tasks-dir DIR` its multiple-choice accuracy, one
JSON line each (jaxpar.inference.evaluate evaluates)."""

import json
import sys

try:
    from jaxpar.cli import add_model_source
    from jaxpar.core.errors import ArgumentParser, UserError, exit_on_interrupt, exit_on_user_error
    from jaxpar.core.paths import given
    from jaxpar.inference.evaluate import check_samples_path, data_for, evaluate_sources, evaluate_tasks, write_samples
    from jaxpar.inference.loading import load_source
    from jaxpar.training.run import task_scoring
except KeyboardInterrupt:  # Ctrl-C while JAX loads: one line and 130, as main's own
    print("jaxpar.eval: interrupted", file=sys.stderr)
    sys.exit(130)


def parse_args(argv):
    parser = ArgumentParser(prog="jaxpar.eval", description="Loss over the whole val split, or "
                            "multiple-choice accuracy on downstream tasks.")
    add_model_source(parser)
    parser.add_argument("--data", type=given("--data"), help="a jaxpar.prepare directory or text file (default: "
                        "the run's own data; needed with --hf)")
    parser.add_argument("--rows", type=int, default=None, help="rows per forward pass (default: 16 "
                        "blocks for the loss, 32 requests for tasks)")
    parser.add_argument("--tasks", help="comma-separated: hellaswag, arc_easy, arc_challenge, piqa, winogrande")
    parser.add_argument("--tasks-dir", type=given("--tasks-dir"), help="where the tasks are: save_to_disk folders, .arrow or .jsonl")
    parser.add_argument("--limit", type=int, help="with --tasks: each task's first N items")
    parser.add_argument("--samples", type=given("--samples"), help="with --tasks: write each item's log-likelihoods here (jsonl)")
    args = parser.parse_args(argv)
    if args.rows is not None and args.rows < 1:
        raise UserError(f"--rows must be at least 1, got {args.rows}")
    if args.tasks is None:
        extra = [flag for flag, value in (("--tasks-dir", args.tasks_dir), ("--limit", args.limit),
                                          ("--samples", args.samples)) if value is not None]
        if extra:
            raise UserError(f"{extra[0]} is for --tasks; name the tasks to run, e.g. --tasks hellaswag")
        if args.hf and args.data is None:
            raise UserError("--hf needs --data: a jaxpar.prepare directory made with the model's tokenizer")
    else:
        if args.tasks_dir is None:
            raise UserError("--tasks needs --tasks-dir DIR: the folder holding the tasks (see the guide)")
        if args.limit is not None and args.limit < 1:
            raise UserError(f"--limit must be at least 1, got {args.limit}")
        if args.samples is not None:
            check_samples_path(args.samples)
        task_scoring.find_all(args.tasks, args.tasks_dir)  # a bad task fails before the model loads
    return args


def main(argv: list[str] | None = None) -> None:
    with exit_on_interrupt("jaxpar.eval"):
        run_command(argv)


def run_command(argv: list[str] | None) -> None:
    """The command itself: the model loaded, each source or task evaluated, a JSON line each."""
    with exit_on_user_error("jaxpar.eval"):
        args = parse_args(sys.argv[1:] if argv is None else argv)
        model = load_source(args, "jaxpar.eval")
        source = {"step": model.step} if args.ckpt else {"hf": args.hf}
        rows_given = args.rows is not None
        if args.tasks is not None:
            args.rows = args.rows or 32
            results, samples = evaluate_tasks(model, args, rows_given)
            for result in results:  # the scores first: a --samples that fails to write takes nothing from them
                print(strict_line({**source, **result}), flush=True)
            if args.samples:
                write_samples(args.samples, samples)
            return
        for result in evaluate_sources(model, data_for(model, args.data), args.rows or 16, rows_given):
            print(strict_line({**source, **result}))


def strict_line(result: dict) -> str:
    """One JSON line any strict parser reads; a non-finite figure is an error, not a NaN token."""
    try:
        return json.dumps(result, allow_nan=False)
    except ValueError:
        raise UserError(f"the evaluation gave a non-finite figure ({result}); the model's outputs "
                        "overflow: evaluate it in float32") from None


if __name__ == "__main__":
    main()

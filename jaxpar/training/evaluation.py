"""Evaluation during training: the val loss over the run's fixed val batches, and the downstream
tasks' accuracies (--eval.tasks), each at its own steps, recorded in metrics.jsonl, TensorBoard,
W&B and the progress bar."""

from jaxpar.training.metrics import MetricsWriters


def make_evaluate(c, t, writers: MetricsWriters | None, result, bar):
    """(due(updates), evaluate(updates, params)): the mean val loss over the fixed val batches and
    the tasks' accuracies, each at its own steps, recorded."""
    val_due = lambda u: bool(c.val_batches) and (u % t.eval_every == 0 or u == t.steps)  # noqa: E731
    tasks_due = lambda u: c.tasks is not None and c.tasks.due(u, t.steps)  # noqa: E731

    def evaluate(updates: int, params):
        if val_due(updates):
            # One eval in flight at a time: many multi-device evals queued at once deadlocked
            # XLA:CPU's collectives (rendezvous timeout, abort) on dp=2.
            val = sum(float(c.eval_step(params, b)) for b in c.val_batches) / len(c.val_batches)
            result.val_losses[updates] = val
            record(writers, bar, {"step": updates, "val_loss": val}, f"val loss {val:.4f}")
        if tasks_due(updates):
            scores = c.tasks(updates, params)
            record(writers, bar, scores, ", ".join(f"{k} {v:.4f}" for k, v in scores.items() if k != "step"))
    return lambda u: val_due(u) or tasks_due(u), evaluate


def record(writers: MetricsWriters | None, bar, values: dict, line: str) -> None:
    if writers:
        writers.write(values)
    if not bar.disable:
        bar.write(f"step {values['step']}: {line}")

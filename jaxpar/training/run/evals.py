"""Evaluation during training: the val loss over the run's fixed val batches, and the downstream
tasks' accuracies (--eval.tasks), each at its own steps, recorded in metrics.jsonl, TensorBoard,
W&B and the progress bar."""

from jaxpar.training.run.metrics import MetricsWriters, record


def make_evaluate(c, t, writers: MetricsWriters | None, result, bar):
    """(due(updates), evaluate(updates, params)): the mean val loss over the fixed val batches and
    the tasks' accuracies, each every its own number of updates and at the run's last step (not
    again at the start of a run resumed there), recorded."""
    def every(n: int, u: int, at_start: bool) -> bool:
        return u % n == 0 or (u == t.steps and not at_start)
    val_due = lambda u, at_start=False: bool(c.val_batches) and every(t.eval_every, u, at_start)  # noqa: E731
    tasks_due = lambda u, at_start=False: c.tasks is not None and every(c.tasks.every, u, at_start)  # noqa: E731

    def evaluate(updates: int, params, at_start: bool = False):
        if val_due(updates, at_start):
            # One eval in flight at a time: many multi-device evals queued at once deadlocked
            # XLA:CPU's collectives (rendezvous timeout, abort) on dp=2.
            mean = lambda batches: sum(float(c.eval_step(params, b)) for b in batches) / len(batches)  # noqa: E731
            val = mean(c.val_batches)
            result.val_losses[updates] = val
            sources = {f"val_loss/{name}": mean(batches) for name, batches in c.source_val.items()}
            record(writers, bar, {"step": updates, "val_loss": val, **sources},
                   f"val loss {val:.4f}" + "".join(f", {k[9:]} {v:.4f}" for k, v in sources.items()))
        if tasks_due(updates, at_start):
            scores = c.tasks(updates, params)
            record(writers, bar, scores, ", ".join(f"{k} {v:.4f}" for k, v in scores.items() if k != "step"))
    return lambda u, at_start=False: val_due(u, at_start) or tasks_due(u, at_start), evaluate


"""`python -m jaxpar.eval --ckpt RUN_DIR [--data DIR] [--mesh SPEC]`: a checkpoint's loss over the
whole val split, every non-overlapping block of it (not a sample of random batches), as one JSON line;
for a run on a mixture, a line per source and one for the mixture (the losses weighted as data.mix).
With `--tasks hellaswag,arc_easy --tasks-dir DIR` instead: multiple-choice accuracy, one JSON line
per task (jaxpar.training.run.task_scoring).

The loss is the mean next-token cross-entropy over all scored tokens; the perplexity is its exp.
"""

import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np

from jaxpar.core.axes import splitting
from jaxpar.core.config import DataConfig
from jaxpar.core.data_config import parse_mix
from jaxpar.core.errors import UserError
from jaxpar.core.paths import checked
from jaxpar.data.loader import load_dataset
from jaxpar.data.tokenizer import check_same_tokenizer
from jaxpar.inference.loading import Model
from jaxpar.nn.loss import cross_entropy
from jaxpar.training.run import task_scoring
from jaxpar.training.step.row_batches import over_rows, passes_rows


def blocks_of(tokens: np.ndarray, block_size: int) -> int:
    """How many non-overlapping blocks (inputs and their next-token targets) the split holds."""
    return (len(tokens) - 1) // block_size


def block_rows(tokens: np.ndarray, first: int, count: int, block_size: int):
    """(inputs, targets) of blocks first..first+count-1, as int32 (count, block_size) arrays."""
    start, stop = first * block_size, (first + count) * block_size
    window = np.asarray(tokens[start:stop + 1]).astype(np.int32)
    return window[:-1].reshape(count, block_size), window[1:].reshape(count, block_size)


def make_row_losses(model: Model):
    """jit(params, inputs, targets) -> each row's mean loss, under the execution plan that the
    checkpoint's config gets on this mesh (its attention kernel as in training); each device of a
    context ring computes its rows' sequences whole (no ring here)."""
    net = model.net.on(model.execution.unsplit(*splitting("seq")))  # documents as trained

    def row_losses(params, inputs, targets):
        logits = net(params, inputs)
        return jax.vmap(lambda lg, tg: cross_entropy(lg[None], tg[None]))(logits, targets)
    return jax.jit(row_losses)


def evaluate(model: Model, tokens: np.ndarray, rows: int = 16, progress: bool = False,
             say_capped: bool = False) -> dict:
    """Loss and perplexity of `model` over every non-overlapping block of `tokens`, in passes of
    `rows` blocks (at most the blocks there are; `say_capped`: a note on stderr when capped)."""
    block = model.cfg.model.block_size
    total = blocks_of(tokens, block)
    if total < 1:
        raise UserError(f"the val split has {len(tokens)} tokens, fewer than a block of {block} "
                        "and its target; use more data")
    rows = rows_for(rows, total, "blocks in the val split", say_capped)
    row_losses = make_row_losses(model)
    losses, seconds = over_rows(lambda *batch: row_losses(model.params, *batch),
                                lambda first, count: block_rows(tokens, first, count, block),
                                total, model.mesh, rows, progress, unit="block")
    loss = float(losses.astype(np.float64).mean())
    scored = total * block
    timed = scored - min(passes_rows(model.mesh, rows), total) * block
    return {"split": "val", "loss": loss, "perplexity": math.exp(loss), "tokens": scored,
            "blocks": total, "tokens_per_s": round(timed / seconds, 1) if seconds else None}


def rows_for(rows: int, total: int, what: str, say: bool) -> int:
    """`rows` per pass, at most `total`: a pass is padded to its rows, so more than there are to
    score would only hold padding (and a huge --rows, all the host's memory). With `say`, a
    capped --rows is noted on stderr."""
    if rows > total and say:
        print(f"jaxpar.eval: note: --rows {rows:,} is more than the {total:,} {what}; "
              f"{total:,} rows per pass", file=sys.stderr)
    return min(rows, total)


def data_for(model: Model, path: str | None) -> dict:
    """{source name: its val split} of --data (or of the run's own data: each source of a
    mixture, else one named ""), which must use the model's tokenizer."""
    given = {"path": path, "mix": ""} if path is not None else {}
    cfg = DataConfig(**{**vars(model.cfg.data), **given})
    dataset = load_dataset(cfg, model.cfg.model.block_size)
    # An HF directory without tokenizer.json: the data's ids must fit.
    if model.tokenizer is None and dataset.tokenizer.vocab_size > model.vocab_size:
        raise UserError(f"the data '{cfg.path}' has {dataset.tokenizer.vocab_size} tokens, more than "
                        f"the model's {model.vocab_size}; pass data prepared with the model's tokenizer")
    check_same_tokenizer(model.tokenizer, dataset.tokenizer, model.source,
                         "pass --data prepared with the model's tokenizer")
    if dataset.mixture is None:
        return {"": dataset.val}
    return {name: part.val for name, part in zip(dataset.mixture.names, dataset.parts)}


def evaluate_sources(model: Model, splits: dict, rows: int, say_capped: bool = False) -> list[dict]:
    """One result per source; for a mixture, then the mixture's: the sources' losses weighted as
    data.mix weighs its rows."""
    results = [{**({"source": name} if name else {}), **evaluate(model, tokens, rows, True, say_capped)}
               for name, tokens in splits.items()]
    if len(results) > 1:
        weights = np.array([s.weight for s in parse_mix(model.cfg.data.mix)])
        loss = float(np.dot(weights / weights.sum(), [r["loss"] for r in results]))
        results.append({"source": "mixture", "split": "val", "loss": loss,
                        "perplexity": math.exp(loss), "weights": model.cfg.data.mix})
    return results


def evaluate_tasks(model: Model, args, say_capped: bool = False) -> tuple[list[dict], list[dict]]:
    """(one result per task of --tasks, each item's log-likelihoods for --samples)."""
    if model.tokenizer is None:
        raise UserError(f"'{args.hf}' has no tokenizer.json; --tasks needs the model's tokenizer")
    loaded = task_scoring.load_requests(args.tasks, args.tasks_dir, model.tokenizer,
                                        model.cfg.model.block_size, args.limit)
    scorer = task_scoring.make_scorer(replace(model.net, eot_id=None))
    results, samples = [], []
    for task, requests in loaded:
        rows = rows_for(args.rows, len(requests.inputs), f"requests of {task.name}", say_capped)
        result, items = task_scoring.score_task(task, requests, scorer, model.params, model.mesh,
                                                rows, progress=True)
        results.append(result)
        samples += [{"task": task.name, **item} for item in items]
        if result["dropped_chars"]:
            print(f"jaxpar.eval: note: {task.name}: the tokenizer lacks {result['dropped_chars']} of the "
                  "task's characters; they were left out of the texts", file=sys.stderr)
        if result["unscored"]:
            print(f"jaxpar.eval: note: {task.name}: {result['unscored']} items have a choice with nothing to "
                  "score (no token, or no characters for acc_norm); they were left out", file=sys.stderr)
    return results, samples


def reason(error: OSError) -> str:
    return os.strerror(error.errno) if error.errno else str(error)


def partial_path(path: Path) -> Path:
    """The hidden file beside `path` that its text is written to before it is renamed to `path`."""
    return path.with_name(f".{path.name}.{os.getpid()}.jaxpar-partial")


def samples_target(path: str) -> Path | None:
    """Where --samples writes, through a hidden file and a rename: the file a symbolic link names
    (the link stays). None for a pipe or a terminal (/dev/stdout), written as it is."""
    given = Path(path)
    if given.exists() and not given.is_file() and not given.is_dir():
        return None
    return Path(os.path.realpath(path))


SAMPLE_KEYS = {"task", "item", "gold", "loglikelihoods"}  # in every line write_samples writes


def samples_by_jaxpar(path: Path) -> bool:
    """Whether the file is empty or an earlier --samples: its first line one of write_samples' records."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline(1 << 20)
        return not first or SAMPLE_KEYS <= set(json.loads(first))
    except (OSError, ValueError, TypeError):
        return False


def check_samples_path(path: str) -> None:
    """--samples, before any work: not a folder, and in a folder that exists and takes a new file
    (one is made there and removed). A pipe or a terminal is written as it is."""
    target = samples_target(path)
    if target is None:
        return
    checked(target, "--samples", spare=len(partial_path(target).name) - len(target.name))
    if target.is_dir():
        raise UserError(f"--samples '{path}' is a folder; pass a file's path, e.g. '{Path(path) / 'samples.jsonl'}'")
    if not target.parent.is_dir():
        raise UserError(f"--samples '{path}': the folder '{target.parent}' does not exist; make it, or "
                        "pass a path in a folder that exists")
    if target.is_file() and not samples_by_jaxpar(target):  # a report is a user's file like any other
        raise UserError(f"--samples '{path}' holds a file jaxpar did not write, which it would overwrite; move "
                        "it away, or pass another --samples")
    probe = partial_path(target)
    try:
        with open(probe, "x"):
            pass
    except OSError as e:
        raise UserError(f"--samples '{path}' cannot be written: '{target.parent}' takes no new file "
                        f"({reason(e)}); pass a path in a folder this user may write") from None
    try:
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot remove '{probe}', made to check that --samples can be written "
                        f"({reason(e)}); remove it by hand") from None


def write_samples(path: str, samples: list[dict]) -> None:
    """Each item's log-likelihoods, a JSON line each, to --samples: written to a hidden file beside
    it, then renamed, so a failure (a full disk) leaves no half-written file, and is one line."""
    lines = [json.dumps(sample) + "\n" for sample in samples]
    target = samples_target(path)
    if target is None:  # a pipe or a terminal: nothing to rename
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(lines)
        except OSError as e:
            raise UserError(f"cannot write --samples '{path}' ({reason(e)}); the scores above are "
                            "complete: pass another --samples to keep the log-likelihoods") from None
        return
    partial = partial_path(target)
    try:
        with open(partial, "x", encoding="utf-8") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, target)
    except OSError as e:
        message = (f"cannot write --samples '{path}' ({reason(e)}); the scores above are complete: free "
                   "some space, or pass another --samples, to keep the log-likelihoods")
        try:
            partial.unlink(missing_ok=True)
        except OSError as left:
            message += f"; and '{partial}' could not be removed ({reason(left)}): remove it by hand"
        raise UserError(message) from None

"""Scoring multiple-choice tasks (jaxpar.data.tasks) with a model, on the mesh its params live on:
the summed log-likelihood of each choice's continuation, then `acc` and `acc_norm`.

Tokens as lm-evaluation-harness makes them: a context's trailing spaces move to the continuation;
the context is encoded, and the context joined with the continuation; the continuation's tokens are
the joined string's past the context's. The request is (context + continuation)[-(block + 1):],
so a long context loses its start, and a continuation longer than the block is scored on its
last `block` tokens (counted as `truncated`). A character tokenizer drops the characters it lacks
(counted as `dropped_chars`) instead of failing.

An item is left out (counted as `unscored`) when one of its choices has nothing to score: no
continuation token that a token before it predicts (its text empty after the task's template, or
all of it dropped or merged into the context by the tokenizer), or for `acc_norm` no characters.
Its score would be 0 or a division by zero, which wins or breaks the comparison; a task left with
no item is one line.

Every request of a task is one row of one fixed length (the longest, rounded up to 16, at most the
block), padded on the right: one compile serves a task, and a causal model's scores do not see
the padding. Rows are split over the mesh's batch axes as training splits them.
"""

import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.core.axes import splitting
from jaxpar.core.errors import UserError
from jaxpar.data.task_files import find_task_files, read_rows
from jaxpar.data.tasks import Item, Task, parse_tasks, to_items
from jaxpar.training.step.row_batches import over_rows, passes_rows

ROW_MULTIPLE = 16  # a task's row length is rounded up to this


@dataclass
class Requests:
    """One task's requests, encoded: one row per (item, choice) of the items kept, in item order."""
    items: list[Item]  # the items kept: every choice has something to score
    indices: list[int]  # each kept item's index among the task's items
    inputs: np.ndarray  # (requests, length) int32
    targets: np.ndarray  # (requests, length) int32
    scored: np.ndarray  # (requests, length) bool: the continuation's targets
    lengths: np.ndarray  # (requests,): each row's real (unpadded) input tokens
    truncated: int  # requests whose continuation was cut to the block
    dropped_chars: int  # characters a character tokenizer does not have
    unscored: int  # items left out: a choice with nothing to score


def covering(tokenizer):
    """text -> (the text less the characters the tokenizer lacks, how many were dropped)."""
    if not hasattr(tokenizer, "chars"):  # bytes and BPE cover every text
        return lambda text: (text, 0)
    known = set(tokenizer.chars)

    def cover(text):
        kept = "".join(c for c in text if c in known)
        return kept, len(text) - len(kept)
    return cover


def encode_pair(encode, context: str, continuation: str) -> tuple[np.ndarray, np.ndarray]:
    """lm-eval's (context tokens, continuation tokens) of a pair."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = encode(context)
    return context_ids, encode(context + continuation)[len(context_ids):]


def item_rows(item: Item, tokenizer, cover, block: int) -> tuple[list, int]:
    """([(window, scored targets, continuation tokens)] per choice, characters dropped)."""
    rows, dropped = [], 0
    for context, continuation in item.pairs:
        (context, lost_a), (continuation, lost_b) = cover(context), cover(continuation)
        dropped += lost_a + lost_b
        context_ids, continuation_ids = encode_pair(tokenizer.encode, context, continuation)
        if not len(context_ids) and tokenizer.eot_id is not None:  # lm-eval's empty context
            context_ids = np.array([tokenizer.eot_id], np.int32)
        window = np.concatenate([context_ids, continuation_ids]).astype(np.int32)[-(block + 1):]
        rows.append((window, max(0, min(len(continuation_ids), len(window) - 1)), len(continuation_ids)))
    return rows, dropped


def encode_requests(items: list[Item], tokenizer, block: int) -> Requests:
    cover, dropped, rows, indices = covering(tokenizer), 0, [], []
    for index, item in enumerate(items):
        item_requests, lost = item_rows(item, tokenizer, cover, block)
        dropped += lost
        # The single check that an item still has something to score in every choice.
        if all(n_scored for _, n_scored, _ in item_requests) and 0 not in (item.norm_chars or ()):
            rows += item_requests
            indices.append(index)
    longest = max([1] + [len(w) - 1 for w, _, _ in rows])
    length = min(block, -(-longest // ROW_MULTIPLE) * ROW_MULTIPLE)
    inputs, targets = (np.zeros((len(rows), length), np.int32) for _ in range(2))
    scored = np.zeros((len(rows), length), bool)
    for r, (window, n_scored, _) in enumerate(rows):
        n = len(window) - 1
        inputs[r, :n], targets[r, :n] = window[:-1], window[1:]
        scored[r, n - n_scored:n] = True
    return Requests([items[i] for i in indices], indices, inputs, targets, scored,
                    np.array([len(w) - 1 for w, _, _ in rows], int),
                    truncated=sum(s < full for _, s, full in rows), dropped_chars=dropped,
                    unscored=len(items) - len(indices))


def find_all(spec: str, tasks_dir: str) -> None:
    """Fail now, in one line, if a task `spec` names is unknown or has no files."""
    for task in parse_tasks(spec):
        find_task_files(tasks_dir, task)


def load_requests(spec: str, tasks_dir: str, tokenizer, block: int, limit: int = 0) -> list:
    """[(task, its Requests)] for the tasks `spec` names ("hellaswag,arc_easy"), each from its
    first `limit` items (0: all)."""
    loaded = []
    for task in parse_tasks(spec):
        files = find_task_files(tasks_dir, task)
        rows = read_rows(files)[:limit or None]
        items = to_items(task, rows, str(files[0]))
        if not items:
            raise UserError(f"{files[0]} holds no {task.name} rows; pass the task's files")
        requests = encode_requests(items, tokenizer, block)
        if not requests.items:
            raise UserError(f"{files[0]}: none of the {len(items)} {task.name} items can be scored: each has a "
                            "choice with nothing to score (its text empty after the task's template, or "
                            f"dropped whole by the tokenizer {tokenizer.spec}); pass the task's own files, or "
                            "a model whose tokenizer covers their text")
        loaded.append((task, requests))
    return loaded


def make_scorer(net):
    """jit(params, inputs, targets, scored) -> each row's summed log-likelihood of its scored
    targets, float32, replicated (every process reads all rows), on the mesh of net's plan."""
    # Each device of a context ring computes its rows' sequences whole (no ring here).
    net = net.on(net.plan.unsplit(*splitting("seq")))

    def continuation_lls(params, inputs, targets, scored):
        logp = jax.nn.log_softmax(net(params, inputs).astype(np.float32), axis=-1)
        return jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0] * scored, axis=1)
    return jax.jit(continuation_lls, out_shardings=NamedSharding(net.plan.mesh, P()))


def loglikelihoods(scorer, params, mesh, req: Requests, rows: int, progress: bool = False):
    """(each request's summed continuation log-likelihood; the input tokens past the first pass,
    and the seconds they took)."""
    arrays = (req.inputs, req.targets, req.scored)
    lls, seconds = over_rows(lambda *batch: scorer(params, *batch),
                             lambda first, count: [a[first:first + count] for a in arrays],
                             len(req.inputs), mesh, rows, progress, unit="request")
    return lls.astype(np.float64), int(req.lengths[passes_rows(mesh, rows):].sum()), seconds


def accuracies(items: list[Item], indices: list[int], lls: np.ndarray) -> tuple[dict, list[dict]]:
    """({acc, acc_norm}, one record per item, by its index among the task's) from each request's
    log-likelihood."""
    hits, hits_norm, samples, at = 0, 0, [], 0
    for index, item in zip(indices, items):
        ll = lls[at:at + len(item.pairs)]
        at += len(item.pairs)
        pick = int(np.argmax(ll))
        pick_norm = int(np.argmax(ll / np.array(item.norm_chars))) if item.norm_chars else None
        hits += pick == item.gold
        hits_norm += pick_norm == item.gold
        samples.append({"item": index, "gold": item.gold, "loglikelihoods": ll.tolist(), "pick": pick,
                        "pick_norm": pick_norm})
    n = len(items)
    return {"acc": hits / n, "acc_norm": hits_norm / n if items[0].norm_chars else None}, samples


def score_task(task: Task, req: Requests, scorer, params, mesh, rows: int = 32,
               progress: bool = False) -> tuple[dict, list[dict]]:
    """(the task's one-line result, its per-item records)."""
    lls, timed, seconds = loglikelihoods(scorer, params, mesh, req, rows, progress)
    acc, samples = accuracies(req.items, req.indices, lls)
    return {"task": task.name, **acc, "items": len(req.items), "requests": len(req.inputs),
            "tokens": int(req.lengths.sum()), "tokens_per_s": round(timed / seconds, 1) if seconds else None,
            "truncated": req.truncated, "dropped_chars": req.dropped_chars, "unscored": req.unscored}, samples


@dataclass
class TaskEval:
    """The tasks --eval.tasks scores during training, every `every` updates and at the end
    (jaxpar.training.run.evals decides when)."""
    loaded: list  # [(task, its Requests)]
    scorer: object
    mesh: object
    every: int

    def __call__(self, updates: int, params) -> dict:
        """{"step", "<task>/acc", "<task>/acc_norm", ...} at this point of training."""
        record = {"step": updates}
        for task, req in self.loaded:
            result, _ = score_task(task, req, self.scorer, params, self.mesh)
            record |= {f"{task.name}/{key}": result[key] for key in ("acc", "acc_norm") if result[key] is not None}
        return record


def task_eval_for(cfg, net, mesh, tokenizer) -> TaskEval | None:
    """The run's TaskEval, its tasks read and encoded now; None without --eval.tasks. `net`: the
    model under the run's execution plan."""
    e = cfg.eval
    if not e.tasks:
        return None
    loaded = load_requests(e.tasks, e.tasks_dir, tokenizer, cfg.model.block_size, e.tasks_limit)
    for task, req in loaded:
        if (req.dropped_chars or req.truncated or req.unscored) and jax.process_index() == 0:
            print(f"jaxpar.train: note: {task.name}: {req.dropped_chars} characters the tokenizer lacks are left "
                  f"out, {req.truncated} of {len(req.inputs)} continuations outgrow the block, {req.unscored} "
                  "items with a choice that has nothing to score are left out", file=sys.stderr)
    return TaskEval(loaded, make_scorer(net), mesh, e.tasks_every or cfg.train.eval_every or cfg.train.steps)

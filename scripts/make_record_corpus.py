"""Generate a record corpus of a chosen size, with no download, for jaxpar.prepare's benchmarks:
DIR/corpus.jsonl ({"id", "text"} a line) and DIR/corpus.parquet (the same rows, row groups of
10,000), each at least --gb gigabytes. The documents are 1 to 8 paragraphs of the built-in Tiny
Shakespeare drawn with a seeded generator, a few with accented and CJK characters mixed in.

    python scripts/make_record_corpus.py --out /tmp/records --gb 1
"""

import argparse
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jaxpar.data.loader import read_text

ROWS_PER_GROUP = 10_000
EXTRAS = ["café", "naïve", "日本語", "Ünïcödé", "😀"]


def documents(seed: int):
    paragraphs = [p for p in read_text("").split("\n\n") if p.strip()]
    rng = np.random.default_rng(seed)
    doc_id = 0
    while True:
        picked = [paragraphs[i] for i in rng.integers(0, len(paragraphs), rng.integers(1, 9))]
        if rng.random() < 0.1:
            picked.append(" ".join(rng.choice(EXTRAS, 3)))
        yield {"id": doc_id, "text": "\n\n".join(picked)}
        doc_id += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    target, written, rows = int(args.gb * 1e9), 0, []
    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    with open(args.out / "corpus.jsonl", "w", encoding="utf-8") as jsonl, \
            pq.ParquetWriter(args.out / "corpus.parquet", schema) as parquet:
        for doc in documents(args.seed):
            line = json.dumps(doc, ensure_ascii=False) + "\n"
            jsonl.write(line)
            written += len(line.encode())
            rows.append(doc)
            if len(rows) == ROWS_PER_GROUP or written >= target:
                parquet.write_table(pa.Table.from_pylist(rows, schema))
                rows = []
            if written >= target:
                break
    for name in ("corpus.jsonl", "corpus.parquet"):
        print(f"{args.out / name}: {(args.out / name).stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()

"""`jaxpar.prepare` on records: jsonl (plain and gzip), parquet and `datasets` Arrow give the same
train.bin and val.bin as the same documents in .txt files, one each, with --val-split documents
(records' default: every 1/val_fraction-th whole document to val). A bad record is one line that
names the file and the record, exit 2, nothing written; --skip-bad-records counts them."""

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import exits_with_one_line

from jaxpar.data.loader import read_text
from jaxpar.data.token_files import read_prepared
from jaxpar.prepare import main

DOCS = [d for d in read_text("")[:200_000].split("\n\n") if d.strip()]  # ~1,000 short documents


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("records")
    (root / "txt").mkdir()
    for i, doc in enumerate(DOCS):
        (root / "txt" / f"{i:05d}.txt").write_text(doc, encoding="utf-8")
    lines = "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(DOCS))
    (root / "c.jsonl").write_text(lines, encoding="utf-8")
    with gzip.open(root / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(lines)
    table = pa.table({"id": list(range(len(DOCS))), "content": DOCS})
    pq.write_table(table, root / "c.parquet", row_group_size=300)
    (root / "ds").mkdir()
    with pa.OSFile(str(root / "ds" / "data-00000-of-00001.arrow"), "wb") as sink, \
            pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=250)
    return root


def prepared(root, name, *argv):
    out = root / f"out_{name}"
    main([*map(str, argv), "--out", str(out), "--force"])
    meta, train, val = read_prepared(out)
    return meta, np.asarray(train), np.asarray(val)


@pytest.mark.parametrize("tokenizer", [["--tokenizer", "bytes"], ["--tokenizer", "bpe", "--vocab-size", "300"]])
def test_every_format_gives_the_text_files_tokens(corpora, tokenizer):
    _, train, val = prepared(corpora, "txt", corpora / "txt" / "*.txt", "--val-split", "documents", *tokenizer)
    assert len(val) and len(train)
    for name, source, extra in (("jsonl", "c.jsonl", []), ("gz", "c.jsonl.gz", []),
                                ("parquet", "c.parquet", ["--text-field", "content"]),
                                ("arrow", "ds", ["--text-field", "content"])):
        meta, got_train, got_val = prepared(corpora, name, corpora / source, *tokenizer, *extra)
        np.testing.assert_array_equal(got_train, train, err_msg=name)
        np.testing.assert_array_equal(got_val, val, err_msg=name)
        assert meta["val_split"] == {"records": "documents"} and meta["skipped_records"] == 0
        assert meta["splits"]["val"]["documents"] == len(DOCS) // 10
    # Control: the text files split by tokens (their default) differ.
    assert not np.array_equal(prepared(corpora, "txt_tokens", corpora / "txt" / "*.txt", *tokenizer)[1], train)


def test_bad_records_are_one_line_or_skipped_and_counted(capsys, tmp_path):
    good = [json.dumps({"text": d}) for d in DOCS[:50]]
    cases = {"missing.jsonl": ('{"body": "x"}', "record 3 has no 'text' field"),
             "number.jsonl": ('{"text": 7}', "record 3 has a int, not a string, as its 'text' field"),
             "broken.jsonl": ('{"text": "x"', "line 4 is not JSON")}
    for name, (bad, expected) in cases.items():
        (tmp_path / name).write_text("\n".join(good[:3] + [bad] + good[3:]) + "\n")
        out = tmp_path / f"out_{name}"
        exits_with_one_line(capsys, "jaxpar.prepare", lambda: main(
            [str(tmp_path / name), "--tokenizer", "bytes", "--out", str(out)]), f"{name}': {expected}")
        assert not out.exists(), "a failed prepare writes nothing"
        meta, _, _ = prepared(tmp_path, name, tmp_path / name, "--tokenizer", "bytes", "--skip-bad-records")
        assert meta["skipped_records"] == 1 and sum(s["documents"] for s in meta["splits"].values()) == 50
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    exits_with_one_line(capsys, "jaxpar.prepare", lambda: main(
        [str(tmp_path / "bad.parquet"), "--tokenizer", "bytes", "--out", str(tmp_path / "o")]),
        "bad.parquet' is not a readable parquet file")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "other.parquet")
    exits_with_one_line(capsys, "jaxpar.prepare", lambda: main(
        [str(tmp_path / "other.parquet"), "--tokenizer", "bytes", "--out", str(tmp_path / "o")]),
        "has no column 'text' (its columns: body); pass --text-field NAME")
    assert not (tmp_path / "o").exists()

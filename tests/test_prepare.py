"""`python -m jaxpar.prepare` writes nanoGPT's train.bin/val.bin exactly, with meta.json and
tokenizer.json; bad input is one line, exit 2, and no train.bin; read_prepared checks it all."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import exits_with_one_line
from tokenizers import Tokenizer, models, pre_tokenizers

from jaxpar.core.errors import UserError
from jaxpar.core.out_lock import LOCK_NAME, RunLock
from jaxpar.data import prepare as prep
from jaxpar.data.token_files import read_prepared
from jaxpar.data.tokenizer import EOT, CharTokenizer
from jaxpar.prepare import main

DOCS = ["First Citizen:\nBefore we proceed any further, hear me speak.\n" * 3,
        "Café, naïve, 日本語 😀\nline two\n" * 2,
        "short doc\n" * 5]


@pytest.fixture
def docs(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, text in enumerate(DOCS):
        (folder / f"doc{i}.txt").write_text(text, encoding="utf-8")
    return folder


def run(out, *argv):
    main([*map(str, argv), "--out", str(out)])
    return json.loads((out / "meta.json").read_text())


def tokens(path, dtype="<u2"):
    return np.fromfile(path, dtype=dtype)


def expected_splits(doc_ids, eot, fraction=0.1):
    """The last floor(fraction * n) tokens of each document go to val; eot ends each part."""
    train, val = [], []
    for ids in doc_ids:
        n_val = int(len(ids) * fraction)
        for split, part in ((train, ids[:len(ids) - n_val]), (val, ids[len(ids) - n_val:])):
            if len(part):
                split += list(part) + ([] if eot is None else [eot])
    return np.array(train), np.array(val)


def test_bytes_writes_nanogpts_format_exactly(tmp_path, docs):
    meta = run(tmp_path / "out", docs / "doc*.txt", "--tokenizer", "bytes")
    train, val = expected_splits([list(d.encode()) for d in DOCS], 256)
    np.testing.assert_array_equal(tokens(tmp_path / "out" / "train.bin"), train)
    np.testing.assert_array_equal(tokens(tmp_path / "out" / "val.bin"), val)
    assert (tmp_path / "out" / "train.bin").stat().st_size == 2 * len(train)
    assert meta["splits"] == {
        split: {"tokens": len(ids), "documents": 3, "max_token": int(ids.max()),
                "mtime_ns": (tmp_path / "out" / f"{split}.bin").stat().st_mtime_ns}
        for split, ids in (("train", train), ("val", val))}
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"], meta["eot_id"]) == \
        ("bytes", 257, "uint16", 256)
    assert meta["tokenizer_meta"] == {"kind": "bytes"}
    assert sorted(os.listdir(tmp_path / "out")) == ["meta.json", "tokenizer.json", "train.bin",
                                                    "val.bin"]


def test_char_concatenates_documents_without_a_separator(tmp_path, docs):
    meta = run(tmp_path / "out", *sorted(docs.iterdir()), "--tokenizer", "char",
               "--val-fraction", "0.25")
    tok = CharTokenizer.from_text("".join(DOCS))
    train, val = expected_splits([tok.encode(d) for d in DOCS], None, 0.25)
    np.testing.assert_array_equal(tokens(tmp_path / "out" / "train.bin"), train)
    np.testing.assert_array_equal(tokens(tmp_path / "out" / "val.bin"), val)
    assert meta["eot_id"] is None and meta["tokenizer_meta"] == {"kind": "char",
                                                                 "chars": tok.chars}


def test_bpe_separates_documents_with_its_end_of_text_token(tmp_path, docs):
    meta = run(tmp_path / "out", docs / "*.txt", "--tokenizer", "bpe", "--vocab-size", "300")
    hf = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    eot = hf.token_to_id(EOT)
    assert meta["eot_id"] == eot == 0 and meta["vocab_size"] <= 300
    train, val = expected_splits([hf.encode(d, add_special_tokens=False).ids for d in DOCS], eot)
    got = tokens(tmp_path / "out" / "train.bin")
    np.testing.assert_array_equal(got, train)
    np.testing.assert_array_equal(tokens(tmp_path / "out" / "val.bin"), val)
    assert (got == eot).sum() == meta["splits"]["train"]["documents"] == 3
    assert hf.decode(got.tolist(), skip_special_tokens=False).count(EOT) == 3


def test_a_vocabulary_over_65536_is_stored_as_uint32(tmp_path):
    words = ["alpha", "beta", "gamma"]
    vocab = {f"w{i}": i for i in range(70_000)} | {w: 70_000 + i for i, w in enumerate(words)}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "big.json"))
    (tmp_path / "doc.txt").write_text("alpha beta gamma " * 10)
    meta = run(tmp_path / "out", tmp_path / "doc.txt", "--tokenizer", tmp_path / "big.json")
    assert (meta["dtype"], meta["vocab_size"], meta["eot_id"]) == ("uint32", 70_003, None)
    all_ids = np.concatenate([tokens(tmp_path / "out" / f"{split}.bin", "<u4")
                              for split in ("train", "val")])
    np.testing.assert_array_equal(all_ids, [70_000, 70_001, 70_002] * 10)


def test_one_file_gives_both_splits_the_same_on_every_run_and_worker_count(tmp_path):
    """A 3 MB file is three pieces or more: two worker processes must write the same bytes."""
    line = "ROMEO: But soft, what light through yonder window breaks?\n"
    (tmp_path / "one.txt").write_text(line * 60_000)
    outputs = []
    for i, workers in enumerate([1, 1, 2]):
        out = tmp_path / f"out{i}"
        meta = run(out, tmp_path / "one.txt", "--tokenizer", "bytes", "--workers", workers)
        outputs.append([(out / name).read_bytes() for name in ("train.bin", "val.bin")])
    assert outputs[0] == outputs[1] == outputs[2]
    n_val = int(len(line) * 60_000 * 0.1)
    assert (meta["splits"]["val"]["tokens"], meta["splits"]["val"]["documents"]) == (n_val + 1, 1)
    for split, data in zip(("train", "val"), outputs[-1]):  # a document of many pieces
        assert meta["splits"][split]["max_token"] == np.frombuffer(data, "<u2").max()


def test_a_non_empty_out_dir_needs_force(capsys, tmp_path, docs):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    fails_with(capsys, out, [docs / "doc0.txt", "--tokenizer", "bytes"], "is not empty",
               "pass --force")
    run(out, docs / "doc0.txt", "--tokenizer", "char", "--force")
    assert (out / "notes.txt").read_text() == "mine"
    before = (out / "train.bin").read_bytes()
    run(out, docs / "doc1.txt", "--tokenizer", "bytes", "--force")
    assert (out / "train.bin").read_bytes() != before
    read_prepared(out)


def test_a_second_prepare_into_a_locked_out_is_refused_and_changes_nothing(capsys, tmp_path, docs):
    out = tmp_path / "out"
    run(out, docs / "doc0.txt", "--tokenizer", "bytes")
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    with RunLock(out):  # another prepare is writing here
        fails_with(capsys, out, [docs / "doc1.txt", "--tokenizer", "char", "--force"],
                   f"--out '{out}' is in use by another jaxpar command (pid {os.getpid()}")
        assert {path.name: path.read_bytes() for path in out.iterdir() if path.name != LOCK_NAME} == before
    assert read_prepared(out)[0]["tokenizer"] == "bytes"


def test_a_lock_file_left_by_a_killed_prepare_is_not_content(tmp_path, docs):
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_text('{"host": "gone", "pid": 999999, "started": "then"}')
    meta = run(out, docs / "doc0.txt", "--tokenizer", "bytes")  # no --force needed
    assert read_prepared(out)[0] == meta
    assert sorted(os.listdir(out)) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]


def test_force_removes_a_stale_tokenizer_json(tmp_path, docs, monkeypatch):
    from helpers import fake_tiktoken
    fake_tiktoken(monkeypatch)
    out = tmp_path / "out"
    run(out, docs / "doc0.txt", "--tokenizer", "bytes")
    meta = run(out, docs / "doc0.txt", "--tokenizer", "tiktoken:gpt2", "--force")
    assert meta["tokenizer_meta"] == {"kind": "tiktoken", "name": "gpt2"}
    assert meta["eot_id"] == 259 and not (out / "tokenizer.json").exists()


def fails_with(capsys, out, argv, *expected):
    train_before = (out / "train.bin").read_bytes() if (out / "train.bin").exists() else None
    err = exits_with_one_line(capsys, "jaxpar.prepare", lambda: main([*map(str, argv), "--out", str(out)]), *expected)
    now = (out / "train.bin").read_bytes() if (out / "train.bin").exists() else None
    assert now == train_before, "a failed run must not write train.bin"
    assert not any(p.name.endswith(".partial") for p in out.glob("*"))
    return err


@pytest.mark.parametrize("argv, expected", [
    (["missing.txt", "--tokenizer", "bytes"], ["input 'missing.txt' not found"]),
    (["nothing*.txt", "--tokenizer", "bytes"], ["input glob 'nothing*.txt' matches no files"]),
    (["--tokenizer", "bytes"], ["the following arguments are required: INPUT"]),
    (["{docs}/doc0.txt", "--tokenizer", "bpe", "--vocab-size", "100"], ["too small", "257"]),
    (["{docs}/doc0.txt", "--tokenizer", "bpe", "--vocab-size", str(2**32 + 1)], ["too large"]),
    (["{docs}/doc0.txt", "--tokenizer", "bpe"], ["needs --vocab-size"]),
    (["{docs}/doc0.txt", "--tokenizer", "char", "--vocab-size", "300"], ["bpe only"]),
    (["{docs}/doc0.txt", "--tokenizer", "{docs}/doc1.txt"], ["is not a valid tokenizer.json"]),
    (["{docs}/doc0.txt", "--tokenizer", "nope.json"], ["no such file"]),
    (["{docs}/doc0.txt", "--tokenizer", "bytes", "--val-fraction", "1"], ["between 0 and 1"]),
    (["{docs}/doc0.txt", "--tokenizer", "bytes", "--val-fraction", "0.001"],
     ["the val split is empty", "--val-fraction 0.001"]),
    (["{docs}", "--tokenizer", "bytes"], ["is a directory", "/*.txt"]),
])
def test_bad_input_is_one_line_and_writes_nothing(capsys, tmp_path, docs, argv, expected):
    argv = [a.replace("{docs}", str(docs)) for a in argv]
    fails_with(capsys, tmp_path / "out", argv, *expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tokenizer", ["bytes", "char", "tokenizer.json"])
def test_a_non_utf8_input_names_the_file_and_byte(capsys, tmp_path, docs, tokenizer):
    bad = docs / "doc9.txt"
    bad.write_bytes(b"fine text\n" * 100 + b"caf\xe9\n")
    if tokenizer == "tokenizer.json":
        run(tmp_path / "first", docs / "doc0.txt", "--tokenizer", "bytes")
        tokenizer = tmp_path / "first" / "tokenizer.json"
    out = tmp_path / "new" / "out"  # the directories it made are removed again
    fails_with(capsys, out, [docs / "*.txt", "--tokenizer", tokenizer],
               f"input '{bad}' is not UTF-8 text (byte 1003)")
    assert not (tmp_path / "new").exists()


def test_empty_inputs_are_refused(capsys, tmp_path):
    (tmp_path / "a.txt").write_bytes(b"")
    fails_with(capsys, tmp_path / "out", [tmp_path / "a.txt", "--tokenizer", "bytes"],
               "the inputs are empty")


@pytest.mark.parametrize("texts, tokenizer", [(["", ""], "bytes"), (["  ", "\n"], "word-level")])
def test_inputs_that_give_no_token_are_one_line(capsys, tmp_path, texts, tokenizer):
    """Records whose texts are empty, or whitespace a word-level tokenizer drops whole: no
    --val-fraction helps, so the line says what became empty instead of suggesting one."""
    (tmp_path / "r.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    if tokenizer == "word-level":
        hf = Tokenizer(models.WordLevel({"w": 0}, unk_token="w"))
        hf.pre_tokenizer = pre_tokenizers.Whitespace()
        hf.save(str(tmp_path / "words.json"))
        tokenizer = tmp_path / "words.json"
    fails_with(capsys, tmp_path / "out", [tmp_path / "r.jsonl", "--tokenizer", tokenizer],
               "the inputs give no tokens: every document's text is empty or dropped whole")
    assert not (tmp_path / "out").exists()


def test_an_uncached_tiktoken_encoding_is_refused(capsys, tmp_path, docs, monkeypatch):
    pytest.importorskip("tiktoken")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    fails_with(capsys, tmp_path / "out", [docs / "doc0.txt", "--tokenizer", "tiktoken:gpt2"],
               "not in tiktoken's cache", "TIKTOKEN_CACHE_DIR")


def test_missing_tiktoken_is_refused(capsys, tmp_path, docs, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    fails_with(capsys, tmp_path / "out", [docs / "doc0.txt", "--tokenizer", "tiktoken:gpt2"],
               "pip install tiktoken")


@pytest.mark.parametrize("existing", [False, True])
def test_an_interrupted_run_leaves_no_train_bin(tmp_path, docs, monkeypatch, existing):
    """A crash mid-way removes its partial files; a complete earlier run stays readable."""
    out = tmp_path / "out"
    if existing:
        run(out, docs / "doc0.txt", "--tokenizer", "bytes")

    def crash(self, *args):
        raise KeyboardInterrupt
    monkeypatch.setattr(prep.SplitWriter, "end_document", crash)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare([str(docs / "*.txt")], out, "char", force=True)
    if existing:
        meta, train, _ = read_prepared(out)
        assert meta["tokenizer"] == "bytes" and len(train) == meta["splits"]["train"]["tokens"]
        assert sorted(os.listdir(out)) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    else:
        assert not out.exists()


def test_an_interrupted_cli_run_exits_130_and_says_so(capsys, tmp_path, docs, monkeypatch):
    monkeypatch.setattr(prep, "commit", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(SystemExit) as exit_info:
        main([str(docs / "doc0.txt"), "--tokenizer", "bytes", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 130
    assert "interrupted; nothing new written" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def no_space(writer, ids):
    """SplitWriter.add on a full disk: the write fails as the kernel fails it."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_is_one_line_and_leaves_no_partial_file(capsys, tmp_path, docs, monkeypatch):
    """ENOSPC while the token files are written: one line naming --out and the fix, exit 2, the
    .partial files removed (before: a traceback)."""
    monkeypatch.setattr(prep.SplitWriter, "add", no_space)
    out = tmp_path / "out"
    fails_with(capsys, out, [docs / "*.txt", "--tokenizer", "bytes"],
               f"no space left to write --out '{out}' (No space left on device); free space on that disk")
    assert not out.exists()


def test_a_partial_file_that_cannot_be_removed_is_said(capsys, tmp_path, docs, monkeypatch):
    """A .partial file whose removal fails after a full disk is named in the same line, with what
    to do; it is not ignored (before: the removal's PermissionError, a traceback)."""
    monkeypatch.setattr(prep.SplitWriter, "add", no_space)
    out = tmp_path / "out"
    unlink = Path.unlink

    def refuse_partials(path, *args, **kwargs):
        if path.name.endswith(".partial") and path.exists():
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return unlink(path, *args, **kwargs)
    monkeypatch.setattr(Path, "unlink", refuse_partials)
    err = exits_with_one_line(capsys, "jaxpar.prepare", lambda: main([str(docs / "doc0.txt"), "--tokenizer", "bytes",
                                                                      "--out", str(out)]),
                              "no space left to write", f"'{out / 'train.bin.partial'}' could not be removed "
                              "(Permission denied); remove it by hand", "val.bin.partial' could not be removed")
    assert err.count("could not be removed") == 2


def test_read_prepared_maps_what_prepare_wrote(tmp_path, docs):
    meta = run(tmp_path / "out", docs / "*.txt", "--tokenizer", "bytes")
    got, train, val = read_prepared(tmp_path / "out")
    assert got == meta and isinstance(train, np.memmap) and train.dtype == np.uint16
    np.testing.assert_array_equal(train, tokens(tmp_path / "out" / "train.bin"))
    assert len(val) == meta["splits"]["val"]["tokens"]
    with pytest.raises(ValueError):
        train[0] = 1  # read-only


@pytest.mark.parametrize("damage, expected", [
    (lambda d: (d / "meta.json").unlink(), "meta.json' not found"),
    (lambda d: (d / "val.bin").unlink(), "val.bin' not found"),
    (lambda d: (d / "meta.json").write_text("{oops"), "cannot be read as JSON"),
    (lambda d: (d / "meta.json").write_text('{"dtype": "uint16"}'), "lacks vocab_size"),
    (lambda d: edit_meta(d, dtype="float32"), "dtype 'float32'"),
    (lambda d: edit_meta(d, vocab_size=70_000), "vocab_size 70000, which uint16"),
    (lambda d: truncate(d / "train.bin", 1), "truncated or from another run"),
    (lambda d: truncate(d / "train.bin", 2), "truncated or from another run"),
    (lambda d: edit_meta(d, format=2), "newer than this jaxpar reads"),
])
def test_read_prepared_names_each_inconsistency(tmp_path, docs, damage, expected):
    run(tmp_path / "out", docs / "*.txt", "--tokenizer", "bytes")
    damage(tmp_path / "out")
    with pytest.raises(UserError, match=expected) as info:
        read_prepared(tmp_path / "out")
    assert "\n" not in str(info.value) and "jaxpar.prepare" in str(info.value)


def edit_meta(directory, **changes):
    meta = json.loads((directory / "meta.json").read_text())
    (directory / "meta.json").write_text(json.dumps(meta | changes))


def truncate(path, n_bytes):
    os.truncate(path, path.stat().st_size - n_bytes)


def test_cli_process_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jaxpar.prepare", str(tmp_path / "none.txt"),
                           "--tokenizer", "bytes", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"jaxpar.prepare: error: input '{tmp_path / 'none.txt'}' not "
                                   "found; pass existing UTF-8 text files or globs")
    assert not (tmp_path / "out").exists()

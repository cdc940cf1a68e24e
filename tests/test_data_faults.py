"""Damaged data and logs: token ids beyond meta.json's vocabulary are one line naming the file,
the id and the fix (prepare records each split's largest id, trusted while the file's mtime is
the one recorded; other data is scanned; and every batch the loader builds is checked, since an
mtime can be put back), for a mixture's sources too; a torn or undecodable line in metrics.jsonl
is skipped with one warning, and a run resumes over it exactly."""

import json
import os
import shutil
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import mesh_overrides, tiny_config
from helpers import fails_with

from jaxpar.core.config import DataConfig
from jaxpar.core.errors import UserError
from jaxpar.data import split_writer
from jaxpar.data import token_files as prep_read
from jaxpar.data.loader import BatchLoader, Dataset, Prefetcher, load_dataset, read_text
from jaxpar.parallel.mesh import build_mesh
from jaxpar.prepare import main as prepare_main
from jaxpar.train import run
from jaxpar.training.run import loss_plots, metrics

FAR_ID = 60_123  # beyond any test vocabulary, within uint16
BLOCK = 32


@pytest.fixture(scope="module")
def chars(tmp_path_factory):
    """The first 4,000 characters of the built-in corpus prepared by character: ~65 tokens."""
    root = tmp_path_factory.mktemp("chars")
    (root / "text.txt").write_text(read_text("")[:4000], encoding="utf-8")
    prepare_main([str(root / "text.txt"), "--tokenizer", "char", "--out", str(root / "data")])
    return root / "data"


def copy_of(data, tmp_path, name="data"):
    return shutil.copytree(data, tmp_path / name)  # copy2 keeps the files' mtimes


def meta_of(directory) -> dict:
    return json.loads((directory / "meta.json").read_text())


def overwrite_with_far_ids(path) -> None:
    """As many random ids as the file held, one of them FAR_ID. A write in prepare's clock tick
    could keep a coarse mtime: the new one is set as a later write would leave it."""
    before = path.stat()
    ids = np.random.default_rng(0).integers(0, FAR_ID, before.st_size // 2).astype("<u2")
    ids[len(ids) // 2] = FAR_ID
    ids.tofile(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))


def rewrite_keeping_mtime(path, ids) -> None:
    """`ids` written over the file, its mtime put back as prepare recorded it (os.utime, as some
    copies and restores do): meta.json's record of its largest id still looks current."""
    before = path.stat()
    np.asarray(ids, "<u2").tofile(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def all_far_ids_keeping_mtime(path) -> None:
    rewrite_keeping_mtime(path, np.full(path.stat().st_size // 2, FAR_ID))


@pytest.fixture(scope="module")
def mesh():
    return build_mesh(tiny_config(**mesh_overrides("dp=2")), jax.devices()[:2])


def loader(dataset, split, mesh) -> BatchLoader:
    return BatchLoader(dataset, split, 7, 8, 1, BLOCK, mesh)


def beyond(path, token_id, vocab) -> str:
    return (f"'{path}' holds token id {token_id}, beyond the vocabulary of {vocab} tokens of "
            "meta.json's tokenizer (char): it is not that tokenizer's data, or was changed after "
            "jaxpar.prepare; run python -m jaxpar.prepare again")


def test_the_writer_records_each_splits_largest_id_exactly(tmp_path):
    """The val part's ids come from the blocks moved to val.bin, the train part's from each
    piece's maximum and, for the piece the cut splits, its kept ids or a read of it back."""
    cases = {  # documents (pieces of ids, whole-document choice) -> (train's, val's largest id)
        "cut in a piece before the last": ([([1, 70, 2, 60], [3])], None, (70, 60)),
        "cut in the last piece": ([([5, 6], [80, 7, 8, 9])], None, (80, 9)),
        "whole documents": ([([9, 1],), ([4], [3])], [True, False], (4, 9)),
    }
    for name, (documents, to_val, expected) in cases.items():
        (tmp_path / name).mkdir()
        writer = split_writer.SplitWriter(tmp_path / name, "uint16", 2, 0.5)
        for i, pieces in enumerate(documents):
            for piece in pieces:
                writer.add(np.array(piece, np.uint16))
            writer.end_document(None if to_val is None else to_val[i])
        writer.close()
        got = tuple(writer.record(split)["max_token"] for split in ("train", "val"))
        in_files = tuple(int(np.fromfile(tmp_path / name / f"{split}.bin.partial", "<u2").max())
                         for split in ("train", "val"))
        assert got == in_files == expected, name


def test_prepare_records_the_largest_id_and_mtime_and_loading_trusts_them(chars, tmp_path):
    meta = meta_of(chars)
    for split in ("train", "val"):
        path = chars / f"{split}.bin"
        assert meta["splits"][split]["max_token"] == int(np.fromfile(path, "<u2").max())
        assert meta["splits"][split]["mtime_ns"] == path.stat().st_mtime_ns
    # The record is what loading checks while val.bin is unchanged: no pass over the file.
    data = copy_of(chars, tmp_path)
    edited = meta_of(data)
    edited["splits"]["val"]["max_token"] = FAR_ID
    (data / "meta.json").write_text(json.dumps(edited))
    with pytest.raises(UserError) as info:
        prep_read.read_prepared(data)
    assert str(info.value) == beyond(data / "val.bin", FAR_ID, meta["vocab_size"])


@pytest.mark.parametrize("recorded", [True, False], ids=["changed after prepare", "no record"])
def test_ids_beyond_the_vocabulary_are_found_in_the_file(chars, tmp_path, recorded):
    """A train.bin overwritten with as many random ids fails to load, whether meta.json recorded
    the largest id (the file's new mtime sends it to a scan) or, as older data, did not."""
    data = copy_of(chars, tmp_path)
    if recorded:  # Control: a file touched after prepare is scanned, and its own ids fit.
        os.utime(data / "train.bin", ns=(0, 0))
    else:  # Control: older data whose ids fit loads.
        meta = meta_of(data)
        for split in meta["splits"].values():
            split.pop("max_token", None), split.pop("mtime_ns", None)
        (data / "meta.json").write_text(json.dumps(meta))
    assert prep_read.read_prepared(data)
    overwrite_with_far_ids(data / "train.bin")
    with pytest.raises(UserError) as info:
        prep_read.read_prepared(data)
    assert str(info.value) == beyond(data / "train.bin", FAR_ID, meta_of(data)["vocab_size"])


@pytest.mark.parametrize("overwrite", [overwrite_with_far_ids, all_far_ids_keeping_mtime],
                         ids=["mtime changed", "mtime put back"])
def test_training_on_another_tokenizers_ids_is_one_line_and_writes_nothing(chars, tmp_path, capsys, overwrite):
    """Found when loading (a changed mtime sends the file to a scan), or in the first batch, before
    the compile (a put-back mtime keeps the stale record)."""
    data = copy_of(chars, tmp_path)
    overwrite(data / "train.bin")
    fails_with(capsys, tmp_path, ["--config", "tiny", "--mesh", "dp=8", "--steps", "1", f"--data.path={data}"],
               beyond(data / "train.bin", FAR_ID, meta_of(data)["vocab_size"]))


def test_each_source_of_a_mixture_is_checked(chars, tmp_path):
    good, bad = copy_of(chars, tmp_path, "good"), copy_of(chars, tmp_path, "bad")
    overwrite_with_far_ids(bad / "train.bin")
    mix = f"a={good}:1,b={bad}:1"
    with pytest.raises(UserError) as info:
        load_dataset(DataConfig(mix=mix), 32)
    assert str(info.value) == "data.mix source 'b': " + beyond(bad / "train.bin", FAR_ID, meta_of(bad)["vocab_size"])
    assert load_dataset(DataConfig(mix=f"a={good}:1,b={good}:1"), 32).mixture  # Control


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_batch_holding_ids_beyond_the_vocabulary_is_one_line(chars, tmp_path, mesh, split):
    """The split rewritten with another tokenizer's ids, its mtime put back, still loads (the
    record is trusted); its first batch names the file and the id."""
    data = copy_of(chars, tmp_path)
    all_far_ids_keeping_mtime(data / f"{split}.bin")
    dataset = load_dataset(DataConfig(path=str(data)), BLOCK)
    loader(dataset, {"train": "val", "val": "train"}[split], mesh)(0)  # Control: the other split
    with pytest.raises(UserError) as info:
        loader(dataset, split, mesh)(0)
    assert str(info.value) == beyond(data / f"{split}.bin", FAR_ID, meta_of(data)["vocab_size"])


def test_a_prefetched_batchs_error_reaches_the_caller(chars, tmp_path, mesh):
    """One id beyond the vocabulary where step 1's batch reads and step 0's does not: step 0
    trains, and step 1's batch, built on the worker thread, raises the one line in the caller."""
    data = copy_of(chars, tmp_path)
    path, ids = data / "train.bin", np.fromfile(data / "train.bin", "<u2")
    order = loader(load_dataset(DataConfig(path=str(data)), BLOCK), "train", mesh)
    reads = lambda step: set((order.rows(step)[1][..., None] + np.arange(BLOCK + 1)).ravel())
    ids[min(reads(1) - reads(0))] = FAR_ID
    rewrite_keeping_mtime(path, ids)
    batches = Prefetcher(loader(load_dataset(DataConfig(path=str(data)), BLOCK), "train", mesh), 0)
    try:
        batches(0)  # Control: step 0's batch holds no such id
        with pytest.raises(UserError) as info:
            batches(1)
    finally:
        batches.close()
    assert str(info.value) == beyond(path, FAR_ID, meta_of(data)["vocab_size"])


def test_a_mixtures_batch_names_the_source_beyond_the_vocabulary(chars, tmp_path, mesh):
    good, bad = copy_of(chars, tmp_path, "good"), copy_of(chars, tmp_path, "bad")
    all_far_ids_keeping_mtime(bad / "train.bin")
    dataset = load_dataset(DataConfig(mix=f"a={good}:1,b={bad}:1"), BLOCK)
    loader(dataset, "val", mesh)(0)  # Control: both val splits are sound
    with pytest.raises(UserError) as info:
        loader(dataset, "train", mesh)(0)
    assert str(info.value) == ("data.mix source 'b': "
                               + beyond(bad / "train.bin", FAR_ID, meta_of(bad)["vocab_size"]))


def test_text_and_uint32_sources_are_checked_too(mesh, tmp_path):
    """The built-in corpus (ids from a tokenizer made from it, so a bad one is a bug), and a uint32
    file's id past 2**31, which the cast to int32 would turn negative (never seen by a max after)."""
    builtin = load_dataset(DataConfig(), BLOCK)
    loader(builtin, "val", mesh)(0)  # Control
    vocab = builtin.tokenizer.vocab_size
    broken = Dataset(builtin.tokenizer, builtin.train[:1000].copy(), builtin.val[:1000].copy())
    broken.train[:] = vocab
    with pytest.raises(RuntimeError, match=f"token id {vocab}, beyond the vocabulary of {vocab} "):
        loader(broken, "train", mesh)(0)
    wide = np.full(1000, 2**31 + 5, np.uint32)
    tokenizer = SimpleNamespace(vocab_size=200_019, spec="tiktoken:o200k_base")
    with pytest.raises(UserError) as info:
        loader(Dataset(tokenizer, wide, wide, prepared=str(tmp_path)), "train", mesh)(0)
    assert str(info.value).startswith(f"'{tmp_path / 'train.bin'}' holds token id {2**31 + 5}, "
                                      "beyond the vocabulary of 200019 tokens")


TORN = b'{"step": 6, "loss": 4.1'
NOT_UTF8 = b'{"step": 6, "loss": 4.1, "note": "\xff"}'


@pytest.mark.parametrize("damage, skipped, where", [
    (TORN, [4], "(line 4: the last, what a write cut short leaves)"),
    (NOT_UTF8 + b"\n", [4], "(line 4: the last, what a write cut short leaves)"),
    (b"\n" + NOT_UTF8 + b"\n" + b'{"step": 3, "loss": 3.9}\n[]\n' + TORN, [5, 7, 8],
     "(lines 5, 7, 8: line 5 is not the last, so more than a write cut short damaged the file)"),
], ids=["torn last line", "non-UTF-8 last line", "bad lines before the last"])
def test_a_torn_or_undecodable_line_is_skipped_and_counted(tmp_path, capsys, damage, skipped, where):
    path = tmp_path / "metrics.jsonl"
    good = [{"step": 0, "loss": 4.5}, {"step": 1, "loss": 4.3}, {"step": 2, "val_loss": 4.4}]
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in good) + damage)
    records, lines = metrics.read_metrics(path)
    assert lines == skipped
    assert records == good + ([{"step": 3, "loss": 3.9}] if len(skipped) > 1 else [])
    n = len(skipped)
    assert capsys.readouterr().err == (f"jaxpar: warning: {path}: skipped {n} torn or undecodable "
                                       f"line{'s' * (n > 1)} {where}\n")
    # jaxpar.plot reads past it too.
    assert loss_plots.read_metrics(tmp_path)[:2] == ([(0, 4.5), (1, 4.3)] + [(3, 3.9)] * (n > 1), [(2, 4.4)])


def test_a_torn_metrics_jsonl_resumes_exactly(tmp_path, capsys):
    """Cut short while writing step 3's line after checkpoint 2: the resumed run drops the torn
    line with the lines after the checkpoint, and logs the uninterrupted run's losses."""
    cfg = tiny_config(**{"train.steps": 4, "train.eval_every": 0})
    straight = run(cfg, None, jax.devices()[:1], progress=False)
    run(cfg, tmp_path, jax.devices()[:1], progress=False, stop_at=2)
    with open(tmp_path / "metrics.jsonl", "ab") as log:
        log.write(b'{"step": 2, "loss": 4.0}\n' + TORN.replace(b"6", b"3"))
    capsys.readouterr()
    resumed = run(cfg, tmp_path, jax.devices()[:1], progress=False)
    assert resumed.info["resumed_from"] == 2
    assert resumed.losses == {s: straight.losses[s] for s in (2, 3)}
    assert "metrics.jsonl: skipped 1 torn or undecodable line (line 4: the last" in capsys.readouterr().err
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in logged] == sorted(straight.losses.items())

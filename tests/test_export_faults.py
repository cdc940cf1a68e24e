"""jaxpar.export deletes only what it wrote: --force replaces an earlier export (the files its
jaxpar_export.json lists) and refuses, in one line and before the checkpoint is read, the run it
reads, a folder holding it or inside it, another run and any folder above one, and a folder holding
a file it did not write; every run file survives each refusal byte for byte. One export per --out
(a second is refused while the first holds the lock), and its files have the usual mode. A full
disk is one line that leaves --out as it was and nothing staged (or names what it could not remove).

One training run of the tiny config (3 steps) and one export of it serve every test.
"""

import errno
import json
import os
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from helpers import exits_with_one_line
from helpers import placed as helpers_placed

from jaxpar.export import main as export_main
from jaxpar.formats import hf_files
from jaxpar.formats.hf_files import MANIFEST_FILE
from jaxpar.inference import export, sample
from jaxpar.models import hf

TRAINED = "tiny"  # a run directory, alone in its parent (conftest.TRAINED_RUNS)


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory) -> Path:
    """An export of `trained`, written under umask 022."""
    out = tmp_path_factory.mktemp("export") / "hf"
    umask = os.umask(0o022)
    try:
        export.export(trained, out)
    finally:
        os.umask(umask)
    return out


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path below `folder` and each file's bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


@pytest.fixture
def no_load(monkeypatch):
    """Reading the checkpoint fails the test: a refusal comes before it."""
    def load(*args, **kwargs):
        raise AssertionError("the checkpoint was read before the refusal")
    monkeypatch.setattr(sample, "load", load)


def refused(capsys, argv: list[str], *expected: str) -> str:
    return exits_with_one_line(capsys, "jaxpar.export", lambda: export_main(argv), *expected)


@pytest.mark.parametrize("ckpt, out, expected", [
    ("run", "run", "is the run that --ckpt reads"),
    ("run", ".", "holds '{run}', which --ckpt reads"),
    ("run", "run/checkpoints", "is inside '{run}', which --ckpt reads"),
    ("run/checkpoints", "run", "holds '{run}/checkpoints', which --ckpt reads"),
], ids=["run", "parent", "checkpoints", "run-of-checkpoints"])
def test_force_refuses_the_run_it_reads(trained, capsys, no_load, ckpt, out, expected):
    """Into the run, its parent, its checkpoints folder (that --ckpt may name too)."""
    parent = trained.parent
    before = snapshot(parent)
    where = {"run": trained, ".": parent, "run/checkpoints": trained / "checkpoints"}
    refused(capsys, ["--ckpt", str(where[ckpt]), "--out", str(where[out]), "--force"],
            expected.format(run=trained), "pass another --out, apart from the run")
    assert snapshot(parent) == before


@pytest.mark.parametrize("out, expected", [
    ("other/run", "holds a training run (its checkpoints)"),
    ("other", "holds the training run '{tmp}/other/run' below it"),
    (".", "holds the training run '{tmp}/other/run' below it"),
], ids=["run", "parent", "grandparent"])
def test_force_refuses_another_run_and_every_folder_above_it(trained, tmp_path, capsys, no_load, out, expected):
    shutil.copytree(trained, tmp_path / "other" / "run")
    before = snapshot(tmp_path)
    refused(capsys, ["--ckpt", str(trained), "--out", str(tmp_path / out), "--force"],
            expected.format(tmp=tmp_path), "replaces only an export it wrote")
    assert snapshot(tmp_path) == before


def test_force_refuses_an_export_that_holds_a_file_it_did_not_write(exported, trained, tmp_path, capsys,
                                                                    no_load):
    out = tmp_path / "hf"
    shutil.copytree(exported, out)
    (out / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    refused(capsys, ["--ckpt", str(trained), "--out", str(out), "--force"],
            f"--out '{out}' holds 'notes.txt', which jaxpar.export did not write; move it out")
    assert snapshot(tmp_path) == before


def test_a_replaced_export_lists_its_files_and_loads(exported, trained, tmp_path, capsys):
    out = tmp_path / "hf"
    shutil.copytree(exported, out)
    export_main(["--ckpt", str(trained), "--out", str(out), "--force", "--dtype", "bfloat16"])
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert sorted(p.name for p in out.iterdir()) == sorted([*manifest["files"], MANIFEST_FILE])
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # neither the lock's folder nor the old export
    cfg, vocab, _, shardings = helpers_placed("dp=1", 0, out)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = jax.tree.map(np.array, hf.load_hf_params(out, cfg.model, vocab, shardings))
    params = jax.tree.map(lambda a: np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32),
                          sample.load(trained).params)
    params["wte"][vocab:] = 0  # padding rows are not exported
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_exported_files_have_the_usual_mode(exported):
    """0644 under umask 022, as the files beside them: not safetensors' temporary file's 0600."""
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in exported.iterdir()}
    assert modes == dict.fromkeys(modes, "0o644") and oct(exported.stat().st_mode & 0o777) == "0o755"


def test_a_second_export_while_one_holds_the_lock_is_refused(trained, tmp_path, capsys, monkeypatch):
    """The second starts while the first reads the checkpoint; then the first stops (an error):
    neither leaves anything behind."""
    out = tmp_path / "hf"

    class Stop(Exception):
        pass

    def load(*args, **kwargs):
        monkeypatch.setattr(sample, "load", lambda *a, **k: pytest.fail("the second export read the checkpoint"))
        refused(capsys, ["--ckpt", str(trained), "--out", str(out)],
                f"--out '{out}' is in use by another jaxpar command (pid {os.getpid()} on")
        raise Stop

    monkeypatch.setattr(sample, "load", load)
    with pytest.raises(Stop):
        export_main(["--ckpt", str(trained), "--out", str(out)])
    assert list(tmp_path.iterdir()) == []


# ---- a full disk: one line, the earlier export kept, nothing staged left ----

def no_space(tensors, path):
    """save_tensors on a full disk: part of the file, then ENOSPC."""
    path.write_bytes(b"part of a file")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def safetensors_no_space(tensors, path, metadata=None):
    """safetensors' own writer on a full disk, as it reports it."""
    from safetensors import SafetensorError
    path.write_bytes(b"part of a file")
    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                          '"No space left on device" })')


@pytest.mark.parametrize("writer, earlier", [("oserror", True), ("safetensors", True), ("oserror", False)],
                         ids=["oserror-over-an-export", "safetensors-over-an-export", "oserror-into-a-new-out"])
def test_a_full_disk_is_one_line_and_leaves_out_as_it_was(exported, trained, tmp_path, capsys, monkeypatch,
                                                          writer, earlier):
    out = tmp_path / "hf"
    if earlier:
        shutil.copytree(exported, out)
    before = snapshot(tmp_path)
    if writer == "oserror":
        monkeypatch.setattr(hf_files, "save_tensors", no_space)
    else:
        import safetensors.numpy
        monkeypatch.setattr(safetensors.numpy, "save_file", safetensors_no_space)
    refused(capsys, ["--ckpt", str(trained), "--out", str(out)] + (["--force"] if earlier else []),
            f"cannot write the export in '{tmp_path}' (", "No space left on device",
            f"--out '{out}' is as it was: free some space or make it writable, or pass another --out")
    assert snapshot(tmp_path) == before  # no staging folder, no lock folder, the earlier export byte for byte


def test_a_staged_export_that_cannot_be_removed_is_said(trained, tmp_path, capsys, monkeypatch):
    """The write fails, and so does the removal of what was staged: both are in the one line."""
    out = tmp_path / "hf"
    staging = tmp_path / ".hf.jaxpar-export" / "staging"

    def cannot_remove(path, *args, **kwargs):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(path))
    monkeypatch.setattr(hf_files, "save_tensors", no_space)
    monkeypatch.setattr(export.shutil, "rmtree", cannot_remove)
    refused(capsys, ["--ckpt", str(trained), "--out", str(out)], "No space left on device",
            f"; and '{staging}' could not be removed (Permission denied): remove '{staging}' by hand")
    assert not out.exists() and staging.is_dir()


def test_export_force_twice_through_a_symbolic_link(tmp_path, capsys, trained):
    """The second --force replaces the first export, where the link points; the link stays."""
    target, link = tmp_path / "target", tmp_path / "hf"
    target.mkdir()
    os.symlink(target, link)
    for _ in range(2):
        export_main(["--ckpt", str(trained), "--out", str(link), "--force"])
        assert link.is_symlink() and (target / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "target"], "the export's own folders are gone"

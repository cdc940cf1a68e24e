"""jaxpar writes over and removes only what it wrote (jaxpar.core.written): in a training run's --out,
a plan's --out, and the pictures of jaxpar.plot and jaxpar.schedule. A path that holds a user's file,
or the wrong kind of thing, is refused in one line before any work, and is left byte for byte as it
was. The controls: the same commands go on over what jaxpar itself wrote, a record or not.
"""

import json

import pytest

from jaxpar.plan import main as plan_main
from jaxpar.plot import main as plot_main
from jaxpar.train import main as train_main
from jaxpar.training.run import loss_plots

TRAIN = ["--config", "tiny", "--steps", "2", "--train.eval_every=0"]


def refused(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def snapshot(folder) -> dict:
    return {str(p.relative_to(folder)): (p.is_dir(), None if p.is_dir() else p.read_bytes())
            for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("name, made", [
    ("metrics.jsonl", "a user's file"), ("run.json", "a user's file"), ("loss.png", "a user's file"),
    ("metrics.jsonl", "folder"), ("run.json", "link"),
])
def test_train_refuses_an_output_path_it_did_not_write_before_any_work(tmp_path, capsys, name, made):
    out = tmp_path / "out"
    out.mkdir()
    if made == "folder":
        (out / name).mkdir()
        (out / name / "inside").write_text("kept")
    elif made == "link":
        (tmp_path / "elsewhere.json").write_text('{"a user": "file"}')
        (out / name).symlink_to(tmp_path / "elsewhere.json")
    else:
        (out / name).write_text(made)
    before = snapshot(tmp_path)
    err = refused(train_main, [*TRAIN, "--out", str(out)], capsys)
    kind = {"folder": "is a folder, where jaxpar writes a file", "link": "is a symbolic link, where jaxpar writes a file"}
    assert err.startswith(f"jaxpar.train: error: '{out / name}' ") and "pass another --out" in err
    assert kind.get(made, "was not written by jaxpar, which would overwrite it") in err
    assert snapshot(tmp_path) == before  # no metrics.jsonl.tmp, no record, nothing


def test_a_checkpoints_path_that_is_a_file_is_refused_before_any_work(tmp_path, capsys):
    (tmp_path / "checkpoints").write_text("a user's file")
    err = refused(train_main, [*TRAIN, "--out", str(tmp_path)], capsys)
    assert f"'{tmp_path / 'checkpoints'}' is a file, where jaxpar keeps the run's checkpoints in a folder" in err
    assert snapshot(tmp_path) == {"checkpoints": (False, b"a user's file")}


def test_the_record_lists_what_was_written_and_a_run_from_before_it_is_adopted(tmp_path):
    from jaxpar.core.written import FILE, FOLDER, RECORD, Outputs
    outputs = Outputs(tmp_path, {"run.json": FILE, "metrics.jsonl": FILE, "tensorboard": FOLDER},
                      legacy=("run.json", lambda p: json.loads(p.read_text()).get("versions") is not None))
    (tmp_path / "run.json").write_text('{"versions": {"jaxpar": "0.1.0"}}')  # written before the record
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    outputs.check()  # adopted: jaxpar's run.json marks the folder
    outputs.claim("run.json", "tensorboard")
    assert json.loads((tmp_path / RECORD).read_text())["written"] == ["metrics.jsonl", "run.json", "tensorboard"]
    outputs.release("metrics.jsonl", "tensorboard")
    assert not (tmp_path / "metrics.jsonl").exists() and (tmp_path / "run.json").exists()
    # control: without jaxpar's run.json, a metrics.jsonl is a user's
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(Exception, match="was not written by jaxpar"):
        Outputs(other, outputs.names, legacy=outputs.legacy).check()


def test_plan_refuses_a_report_file_it_did_not_write(tmp_path, capsys):
    (tmp_path / "plan.md").write_text("a user's notes")
    err = refused(plan_main, ["--config", "tiny", "--target", "cpu:2", "--out", str(tmp_path)], capsys)
    assert f"'{tmp_path / 'plan.md'}' was not written by jaxpar" in err
    assert snapshot(tmp_path) == {"plan.md": (False, b"a user's notes")}


def make_run(run_dir):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 4.0 - s}) + "\n" for s in range(3)))
    return run_dir


def test_plot_into_a_folder_writes_loss_png_there_and_a_name_without_a_kind_is_refused(tmp_path, capsys):
    run_dir, pictures = make_run(tmp_path / "run"), tmp_path / "pictures"
    pictures.mkdir()
    plot_main([str(run_dir), "--out", str(pictures)])
    assert capsys.readouterr().out.strip() == f"wrote {pictures / 'loss.png'}"
    assert (pictures / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert not (tmp_path / "pictures.png").exists()
    err = refused(plot_main, [str(run_dir), "--out", str(tmp_path / "curves")], capsys)
    assert "a picture's name must end in one of" in err and not (tmp_path / "curves.png").exists()


def test_plot_by_default_redraws_only_its_own_picture(tmp_path, capsys, monkeypatch):
    run_dir = make_run(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loss.png").write_bytes(b"\x89PNG\r\n\x1a\n a user's picture")
    err = refused(plot_main, [str(run_dir)], capsys)
    assert "'loss.png' was not drawn by jaxpar, which would overwrite it; pass --out" in err
    assert (tmp_path / "loss.png").read_bytes() == b"\x89PNG\r\n\x1a\n a user's picture"
    (tmp_path / "loss.png").unlink()
    plot_main([str(run_dir)])  # control: jaxpar's own picture is drawn again
    plot_main([str(run_dir)])
    assert loss_plots.drawn_by_jaxpar(tmp_path / "loss.png")


@pytest.mark.parametrize("name, folder", [("bench.md", False), ("dp=2", True)])
def test_bench_refuses_a_report_file_or_layout_folder_it_did_not_write(tmp_path, capsys, name, folder):
    from jaxpar.bench import main as bench_main
    if folder:
        (tmp_path / "dp2").mkdir()
        (tmp_path / "dp2" / "notes.txt").write_text("a user's notes")
    else:
        (tmp_path / name).write_text("a user's notes")
    before = snapshot(tmp_path)
    err = refused(bench_main, ["--config", "tiny", "--layouts", "dp=1;dp=2", "--steps", "1", "--out", str(tmp_path)],
                  capsys)
    assert f"'{tmp_path / ('dp2' if folder else name)}' was not written by jaxpar" in err
    assert snapshot(tmp_path) == before

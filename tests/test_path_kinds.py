"""Every path of every command against every kind of path the file system can refuse, each run twice.

Generated, not listed: COMMANDS names each command's path flags (an input to read, or a folder or
picture to write) and KINDS the paths that file systems refuse or that links make odd. Each pair is
run twice in-process: it exits 2 with one line naming the reason (or succeeds), never a traceback,
and the test's folder is byte for byte as before. Then each command that writes a folder writes it
twice through a symbolic link, keeping the link and the user's file beside its own.
"""

import contextlib
import hashlib
import os

import pytest
from helpers import exits_with_one_line, read_only


def main_of(command: str):
    """The command's main, imported when first run (sample and eval load JAX's pieces lazily)."""
    import importlib
    module = {"train": "jaxpar.train", "sample": "jaxpar.sample", "eval": "jaxpar.eval",
              "export": "jaxpar.export", "prepare": "jaxpar.prepare", "bench": "jaxpar.bench",
              "plan": "jaxpar.plan", "schedule": "jaxpar.schedule", "plot": "jaxpar.plot"}
    return importlib.import_module(module[command]).main


# (command, the flag, what it names: "in" a path read, "out" a folder written, "picture" a picture drawn;
# argv, with {p} the path under test, {run} a trained run, {text} a text file, {tmp} the test's folder)
COMMANDS = [
    ("train", "--out", "out", ["--config", "tiny", "--steps", "1", "--out", "{p}"]),
    ("train", "--config", "in", ["--config", "{p}", "--out", "{tmp}/unused"]),
    ("train", "--init-from", "in", ["--config", "tiny", "--init-from", "{p}", "--out", "{tmp}/unused"]),
    ("train", "data.path", "in", ["--config", "tiny", "--data.path={p}", "--out", "{tmp}/unused"]),
    ("train", "data.mix", "in", ["--config", "tiny", "--data.mix=a={p}:1", "--out", "{tmp}/unused"]),
    ("train", "eval.tasks_dir", "in", ["--config", "tiny", "--eval.tasks=piqa", "--eval.tasks_dir={p}",
                                       "--out", "{tmp}/unused"]),
    ("sample", "--ckpt", "in", ["--ckpt", "{p}"]),
    ("sample", "--hf", "in", ["--hf", "{p}"]),
    ("eval", "--ckpt", "in", ["--ckpt", "{p}"]),
    ("eval", "--data", "in", ["--ckpt", "{run}", "--data", "{p}"]),
    ("eval", "--tasks-dir", "in", ["--ckpt", "{run}", "--tasks", "piqa", "--tasks-dir", "{p}"]),
    ("export", "--ckpt", "in", ["--ckpt", "{p}", "--out", "{tmp}/unused"]),
    ("export", "--out", "out", ["--ckpt", "{run}", "--out", "{p}"]),
    ("prepare", "INPUT", "in", ["{p}", "--out", "{tmp}/unused", "--tokenizer", "char"]),
    ("prepare", "--out", "out", ["{text}", "--out", "{p}", "--tokenizer", "char"]),
    ("bench", "--config", "in", ["--config", "{p}", "--out", "{tmp}/unused"]),
    ("bench", "--out", "out", ["--config", "tiny", "--out", "{p}"]),
    ("plan", "--config", "in", ["--config", "{p}", "--target", "tpu:v5e-4", "--out", "{tmp}/unused"]),
    ("plan", "--out", "out", ["--config", "tiny", "--target", "tpu:v5e-4", "--out", "{p}"]),
    ("schedule", "--out", "picture", ["--pp", "2", "--microbatches", "2", "--out", "{p}"]),
    ("plot", "RUN_DIR", "in", ["{p}", "--out", "{tmp}/unused.png"]),
    ("plot", "--out", "picture", ["{run}", "--out", "{p}"]),
]


def make_kind(tmp_path, kind: str, role: str):
    """A path of `kind` in tmp_path, and what the one line must say of it."""
    (tmp_path / "notes.txt").write_text("a user's notes")
    if kind == "long name":
        return tmp_path / ("x" * 300), "ENAMETOOLONG"
    if kind == "long name below a missing folder":  # mkdir(parents=True) would make the folder first
        return tmp_path / "new" / ("y" * 300), "ENAMETOOLONG"
    if kind == "links round a circle":
        os.symlink(tmp_path / "loop", tmp_path / "loop")
        return tmp_path / "loop", "ELOOP"
    if kind == "path too long":
        return tmp_path.joinpath(*["z" * 200] * 25), "ENAMETOOLONG"
    if kind == "a read-only disk":  # mounted read-only by the test, below
        (tmp_path / "ro").mkdir()
        return tmp_path / "ro" / ("s.png" if role == "picture" else "out"), "read-only disk (EROFS)"
    if kind == "link to nothing":
        os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
        return tmp_path / "dangling", "symbolic link" if role == "out" else ""
    assert kind == "a user's file in the way"
    return tmp_path / "notes.txt", "is a file" if role == "out" else ""


KINDS = ["long name", "long name below a missing folder", "links round a circle", "path too long",
         "link to nothing", "a user's file in the way", "a read-only disk"]


def snapshot(folder) -> dict:
    """Every entry below `folder`: a link's target, a file's hash, or a folder."""
    seen = {}
    for root, folders, files in os.walk(folder):
        for name in folders + files:
            path = os.path.join(root, name)
            if os.path.islink(path):
                seen[path] = "-> " + os.readlink(path)
            elif os.path.isfile(path):
                seen[path] = hashlib.sha256(open(path, "rb").read()).hexdigest()
            else:
                seen[path] = "folder"
    return seen


# An input that is a link to nothing or a file is each command's own check (test_errors and others).
CASES = [(*c, kind) for c in COMMANDS for kind in KINDS
         if c[2] != "in" or kind not in ("link to nothing", "a user's file in the way", "a read-only disk")]


@pytest.mark.parametrize("command, flag, role, argv, kind", CASES, ids=[f"{c[0]} {c[1]}: {c[4]}" for c in CASES])
def test_each_path_of_each_command_is_one_line_twice_and_changes_nothing(
        tmp_path, capsys, command, flag, role, argv, kind):
    work = tmp_path / "work"
    work.mkdir()
    path, reason = make_kind(work, kind, role)
    text = tmp_path / "input.txt"
    text.write_text("to be or not to be " * 40)
    run = tmp_path / "run"  # never read: the path under test is refused first
    args = [a.format(p=path, run=run, tmp=tmp_path, text=text) for a in argv]
    before = snapshot(tmp_path)
    with read_only(work / "ro") if kind == "a read-only disk" else contextlib.nullcontext():
        lines = [exits_with_one_line(capsys, f"jaxpar.{command}", lambda: main_of(command)(args), reason)
                 for _ in range(2)]
    assert lines[0] == lines[1], lines
    assert "Traceback" not in lines[0]
    assert snapshot(tmp_path) == before, f"{command} {flag} changed the disk for a {kind}"


def link_to_a_folder(tmp_path):
    """A symbolic link to a folder that holds a user's file."""
    target, link = tmp_path / "target", tmp_path / "link"
    target.mkdir()
    (target / "notes.txt").write_text("a user's notes")
    os.symlink(target, link)
    return link


# Each command that writes a folder or a picture, twice through a link. train, bench and plan are
# judged at the folder they resolve, before any work: past it they run as in a plain folder, which
# their own tests cover, and their runs cost a compile each.
TWICE = {
    "prepare": ["{text}", "--out", "{link}", "--tokenizer", "char", "--force"],
    "schedule": ["--pp", "2", "--microbatches", "2", "--out", "{link}/s.png"],
    "plot": ["{run}", "--out", "{link}"],
}


@pytest.mark.parametrize("command", TWICE)
def test_a_command_writes_twice_through_a_link_and_keeps_it(tmp_path, capsys, command):
    link = link_to_a_folder(tmp_path)
    text = tmp_path / "input.txt"
    text.write_text("to be or not to be " * 40)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n')
    args = [a.format(link=link, run=run, text=text) for a in TWICE[command]]
    for _ in range(2):
        main_of(command)(args)
        assert link.is_symlink() and os.readlink(link) == str(tmp_path / "target")
    assert (tmp_path / "target" / "notes.txt").read_text() == "a user's notes"
    assert len(os.listdir(tmp_path / "target")) > 1, "nothing written through the link"


@pytest.mark.parametrize("command, argv", [
    ("train", ["--config", "tiny", "--out", "{link}"]),
    ("bench", ["--config", "tiny", "--out", "{link}"]),
    ("plan", ["--config", "tiny", "--target", "tpu:v5e-4", "--out", "{link}"])])
def test_train_bench_and_plan_write_in_the_folder_a_link_names(tmp_path, command, argv):
    from jaxpar import bench, plan, train
    link = link_to_a_folder(tmp_path)
    args = [a.format(link=link) for a in argv]
    if command == "train":
        out = train.parse_args(args)[1]
    else:
        out = bench.parse_args(args)[2] if command == "bench" else plan.parse_args(args)[2].out
    assert out == tmp_path / "target" and link.is_symlink()


def test_schedule_keeps_a_picture_it_did_not_draw(tmp_path, capsys):
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"\x89PNG\r\n\x1a\n a user's picture")
    argv = ["--pp", "4", "--microbatches", "8", "--out", str(mine)]
    exits_with_one_line(capsys, "jaxpar.schedule", lambda: main_of("schedule")(argv), "was not drawn by jaxpar")
    assert mine.read_bytes() == b"\x89PNG\r\n\x1a\n a user's picture"
    mine.unlink()
    for _ in range(2):  # control: its own picture is drawn, and drawn again
        main_of("schedule")(argv)
    assert mine.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("suffix", ["pdf", "svg"])
def test_pictures_of_other_kinds_are_known_as_jaxpar_s(tmp_path, suffix):
    from jaxpar.training.run import loss_plots
    pyplot = loss_plots.pyplot()
    path = tmp_path / f"a.{suffix}"
    loss_plots.save(pyplot, pyplot.figure(), path)
    assert loss_plots.drawn_by_jaxpar(path)
    path.write_bytes(path.read_bytes().replace(b"jaxpar", b"someone"))  # control
    assert not loss_plots.drawn_by_jaxpar(path)


def test_schedule_sizes_its_table_before_building_it(capsys, monkeypatch):
    from jaxpar import schedule
    monkeypatch.setattr(schedule, "make_schedule", lambda *a: pytest.fail("built a table it cannot draw"))
    for pp in (1000, 100_000):
        exits_with_one_line(capsys, "jaxpar.schedule", lambda: schedule.main(
            ["--pp", str(pp), "--microbatches", str(pp)]), "forward passes, past the 131,072")


def test_plan_interrupted_writes_nothing_and_says_so(tmp_path, capsys, monkeypatch):
    from jaxpar import plan
    out = tmp_path / "plan"

    def interrupted(*args):
        raise KeyboardInterrupt

    def exit_(code):
        raise SystemExit(code)
    monkeypatch.setattr(plan, "plan", interrupted)
    monkeypatch.setattr(plan.os, "_exit", exit_)
    with pytest.raises(SystemExit) as stop:
        plan.main(["--config", "tiny", "--target", "tpu:v5e-4", "--layouts", "dp=4", "--out", str(out)])
    assert stop.value.code == 130
    err = capsys.readouterr().err.strip()
    assert err == f"jaxpar.plan: interrupted; nothing new written in {out} (an earlier plan there is as it was)"
    assert not out.exists() or os.listdir(out) == [], os.listdir(out)


TASKS = os.path.join(os.path.dirname(__file__), "fixtures", "tasks")


@pytest.mark.parametrize("command, argv", [
    ("export", ["--ckpt", "{tmp}", "--out", "{name}"]),  # its lock's folder: .NAME.jaxpar-export
    ("schedule", ["--out", "{name}.png"]),  # a picture is drawn as NAME.png.partial first
    ("plot", ["{tmp}", "--out", "{name}.png"]),
    ("eval", ["--ckpt", "{tmp}", "--tasks", "piqa", "--tasks-dir", TASKS, "--samples", "{name}"]),
])
def test_a_name_that_leaves_no_room_for_what_jaxpar_writes_beside_it(tmp_path, capsys, command, argv):
    name = tmp_path / ("n" * 250)
    args = [a.format(tmp=tmp_path, name=name) for a in argv]
    before = snapshot(tmp_path)
    exits_with_one_line(capsys, f"jaxpar.{command}", lambda: main_of(command)(args), "ENAMETOOLONG",
                        "bytes longer beside it")
    assert snapshot(tmp_path) == before

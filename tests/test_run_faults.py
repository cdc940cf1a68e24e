"""A user's work is never lost: a checkpoint that does not fit is refused without touching it, a
damaged one is found by its checksums (and kept aside, never deleted), --out is locked for one
run, SIGTERM/SIGINT at any moment of a run end in exit 0 with nothing lost, and a read-only or
full checkpoints folder is one line, the checkpoints before it intact (real mounts: root only).

Tolerances: resumes on one device are bit-identical (exact equality of every loss).
"""

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import fresh_process_env, tiny_config

from jaxpar.core.errors import UserError
from jaxpar.core.out_lock import LOCK_NAME, RunLock
from jaxpar.inference.loading import load
from jaxpar.train import main as train_main
from jaxpar.train import run
from jaxpar.training.checkpoints.checkpoint import Checkpoints
from jaxpar.training.run import setup, trainer
from jaxpar.training.run.stopping import StopRequest

ONE = jax.devices()[:1]
TINY = {"train.eval_every": 0, "ckpt.every": 2, "train.decay_steps": 100}


def files(directory) -> dict:
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def train(steps: int, out=None, **overrides):
    return run(tiny_config(**{**TINY, "train.steps": steps, **overrides}), out, ONE, progress=False)


@pytest.fixture(scope="module")
def adafactor_run(tmp_path_factory):
    """The issue's sequence: adafactor to step 4, then on to 8 with factored_min_dim=32 and a new
    optimizer state (checkpoints 6 and 8 hold that state's shapes)."""
    out = tmp_path_factory.mktemp("adafactor")
    train(4, out, **{"optimizer.name": "adafactor"})
    train(8, out, **{"optimizer.name": "adafactor", "optimizer.factored_min_dim": 32,
                     "optimizer.reset_state": "true"})
    return out


@pytest.mark.parametrize("overrides, expected", [
    ({}, "optimizer.factored_min_dim=32 there, 128 here changes the optimizer state's shapes"),
    ({"optimizer.factored_min_dim": 32, "optimizer.weight_decay": 0},
     "optimizer.weight_decay=0.1 there, 0.0 here changes"),
    ({"optimizer.factored_min_dim": 32, "optimizer.clip_threshold": 0},
     "optimizer.clip_threshold=1.0 there, 0.0 here changes"),
])
def test_an_optimizer_state_of_other_shapes_is_refused_and_no_checkpoint_is_touched(
        adafactor_run, tmp_path, overrides, expected):
    out = tmp_path / "run"
    shutil.copytree(adafactor_run, out)
    before = files(out)
    with pytest.raises(UserError) as error:
        train(10, out, **{"optimizer.name": "adafactor", **overrides})
    message = str(error.value)
    assert message.startswith(f"the checkpoint '{out}/checkpoints/8' does not fit this run: "), message
    assert expected in message and "--optimizer.reset_state=true" in message and "another --out" in message
    assert "damaged" not in message
    assert files(out) == before  # checkpoints 4, 6 and 8, byte for byte


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny run to step 4 (checkpoints 2 and 4), and the same run to step 6 without a stop."""
    out = tmp_path_factory.mktemp("saved")
    return out, train(4, out), train(6)


def corrupt(path, rng) -> None:
    """4 KiB of random bytes over a random place in the file (all of it, if smaller)."""
    data = bytearray(path.read_bytes())
    size = min(4096, len(data))
    start = int(rng.integers(0, len(data) - size + 1))
    data[start:start + size] = rng.bytes(size)
    path.write_bytes(bytes(data))


def largest_params_file(step_dir):
    return max((p for p in (step_dir / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_twenty_random_corruptions_of_the_params_are_each_found(saved, tmp_path, capsys):
    """eval, sample and export read a checkpoint through `load`: each corruption of the newest
    checkpoint's largest params file is found (its bytes do not read, or an array's checksum
    differs) and the one before it is used."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        out = tmp_path / str(trial)
        shutil.copytree(saved[0] / "checkpoints", out)
        corrupt(largest_params_file(out / "4"), rng)
        capsys.readouterr()
        model = load(out)
        warning = capsys.readouterr().err
        assert model.step == 2, f"trial {trial}: the corrupted checkpoint 4 was used"
        assert f"checkpoint {out}/4 is damaged (" in warning, warning
        shutil.rmtree(out)


def tamper_checksum(step_dir, item: str = "params") -> None:
    """Meta's record of one array's checksum changed: what a change of that array's bytes that
    still decodes looks like to a restore."""
    meta_file = step_dir / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    path = sorted(meta["checksums"][item])[0]
    meta["checksums"][item][path] = "0" * 16
    meta_file.write_text(json.dumps(meta))


@pytest.mark.parametrize("command", ["eval", "sample", "export"])
def test_each_command_refuses_a_checkpoint_whose_arrays_do_not_match(saved, tmp_path, capsys, command):
    from jaxpar.eval import main as eval_main
    from jaxpar.export import main as export_main
    from jaxpar.sample import main as sample_main
    out = tmp_path / "run"
    shutil.copytree(saved[0], out)
    shutil.rmtree(out / "checkpoints" / "2")  # nothing to fall back to
    tamper_checksum(out / "checkpoints" / "4")
    argv = {"eval": ["--ckpt", str(out)], "sample": ["--ckpt", str(out), "--max-new-tokens", "4"],
            "export": ["--ckpt", str(out), "--out", str(tmp_path / "hf")]}[command]
    main = {"eval": eval_main, "sample": sample_main, "export": export_main}[command]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "does not match its checksum" in err[0] and err[-1].startswith(f"jaxpar.{command}: error: no intact ")
    assert not (tmp_path / "hf").exists()


def test_resume_skips_a_mismatched_checkpoint_keeps_it_aside_and_trains_exactly(saved, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(saved[0], out)
    tamper_checksum(out / "checkpoints" / "4", "opt_state")
    set_aside = files(out / "checkpoints" / "4")
    resumed = train(6, out)
    assert resumed.info["resumed_from"] == 2
    assert resumed.losses == {s: saved[2].losses[s] for s in range(2, 6)}
    assert {p.name for p in (out / "checkpoints").iterdir()} == {"2", "4", "6", "4.damaged"}
    assert [p.read_bytes() for p in files(out / "checkpoints" / "4.damaged")] == list(set_aside.values())


def test_a_locked_out_is_refused_in_one_line_and_the_holder_trains_undisturbed(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--config", "tiny", "--train.eval_every=0", "--train.decay_steps=100", "--log-every", "1"]
    holder = subprocess.Popen([sys.executable, "-m", "jaxpar.train", *args, "--steps", "30", "--out", str(out)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=fresh_process_env())
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").exists():  # it holds the lock and is training
            assert holder.poll() is None and time.monotonic() < deadline, holder.stderr.read().decode()
            time.sleep(0.05)
        with pytest.raises(SystemExit) as exit_:
            train_main([*args, "--steps", "30", "--seed", "7", "--out", str(out)])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"--out '{out}' is in use by another jaxpar command (pid {holder.pid} on " in err, err
        assert holder.wait(timeout=300) == 0, holder.stderr.read().decode()
    finally:
        holder.kill()
    logged = {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    undisturbed = run(tiny_config(**{"train.eval_every": 0, "train.decay_steps": 100, "train.steps": 30}),
                      None, ONE, progress=False)
    assert logged == undisturbed.losses
    assert not (out / LOCK_NAME).exists()


def test_a_stale_lock_is_taken_over_and_an_unwritable_out_is_one_line(tmp_path, capsys):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "gone", "pid": 999999, "started": "then"}))
    with RunLock(tmp_path):  # its holder died: the kernel's lock went with it
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] != 999999
    assert not (tmp_path / LOCK_NAME).exists()
    # root may write anywhere by os.access, but not into /proc: found before anything compiles
    with pytest.raises(SystemExit) as exit_:
        train_main(["--config", "tiny", "--out", "/proc/jaxpar-test-out"])
    assert exit_.value.code == 2
    assert "--out '/proc/jaxpar-test-out' cannot be written" in capsys.readouterr().err


def signal_in(monkeypatch, owner, name: str, stop: StopRequest, signum=signal.SIGTERM):
    """`owner.name`'s first call receives `signum` as it starts: the handler runs, as the kernel
    would run it."""
    real, calls = getattr(owner, name), []

    def interrupted(*args, **kwargs):
        if not calls:
            stop._on_signal(signum, None)
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, interrupted)


def evaluate_interrupted(monkeypatch, stop: StopRequest, signum):
    real = trainer.make_evaluate

    def make(*args, **kwargs):
        due, evaluate = real(*args, **kwargs)

        def interrupted(*a, **k):
            stop._on_signal(signum, None)
            return evaluate(*a, **k)
        return due, interrupted
    monkeypatch.setattr(trainer, "make_evaluate", make)


@pytest.mark.parametrize("moment, signum", [("restore", signal.SIGINT), ("compile", signal.SIGTERM),
                                            ("first eval", signal.SIGINT)])
def test_a_signal_before_the_first_step_ends_at_once_with_nothing_new_written(
        saved, tmp_path, monkeypatch, moment, signum):
    """A resumed run (restore, compile) and a fresh one (first eval) stopped before a step:
    every file as it was, and the run resumed afterwards trains exactly."""
    out = tmp_path / "run"
    if moment != "first eval":
        shutil.copytree(saved[0], out)
    before = files(out) if out.exists() else None
    stop = StopRequest()
    if moment == "first eval":
        evaluate_interrupted(monkeypatch, stop, signum)
    else:
        owner, name = {"restore": (setup, "restore_train_state"), "compile": (trainer, "compile_run")}[moment]
        signal_in(monkeypatch, owner, name, stop, signum)
    cfg = tiny_config(**{**TINY, "train.steps": 6, "train.eval_every": 2 if moment == "first eval" else 0})
    result = run(cfg, out, ONE, progress=False, stop=stop)
    assert result.info["interrupted"]["signal"] == signal.Signals(signum).name
    assert result.info["interrupted"]["before_first_step"]
    assert (files(out) if out.exists() else None) == before
    if moment == "restore":
        monkeypatch.undo()
        assert train(6, out).losses == {s: saved[2].losses[s] for s in (4, 5)}


def test_a_signal_during_an_async_save_saves_the_next_step_and_resumes_exactly(saved, tmp_path, monkeypatch):
    """The signal arrives while step 2 is being saved: that save completes, step 3 runs and is
    saved, and the run stops."""
    stop = StopRequest()
    signal_in(monkeypatch, Checkpoints, "save", stop)
    cfg = tiny_config(**{**TINY, "train.steps": 6})
    stopped = run(cfg, tmp_path, ONE, progress=False, stop=stop)
    assert stopped.info["interrupted"] == {"step": 3, "signal": "SIGTERM"}
    assert Checkpoints(tmp_path / "checkpoints").steps() == [2, 3]
    monkeypatch.undo()
    assert train(6, tmp_path).losses == {s: saved[2].losses[s] for s in range(3, 6)}


def test_a_second_signal_stops_at_once_in_one_line(tmp_path):
    """SIGINT, then SIGTERM before the first is acted on: the second forces the stop. No
    traceback, exit code 128 + 15, and the newest complete checkpoint still resumes."""
    out = tmp_path / "run"
    args = ["--config", "tiny", "--train.eval_every=0", "--train.decay_steps=100", "--ckpt.every=5"]
    proc = subprocess.Popen([sys.executable, "-m", "jaxpar.train", *args, "--steps", "100000", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=fresh_process_env(), text=True)
    try:
        deadline = time.monotonic() + 300
        while not Checkpoints(out / "checkpoints").steps():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("jaxpar.train: stopped at once by a second SIGTERM; a save in "
                                            "progress is discarded, and the newest complete checkpoint resumes")
    newest = Checkpoints(out / "checkpoints").steps()[-1]
    assert load(out).step == newest and not (out / LOCK_NAME).exists()


def test_weights_with_a_nan_are_not_evaluated_sampled_or_exported(tmp_path):
    """A checkpoint whose arrays are intact but not finite (written by hand: training never saves
    one): `load`, behind eval, sample and export, refuses it in one line."""
    from helpers import save_random_gpt2

    from jaxpar.data.loader import load_dataset
    cfg = tiny_config()
    save_random_gpt2(tmp_path, cfg, load_dataset(cfg.data, cfg.model.block_size).tokenizer, 1, float("nan"))
    with pytest.raises(UserError, match=r"^the weights in '.*checkpoints/1' hold NaN or infinite values "
                                        r"\(params\['blocks'\]\['attn_out'\]\['bias'\] and \d+ more\)"):
        load(tmp_path)


@contextlib.contextmanager
def mounted(*args: str, target):
    """`mount ARGS target` for the block (root only; the test is skipped where mount is refused)."""
    made = subprocess.run(["mount", *args, str(target)], capture_output=True, check=False)
    if made.returncode:
        pytest.skip(f"mount {' '.join(args)} refused here: {made.stderr.decode().strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=True)


@contextlib.contextmanager
def read_only(folder):
    with mounted("--bind", str(folder), target=folder):
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        yield folder


def test_a_read_only_checkpoints_folder_is_one_line_before_the_compile_and_mid_run(saved, tmp_path, monkeypatch):
    """Read-only from the start: refused before the compile, nothing written. Turned read-only
    after the run has started: the save of step 6 is refused in one line that names checkpoint 4,
    which is intact and resumes exactly once the folder is writable."""
    out = tmp_path / "run"
    shutil.copytree(saved[0], out)
    before = files(out)
    with read_only(out / "checkpoints"), monkeypatch.context() as patch:
        patch.setattr(trainer, "compile_run", lambda *a: pytest.fail("compiled before refusing"))
        with pytest.raises(UserError, match=r"^cannot save checkpoints in '.*/checkpoints' \(Read-only file "
                                            r"system\); free space on that disk, make the folder writable"):
            train(6, out)
    assert files(out) == before
    with contextlib.ExitStack() as held:
        real = Checkpoints.save
        monkeypatch.setattr(Checkpoints, "save", lambda self, *a: (held.enter_context(read_only(self.directory)),
                                                                    real(self, *a)))
        with pytest.raises(UserError) as error:
            train(6, out)
    assert str(error.value) == (f"cannot save checkpoint 6 in '{out}/checkpoints' (Read-only file system); the "
                                f"last good checkpoint is {out}/checkpoints/4; free space on that disk or make the "
                                "folder writable, then run the same command to resume")
    assert {p: b for p, b in files(out).items() if "checkpoints" in p.parts} == {
        p: b for p, b in before.items() if "checkpoints" in p.parts}
    monkeypatch.undo()
    assert train(6, out).losses == {s: saved[2].losses[s] for s in (4, 5)}


def test_a_full_disk_is_one_line_before_the_compile_and_when_it_fills_during_a_save(saved, tmp_path):
    """A tmpfs with less room than one checkpoint: refused before the compile. The same disk with
    the room check skipped, so that orbax's own write fails in its background threads: one line,
    exit 2 within a minute (not orbax's 300 s wait for its signals), its temporary folder gone,
    and checkpoint 4 resumes exactly on a larger disk."""
    used = sum(-(-p.stat().st_size // 4096) * 4 for p in saved[0].rglob("*") if p.is_file())  # KiB, whole pages
    with mounted("-t", "tmpfs", "-o", f"size={used + 200}k", "tmpfs", target=tmp_path):
        out = tmp_path / "run"
        shutil.copytree(saved[0], out)
        with pytest.raises(UserError, match=r"^cannot save checkpoints in .* \(No space left on device: "
                                            r"0\.\d MiB free of the 0\.\d MiB a checkpoint needs\)"):
            train(6, out)
        skip_room_check = ("import sys; from jaxpar.training.checkpoints import checkpoint; "
                           "checkpoint.check_room = lambda *a: None; from jaxpar.train import main; main(sys.argv[1:])")
        argv = ["--config", "tiny", "--train.eval_every=0", "--train.decay_steps=100", "--ckpt.every=2"]
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", skip_room_check, *argv, "--steps", "8", "--out", str(out)],
                              check=False, capture_output=True, text=True, env=fresh_process_env(), timeout=120)
        assert proc.returncode == 2 and time.monotonic() - start < 60, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert "Traceback" not in proc.stderr and last == (
            f"jaxpar.train: error: cannot save checkpoint 6 in '{out}/checkpoints' (No space left on device); the "
            f"last good checkpoint is {out}/checkpoints/4; free space on that disk or make the folder writable, "
            "then run the same command to resume"), proc.stderr
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2", "4"]
        subprocess.run(["mount", "-o", "remount,size=64m", str(tmp_path)], check=True)
        assert train(6, out).losses == {s: saved[2].losses[s] for s in (4, 5)}


@pytest.mark.parametrize("writer", ["metrics.jsonl", "tensorboard"])
def test_a_metrics_write_on_a_full_disk_is_one_line_and_keeps_the_checkpoints(saved, tmp_path, monkeypatch, writer):
    """metrics.jsonl's write fails for want of room, and so does its close (the buffered lines);
    or tensorboardX's writer thread dies of it (its queue would then block the run forever): one
    line naming the file and the checkpoint that resumes, not a traceback or a hang."""
    import errno

    import tensorboardX.event_file_writer

    from jaxpar.training.run.metrics import MetricsWriters
    out = tmp_path / "run"
    shutil.copytree(saved[0], out)
    before = files(out / "checkpoints")

    def full(self, *args):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / writer))
    if writer == "metrics.jsonl":
        monkeypatch.setattr(MetricsWriters, "write", full)
        monkeypatch.setattr(MetricsWriters, "close", full)
    else:
        monkeypatch.setattr(tensorboardX.event_file_writer.EventsWriter, "write_event", full)
    with pytest.raises(UserError) as error:
        train(6, out, **{"train.log_every": 1})
    assert str(error.value) == (f"cannot write '{out}/{writer}' (No space left on device); the last good "
                                f"checkpoint is {out}/checkpoints/4; free space on that disk or make the folder "
                                "writable, then run the same command to resume")
    assert files(out / "checkpoints") == before


@pytest.mark.parametrize("linked", [False, True], ids=["folder", "linked-folder"])
def test_fresh_removes_only_the_checkpoints_jaxpar_saved_and_says_what_it_kept(saved, tmp_path, capsys, linked):
    """--fresh over a run to step 4 whose checkpoints/ also holds a user's file and folder (and is,
    when `linked`, a symbolic link to a folder elsewhere): the new run's checkpoints are written
    there, the old run's are gone, the user's are byte for byte as they were."""
    out, where = tmp_path / "run", tmp_path / "run" / "checkpoints"
    shutil.copytree(saved[0], out)
    if linked:
        where = tmp_path / "elsewhere"
        (out / "checkpoints").rename(where)
        (out / "checkpoints").symlink_to(where, target_is_directory=True)
    (where / "model_epoch9.pt").write_bytes(b"a user's weights")
    (where / "old").mkdir()
    (where / "old" / "notes.txt").write_text("a user's notes")
    users = files(where / "old") | {where / "model_epoch9.pt": b"a user's weights"}
    result = run(tiny_config(**{**TINY, "train.steps": 2, "train.seed": 7}), out, ONE, progress=False, fresh=True)
    assert result.info["resumed_from"] == 0
    assert sorted(p.name for p in where.iterdir()) == ["2", "model_epoch9.pt", "old"]  # 4 was the old run's
    assert (out / "checkpoints").is_symlink() == linked
    assert {p: p.read_bytes() for p in users} == users
    err = capsys.readouterr().err
    assert f"--fresh removed only the checkpoints jaxpar saved in '{out / 'checkpoints'}' and kept what it did " \
           "not write: model_epoch9.pt, old/" in err
    meta = json.loads((where / "2" / "meta" / "metadata").read_text())
    assert meta["rng"] == {"seed": 7, "step": 2}  # the new run's, not the old one's
    resumed = train(4, out, **{"train.seed": 7})
    assert resumed.info["resumed_from"] == 2


def test_a_checkpoint_fresh_cannot_remove_is_one_line(tmp_path, monkeypatch):
    """A removal that fails is never ignored: a step left behind would keep the new run's save of
    that step from being written. A user's folder named like a step, but not orbax's, is kept."""
    step = tmp_path / "4"
    step.mkdir()
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    (tmp_path / "6").mkdir()  # no orbax metadata in it: not jaxpar's
    monkeypatch.setattr(shutil, "rmtree", lambda path, *a, **k: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied", str(path))))
    with pytest.raises(UserError, match=rf"cannot remove '{step}' \(Permission denied\); make its folder "):
        Checkpoints(tmp_path).remove_own()
    monkeypatch.undo()
    assert Checkpoints(tmp_path).remove_own() == ["6/"] and not step.exists()


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("a user's file")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / LOCK_NAME).symlink_to(target)
    with pytest.raises(UserError, match="is a symbolic link, where jaxpar keeps its lock file"), RunLock(tmp_path / "out"):
        pass
    assert target.read_text() == "a user's file" and (tmp_path / "out" / LOCK_NAME).is_symlink()


def test_a_disk_too_full_for_the_lock_files_name_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """The lock file is made on a full disk, but its holder's name cannot be written in it: one
    line, and the file and the folders the lock made are gone (a full tmpfs does exactly this)."""
    import errno

    from jaxpar.core import out_lock

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(out_lock.os, "write", full)
    refused = pytest.raises(UserError, match=r"--out '.*/new/run' cannot be written \(No space left on device\)")
    with refused, RunLock(tmp_path / "new" / "run"):
        pass
    assert not (tmp_path / "new").exists()

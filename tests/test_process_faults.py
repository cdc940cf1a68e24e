"""Faults of a whole process, met in one line: an XLA option that crashes XLA's compiler, and
SIGTERM or SIGINT to a command whose child processes (bench's jaxpar.train, prepare's tokenizing
workers) must stop with it, and be waited for, before it ends.

One jaxpar.train in a fresh process (the crash must end a child, not the test). The signals are
sent to this process while the command runs in it, by a stand-in child or a stand-in step; a
handler of the test's own catches them where the command installs none, so that a command
without its handlers fails its test instead of ending the test run.
"""

import multiprocessing
import os
import signal
import subprocess
import sys

import pytest

from jaxpar.bench import main as bench_main
from jaxpar.core import xla_options
from jaxpar.core.out_lock import LOCK_NAME
from jaxpar.data import prepare as prep
from jaxpar.planning import bench
from jaxpar.prepare import main as prepare_main

CRASHING = "xla_cpu_parallel_codegen_split_count=-7"  # parsed by XLA, then std::length_error: an abort


def test_an_xla_option_that_crashes_the_compiler_is_one_line(tmp_path):
    """The options' check compiles its one-line function in a child process, so XLA's abort ends
    the child and the run says so in one line, exit 2, having written nothing (before: the
    run's own process aborted, exit 134). The control: the same option with a value in its range
    passes the check."""
    out = tmp_path / "run"
    # cwd: not the checkout's folder, so that the child imports the jaxpar that this process does.
    done = subprocess.run([sys.executable, "-m", "jaxpar.train", "--config", "tiny", "--steps", "2",
                           "--out", str(out), f"--train.xla_options={CRASHING}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
    assert done.stderr.startswith("jaxpar.train: error: train.xla_options: XLA crashed (SIGABRT) compiling "
                                  "a one-line function with them"), done.stderr
    assert "drop the option that crashed it, or give it a value in its range" in done.stderr
    assert not out.exists()
    xla_options.check((("xla_cpu_parallel_codegen_split_count", 2),))  # the control


@pytest.fixture
def caught():
    """The signals this process got that no handler of the command's took."""
    got = []
    previous = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in (signal.SIGTERM, signal.SIGINT)}
    yield got
    for s, handler in previous.items():
        signal.signal(s, handler)


# A stand-in for jaxpar.train in bench's child: it signals the bench (the user's kill while the run
# compiles), then notes the signals passed on to it, and ends late, as a run does at a safe point.
STAND_IN_TRAIN = """
import os, signal, sys, time
signum, note = int(sys.argv[1]), sys.argv[2]
got = []
signal.signal(signum, lambda s, frame: got.append(s))
os.kill(os.getppid(), signum)
deadline = time.monotonic() + 10
while not got and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.3)
open(note, "w").write(f"got {len(got)}")
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_bench_is_passed_on_to_its_run_which_it_waits_for(tmp_path, monkeypatch, capsys, caught,
                                                                     signum):
    """A signal while a layout's jaxpar.train runs reaches that run once (its first: stop at its
    next safe point), the bench waits for it to end, then stops: 128 + the signal's number, one
    line, no row kept of that layout, no bench.md, and the lock released (before: SIGTERM ended
    the bench alone, its run left running, orphaned and holding the layout's lock)."""
    note = tmp_path / "note"
    monkeypatch.setattr(bench, "train_argv", lambda layout, config, run_dir: [
        sys.executable, "-c", STAND_IN_TRAIN, str(int(signum)), str(note)], raising=False)
    out = tmp_path / "bench"
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--config", "tiny", "--layouts", "dp=1", "--steps", "1", "--out", str(out)])
    assert exit_info.value.code == 128 + signum and not caught
    assert note.read_text() == "got 1"  # passed on once, and waited for: the note is written late
    err = capsys.readouterr().err
    name = signal.Signals(signum).name
    assert f"jaxpar.bench: {name}: passed on to the running jaxpar.train" in err, err
    assert err.strip().splitlines()[-1].startswith(f"jaxpar.bench: stopped by {name} during layout dp=1"), err
    assert not (out / "bench.md").exists() and not (out / "dp1" / bench.RECORD).exists()
    assert not (out / LOCK_NAME).exists()


def test_sigterm_to_prepare_stops_its_workers_and_removes_its_partial_files(tmp_path, monkeypatch, capsys, caught):
    """SIGTERM once the two tokenizing workers have sent their first pieces: the workers are
    stopped and waited for, the partial files removed, and prepare ends in one line, exit 143
    (before: SIGTERM's default ended prepare alone, its workers orphaned for some 20 s and its
    .partial files left)."""
    text = tmp_path / "one.txt"
    text.write_text("ROMEO: But soft, what light through yonder window breaks?\n" * 40_000)  # 2.3 MB: 2 pieces
    out, seen = tmp_path / "out", {}
    add = prep.SplitWriter.add

    def add_then_sigterm(writer, ids):
        add(writer, ids)
        if not seen:
            seen["workers"] = multiprocessing.active_children()
            seen["partial"] = sorted(path.name for path in out.glob("*.partial"))
            os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(prep.SplitWriter, "add", add_then_sigterm)
    with pytest.raises(SystemExit) as exit_info:
        prepare_main([str(text), "--tokenizer", "bytes", "--workers", "2", "--out", str(out)])
    assert exit_info.value.code == 143 and not caught
    assert len(seen["workers"]) == 2 and seen["partial"] == ["train.bin.partial", "val.bin.partial"]
    assert all(worker.exitcode is not None for worker in seen["workers"])  # stopped, and waited for
    assert capsys.readouterr().err.strip() == f"jaxpar.prepare: interrupted by SIGTERM; nothing new written in {out}"
    assert not out.exists()

"""jaxpar.plot: loss curves from run directories, and a one-line error for a directory without them."""

import json

import pytest

from jaxpar.plot import main as plot_main
from jaxpar.training.run import loss_plots as plot


def make_run(run_dir, losses, val_losses, mesh=None):
    """A run directory as jaxpar.train writes it, with only what plotting reads."""
    run_dir.mkdir(parents=True)
    lines = [{"step": s, "loss": v} for s, v in enumerate(losses)]
    lines += [{"step": s, "val_loss": v} for s, v in val_losses.items()]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if mesh:
        (run_dir / "run.json").write_text(json.dumps({"mesh": mesh}))
    return run_dir


def test_cli_overlays_runs(tmp_path, capsys):
    a = make_run(tmp_path / "a", [4.0, 3.5, 3.2], {0: 4.1, 3: 3.3}, {"dp": 2, "tp": 2, "pp": 1})
    b = make_run(tmp_path / "b", [4.0, 3.6, 3.1], {})
    out = tmp_path / "both.png"
    plot_main([str(a), str(b), "--out", str(out)])
    assert out.read_bytes().startswith(b"\x89PNG")
    assert str(out) in capsys.readouterr().out
    assert plot.run_label(a) == "a (dp=2,tp=2)" and plot.run_label(b) == "b"


def test_cli_rejects_a_dir_without_metrics(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        plot_main([str(tmp_path / "nope")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxpar.plot: error: ") and "has no metrics.jsonl" in err
    assert len(err.splitlines()) == 1

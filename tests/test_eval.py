"""`jaxpar.eval`: a checkpoint's loss over every non-overlapping block of the val split.

The reference is computed here independently: the model's forward (nnx.merge of the checkpoint's
params) on all blocks at once, then each token's cross-entropy in float64 numpy, averaged.
Tolerance: eval's loss within rtol 1e-5 of it, on one device and on dp=2, with a number of rows
per pass that divides the blocks and ones that do not (the last pass padded); a --rows past the
blocks is capped to them. --samples is checked before any work, and a failure to write it comes
after the scores, in one line.
"""

import errno
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import tiny_config
from helpers import read_only, save_random_gpt2

import jaxpar.eval as eval_command
import jaxpar.inference.evaluate as evaluate_command
from jaxpar.data.loader import load_dataset, read_text
from jaxpar.data.prepare import prepare
from jaxpar.eval import main
from jaxpar.inference import sample
from jaxpar.inference.evaluate import evaluate
from jaxpar.models.transformer import abstract_model

RTOL = 1e-5
BLOCK = 32  # configs/tiny.toml
STEP = 7  # the step the checkpoint says it holds


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """30 KB of Tiny Shakespeare prepared as bytes (its val split: 3,001 tokens, 93 blocks), and
    a checkpoint of a tiny model with random params for it."""
    root = tmp_path_factory.mktemp("eval")
    text = root / "text.txt"
    text.write_text(read_text("")[:30_000], encoding="utf-8")
    prepare([str(text)], root / "bytes", "bytes")
    cfg = tiny_config(**{"data.path": str(root / "bytes")})
    tokenizer = load_dataset(cfg.data, BLOCK).tokenizer
    save_random_gpt2(root / "run", cfg, tokenizer, STEP, scale=0.1)
    val = load_dataset(cfg.data, BLOCK).val
    assert len(val) == 3_001 and (len(val) - 1) // BLOCK == 93
    return SimpleNamespace(run=root / "run", data=root / "bytes", text=text, val=val)


@pytest.fixture(scope="module")
def direct(saved):
    """(loss, blocks, each token's loss): every block's per-token cross-entropy, from one forward
    over all of them."""
    model = sample.load(saved.run)
    tokens = np.asarray(saved.val).astype(np.int64)
    blocks = (len(tokens) - 1) // BLOCK
    inputs = tokens[:blocks * BLOCK].reshape(blocks, BLOCK)
    targets = tokens[1:blocks * BLOCK + 1].reshape(blocks, BLOCK)
    net, _, _ = abstract_model(model.cfg, model.vocab_size)
    with jax.set_mesh(model.mesh):
        logits = jax.jit(net)(model.params, inputs.astype(np.int32))
    logits = np.asarray(logits, np.float64)[..., :model.vocab_size]
    top = logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return float((log_z - picked).mean()), blocks, log_z - picked


@pytest.mark.parametrize("spec, rows", [
    ("dp=1", 16),  # 93 blocks: 5 passes of 16, then 13 rows and 3 of padding
    ("dp=1", 31),  # 3 passes, none padded
    ("dp=2", 5),  # rounded up to 6 rows, 3 per replica: 15 passes, then 3 rows and 3 of padding
    ("dp=2", 128),  # one pass, mostly padding (and so no timed pass)
])
def test_the_loss_is_the_mean_over_every_block(saved, direct, spec, rows):
    model = sample.load(saved.run, spec)
    assert model.mesh.shape["data"] == int(spec.split("=")[1]) and model.step == STEP
    result = evaluate(model, saved.val, rows)
    loss, blocks, _ = direct
    assert result["loss"] == pytest.approx(loss, rel=RTOL)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-12)
    assert (result["blocks"], result["tokens"], result["split"]) == (blocks, blocks * BLOCK, "val")
    dp = model.mesh.shape["data"]
    if -(-rows // dp) * dp >= blocks:  # one pass, which compiles: none is timed
        assert result["tokens_per_s"] is None
    else:
        assert result["tokens_per_s"] > 0


def test_the_loss_is_of_the_split_given(saved, direct):
    """A control: the first half of the split has its own loss, which eval finds too."""
    model = sample.load(saved.run)
    loss, _, per_token = direct
    half = evaluate(model, saved.val[:47 * BLOCK + 1], 16)
    assert half["blocks"] == 47
    assert half["loss"] == pytest.approx(per_token[:47].mean(), rel=RTOL)
    assert abs(half["loss"] - loss) > 10 * RTOL * loss


def one_json_line(capsys) -> dict:
    out, _ = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 1 and out.endswith("\n"), out
    return json.loads(lines[0])


@pytest.mark.parametrize("argv", [[], ["--mesh", "dp=2", "--rows", "5"]])
def test_cli_prints_one_json_line(saved, direct, capsys, argv):
    main(["--ckpt", str(saved.run), "--data", str(saved.data), *argv])
    result = one_json_line(capsys)
    loss, blocks, _ = direct
    assert {"step", "loss", "perplexity", "tokens", "blocks", "tokens_per_s"} <= set(result)
    assert result["step"] == STEP
    assert result["loss"] == pytest.approx(loss, rel=RTOL)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-12)
    assert result["blocks"] == blocks and result["tokens"] == blocks * BLOCK
    assert result["tokens_per_s"] > 0


def test_cli_reads_the_runs_own_data_by_default(saved, direct, capsys):
    main(["--ckpt", str(saved.run)])
    assert one_json_line(capsys)["loss"] == pytest.approx(direct[0], rel=RTOL)


def fails_with(capsys, argv, expected: str):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("jaxpar.eval: error: ") and expected in err, err


@pytest.fixture(scope="module")
def char_data(saved, tmp_path_factory):
    out = tmp_path_factory.mktemp("char") / "data"
    prepare([str(saved.text)], out, "char")
    return out


@pytest.mark.parametrize("other", ["text file", "char directory"])
def test_data_with_another_tokenizer_is_one_line(saved, char_data, capsys, other):
    data = saved.text if other == "text file" else char_data
    before = sorted(p for p in saved.run.parent.rglob("*"))
    vocab = len(set(saved.text.read_text()))
    fails_with(capsys, ["--ckpt", str(saved.run), "--data", str(data)],
               f"the tokenizer of the checkpoint in '{saved.run / 'checkpoints'}' (bytes, 257 ids) is not "
               f"the data's (char, {vocab} ids); pass --data prepared with the model's tokenizer")
    assert sorted(p for p in saved.run.parent.rglob("*")) == before


def test_bad_arguments_are_one_line(saved, tmp_path, capsys):
    fails_with(capsys, ["--ckpt", str(saved.run), "--rows", "0"], "--rows must be at least 1")
    fails_with(capsys, ["--ckpt", str(tmp_path)], f"no checkpoints in '{tmp_path}'")
    fails_with(capsys, ["--ckpt", str(saved.run), "--data", str(tmp_path / "none")],
               f"data file '{tmp_path / 'none'}' not found")
    assert not any(tmp_path.iterdir())


def test_an_export_evaluates_on_the_data_it_was_trained_on(saved, char_data, tmp_path, capsys):
    """The export's tokenizer.json is the bytes tokenizer under another name: `eval --hf` takes
    the run's data, at the checkpoint's loss (rtol 1e-5); char data is still refused."""
    from jaxpar.export import main as export_main
    export_main(["--ckpt", str(saved.run), "--out", str(tmp_path / "hf")])
    capsys.readouterr()
    main(["--ckpt", str(saved.run), "--data", str(saved.data)])
    from_ckpt = json.loads(capsys.readouterr().out)
    main(["--hf", str(tmp_path / "hf"), "--data", str(saved.data), "--block-size", str(BLOCK)])
    from_hf = json.loads(capsys.readouterr().out)
    np.testing.assert_allclose(from_hf["loss"], from_ckpt["loss"], rtol=RTOL)
    fails_with(capsys, ["--hf", str(tmp_path / "hf"), "--data", str(char_data)], "is not the data's (char")


def test_tokenizers_compare_by_what_they_map():
    from tokenizers import Tokenizer

    from jaxpar.data import vocab
    from jaxpar.data.tokenizer import ByteTokenizer, CharTokenizer, HFTokenizer, same_mapping
    as_json = lambda text: HFTokenizer(Tokenizer.from_str(text), "x/tokenizer.json")  # noqa: E731
    assert same_mapping(ByteTokenizer(), as_json(vocab.byte_tokenizer_json(256)))
    assert same_mapping(CharTokenizer("abc"), as_json(vocab.char_tokenizer_json("abc")))
    assert not same_mapping(CharTokenizer("abc"), as_json(vocab.char_tokenizer_json("abd")))  # control
    assert not same_mapping(ByteTokenizer(), CharTokenizer("abc"))


def test_rows_past_the_blocks_are_capped_and_said(saved, direct, capsys, monkeypatch):
    """--rows 100,000,000 on 93 blocks: passes of 93 rows (not padded to 10^8, which took all the
    host's memory), the loss as ever, and one note on stderr."""
    over_rows = evaluate_command.over_rows

    def passes(fn, batch_at, total, mesh, rows, *args, **kwargs):
        assert rows <= total, f"passes of {rows:,} rows for {total} blocks"
        return over_rows(fn, batch_at, total, mesh, rows, *args, **kwargs)
    monkeypatch.setattr(evaluate_command, "over_rows", passes)
    main(["--ckpt", str(saved.run), "--data", str(saved.data), "--rows", "100000000"])
    out, err = capsys.readouterr()
    assert json.loads(out)["loss"] == pytest.approx(direct[0], rel=RTOL)
    assert ("jaxpar.eval: note: --rows 100,000,000 is more than the 93 blocks in the val split; "
            "93 rows per pass\n") in err
    assert evaluate_command.rows_for(16, 93, "blocks", say=True) == 16 and "note" not in capsys.readouterr().err  # control


# ---- --samples PATH: checked before any work; the scores printed whatever happens to the file ----

TASKS_DIR = Path(__file__).parent / "fixtures" / "tasks"


def tasks_argv(saved, samples) -> list[str]:
    return ["--ckpt", str(saved.run), "--tasks", "piqa", "--tasks-dir", str(TASKS_DIR), "--limit", "2",
            "--samples", str(samples)]


@pytest.fixture
def no_load(monkeypatch):
    """Loading the model fails the test: a refusal comes before it."""
    monkeypatch.setattr(eval_command, "load_source",
                        lambda *a, **k: pytest.fail("the model was loaded before the refusal"))


@pytest.mark.parametrize("where, expected", [
    ("none/samples.jsonl", "the folder '{tmp}/none' does not exist"),
    (".", "is a folder; pass a file's path"),
    ("notes.jsonl", "holds a file jaxpar did not write, which it would overwrite"),
], ids=["missing-folder", "folder", "a user's file"])
def test_a_samples_path_that_cannot_be_a_file_is_refused_before_the_model_loads(saved, tmp_path, capsys,
                                                                                no_load, where, expected):
    notes = tmp_path / "notes.jsonl"
    if where == notes.name:
        notes.write_text('{"mine": 1}\n')
    fails_with(capsys, tasks_argv(saved, tmp_path / where), expected.format(tmp=tmp_path))
    assert list(tmp_path.iterdir()) == ([notes] if where == notes.name else [])
    assert where != notes.name or notes.read_text() == '{"mine": 1}\n'



def test_a_samples_path_on_a_read_only_disk_is_refused_before_the_model_loads(saved, tmp_path, capsys, no_load):
    (tmp_path / "ro").mkdir()
    with read_only(tmp_path / "ro"):
        fails_with(capsys, tasks_argv(saved, tmp_path / "ro" / "samples.jsonl"),
                   f"--samples '{tmp_path}/ro/samples.jsonl' cannot be written: '{tmp_path}/ro' takes no new "
                   "file (Read-only file system)")
    assert list((tmp_path / "ro").iterdir()) == []


def test_samples_on_a_full_disk_are_one_line_after_the_scores(saved, tmp_path, capsys, monkeypatch):
    """Writing --samples fails (ENOSPC): the scores are printed all the same, then one line, exit 2;
    the file that was there is as it was, and no partial file is left. A control: with room, the
    same command replaces the file."""
    samples = tmp_path / "samples.jsonl"
    earlier = '{"task": "piqa", "item": 0, "gold": 0, "loglikelihoods": [-1.0, -2.0]}\n'  # an earlier --samples
    samples.write_text(earlier)
    real_open = open

    class FullDisk:
        def __init__(self, file):
            self.file = file

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, *args):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        writelines = write

    def full_disk_open(file, mode="r", *args, **kwargs):
        opened = real_open(file, mode, *args, **kwargs)
        return FullDisk(opened) if set(mode) & set("wxa") else opened
    with monkeypatch.context() as patch:
        patch.setattr(evaluate_command, "open", full_disk_open, raising=False)
        with pytest.raises(SystemExit) as exit_info:
            main(tasks_argv(saved, samples))
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert [json.loads(line)["task"] for line in out.splitlines()] == ["piqa"]
    assert err.strip().splitlines()[-1] == (
        f"jaxpar.eval: error: cannot write --samples '{samples}' (No space left on device); the scores above "
        "are complete: free some space, or pass another --samples, to keep the log-likelihoods")
    assert [p.name for p in tmp_path.iterdir()] == ["samples.jsonl"] and samples.read_text() == earlier
    main(tasks_argv(saved, samples))
    assert len(samples.read_text().splitlines()) == 2 and [p.name for p in tmp_path.iterdir()] == ["samples.jsonl"]

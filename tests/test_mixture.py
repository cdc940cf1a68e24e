"""Weighted mixtures of prepared sources (--data.mix, jaxpar.data.mixture).

Exact: each block of data.mix_block rows holds each source's share; the global batch is the same
on every mesh and for every process's part of it. Tolerance: a run stopped and resumed on another
mesh gives the uninterrupted run's losses within rtol 1e-5 (test_checkpoint's). A bad mixture is
one line, exit 2, nothing written.
"""

import json
import math

import jax
import numpy as np
import pytest
from conftest import mesh_overrides, tiny_config
from helpers import LOSS_RTOL, fails_with

from jaxpar.core.data_config import Source
from jaxpar.core.errors import UserError
from jaxpar.data.loader import BatchLoader, Dataset, load_dataset, read_text
from jaxpar.data.mixture import Mixture
from jaxpar.data.tokenizer import ByteTokenizer
from jaxpar.parallel.mesh import build_mesh
from jaxpar.prepare import main as prepare_main
from jaxpar.train import run

DOCS = [d for d in read_text("")[:120_000].split("\n\n") if d.strip()]
WEIGHTS = (0.6, 0.3, 0.1)
STEPS, STOP_AT = 6, 3


def marked(block: int = 1000) -> Dataset:
    """Three sources whose every token is the source's index: a row shows where it came from."""
    parts = tuple(Dataset(None, np.full(5000, i, np.uint16), np.full(500, i, np.uint16))
                  for i in range(3))
    sources = tuple(Source(name, "", w) for name, w in zip("abc", WEIGHTS))
    return Dataset(ByteTokenizer(), None, None, Mixture(sources, block), parts)


def global_batches(dataset, spec: str, steps, batch_size: int = 12) -> np.ndarray:
    cfg = tiny_config(**mesh_overrides(spec))
    mesh = build_mesh(cfg, jax.devices()[:math.prod(cfg.mesh.__dict__.values())])
    loader = BatchLoader(dataset, "train", 1337, batch_size, 2, 16, mesh)
    return np.stack([np.asarray(loader(s)[0]) for s in steps])


def test_each_block_of_rows_holds_each_sources_exact_share():
    rows = global_batches(marked(), "dp=1", range(200))[..., 0].reshape(-1)  # 200 steps x 12 rows
    for block in range(len(rows) // 1000):
        counts = np.bincount(rows[block * 1000:(block + 1) * 1000], minlength=3)
        np.testing.assert_array_equal(counts, [600, 300, 100])
    # Control: the rows are shuffled within a block, not laid out source after source.
    assert len(np.flatnonzero(np.diff(rows[:1000]))) > 100
    # Largest remainders: 1/3 each over 10 rows is 4/3/3, the tie to the first source.
    thirds = Mixture(tuple(Source(n, "", 1.0) for n in "abc"), 10)
    np.testing.assert_array_equal(thirds.counts(), [4, 3, 3])


def test_the_batches_are_the_same_on_every_mesh_and_for_each_processs_rows():
    dataset = marked(block=7)  # blocks that straddle steps
    reference = global_batches(dataset, "dp=1", range(5), 16)
    for spec in ("dp=2,tp=2", "dp=4", "dp=2,pp=2"):
        np.testing.assert_array_equal(global_batches(dataset, spec, range(5), 16), reference, err_msg=spec)
    # Two processes of a dp=2 mesh each build their half of the rows: together, the whole.
    mesh = build_mesh(tiny_config(**mesh_overrides("dp=2")), jax.devices()[:2])
    loader = BatchLoader(dataset, "train", 1337, 16, 2, 16, mesh)
    halves = []
    for start, stop in ((0, 4), (4, 8)):
        loader.row_start, loader.row_stop = start, stop
        halves.append(loader.local_rows(4)[..., :-1])
    np.testing.assert_array_equal(np.concatenate(halves, axis=1), reference[4])


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three prepared sources (bytes tokenizer) from thirds of the documents, and a bpe one."""
    root = tmp_path_factory.mktemp("mix")
    third = len(DOCS) // 3
    for i, name in enumerate("abc"):
        corpus = root / f"{name}.jsonl"
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[i * third:(i + 1) * third]))
        prepare_main([str(corpus), "--tokenizer", "bytes", "--out", str(root / name)])
    prepare_main([str(root / "a.jsonl"), "--tokenizer", "bpe", "--vocab-size", "300", "--out", str(root / "bpe")])
    return root


def mix(root, weights=WEIGHTS, names="abc") -> str:
    return ",".join(f"{n}={root / n}:{w}" for n, w in zip(names, weights))


def mixed_run(root, spec: str, out=None, **overrides):
    cfg = tiny_config(**mesh_overrides(spec), **{"train.steps": STEPS, "data.mix": mix(root),
                                                 "train.eval_every": STEPS, **overrides})
    return run(cfg, out, jax.devices()[:math.prod(cfg.mesh.__dict__.values())], progress=False)


def test_a_run_stopped_and_resumed_on_another_mesh_matches_the_uninterrupted_run(sources, tmp_path):
    whole = mixed_run(sources, "dp=1")
    out = tmp_path / "run"
    cfg = tiny_config(**{"train.steps": STEPS, "data.mix": mix(sources), "train.eval_every": STEPS})
    run(cfg, out, jax.devices()[:1], progress=False, stop_at=STOP_AT)
    resumed = mixed_run(sources, "dp=2,tp=2", out)
    assert resumed.info["resumed_from"] == STOP_AT and "mix_changed" not in resumed.info
    np.testing.assert_allclose([resumed.losses[s] for s in range(STOP_AT, STEPS)],
                               [whole.losses[s] for s in range(STOP_AT, STEPS)], rtol=LOSS_RTOL)
    # The val loss of the mixture and of each source, in metrics.jsonl beside each other.
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert set(last) == {"step", "val_loss", "val_loss/a", "val_loss/b", "val_loss/c"}
    assert last["val_loss"] == pytest.approx(whole.val_losses[STEPS], rel=LOSS_RTOL)
    assert len({last[f"val_loss/{n}"] for n in "abc"}) == 3  # three splits, three losses


def test_new_weights_on_resume_are_recorded_and_a_moved_source_is_refused(sources, tmp_path):
    out = tmp_path / "run"
    mixed_run(sources, "dp=1", out, **{"train.steps": STOP_AT, "train.eval_every": 0})
    before = (out / "run.json").read_text()
    for changed, words in ((mix(sources, names="bac"), "reorders its sources"),
                           (mix(sources, WEIGHTS[:2], "ab"), "drops or changes source 'c'")):
        with pytest.raises(UserError, match=words):
            mixed_run(sources, "dp=1", out, **{"data.mix": changed})
        assert (out / "run.json").read_text() == before  # nothing written
    new = mix(sources, (0.2, 0.3, 0.5))
    resumed = mixed_run(sources, "dp=1", out, **{"data.mix": new, "train.eval_every": 0})
    assert resumed.info["mix_changed"] == {"step": STOP_AT, "before": mix(sources), "after": new}
    assert json.loads((out / "run.json").read_text())["mix_changed"]["after"] == new


@pytest.mark.parametrize("weights, expected", [((0.5, 0, 0.5), "weight 0; each weight must be positive"),
                                               ((0.5, -1, 0.5), "weight -1; each weight must be positive")])
def test_a_zero_or_negative_weight_is_one_line(sources, capsys, tmp_path, weights, expected):
    fails_with(capsys, tmp_path, ["--config", "tiny", f"--data.mix={mix(sources, weights)}"], expected)


def test_sources_with_different_tokenizers_are_one_line(sources, capsys, tmp_path):
    fails_with(capsys, tmp_path, ["--config", "tiny", f"--data.mix=a={sources / 'a'}:1,b={sources / 'bpe'}:1"],
               "'a' (bytes, 257 tokens) and 'b' (bpe, 300 tokens) use different tokenizers")


def test_a_toml_table_names_the_same_mixture(sources, tmp_path):
    toml = tmp_path / "mix.toml"
    toml.write_text(f'[data.mix]\na = {{path = "{sources / "a"}", weight = 0.6}}\nb = "{sources / "b"}:0.4"\n')
    from jaxpar.core.config import load_config
    cfg = load_config(str(toml), {})
    assert cfg.data.mix == f"a={sources / 'a'}:0.6,b={sources / 'b'}:0.4"
    assert load_dataset(cfg.data, 32).mixture.names == ["a", "b"]

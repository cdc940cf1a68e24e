"""Training on `jaxpar.prepare` output: the first 200 KB of Tiny Shakespeare as a 512-token BPE
(and as bytes), memory-mapped. Every layout and process count trains the same model on it, the
batches do not depend on the mesh, the checkpoint carries the tokenizer to sampling, and a
mismatch between data, tokenizer and model is one line that writes nothing.

Tolerances, as tests/test_equivalence.py: per-step losses within rtol 1e-5 of the one-device
run; each final param within 1e-5 of that tensor's largest magnitude (the 2-process run's params
are read back from its checkpoint). Batches and tokenizers must be equal.
"""

import dataclasses
import json
import math
import shutil
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import mesh_overrides, tiny_config
from helpers import (
    LOSS_RTOL,
    PARAM_TOL,
    STEPS,
    assert_same_training,
    launch,
    logged_losses,
    losses,
    param_errors,
    save_random_gpt2,
    train,
)
from helpers import fails_with as train_fails_with

from jaxpar.core.errors import UserError
from jaxpar.data.loader import BatchLoader, Dataset, batch_offsets, load_dataset, model_vocab, read_text
from jaxpar.data.tokenizer import EOT, ByteTokenizer
from jaxpar.inference import sample
from jaxpar.models.decode import empty_cache, forward
from jaxpar.models.transformer import Transformer, abstract_model
from jaxpar.nn.layers import padded_vocab
from jaxpar.parallel.mesh import build_mesh
from jaxpar.prepare import main as prepare_main
from jaxpar.sample import main as sample_main
from jaxpar.train import main as train_main
from jaxpar.train import run
from jaxpar.training.checkpoints.checkpoint import CHECKPOINTS, Checkpoints, make_meta
from jaxpar.training.step.execution import plan_execution

TEXT_CHARS = 200_000  # of the built-in Tiny Shakespeare
BPE_VOCAB = 512
BLOCK = 32  # configs/tiny.toml


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The start of the built-in corpus, prepared as a 512-token BPE and as bytes."""
    root = tmp_path_factory.mktemp("prepared")
    text = root / "shakespeare.txt"
    text.write_text(read_text("")[:TEXT_CHARS], encoding="utf-8")
    specs = {"bpe": ["--tokenizer", "bpe", "--vocab-size", str(BPE_VOCAB)],
             "bytes": ["--tokenizer", "bytes"]}
    for name, args in specs.items():
        prepare_main([str(text), *args, "--out", str(root / name)])
    meta = {name: json.loads((root / name / "meta.json").read_text()) for name in specs}
    assert meta["bpe"]["vocab_size"] == BPE_VOCAB and meta["bytes"]["vocab_size"] == 257
    return SimpleNamespace(text=text, bpe=root / "bpe", bytes=root / "bytes", meta=meta)


def on_bpe(prepared, **overrides) -> dict:
    """Overrides that train on the BPE data; no evals (one compile fewer per layout)."""
    return {"data.path": str(prepared.bpe), "train.eval_every": 0, **overrides}


def files_in(directory) -> dict:
    return {p: p.read_bytes() for p in directory.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def one_device(prepared, tmp_path_factory):
    """The reference: 10 steps on one device, with a run directory (checkpoint at step 10)."""
    out = tmp_path_factory.mktemp("one") / "run"
    cfg = tiny_config(**{"train.steps": STEPS, **on_bpe(prepared)})
    return SimpleNamespace(out=out, result=run(cfg, out, jax.devices()[:1], progress=False))


# ---- the same training on every layout ----

def test_the_model_predicts_over_the_bpe_vocabulary(one_device):
    """A fresh model's first loss is about ln(512): the softmax spans the data's 512 tokens."""
    result = one_device.result
    assert result.info["vocab_size"] == BPE_VOCAB
    assert result.params["wte"].shape == (padded_vocab(BPE_VOCAB), 32)
    assert abs(result.losses[0] - math.log(BPE_VOCAB)) < 0.02
    assert result.losses[STEPS - 1] < result.losses[0] - 0.2


# pp=2 is slow: the pipeline's equivalence is proven on characters (test_pipeline), and reading
# prepared data is the same for every mesh (dp=2,tp=2 here, and the batch test below).
@pytest.mark.parametrize("spec", ["dp=2,tp=2", pytest.param("pp=2", marks=pytest.mark.slow)])
def test_prepared_data_trains_the_same_on_any_mesh(prepared, one_device, spec):
    assert_same_training(train(spec, **on_bpe(prepared)), one_device.result)


@pytest.mark.slow  # two processes are proven on characters (test_multiprocess); the rows each
# process reads are the batch test's below
def test_two_processes_train_what_one_device_does(prepared, one_device, tmp_path):
    """2 processes x 2 devices (dp=2,tp=2) through scripts/tools/launch_local.sh, on the memory-mapped
    BPE data: each process builds only its own rows of every batch."""
    out = tmp_path / "run"
    launch(out, "--mesh", "dp=2,tp=2", "--steps", str(STEPS), f"--data.path={prepared.bpe}",
           "--train.eval_every=0")
    logged = logged_losses(out)
    np.testing.assert_allclose([logged[s] for s in range(STEPS)], losses(one_device.result),
                               rtol=LOSS_RTOL)
    info = json.loads((out / "run.json").read_text())
    assert info["devices"]["processes"] == 2 and info["vocab_size"] == BPE_VOCAB
    model = sample.load(out)  # the final params, restored onto one device
    assert model.step == STEPS
    assert model.tokenizer.to_meta() == prepared.meta["bpe"]["tokenizer_meta"]
    worst = {k: e for k, e in param_errors(model, one_device.result).items() if e > PARAM_TOL}
    assert not worst, f"params differ beyond {PARAM_TOL} of their max magnitude: {worst}"


# ---- batches: a pure function of (seed, split, step) ----

@pytest.mark.parametrize("split", ["train", "val"])
def test_batches_are_the_same_on_every_mesh_from_a_memmap_or_memory(prepared, split):
    dataset = load_dataset(tiny_config(**on_bpe(prepared)).data, BLOCK)
    mapped = dataset.splits(split)[0]
    assert isinstance(mapped, np.memmap) and mapped.dtype == np.uint16
    in_memory = np.array(mapped)
    seed, batch = 1337, 8
    expected = {}
    for step in (0, 1, 9):
        offsets = batch_offsets(seed, split, step, batch, len(in_memory), BLOCK)
        window = in_memory[offsets[:, None] + np.arange(BLOCK + 1)].astype(np.int32)
        expected[step] = (window[:, :-1], window[:, 1:])
    assert not np.array_equal(expected[0][0], expected[1][0])
    for spec in ["dp=1", "dp=2", "dp=4,tp=2", "pp=2", "dp=2,tp=2,pp=2"]:
        cfg = tiny_config(**mesh_overrides(spec), **on_bpe(prepared))
        mesh = build_mesh(cfg, jax.devices()[:math.prod(cfg.mesh.__dict__.values())])
        microbatches = plan_execution(cfg, mesh).passes
        for tokens in (mapped, in_memory):
            loader = BatchLoader(Dataset(None, tokens, tokens), split, seed, batch, microbatches, BLOCK, mesh)
            for step, (inputs, targets) in expected.items():
                got = loader(step)
                for array, want in zip(got, (inputs, targets)):
                    assert array.shape == (microbatches, batch // microbatches, BLOCK), spec
                    assert array.dtype == np.int32
                    np.testing.assert_array_equal(np.asarray(array).reshape(batch, BLOCK), want,
                                                  err_msg=f"{spec}, step {step}")
    other_seed = BatchLoader(Dataset(None, mapped, mapped), split, seed + 1, batch, 1, BLOCK,
                             build_mesh(tiny_config(), jax.devices()[:1]))(0)
    assert not np.array_equal(np.asarray(other_seed[0])[0], expected[0][0])


# ---- the checkpoint carries the tokenizer ----

def test_the_checkpoint_carries_the_datas_tokenizer(prepared, one_device):
    meta_file = one_device.out / CHECKPOINTS / str(STEPS) / "meta" / "metadata"
    assert json.loads(meta_file.read_text())["tokenizer"] == prepared.meta["bpe"]["tokenizer_meta"]
    model = sample.load(one_device.out)
    assert model.tokenizer.to_meta() == prepared.meta["bpe"]["tokenizer_meta"]
    assert model.tokenizer.vocab_size == model.vocab_size == BPE_VOCAB
    assert model.tokenizer.eot_id == prepared.meta["bpe"]["eot_id"] == 0


def test_sampling_encodes_and_decodes_with_the_bpe(one_device, capsys, monkeypatch):
    model = sample.load(one_device.out)
    greedy = dict(prompt="ROMEO:", max_new_tokens=12, temperature=0)  # the CLI's shapes
    seen = []
    result = sample.generate(model, on_tokens=seen.append, **greedy)
    ids = np.stack(seen, axis=1)
    assert ids.shape == (1, 12) and (ids < BPE_VOCAB).all()
    assert result.texts == ["ROMEO:" + model.tokenizer.decode(ids[0])]
    assert isinstance(result.texts[0], str) and len(result.texts[0]) > len("ROMEO:")
    # The command line streams the same greedy text through the same tokenizer.
    sample_main(["--ckpt", str(one_device.out), "--prompt", "ROMEO:", "--max-new-tokens", "12",
                 "--temperature", "0"])
    assert capsys.readouterr().out == result.texts[0] + "\n"
    # Stopping at the end-of-text token: pretend the token greedy decoding emits 5th is it.
    eot = int(ids[0, 4])
    first = int(np.flatnonzero(ids[0] == eot)[0])
    monkeypatch.setattr(model.tokenizer, "eot_id", eot)
    stopped = sample.generate(model, stop_at_eot=True, **greedy)
    assert stopped.new_tokens == first + 1 < 12  # the sample has ended: no more tokens
    assert stopped.texts == ["ROMEO:" + model.tokenizer.decode(ids[0, :first])]


def test_until_cuts_before_the_first_token():
    assert sample.until(np.array([5, 3, 7, 3]), 3).tolist() == [5]
    assert sample.until(np.array([3, 1]), 3).tolist() == []
    assert sample.until(np.array([1, 2]), 3).tolist() == [1, 2]


def save_checkpoint(out, cfg, params=None, step: int = 0):
    """A checkpoint as training writes one, of `params` (default: random) for cfg's data; the
    optimizer state is left out (sampling and the fit checks read only params and meta)."""
    tokenizer = load_dataset(cfg.data, cfg.model.block_size).tokenizer
    vocab = model_vocab(cfg, tokenizer)
    if params is None:
        _, shapes, _ = abstract_model(cfg, vocab)
        rng = np.random.default_rng(0)
        params = jax.tree.map(lambda s: 0.1 * rng.standard_normal(s.shape, np.float32), shapes)
    checkpoints = Checkpoints(out / CHECKPOINTS)
    checkpoints.save(step, params, {"left_out": np.zeros(())}, make_meta(cfg, tokenizer, step))
    checkpoints.wait()
    checkpoints.close()
    return out


def eot_prone_params(cfg, vocab: int, eot: int, p_eot: float) -> dict:
    """A model whose every next token is the end-of-text one with probability p_eot, else any
    other token uniformly: the blocks are zero (identity), ln_f's scale is 0, so the logits are
    ln_f's bias against wte, which is zero but for wte[eot]."""
    _, shapes, _ = abstract_model(cfg, vocab)
    params = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), shapes)
    for norm in ("ln_1", "ln_2"):
        params["blocks"][norm]["scale"][:] = 1.0
    params["wte"][eot, 0] = 1.0
    params["ln_f"]["bias"][0] = math.log(p_eot / (1 - p_eot) * (vocab - 1))
    return params


@pytest.fixture(scope="module")
def bytes_run(prepared, tmp_path_factory):
    cfg = tiny_config(**{"data.path": str(prepared.bytes)})
    out = tmp_path_factory.mktemp("bytes") / "run"
    return save_checkpoint(out, cfg, eot_prone_params(cfg, 257, 256, 0.25))


def test_stop_at_eot_ends_every_sample_at_its_end_of_text(bytes_run, capsys):
    model = sample.load(bytes_run)
    assert model.tokenizer.spec == "bytes" and model.tokenizer.eot_id == 256
    kwargs = dict(prompt="ROMEO:", max_new_tokens=40, temperature=1.0, top_k=0, num_samples=4,
                  seed=3)
    seen = []
    free = sample.generate(model, on_tokens=seen.append, **kwargs)
    ids = np.stack(seen, axis=1)
    firsts = [int(np.flatnonzero(row == 256)[0]) for row in ids]  # each sample emits it
    assert all(EOT in text for text in free.texts) and free.new_tokens == 40
    stopped = sample.generate(model, stop_at_eot=True, **kwargs)
    assert not any(EOT in text for text in stopped.texts)
    assert stopped.texts == [text.split(EOT)[0] for text in free.texts]  # the same draws
    assert stopped.new_tokens == max(firsts) + 1  # it stops once the last sample has ended
    # The command line (several samples: printed whole at the end) says the same.
    sample_main(["--ckpt", str(bytes_run), "--prompt", "ROMEO:", "--max-new-tokens", "40",
                 "--temperature", "1", "--top-k", "0", "--seed", "3", "--num-samples", "4",
                 "--stop-at-eot"])
    assert capsys.readouterr().out == "\n---------------\n".join(stopped.texts) + "\n"


def test_the_stream_of_one_sample_ends_at_its_end_of_text(capsys):
    """What `jaxpar.sample` prints for a single sample, token by token: a character split over
    several bytes once it is whole, and nothing from the end-of-text token on."""
    streamer = sample.Streamer(ByteTokenizer(), 256)
    for token in [*"Hi ".encode(), *"\u00e9".encode(), 33, 256, 65, 66]:
        streamer(np.array([token, 0]))  # the first sample's token is printed
        if token == 0xC3:
            assert capsys.readouterr().out == "Hi "  # half of the \u00e9: held back
    assert capsys.readouterr().out == "\u00e9!" and streamer.ended
    free = sample.Streamer(ByteTokenizer(), None)  # without --stop-at-eot
    for token in [65, 256, 66]:
        free(np.array([token]))
    assert capsys.readouterr().out == f"A{EOT}B"


@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    """A checkpoint of a character-level model of the built-in corpus (65 characters)."""
    return save_checkpoint(tmp_path_factory.mktemp("char") / "run", tiny_config())


def test_stop_at_eot_on_a_char_model_is_one_line(char_run, capsys):
    before = files_in(char_run)
    with pytest.raises(SystemExit) as exit_info:
        sample_main(["--ckpt", str(char_run), "--stop-at-eot"])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.strip() == ("jaxpar.sample: error: --stop-at-eot: this model's tokenizer (char) "
                           "has no end-of-text token; drop --stop-at-eot")
    with pytest.raises(UserError, match="has no end-of-text token"):
        sample.generate(sample.load(char_run), stop_at_eot=True, max_new_tokens=1)
    assert files_in(char_run) == before


# ---- data, tokenizer and model must agree ----

@pytest.mark.parametrize("vocab_size", [BPE_VOCAB, 0])
def test_resuming_on_data_with_another_tokenizer_is_one_line(prepared, tmp_path, capsys,
                                                             vocab_size):
    """A char-level checkpoint resumed on the BPE data. With model.vocab_size=512 on both, the
    model shapes agree and only the tokenizers differ; with 0, each run's vocabulary follows its
    data's tokenizer (65 and 512)."""
    out = save_checkpoint(tmp_path / "run", tiny_config(**{"model.vocab_size": vocab_size}))
    before = files_in(out)
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--config", "tiny", "--mesh", "dp=8", f"--data.path={prepared.bpe}",
                    f"--model.vocab_size={vocab_size}", "--out", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("jaxpar.train: error: "), err
    assert "(char, 65 ids) is not the data's" in err, err
    assert f"the data's (bpe, {BPE_VOCAB} ids)" in err, err
    assert files_in(out) == before


def test_a_model_vocabulary_smaller_than_the_datas_is_one_line(prepared, tmp_path, capsys):
    train_fails_with(capsys, tmp_path, ["--config", "tiny", "--mesh", "dp=8",
                                        f"--data.path={prepared.bpe}", "--model.vocab_size=500"],
                     f"model.vocab_size=500 is smaller than the data's vocabulary of {BPE_VOCAB} "
                     "tokens")
    with pytest.raises(UserError, match="^model.vocab_size=500 is smaller") as error:
        run(tiny_config(**on_bpe(prepared, **{"model.vocab_size": 500})), tmp_path / "lib",
            jax.devices()[:1], progress=False)
    assert "\n" not in str(error.value) and not (tmp_path / "lib").exists()


def test_a_model_vocabulary_larger_than_the_datas_trains(prepared, tmp_path):
    """600 embedding rows (640 padded) for 512 tokens: the softmax spans all 600, sampling only
    the tokenizer's 512."""
    out = tmp_path / "run"
    cfg = tiny_config(**on_bpe(prepared, **{"model.vocab_size": 600, "train.steps": 2}))
    result = run(cfg, out, jax.devices()[:1], progress=False)
    assert result.params["wte"].shape == (padded_vocab(600), 32) == (640, 32)
    assert result.info["vocab_size"] == 600
    assert abs(result.losses[0] - math.log(600)) < 0.02 and np.isfinite(result.losses[1])
    model = sample.load(out)
    assert (model.vocab_size, model.tokenizer.vocab_size) == (600, BPE_VOCAB)


def damaged_copy(prepared, tmp_path, damage):
    data = tmp_path / "data"
    shutil.copytree(prepared.bytes, data)
    damage(data)
    return data


def edit_meta(directory, **changes):
    meta = json.loads((directory / "meta.json").read_text())
    (directory / "meta.json").write_text(json.dumps(meta | changes))


def with_train_tokens(directory, tokens):
    meta = json.loads((directory / "meta.json").read_text())
    meta["splits"]["train"]["tokens"] = tokens(meta["splits"]["train"]["tokens"])
    (directory / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage, expected", [
    (lambda d: (d / "train.bin").unlink(),
     ["train.bin' not found", "run python -m jaxpar.prepare"]),
    (lambda d: edit_meta(d, dtype="uint32"), ["train.bin' has 360,002 bytes", "180001 uint32",
                                              "truncated or from another run"]),
    (lambda d: with_train_tokens(d, lambda n: n + 1), ["train.bin' has 360,002 bytes",
                                                        "180002 uint16"]),
    (lambda d: edit_meta(d, vocab_size=70_000), ["vocab_size 70000, which uint16"]),
    (lambda d: edit_meta(d, dtype="int8"), ["dtype 'int8'"]),
])
def test_a_damaged_prepared_directory_is_one_line_and_writes_nothing(prepared, tmp_path, capsys,
                                                                     damage, expected):
    data = damaged_copy(prepared, tmp_path, damage)
    train_fails_with(capsys, tmp_path, ["--config", "tiny", f"--data.path={data}"], *expected)


def test_a_document_masked_model_samples_from_the_last_document_alone(prepared, tmp_path):
    """Under data.document_mask a prompt's text before its last end-of-text token is another
    document: the samples after it are those of the last document alone, with the KV cache and
    without, where the samples open documents of their own too (end-of-text made likely).
    Control: without the mask the first document moves the next token's logits."""
    cfg = tiny_config(**{"data.path": str(prepared.bytes), "data.document_mask": True})
    save_random_gpt2(tmp_path, cfg, ByteTokenizer(), 1, 0.5)

    def loaded():
        model = sample.load(tmp_path)
        params = jax.tree.map(np.array, model.params)
        params["wte"][256] = 2.5 * params["ln_f"]["bias"]  # end-of-text: about one token in eight
        return dataclasses.replace(model, params=jax.device_put(params), decoders={})

    def continuations(prompt: str, use_cache: bool = True) -> list[str]:
        kwargs = dict(max_new_tokens=40, temperature=1.0, top_k=0, num_samples=3, seed=3, use_cache=use_cache)
        return [text[len(prompt):] for text in sample.generate(loaded(), prompt, **kwargs).texts]
    alone = continuations(EOT + "ROMEO:")
    assert sum(text.count(EOT) for text in alone) >= 2
    assert continuations("First Citizen:\n" + EOT + "ROMEO:") == alone
    assert continuations("First Citizen:\n" + EOT + "ROMEO:", use_cache=False) == alone
    model = loaded()
    ids = model.tokenizer.encode("First Citizen:\n" + EOT + "ROMEO:")[None]
    starts = np.maximum.accumulate(np.where(ids == 256, np.arange(ids.shape[1]), 0), 1)
    last = [np.asarray(forward(Transformer(model.cfg.model, 257, eot_id=eot), model.params, ids,
                               empty_cache(Transformer(model.cfg.model, 257), 1), 0, at)[0][0, -1])
            for eot, at in ((256, starts), (None, None))]
    assert np.max(np.abs(last[0] - last[1])) > 1e-3

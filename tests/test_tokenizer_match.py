"""A model never meets another tokenizer's ids: every way in (--init-from, resume, eval --hf)
checks the model's tokenizer against the data's by what they map, in one line naming both, before
the vocabulary's size (whose message would blame model.vocab_size).

Two exports of random tiny GPT-2s: one of the built-in corpus at character level (char, 65 ids),
one of bytes data (bytes, 257 ids). A tiktoken export names its encoding in jaxpar_tokenizer.json.
"""

import json
from types import SimpleNamespace

import jax
import pytest
from conftest import tiny_config
from helpers import exits_with_one_line, fails_with, fake_tiktoken, save_random_gpt2

from jaxpar.data.loader import load_dataset, read_text
from jaxpar.data.prepare import prepare
from jaxpar.data.tokenizer import META_FILE, ByteTokenizer
from jaxpar.eval import main as eval_main
from jaxpar.inference.export import export
from jaxpar.train import main as train_main
from jaxpar.train import parse_args, run

BLOCK, STEP = 32, 3
CHAR, BYTES = "(char, 65 ids)", "(bytes, 257 ids)"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """20 KB of Tiny Shakespeare prepared as bytes, and the two exports."""
    root = tmp_path_factory.mktemp("match")
    text = root / "text.txt"
    text.write_text(read_text("")[:20_000], encoding="utf-8")
    prepare([str(text)], root / "bytes", "bytes")
    char_cfg = tiny_config()
    save_random_gpt2(root / "char_run", char_cfg, load_dataset(char_cfg.data, BLOCK).tokenizer, STEP, 0.1)
    save_random_gpt2(root / "bytes_run", tiny_config(**{"data.path": root / "bytes"}), ByteTokenizer(),
                     STEP, 0.1)
    export(root / "char_run", root / "hf_char")
    export(root / "bytes_run", root / "hf_bytes")
    return SimpleNamespace(text=text, bytes=root / "bytes", char_run=root / "char_run",
                           hf_char=root / "hf_char", hf_bytes=root / "hf_bytes")


def init_from(hf, *data: str) -> list[str]:
    return ["--config", "tiny", "--mesh", "dp=8", "--init-from", str(hf), "--steps", "2", "--train.eval_every=0", *data]


def test_init_from_a_bytes_export_on_char_data_is_refused(made, capsys, tmp_path):
    fails_with(capsys, tmp_path, init_from(made.hf_bytes),
               f"the tokenizer of --init-from '{made.hf_bytes}' {BYTES} is not the data's {CHAR}; "
               f"train on data prepared with it", f"--tokenizer {made.hf_bytes}")


def test_init_from_a_char_export_on_bytes_data_is_refused_before_the_vocabulary_size(made, capsys, tmp_path):
    fails_with(capsys, tmp_path, init_from(made.hf_char, f"--data.path={made.bytes}"),
               f"the tokenizer of --init-from '{made.hf_char}' {CHAR} is not the data's {BYTES}")


def test_init_from_an_export_on_its_own_kind_of_data_trains(made, tmp_path):
    """Its tokenizer.json is the bytes tokenizer under another name (one device: a cheaper compile)."""
    cfg, out, _ = parse_args(init_from(made.hf_bytes, f"--data.path={made.bytes}", "--mesh", "dp=1",
                                       "--steps", "1", "--out", str(tmp_path / "run")))
    assert run(cfg, out, jax.devices()[:1], progress=False).losses.keys() == {0}


def eval_fails_with(capsys, argv, *expected):
    exits_with_one_line(capsys, "jaxpar.eval", lambda: eval_main([*argv, "--block-size", str(BLOCK)]),
                        *expected)


def test_eval_of_a_bytes_export_on_char_data_is_refused(made, capsys):
    chars = len(set(made.text.read_text(encoding="utf-8")))
    eval_fails_with(capsys, ["--hf", str(made.hf_bytes), "--data", str(made.text)],
                    f"the tokenizer of --hf '{made.hf_bytes}' {BYTES} is not the data's (char, {chars} ids); "
                    "pass --data prepared with the model's tokenizer")


def test_eval_of_a_char_export_on_bytes_data_is_refused(made, capsys):
    eval_fails_with(capsys, ["--hf", str(made.hf_char), "--data", str(made.bytes)],
                    f"the tokenizer of --hf '{made.hf_char}' {CHAR} is not the data's {BYTES}")


def test_resuming_on_other_data_is_refused(made, capsys):
    before = sorted(made.char_run.rglob("*"))
    exits_with_one_line(capsys, "jaxpar.train", lambda: train_main([
        "--config", "tiny", "--mesh", "dp=8", "--out", str(made.char_run), f"--data.path={made.bytes}", "--steps", str(STEP + 1)]),
        f"the tokenizer of the checkpoint in '{made.char_run / 'checkpoints'}' {CHAR} is not the "
        f"data's {BYTES}; resume on the data it was trained on")
    assert sorted(made.char_run.rglob("*")) == before


def test_a_tiktoken_export_names_its_encoding_and_is_checked(made, capsys, tmp_path, monkeypatch):
    tok = fake_tiktoken(monkeypatch)
    save_random_gpt2(tmp_path / "tiktoken_run", tiny_config(), tok, STEP, 0.1)
    export(tmp_path / "tiktoken_run", tmp_path / "hf")
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    assert json.loads((tmp_path / "hf" / META_FILE).read_text()) == {"kind": "tiktoken", "name": "gpt2"}
    fails_with(capsys, tmp_path, init_from(tmp_path / "hf"),
               f"(tiktoken:gpt2, {tok.vocab_size} ids) is not the data's {CHAR}", "--tokenizer tiktoken:gpt2")


def test_tiktoken_and_a_tokenizer_json_of_the_same_tokens_are_one_tokenizer(monkeypatch):
    """tiktoken's GPT-2 encoding and HF's gpt2 tokenizer.json hold the same tokens under the same
    ids: data prepared with one trains a model of the other. Control: two ids swapped differ."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from jaxpar.data.tokenizer import HFTokenizer, same_mapping
    from jaxpar.data.vocab import bytes_to_unicode
    tok, alphabet = fake_tiktoken(monkeypatch), bytes_to_unicode()

    def tokenizer_json(swap: bool) -> HFTokenizer:
        ids = {alphabet[b]: b for b in range(256)} | {"th": 256, "he": 257, "the": 258}
        if swap:
            ids["th"], ids["he"] = 257, 256
        hf = Tokenizer(models.BPE(ids, [("t", "h"), ("h", "e"), ("th", "e")]))
        hf.pre_tokenizer, hf.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        hf.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
        return HFTokenizer(hf, "tokenizer.json")

    assert same_mapping(tok, tokenizer_json(swap=False)) and same_mapping(tokenizer_json(swap=False), tok)
    assert not same_mapping(tok, tokenizer_json(swap=True))
    assert not same_mapping(tok, ByteTokenizer())


def test_a_damaged_tokenizer_name_is_one_line(tmp_path):
    from jaxpar.core.errors import UserError
    from jaxpar.models.hf import hf_tokenizer
    (tmp_path / META_FILE).write_text("{not json")
    with pytest.raises(UserError, match=r"does not name a tokenizer; export the model again"):
        hf_tokenizer(tmp_path)

"""Every tokenizer kind round-trips text, rebuilds from its meta, and its tokenizer.json encodes
as it does; the corpus is read in pieces that tokenize like the whole."""

import json
import sys

import numpy as np
import pytest
from helpers import fake_tiktoken
from tokenizers import Tokenizer

from jaxpar.core.errors import UserError
from jaxpar.data import corpus
from jaxpar.data.tokenizer import (
    EOT,
    ByteTokenizer,
    CharTokenizer,
    HFTokenizer,
    from_meta,
    load_tokenizer,
    tokenizer_json,
)

SHAKESPEARE = "/work/shared/data/tinyshakespeare.txt"
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\r\nSpeak, speak.\n"
        "  Café, naïve, 日本語, emoji 😀, tabs\tand  spaces \n\n\n")
TEXTS = [TEXT, "", "\n", "a", "😀", f"one{EOT}two\n{EOT}"]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text((TEXT + EOT) * 50 + "the end\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def bpe(corpus_file):
    return load_tokenizer("bpe", [corpus_file], vocab_size=300)


@pytest.fixture(params=["char", "bytes", "bpe", "tokenizer.json", "tiktoken"])
def tok(request, corpus_file, bpe, tmp_path, monkeypatch):
    if request.param == "char":
        return load_tokenizer("char", [corpus_file])
    if request.param == "bpe":
        return bpe
    if request.param == "tokenizer.json":
        (tmp_path / "tokenizer.json").write_text(tokenizer_json(bpe))
        return load_tokenizer(str(tmp_path / "tokenizer.json"))
    if request.param == "tiktoken":
        return fake_tiktoken(monkeypatch)
    return load_tokenizer(request.param)


@pytest.mark.parametrize("text", TEXTS)
def test_every_kind_round_trips_text(tok, text):
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and (ids < tok.vocab_size).all()
    assert tok.decode(ids) == text


def test_the_end_of_text_token(tok):
    if tok.kind == "char":
        assert tok.eot_id is None
        return
    assert 0 <= tok.eot_id < tok.vocab_size
    ids = tok.encode(f"a{EOT}b").tolist()
    assert ids.count(tok.eot_id) == 1 and tok.decode([tok.eot_id]) == EOT


def test_from_meta_inverts_to_meta(tok):
    meta = tok.to_meta()
    rebuilt = from_meta(json.loads(json.dumps(meta)))
    assert (rebuilt.kind, rebuilt.vocab_size, rebuilt.eot_id) == (tok.kind, tok.vocab_size,
                                                                   tok.eot_id)
    np.testing.assert_array_equal(rebuilt.encode(TEXT), tok.encode(TEXT))


def test_the_old_checkpoint_format_is_a_char_tokenizer():
    tok = from_meta({"chars": "\n abc"})
    assert isinstance(tok, CharTokenizer) and tok.vocab_size == 5
    assert tok.encode("cab\n").tolist() == [4, 2, 3, 0]


def test_the_tokenizer_json_encodes_and_decodes_like_the_native_tokenizer(tok):
    exported = tokenizer_json(tok)
    if tok.kind == "tiktoken":
        assert exported is None
        return
    hf = Tokenizer.from_str(exported)
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False).ids
        assert ids == tok.encode(text).tolist(), text
        assert hf.decode(ids, skip_special_tokens=False) == text


def test_transformers_loads_every_exported_tokenizer(tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    exported = tokenizer_json(tok)
    if exported is None:
        return
    (tmp_path / "tokenizer.json").write_text(exported)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    ids = fast(TEXT, add_special_tokens=False)["input_ids"]
    assert ids == tok.encode(TEXT).tolist()
    assert fast.decode(ids, clean_up_tokenization_spaces=False) == TEXT


def test_bytes_round_trips_any_utf8_and_decodes_broken_bytes():
    tok = ByteTokenizer()
    text = "".join(chr(c) for c in range(1, 0x800)) + "\U0001F600\n\x00"
    assert tok.encode(text).tolist()[:3] == [1, 2, 3]
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # half a character: a replacement, not an error


def test_char_names_an_unknown_character():
    with pytest.raises(UserError, match="character 'z' is not in the vocabulary"):
        CharTokenizer("ab").encode("abz")


def test_long_texts_encode_in_pieces_as_a_whole():
    """HF encodes 64K-character pieces cut at "x\\nY" newlines: the same ids as one encode."""
    text = open(SHAKESPEARE, encoding="utf-8").read()[:300_000]
    tok = load_tokenizer("bpe", [SHAKESPEARE], vocab_size=400)
    assert len(corpus.split_text(text, 1 << 16)) > 4
    assert tok.encode(text).tolist() == tok.tokenizer.encode(text, add_special_tokens=False).ids


def test_bpe_trains_on_a_sample(corpus_file):
    tok = load_tokenizer("bpe", [corpus_file], vocab_size=300, sample_bytes=100)
    assert isinstance(tok, HFTokenizer) and tok.decode(tok.encode(TEXT)) == TEXT


@pytest.mark.parametrize("spec, vocab_size, expected", [
    ("bpe", None, "needs --vocab-size"),
    ("bpe", 256, "--vocab-size 256 is too small: byte-level BPE needs the 256 bytes and "
                 "<|endoftext|>, so at least 257"),
    ("bpe", 2**32 + 1, "is too large: token ids are stored as uint32"),
    ("bytes", 1000, "--vocab-size is for --tokenizer bpe only"),
    ("nonexistent.json", None, "no such file; pass char, bytes, bpe, tiktoken:NAME"),
])
def test_bad_specs(spec, vocab_size, expected, corpus_file):
    with pytest.raises(UserError, match=expected.replace("|", r"\|").replace("(", r"\(")):
        load_tokenizer(spec, [corpus_file], vocab_size)


@pytest.mark.parametrize("content, expected", [
    (b"{not json", "is not a valid tokenizer.json"),
    (b'{"version": "1.0"}', "is not a valid tokenizer.json"),
    (b"\xff\xfe{}", "cannot be read"),
])
def test_bad_tokenizer_json(tmp_path, content, expected):
    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(UserError, match=expected) as info:
        load_tokenizer(str(tmp_path))  # a directory holding a tokenizer.json
    assert "\n" not in str(info.value)


def test_an_uncached_tiktoken_encoding_is_one_line_naming_the_file(tmp_path, monkeypatch):
    pytest.importorskip("tiktoken")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(UserError) as info:
        load_tokenizer("tiktoken:gpt2")
    message = str(info.value)
    assert "\n" not in message and str(tmp_path) in message and "https://" in message
    for fix in ("tiktoken.get_encoding('gpt2')", "TIKTOKEN_CACHE_DIR", "--tokenizer bpe"):
        assert fix in message
    assert not list(tmp_path.iterdir()), "nothing downloaded, nothing written"


def test_missing_tiktoken_says_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(UserError, match="pip install tiktoken"):
        load_tokenizer("tiktoken:gpt2")


def test_an_unknown_tiktoken_name_lists_the_known_ones():
    pytest.importorskip("tiktoken")
    with pytest.raises(UserError, match="no encoding 'gpt5'; use one of gpt2, "):
        load_tokenizer("tiktoken:gpt5")


def test_a_real_cached_tiktoken_gpt2(tmp_path):
    """Runs only where gpt2's files are in tiktoken's cache (a machine that downloaded them)."""
    pytest.importorskip("tiktoken")
    try:
        tok = load_tokenizer("tiktoken:gpt2")
    except UserError:
        pytest.skip("tiktoken's gpt2 files are not cached here")
    assert (tok.vocab_size, tok.eot_id) == (50257, 50256)
    assert tok.encode("Hello world").tolist() == [15496, 995]


def test_pieces_cover_the_file_and_end_between_words(tmp_path):
    text = ("word " * 7 + "\n") * 3000 + "é" * 5000 + "\nend"
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    pieces = list(corpus.read_pieces(path, chunk_bytes=4096))
    assert b"".join(p.data for p in pieces) == text.encode()
    assert [p.last for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert [p.offset for p in pieces] == list(np.cumsum([0] + [len(p.data) for p in pieces])[:-1])
    for piece in pieces[:-1]:
        piece.data.decode("utf-8")  # whole characters only
        assert piece.data.endswith((b"\n", "é".encode())), piece.data[-10:]
    assert len(list(corpus.read_pieces(path, chunk_bytes=4096, limit=5000))) == 2


def test_an_empty_file_is_one_empty_last_piece(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    assert [(p.data, p.last) for p in corpus.read_pieces(tmp_path / "empty.txt")] == [(b"", True)]

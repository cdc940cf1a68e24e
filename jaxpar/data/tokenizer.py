"""Every kind of tokenizer behind one interface: char, bytes, byte-level BPE or any tokenizer.json,
and tiktoken's encodings. `load_tokenizer(spec, inputs)` makes one; `from_meta` rebuilds one.

Each has `encode(text) -> int32 ids`, `decode(ids) -> str`, `vocab_size`, `eot_id` (the
end-of-text token between documents; None for char), `spec` (what --tokenizer said) and
`to_meta()` (a self-contained JSON-able dict). `tokenizer_json(tok)` is a Hugging Face
tokenizer.json that encodes as `tok` does, for every kind but tiktoken; `same_mapping(a, b)`
compares two tokenizers by what they map, and `check_same_tokenizer` is the one check that a
model's tokenizer is its data's.

The kinds, by --tokenizer spec:
  char            the sorted set of the inputs' characters; no end-of-text token
  bytes           the 256 byte values, then <|endoftext|> = 256
  bpe             byte-level BPE trained on the inputs (--vocab-size), <|endoftext|> = 0
  PATH            a tokenizer.json (or a directory holding one)
  tiktoken:NAME   tiktoken's encoding NAME, e.g. tiktoken:gpt2, read from tiktoken's cache only

The literal text "<|endoftext|>" encodes as the end-of-text token in every kind that has one
(Hugging Face tokenizers match special tokens' text that way).
"""

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from jaxpar.core.errors import UserError
from jaxpar.data import vocab
from jaxpar.data.corpus import EOT, code_points, split_text
from jaxpar.data.records import RecordOptions

EOT_NAMES = (EOT, "</s>", "<|end_of_text|>", "<eos>")  # a tokenizer.json's end-of-text token
HF_PIECE_CHARS = 1 << 16  # Hugging Face tokenizers encode many short texts much faster than one
MIN_BPE_VOCAB, MAX_VOCAB = 257, 2**32  # the 256 bytes and <|endoftext|>; ids fit uint32


class Tokenizer(Protocol):
    """What every kind below has (for type hints)."""
    kind: str  # char, bytes, tokenizer.json or tiktoken
    spec: str  # what --tokenizer said
    vocab_size: int  # every id is below it
    eot_id: int | None  # the end-of-text token; None for char
    parallel: bool  # whether encoding is worth worker processes

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids) -> str: ...

    def to_meta(self) -> dict: ...


def _joined(parts: list[np.ndarray], eot_id: int) -> np.ndarray:
    """The parts with eot_id between each two, as int32."""
    out = [parts[0]]
    for part in parts[1:]:
        out += [np.array([eot_id]), part]
    return np.concatenate(out).astype(np.int32)


@dataclass(frozen=True)
class CharTokenizer:
    chars: str  # the vocabulary, sorted; a token id is an index into it
    kind = spec = "char"
    eot_id = None
    parallel = False  # encoding costs less than sending the text to another process

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    @functools.cached_property
    def _id_of(self) -> np.ndarray:
        """Token id by code point, -1 for none; its last entry stands for every larger one."""
        points = code_points(self.chars)
        table = np.full(int(points.max(initial=0)) + 2, -1, np.int32)
        table[points] = np.arange(len(points))
        return table

    def encode(self, text: str) -> np.ndarray:
        points = code_points(text)
        ids = self._id_of[np.minimum(points, len(self._id_of) - 1)]
        if (ids < 0).any():
            unknown = text[int(np.argmax(ids < 0))]
            raise UserError(f"character {unknown!r} is not in the vocabulary of this model")
        return ids

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)

    def to_meta(self) -> dict:
        return {"kind": "char", "chars": self.chars}


class ByteTokenizer:
    kind = spec = "bytes"
    vocab_size = 257
    eot_id = 256
    parallel = False  # encoding costs less than sending the text to another process

    def encode(self, text: str) -> np.ndarray:
        try:
            parts = [np.frombuffer(part.encode("utf-8"), np.uint8) for part in text.split(EOT)]
        except UnicodeEncodeError as e:
            raise UserError(f"the text holds {e.object[e.start]!r}, which is not a character") \
                from None
        return _joined(parts, self.eot_id)

    def decode(self, ids) -> str:
        ids = np.asarray(ids)
        ends = np.flatnonzero(ids == self.eot_id)
        parts = np.split(ids, ends)  # each part after the first starts with the eot
        return EOT.join(bytes(part[i > 0:].astype(np.uint8)).decode("utf-8", errors="replace")
                        for i, part in enumerate(parts))

    def to_meta(self) -> dict:
        return {"kind": "bytes"}


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer`: a trained BPE, or any tokenizer.json."""
    kind = "tokenizer.json"
    parallel = True  # worth worker processes (measured: faster than tokenizers' own threads)

    def __init__(self, tokenizer, spec: str):
        self.tokenizer, self.spec = tokenizer, spec
        ids = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(ids.values(), default=-1) + 1  # ids need not be contiguous
        self.eot_id = next((ids[name] for name in EOT_NAMES if name in ids), None)

    def encode(self, text: str) -> np.ndarray:
        # Special tokens are matched in the text; no BOS/EOS added around it.
        pieces = split_text(text, HF_PIECE_CHARS)
        try:
            encodings = self.tokenizer.encode_batch_fast(pieces, add_special_tokens=False)
        except Exception as e:  # tokenizers raises a plain Exception, e.g. for an unknown word
            first_line = (str(e).splitlines() or [""])[0]
            raise UserError(f"the tokenizer '{self.spec}' cannot encode this text ({first_line}); "
                            "pass text it covers, or a tokenizer that has an unknown token") from None
        return np.concatenate([np.array(e.ids, np.int32) for e in encodings])

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_meta(self) -> dict:
        return {"kind": "tokenizer.json", "json": self.tokenizer.to_str(), "spec": self.spec}


class TiktokenTokenizer:
    kind = "tiktoken"
    parallel = True

    def __init__(self, name: str):
        from jaxpar.data.tiktoken_cache import load_encoding
        self.name, self.encoding = name, load_encoding(name)
        self.spec = f"tiktoken:{name}"
        self.vocab_size, self.eot_id = self.encoding.n_vocab, self.encoding.eot_token
        self._allowed = {EOT} & self.encoding.special_tokens_set

    def encode(self, text: str) -> np.ndarray:
        ids = self.encoding.encode(text, allowed_special=self._allowed, disallowed_special=())
        return np.array(ids, np.int32)

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids])

    def to_meta(self) -> dict:
        return {"kind": "tiktoken", "name": self.name}


def from_meta(meta: dict) -> Tokenizer:
    """The tokenizer that to_meta() described; `{"chars": ...}` is a char tokenizer (the format
    of checkpoints from before the kinds)."""
    kind = meta.get("kind", "char")
    if kind == "char":
        return CharTokenizer(meta["chars"])
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "tokenizer.json":
        from tokenizers import Tokenizer
        return HFTokenizer(Tokenizer.from_str(meta["json"]), meta.get("spec", "tokenizer.json"))
    if kind == "tiktoken":
        return TiktokenTokenizer(meta["name"])
    raise UserError(f"unknown tokenizer kind {kind!r}; a newer jaxpar wrote this, use that one")


def tokenizer_json(tok: Tokenizer) -> str | None:
    """A Hugging Face tokenizer.json that encodes and decodes as `tok` does; None for tiktoken."""
    if isinstance(tok, HFTokenizer):
        return tok.tokenizer.to_str()
    if isinstance(tok, CharTokenizer):
        return vocab.char_tokenizer_json(tok.chars)
    if isinstance(tok, ByteTokenizer):
        return vocab.byte_tokenizer_json(tok.eot_id)
    return None


def same_mapping(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two tokenizers map text to the same ids, however each was named or made: a
    `bytes` run's data and the tokenizer.json its export wrote are one tokenizer. Kinds with a
    tokenizer.json are compared by it, as Hugging Face tokenizers reads it back (vocabulary,
    merges, special tokens, pre-tokenizer, normalizer, decoder); tiktoken by its encoding."""
    meta_a, meta_b = ({k: v for k, v in t.to_meta().items() if k != "spec"} for t in (a, b))
    if meta_a == meta_b:
        return True
    json_a, json_b = tokenizer_json(a), tokenizer_json(b)
    if json_a is None or json_b is None:
        kinds = {type(a): a, type(b): b}
        return (kinds.keys() == {TiktokenTokenizer, HFTokenizer}
                and vocab.tiktoken_matches_json(kinds[TiktokenTokenizer].encoding, kinds[HFTokenizer].tokenizer))
    from tokenizers import Tokenizer
    return json.loads(Tokenizer.from_str(json_a).to_str()) == json.loads(Tokenizer.from_str(json_b).to_str())


def described(tok: Tokenizer) -> str:
    """'bytes, 257 ids': a tokenizer.json that maps as bytes or char does (an export's) is named so."""
    name = tok.spec
    if isinstance(tok, HFTokenizer):
        ids = tok.tokenizer.get_vocab(with_added_tokens=True)
        chars = "".join(sorted(ids, key=ids.get))
        if same_mapping(tok, ByteTokenizer()):
            name = "bytes"
        elif len(chars) == len(ids) == tok.vocab_size and same_mapping(tok, CharTokenizer(chars)):
            name = "char"
    return f"{name}, {tok.vocab_size} ids"


def check_same_tokenizer(model: Tokenizer | None, data: Tokenizer, source: str, fix: str) -> None:
    """Every way in (--init-from, resume, eval) checks this, before the vocabulary's size: another
    tokenizer's ids would train silently. None (an HF directory without one) passes unchecked."""
    if model is not None and not same_mapping(model, data):
        raise UserError(f"the tokenizer of {source} ({described(model)}) is not the data's "
                        f"({described(data)}); {fix}")


META_FILE = "jaxpar_tokenizer.json"  # an export's to_meta(), where no tokenizer.json says it (tiktoken)


def meta_files(tok: Tokenizer) -> dict[str, str]:
    """{META_FILE: its to_meta()} for a tokenizer without a tokenizer.json; {} for the others."""
    return {} if tokenizer_json(tok) is not None else {META_FILE: json.dumps(tok.to_meta()) + "\n"}


def load_tokenizer(spec: str, inputs: list[Path] | None = None, vocab_size: int | None = None,
                   *, workers: int = 1, progress: bool | None = False,
                   sample_bytes: int | None = None, options: RecordOptions = RecordOptions()) -> Tokenizer:
    """The tokenizer `spec` names (see the module docstring). char and bpe read `inputs` (files,
    each streamed in pieces) on `workers` processes; bpe trains on the first `sample_bytes` of
    them, shared out by file size (default: all). `options`: how record files give their texts
    (jaxpar.data.records.RecordOptions)."""
    inputs = [Path(path) for path in inputs or []]
    if vocab_size is not None and spec != "bpe":
        raise UserError(f"--vocab-size is for --tokenizer bpe only; --tokenizer {spec} has its "
                        "own vocabulary, drop --vocab-size")
    if spec == "bytes":
        return ByteTokenizer()
    if spec in ("char", "bpe") and not inputs:
        raise UserError(f"--tokenizer {spec} learns its vocabulary from the inputs; pass some")
    if spec == "char":
        return CharTokenizer(vocab.collect_chars(inputs, workers, progress, options))
    if spec == "bpe":
        check_bpe_vocab_size(vocab_size)
        return HFTokenizer(vocab.train_bpe(inputs, vocab_size, progress, sample_bytes, options), "bpe")
    if spec.startswith("tiktoken:"):
        return TiktokenTokenizer(spec.split(":", 1)[1])
    return HFTokenizer(read_tokenizer_json(spec), spec)


def check_bpe_vocab_size(vocab_size: int | None) -> None:
    if vocab_size is None:
        raise UserError("--tokenizer bpe needs --vocab-size N: how many tokens to learn "
                        "(e.g. 4096 for a few MB of text, 32768 for GBs)")
    if vocab_size < MIN_BPE_VOCAB:
        raise UserError(f"--vocab-size {vocab_size} is too small: byte-level BPE needs the 256 "
                        f"bytes and {EOT}, so at least {MIN_BPE_VOCAB}")
    if vocab_size > MAX_VOCAB:
        raise UserError(f"--vocab-size {vocab_size} is too large: token ids are stored as uint32, "
                        f"so at most 2^32 = {MAX_VOCAB}")


def read_tokenizer_json(spec: str):
    from tokenizers import Tokenizer
    path = Path(spec)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"--tokenizer '{spec}': no such file; pass char, bytes, bpe, "
                        "tiktoken:NAME, or the path of a tokenizer.json")
    try:
        text = path.read_text(encoding="utf-8")
        tokenizer = Tokenizer.from_str(text)
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--tokenizer '{spec}' cannot be read ({e.__class__.__name__}); "
                        "fix its permissions or pass another tokenizer.json") from None
    except Exception as e:  # tokenizers raises a plain Exception for JSON it does not accept
        first_line = (str(e).splitlines() or [""])[0]
        raise UserError(f"--tokenizer '{spec}' is not a valid tokenizer.json ({first_line}); "
                        "pass one saved by Hugging Face tokenizers") from None
    if not tokenizer.get_vocab_size(with_added_tokens=True):
        raise UserError(f"--tokenizer '{spec}' has an empty vocabulary; pass a trained tokenizer")
    return tokenizer

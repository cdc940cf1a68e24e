"""Vocabularies made here: the character set of a corpus, a byte-level BPE trained on one, and
the Hugging Face tokenizer.json that encodes as char or bytes does (what an exported model ships).
"""

import contextlib
from pathlib import Path

import numpy as np

from jaxpar.data.corpus import EOT, code_points, ordered_map, pieces_of, progress_bar, split_text, texts_of
from jaxpar.data.records import RecordOptions, input_size

TRAIN_PIECE_CHARS = 1 << 16  # the BPE trainer's pre-tokenizer is slow on long texts


def _piece_code_points():
    def code_points_in(piece):
        counts = np.bincount(code_points("".join(texts_of(piece)[0])), minlength=1)
        return piece.size, np.flatnonzero(counts)
    return code_points_in


def collect_chars(inputs: list[Path], workers: int = 1, progress: bool | None = False,
                  options: RecordOptions = RecordOptions()) -> str:
    """The sorted set of the characters in `inputs`: one pass, its pieces on `workers` processes."""
    points = set()
    pieces = (piece for path in inputs for piece in pieces_of(path, options))
    found_in = ordered_map(_piece_code_points, (), pieces, workers)
    # closing: an error or a signal here stops the workers now, not when the traceback is freed.
    with contextlib.closing(found_in), progress_bar(sum(input_size(p) for p in inputs), "characters", progress) as bar:
        for size, found in found_in:
            points.update(found.tolist())
            bar.update(size)
    return "".join(map(chr, sorted(points)))


def sample_limits(inputs: list[Path], sample_bytes: int | None) -> list[int | None]:
    """How much of each input's start a sample of `sample_bytes` takes: the same share of each."""
    sizes = [input_size(path) for path in inputs]
    if sample_bytes is None or sample_bytes >= sum(sizes):
        return [None] * len(inputs)
    return [max(1, size * sample_bytes // sum(sizes)) for size in sizes]


def train_bpe(inputs: list[Path], vocab_size: int, progress: bool | None = False,
              sample_bytes: int | None = None, options: RecordOptions = RecordOptions()):
    """A byte-level BPE (GPT-2's pre-tokenizer and byte alphabet) of `vocab_size` tokens with
    <|endoftext|> = 0, trained on `inputs` streamed in pieces (or a `sample_bytes` sample)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    limits = sample_limits(inputs, sample_bytes)
    total = sum(input_size(p) if n is None else n for p, n in zip(inputs, limits))
    with progress_bar(total, "training BPE", progress) as bar:
        def texts():
            for path, limit in zip(inputs, limits):
                for piece in pieces_of(path, options, limit):
                    for text in texts_of(piece)[0]:
                        yield from split_text(text, TRAIN_PIECE_CHARS)
                    bar.update(piece.size)
            bar.set_description("training BPE: merging")
        tokenizer.train_from_iterator(texts(), trainer)
    return tokenizer


def char_tokenizer_json(chars: str) -> str:
    """Each character its own word, looked up in a word-level vocabulary; decoding concatenates."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return tokenizer.to_str()


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte: the alphabet of byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable},
            **{b: chr(256 + i) for i, b in enumerate(others)}}


def byte_tokenizer_json(eot_id: int) -> str:
    """Byte-level BPE with no merges: token id = byte value, then <|endoftext|> = eot_id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    alphabet = bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE({alphabet[b]: b for b in range(256)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(EOT, special=True)])
    assert tokenizer.token_to_id(EOT) == eot_id
    return tokenizer.to_str()


def tiktoken_matches_json(encoding, tokenizer) -> bool:
    """Whether a tiktoken encoding and a byte-level Hugging Face tokenizer hold the same tokens
    under the same ids (tiktoken's GPT-2 and HF's gpt2 tokenizer.json do): each token's bytes, in
    GPT-2's printable alphabet, and each special token."""
    if type(tokenizer.pre_tokenizer).__name__ != "ByteLevel":
        return False
    alphabet, special = bytes_to_unicode(), encoding.special_tokens_set
    ids = {name: encoding.encode(name, allowed_special=special)[0] for name in special}
    ids |= {"".join(alphabet[b] for b in encoding.decode_single_token_bytes(i)): i
            for i in range(encoding.n_vocab) if i not in ids.values()}
    return tokenizer.get_vocab(with_added_tokens=True) == ids

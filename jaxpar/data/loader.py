"""Training data and deterministic batches: a `jaxpar.prepare` directory (train.bin and val.bin,
memory-mapped), a UTF-8 text file (the built-in Tiny Shakespeare by default) at character level,
or a weighted mixture of sources sharing one tokenizer (jaxpar.data.mixture).

The global batch at step s is a pure function of (seed, split, s): the same for every mesh and
process count. Each process materialises only the rows its devices hold, and checks that each id
lies within the tokenizer's vocabulary before it leaves the host: meta.json's record of a
file's largest id can be stale (an edited train.bin whose mtime was put back), and an embedding
lookup beyond the vocabulary clamps or reads garbage, silently.
"""

import gzip
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jax
import numpy as np

from jaxpar.core.config import DataConfig
from jaxpar.core.data_config import parse_mix
from jaxpar.core.errors import UserError
from jaxpar.core.sharding import batch_sharding
from jaxpar.data.mixture import Mixture, mixture_rows
from jaxpar.data.token_files import beyond_vocab, read_prepared
from jaxpar.data.tokenizer import CharTokenizer, from_meta, same_mapping

BUILTIN_NAME = "tinyshakespeare.txt.gz"
SPLIT_IDS = {"train": 0, "val": 1}


@dataclass(frozen=True)
class Dataset:
    tokenizer: object  # any kind of jaxpar.data.tokenizer
    train: np.ndarray | None  # token ids; memory-mapped for prepared data; None for a mixture
    val: np.ndarray | None
    mixture: Mixture | None = None
    parts: tuple["Dataset", ...] = ()  # a mixture's sources, in its order
    prepared: str = ""  # the jaxpar.prepare directory the splits were mapped from; "" for text

    def splits(self, name: str) -> list[np.ndarray]:
        """The split's tokens, one array per source."""
        if self.mixture is not None:
            return [part.train if name == "train" else part.val for part in self.parts]
        return [self.train if name == "train" else self.val]


def read_text(path: str) -> str:
    """The built-in corpus when path is empty, else the UTF-8 file at path."""
    if not path:
        return gzip.decompress(resources.files("jaxpar").joinpath("assets", BUILTIN_NAME)
                               .read_bytes()).decode("utf-8")
    file = Path(path)
    # Anything but a directory (prepared data) is read: a pipe such as <(zcat corpus.gz) works.
    if not file.exists():
        raise UserError(f"data file '{path}' not found; pass an existing UTF-8 text file or a "
                        "jaxpar.prepare directory with --data.path, or omit it for the built-in "
                        "Tiny Shakespeare")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"data file '{path}' is not UTF-8 text (byte {e.start}); "
                        "convert it to UTF-8 first") from None
    except PermissionError:
        raise UserError(f"data file '{path}' is not readable by this user; fix its "
                        "permissions or copy it somewhere readable") from None


def load_dataset(cfg: DataConfig, block_size: int) -> Dataset:
    """A jaxpar.prepare directory (memory-mapped), or a text file tokenised by character and split
    train/val; both splits must hold a block."""
    if cfg.mix:
        return load_mixture(cfg, block_size)
    prepared = bool(cfg.path) and Path(cfg.path).is_dir()
    name = f"prepared data '{cfg.path}'" if prepared else f"data file '{cfg.path or 'the built-in corpus'}'"
    return checked(load_text(cfg.path, cfg.val_fraction) if not prepared else load_prepared(cfg.path),
                   name, "tokens" if prepared else "characters", block_size)


def load_text(path: str, val_fraction: float) -> Dataset:
    """The text file at `path` (the built-in corpus where empty), tokenised by character and split
    train/val."""
    text = read_text(path)
    if not text:
        raise UserError(f"data file '{path or 'the built-in corpus'}' is empty; pass a file with text in it")
    tokenizer = CharTokenizer.from_text(text)
    ids = tokenizer.encode(text)
    n_val = int(len(ids) * val_fraction)
    return Dataset(tokenizer, ids[: len(ids) - n_val], ids[len(ids) - n_val:])


def load_prepared(directory: str) -> Dataset:
    """A jaxpar.prepare directory, memory-mapped."""
    meta, train, val = read_prepared(directory)
    if "tokenizer_meta" not in meta:
        raise UserError(f"'{directory}/meta.json' does not describe its tokenizer; run "
                        "python -m jaxpar.prepare again")
    return Dataset(from_meta(meta["tokenizer_meta"]), train, val, prepared=directory)


def load_mixture(cfg: DataConfig, block_size: int) -> Dataset:
    """Each source of data.mix, which must all map text to ids alike."""
    sources, parts = parse_mix(cfg.mix), []
    for source in sources:
        try:
            parts.append(load_dataset(DataConfig(path=source.path, val_fraction=cfg.val_fraction),
                                      block_size))
        except UserError as e:
            raise UserError(f"data.mix source '{source.name}': {e}") from None
    first = parts[0].tokenizer
    for source, part in zip(sources[1:], parts[1:]):
        if not same_mapping(first, part.tokenizer):
            raise UserError(f"data.mix sources '{sources[0].name}' ({first.spec}, {first.vocab_size} "
                            f"tokens) and '{source.name}' ({part.tokenizer.spec}, "
                            f"{part.tokenizer.vocab_size} tokens) use different tokenizers; prepare "
                            "every source with the same --tokenizer")
    return Dataset(first, None, None, Mixture(sources, cfg.mix_block), tuple(parts))


def checked(dataset: Dataset, name: str, unit: str, block_size: int) -> Dataset:
    shortest = min(len(dataset.train), len(dataset.val))
    if shortest <= block_size:
        raise UserError(f"{name} is too short: its smaller split has {shortest} {unit}, but "
                        f"model.block_size={block_size} needs at least {block_size + 1}; use "
                        "more text or a smaller block_size")
    return dataset


def model_ids(cfg, tokenizer) -> tuple[int, int | None]:
    """(the model's vocabulary, the end-of-text id that opens documents or None), each checked
    against the data's tokenizer: the one place a run derives them (jaxpar.training.step.build)."""
    return model_vocab(cfg, tokenizer), document_eot(cfg, tokenizer)


def model_vocab(cfg, tokenizer) -> int:
    """The model's vocabulary: model.vocab_size, or the tokenizer's when that is 0."""
    wanted = cfg.model.vocab_size
    if wanted and wanted < tokenizer.vocab_size:
        raise UserError(f"model.vocab_size={wanted} is smaller than the data's vocabulary of "
                        f"{tokenizer.vocab_size} tokens; raise it, or set 0 to follow the data")
    return wanted or tokenizer.vocab_size


def document_eot(cfg, tokenizer) -> int | None:
    """The end-of-text token that opens documents under data.document_mask, else None."""
    if not cfg.data.document_mask:
        return None
    if tokenizer.eot_id is None:
        raise UserError(f"data.document_mask needs an end-of-text token, and the data's tokenizer "
                        f"({tokenizer.spec}) has none; prepare the data with --tokenizer bytes, bpe, "
                        "gpt2 or a tokenizer.json that has one, or drop data.document_mask")
    return tokenizer.eot_id


def batch_offsets(seed: int, split: str, step: int, batch_size: int, n_tokens: int,
                  block_size: int) -> np.ndarray:
    """Start offsets of the global batch: a pure function of (seed, split, step)."""
    rng = np.random.default_rng([seed, SPLIT_IDS[split], step])
    return rng.integers(0, n_tokens - block_size, size=batch_size)


class BatchLoader:
    """Builds global (inputs, targets) arrays of shape (microbatches, rows, block_size).

    Rows are split as the rule table splits 'batch' (over 'data'); this process builds only the rows its devices hold.
    """

    def __init__(self, dataset: Dataset, split: str, seed: int, batch_size: int,
                 microbatches: int, block_size: int, mesh):
        self.sources, self.mixture = dataset.splits(split), dataset.mixture
        self.parts = dataset.parts if dataset.mixture else (dataset,)
        # The mapping the model embeds (a mixture's sources share it); None: unchecked (tests).
        self.vocab = None if dataset.tokenizer is None else dataset.tokenizer.vocab_size
        self.split, self.seed = split, seed
        self.batch_size, self.block_size = batch_size, block_size
        self.shape = (microbatches, batch_size // microbatches, block_size)
        self.sharding = batch_sharding(mesh)
        rows = [idx[1] for idx in self.sharding.addressable_devices_indices_map(self.shape).values()]
        self.row_start = min(r.start or 0 for r in rows)
        self.row_stop = max(self.shape[1] if r.stop is None else r.stop for r in rows)

    def rows(self, step: int) -> tuple[np.ndarray | None, np.ndarray]:
        """(source of each row or None for one source, start offsets), shaped (microbatches, rows)."""
        if self.mixture is None:
            return None, batch_offsets(self.seed, self.split, step, self.batch_size,
                                       len(self.sources[0]), self.block_size).reshape(self.shape[:2])
        which, offsets = mixture_rows(self.mixture, self.seed, SPLIT_IDS[self.split], step,
                                      self.batch_size, [len(t) for t in self.sources], self.block_size)
        return which.reshape(self.shape[:2]), offsets.reshape(self.shape[:2])

    def local_rows(self, step: int) -> np.ndarray:
        """This process's rows of the batch at `step`: (microbatches, local rows, block_size + 1)."""
        which, offsets = self.rows(step)
        window = offsets[:, self.row_start:self.row_stop, None] + np.arange(self.block_size + 1)
        if which is None:
            return self.gather(0, window).astype(np.int32)
        which, chunk = which[:, self.row_start:self.row_stop], np.empty(window.shape, np.int32)
        for source in np.unique(which):
            chunk[which == source] = self.gather(source, window[which == source])
        return chunk

    def gather(self, source: int, window: np.ndarray) -> np.ndarray:
        """The source's ids at `window`, checked against the vocabulary before the cast to int32
        (which would wrap a uint32 id past 2**31 to a negative one)."""
        ids = self.sources[source][window]
        if self.vocab is not None and (top := int(ids.max())) >= self.vocab:
            raise self.beyond(source, top)
        return ids

    def beyond(self, source: int, top: int) -> Exception:
        """The error for a batch of the source's split holding id `top`, past the vocabulary."""
        part = self.parts[source]
        if not part.prepared:  # text is encoded by a tokenizer made from it: only a bug gets here
            return RuntimeError(f"a {self.split} batch holds token id {top}, beyond the vocabulary "
                                f"of {self.vocab} tokens of the tokenizer that encoded it; this is "
                                "a bug in jaxpar: please report it")
        error = beyond_vocab(Path(part.prepared) / f"{self.split}.bin", top, self.vocab,
                             part.tokenizer.spec)
        if self.mixture is None:
            return error
        return UserError(f"data.mix source '{self.mixture.sources[source].name}': {error}")

    def __call__(self, step: int) -> tuple[jax.Array, jax.Array]:
        chunk = self.local_rows(step)
        return tuple(jax.make_array_from_process_local_data(self.sharding, part, self.shape)
                     for part in (chunk[..., :-1], chunk[..., 1:]))


class Prefetcher:
    """The loader's batches for consecutive steps, each built on a worker thread while the step
    before it runs, so building a batch (reading a memory-mapped file, above all) never holds up
    the device. Any step may be asked for; a step out of order is built at once. A batch that
    fails to build (an id past the vocabulary) raises its error in the call for its step."""

    def __init__(self, loader: BatchLoader, first_step: int):
        self.loader, self.sharding = loader, loader.sharding
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="jaxpar-batches")
        self.next = (first_step, self.pool.submit(loader, first_step))

    def __call__(self, step: int) -> tuple[jax.Array, jax.Array]:
        ready_step, ready = self.next
        batch = ready.result() if ready_step == step else self.loader(step)
        self.next = (step + 1, self.pool.submit(self.loader, step + 1))
        return batch

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


"""`python -m jaxpar.sample --ckpt DIR` (or `--hf HF_DIR`): generate text on any mesh, with a KV cache.

Usable as a library: `model = load(dir, "tp=2")` (jaxpar.inference.loading), then
`generate(model, "ROMEO:")`.
"""

import time
from dataclasses import dataclass, replace

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.core.errors import UserError
from jaxpar.inference.loading import Model, load  # noqa: F401  (load: the library face, as the docstring says)
from jaxpar.inference.sample_memory import check_room
from jaxpar.models.decode import empty_cache, forward, pick


@dataclass
class Generation:
    texts: list[str]  # each sample: the prompt, then the new tokens
    new_tokens: int  # per sample
    seconds: float  # generating, compile excluded
    compile_seconds: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.texts) * self.new_tokens / self.seconds


def prompt_ids(tokenizer, prompt: str) -> np.ndarray:
    """The prompt's token ids; an unknown character is a UserError naming it, and so is a prompt
    that gives no token (empty, or text the tokenizer drops, e.g. spaces a word-level one splits
    on): the model would have no position to continue from."""
    ids = tokenizer.encode(prompt)
    if not len(ids):
        what = "is empty" if not prompt else (f"{prompt!r} encodes to no tokens with this model's "
                                              f"tokenizer ({tokenizer.spec}), which drops that text")
        raise UserError(f"the prompt {what}; pass at least one character the tokenizer keeps with --prompt")
    return ids


def make_decoders(model: Model, temperature: float, top_k: int):
    """Jitted (prefill, step, recompute). Each returns the next token of every sample; token i
    uses the key fold_in(key(seed), i) on either path, so both sample the same way."""
    # Rows of the embedding beyond the tokenizer's (model.vocab_size) are never sampled: the
    # logits mask them as the vocabulary's padding.
    net = replace(model.net, vocab_size=model.tokenizer.vocab_size)

    def next_token(logits, seed, i):
        return pick(logits, jax.random.fold_in(jax.random.key(seed), i), temperature, top_k)

    def prefill(params, tokens, seed, i, starts=None):
        logits, cache = forward(net, params, tokens, empty_cache(net, tokens.shape[0]), 0, starts)
        return next_token(logits[:, -1], seed, i), cache

    def step(params, cache, token, pos, seed, i, starts=None):
        logits, cache = forward(net, params, token[:, None], cache, pos, starts)
        return next_token(logits[:, 0], seed, i), cache

    def recompute(params, tokens, length, seed, i, starts=None):
        """The whole window again; tokens are padded to block_size, and causal attention keeps
        the padding from reaching position length - 1."""
        logits, _ = forward(net, params, tokens, empty_cache(net, tokens.shape[0]), 0, starts)
        return next_token(jax.lax.dynamic_index_in_dim(logits, length - 1, 1, False), seed, i)

    return jax.jit(prefill), jax.jit(step, donate_argnums=1), jax.jit(recompute)


def generate(model: Model, prompt: str = "\n", max_new_tokens: int = 500,
             temperature: float = 0.8, top_k: int = 200, seed: int = 1337, num_samples: int = 1,
             use_cache: bool = True, on_tokens=None, stop_at_eot: bool = False) -> Generation:
    """Sample `num_samples` continuations of `prompt`; `on_tokens(ids)` sees each new token of
    every sample as it comes. With `stop_at_eot`, a sample ends at its end-of-text token (left
    out of its text), and generation stops when every sample has ended.

    The window is block_size tokens, as the model was trained (learned positions go no
    further). A longer prompt keeps its last block_size tokens, as nanoGPT does. When the window
    is full, it restarts with its last block_size // 2 tokens, re-prefilled: nanoGPT instead
    recomputes the last block_size tokens for every new token, which a cache cannot do.
    """
    ids = prompt_ids(model.tokenizer, prompt)[-model.cfg.model.block_size:]
    eot = end_of_text(model.tokenizer) if stop_at_eot else None
    if (temperature, top_k) not in model.decoders:
        model.decoders[temperature, top_k] = make_decoders(model, temperature, top_k)
    decoders = model.decoders[temperature, top_k]
    with jax.set_mesh(model.mesh):
        compile_start = time.perf_counter()
        # Compiles the decoders (the warm-up's compile) to weigh them, before anything is allocated.
        check_room(model, decoders, num_samples, len(ids), max_new_tokens, use_cache, seed)
        window = np.tile(ids, (num_samples, 1))
        warm_up(model, decoders, window, seed, use_cache)
        start = time.perf_counter()
        tokens = sample_tokens(model, decoders, window, max_new_tokens, seed, use_cache, eot, on_tokens)
        seconds = time.perf_counter() - start
    texts = [prompt + model.tokenizer.decode(row if eot is None else until(row, eot))
             for row in tokens]
    return Generation(texts, tokens.shape[1], seconds, start - compile_start)


def window_starts(model: Model, window: np.ndarray, last: int | None = None):
    """Each window token's document start (the window's index of the end-of-text token that
    opened it, 0 before any), on the mesh; its last `last` columns; None without documents. A
    document opened before the window's start counts from the window's first token, as a
    restarted window's positions do."""
    eot = model.documents_eot
    if eot is None:
        return None
    index = np.arange(window.shape[1])
    starts = np.maximum.accumulate(np.where(window == eot, index, 0), axis=1)
    return on_mesh(model, starts if last is None else starts[:, -last:])


def on_mesh(model: Model, tokens) -> jax.Array:
    """int32 tokens, replicated over the model's mesh."""
    return jax.device_put(np.asarray(tokens, np.int32), NamedSharding(model.mesh, P()))


def padded(model: Model, window: np.ndarray) -> jax.Array:
    """The window, padded to block_size with zeros (the no-cache path's one shape)."""
    out = np.zeros((window.shape[0], model.cfg.model.block_size), np.int32)
    out[:, :window.shape[1]] = window
    return on_mesh(model, out)


def padded_starts(model: Model, window: np.ndarray):
    """window_starts of the padded window (the padding in the last document), or None."""
    starts = window_starts(model, window)
    if starts is None:
        return None
    return on_mesh(model, np.pad(np.asarray(starts), ((0, 0), (0, model.cfg.model.block_size - window.shape[1])),
                                 mode="edge"))


def warm_up(model: Model, decoders, window: np.ndarray, seed: int, use_cache: bool) -> None:
    """Compile outside the timing: one call of each decoder, on the shapes the loop will use."""
    prefill, step, recompute = decoders
    rows, keep = window.shape[0], max(model.cfg.model.block_size // 2, 1)
    if use_cache:
        for n in {window.shape[1], keep}:
            zeros = np.zeros((rows, n))
            cache = None  # one cache at a time, as check_room weighs them
            token, cache = prefill(model.params, on_mesh(model, zeros), seed, 0, window_starts(model, zeros))
        jax.block_until_ready(step(model.params, cache, token, 0, seed, 0, window_starts(model, zeros, 1)))
    else:
        jax.block_until_ready(recompute(model.params, padded(model, window), 1, seed, 0, padded_starts(model, window)))


def sample_tokens(model: Model, decoders, window: np.ndarray, max_new_tokens: int, seed: int,
                  use_cache: bool, eot: int | None, on_tokens) -> np.ndarray:
    """(samples, new tokens): up to max_new_tokens each, fewer once every sample has met `eot`.

    When the window is full it restarts from its last block_size // 2 tokens, re-prefilled."""
    prefill, step, recompute = decoders
    block, params = model.cfg.model.block_size, model.params
    keep = max(block // 2, 1)
    ended, new, new_window = np.zeros(window.shape[0], bool), [], True
    for i in range(max_new_tokens):
        if not use_cache:
            token = recompute(params, padded(model, window), window.shape[1], seed, i, padded_starts(model, window))
        elif new_window:
            cache = None  # the full window's cache goes before the restarted one is made
            token, cache = prefill(params, on_mesh(model, window), seed, i, window_starts(model, window))
        else:
            token, cache = step(params, cache, token, window.shape[1] - 1, seed, i, window_starts(model, window, 1))
        new_window = False
        latest = np.asarray(token)
        new.append(latest)
        if on_tokens is not None:
            on_tokens(latest)
        window = np.concatenate([window, latest[:, None]], axis=1)
        if window.shape[1] > block:  # no position left for the newest token
            window, new_window = window[:, -keep:], True
        ended |= latest == eot  # never true without stop_at_eot (eot is None)
        if ended.all():
            break
    return np.stack(new, axis=1)


def end_of_text(tokenizer) -> int:
    if tokenizer.eot_id is None:
        raise UserError(f"--stop-at-eot: this model's tokenizer ({tokenizer.spec}) has no "
                        "end-of-text token; drop --stop-at-eot")
    return tokenizer.eot_id


def until(row: np.ndarray, token: int) -> np.ndarray:
    """`row` up to (not including) its first `token`."""
    hits = np.flatnonzero(row == token)
    return row[:hits[0]] if len(hits) else row


class Streamer:
    """Prints one sample's text as its tokens come: the decoded text so far, less what is already
    printed, so that a character split over several byte-level tokens prints once it is whole."""

    def __init__(self, tokenizer, eot: int | None):
        self.tokenizer, self.eot, self.ids, self.printed, self.ended = tokenizer, eot, [], 0, False

    def __call__(self, latest: np.ndarray):
        token = int(latest[0])
        self.ended = self.ended or token == self.eot
        if self.ended:
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):  # a character whose bytes are not all here yet
            self.print_from(text)

    def print_from(self, text: str):
        print(text[self.printed:], end="", flush=True)
        self.printed = len(text)

    def finish(self):
        """Print what is held back when the sample ends: bytes of no whole character, decoded
        with replacement characters as the tokenizer's own decode gives them."""
        self.print_from(self.tokenizer.decode(self.ids))

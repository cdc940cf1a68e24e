"""Sampling from a checkpoint: the decode forward is the model's, the KV cache gives the tokens
that recomputing the window gives, and the command line streams text from a run directory.
Samples that the free memory cannot hold are one line before anything is allocated.

Tolerance: the decode forward's logits are within 1e-5 of the model's (absolute; the logits
are of order 1). Greedy tokens must be equal.
"""

import jax
import numpy as np
import pytest
from helpers import exits_with_one_line

from jaxpar.data.tokenizer import ByteTokenizer
from jaxpar.inference import sample
from jaxpar.models.decode import cache_bytes_per_token, empty_cache, forward
from jaxpar.models.transformer import abstract_model
from jaxpar.parallel import hlo
from jaxpar.sample import main as sample_main

LOGITS_ATOL = 1e-5
TRAINED = "tiny_30_steps"  # the tiny model after 30 steps on dp=2 (conftest.TRAINED_RUNS)


@pytest.mark.parametrize("spec, n_devices", [("dp=1", 1), ("tp=2", 2)])
def test_decode_forward_matches_the_model(trained, spec, n_devices):
    model = sample.load(trained, spec)
    assert model.step == 30 and model.mesh.size == n_devices
    vocab = model.tokenizer.vocab_size
    tokens = np.asarray(model.tokenizer.encode("First Citizen:\nBefore we proceed"))[None, :]
    net, _, _ = abstract_model(model.cfg, vocab)
    with jax.set_mesh(model.mesh):
        expected = jax.jit(net)(model.params, tokens)

        @jax.jit
        def decode(params, tokens):
            logits, _ = forward(net, params, tokens, empty_cache(net, 1), 0)
            # The same positions fed in two parts: the second reads the first from the cache.
            _, cache = forward(net, params, tokens[:, :20], empty_cache(net, 1), 0)
            rest, _ = forward(net, params, tokens[:, 20:], cache, 20)
            return logits, rest
        logits, rest = decode(model.params, tokens)
    real = slice(0, vocab)
    np.testing.assert_allclose(logits[..., real], expected[..., real], atol=LOGITS_ATOL)
    np.testing.assert_allclose(rest[..., real], expected[:, 20:, real], atol=LOGITS_ATOL)


@pytest.mark.parametrize("spec", ["dp=1", "tp=2"])
def test_kv_cache_greedy_equals_recomputing_greedy(trained, spec):
    """50 greedy tokens: past the 32-token window, so the window restart is covered too."""
    model = sample.load(trained, spec)
    kwargs = dict(prompt="ROMEO:", max_new_tokens=50, temperature=0, num_samples=2)
    cached = sample.generate(model, use_cache=True, **kwargs)
    recomputed = sample.generate(model, use_cache=False, **kwargs)
    assert cached.texts == recomputed.texts
    assert len(cached.texts[0]) == len("ROMEO:") + 50
    assert cached.tokens_per_s > 0 and recomputed.tokens_per_s > 0


def test_the_same_seed_samples_the_same_text(trained):
    model = sample.load(trained)
    first, again, other = (sample.generate(model, max_new_tokens=20, seed=s) for s in (1, 1, 2))
    assert first.texts == again.texts != other.texts


@pytest.mark.parametrize("where", ["run", "checkpoints"])
def test_cli_streams_text_from_a_run_or_its_checkpoints(trained, capsys, where):
    path = trained if where == "run" else trained / "checkpoints"
    sample_main(["--ckpt", str(path), "--prompt", "ROMEO:", "--max-new-tokens", "40"])
    out, err = capsys.readouterr()
    assert out.startswith("ROMEO:") and len(out) == len("ROMEO:") + 40 + 1  # and a newline
    assert "tokens/s (KV cache" in err


@pytest.mark.parametrize("argv, expected", [
    (["--prompt", "caf\u00e9"], "character '\u00e9' is not in the vocabulary"),
    (["--prompt", ""], "the prompt is empty"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--mesh", "tp=3"], "tp=3 does not divide model.n_head=4"),
])
def test_cli_bad_input_is_one_line_and_exit_2(trained, capsys, argv, expected):
    with pytest.raises(SystemExit) as exit_info:
        sample_main(["--ckpt", str(trained)] + argv)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("jaxpar.sample: error: ") and expected in err, err


def test_a_prompt_the_tokenizer_drops_whole_is_one_line():
    """Spaces give a word-level tokenizer.json no token: the model would have nothing to continue."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from jaxpar.core.errors import UserError
    from jaxpar.data.tokenizer import HFTokenizer
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = HFTokenizer(words, "words.json")
    assert sample.prompt_ids(tokenizer, "the").tolist() == [1]
    with pytest.raises(UserError, match=r"the prompt '   ' encodes to no tokens .*\(words.json\)"):
        sample.prompt_ids(tokenizer, "   ")


def test_cli_without_checkpoints_names_the_folder(tmp_path, capsys):
    with pytest.raises(SystemExit):
        sample_main(["--ckpt", str(tmp_path)])
    assert f"no checkpoints in '{tmp_path}'" in capsys.readouterr().err


def test_the_streamer_prints_what_it_held_back_when_the_sample_ends(capsys):
    """A byte-level sample may end inside a character: the held-back bytes are printed at the
    end, with replacement characters, as the tokenizer's decode gives them."""
    tokenizer = ByteTokenizer()
    streamer = sample.Streamer(tokenizer, eot=None)
    ids = list(b"ROMEO: caf") + list("\u00e9".encode())[:1] + [0xFF]  # \u00e9 cut short, a stray byte
    for token in ids:
        streamer(np.array([token]))
    assert capsys.readouterr().out == "ROMEO: caf"  # held back: it may be a character's start
    streamer.finish()
    assert capsys.readouterr().out == tokenizer.decode(ids)[len("ROMEO: caf"):] == "\ufffd\ufffd"


GIB = 2**30


@pytest.mark.parametrize("argv, expected", [
    # The KV cache alone, 16 GB, was granted and then filled until the OOM killer ended it.
    (["--num-samples", "1000000", "--max-new-tokens", "1000000000"], "need about 59,604,"),
    (["--max-new-tokens", "1000000000"], "1 sample of 1,000,000,000 tokens needs about 178.8 GiB of host memory"),
], ids=["samples-and-tokens", "tokens"])
def test_samples_past_the_hosts_memory_are_one_line_before_any_allocation(trained, capsys, monkeypatch,
                                                                          argv, expected):
    """With 16 GiB free (whatever this host has): refused in one line before the decoders compile."""
    monkeypatch.setattr(hlo, "host_available_bytes", lambda: 16 * GIB)
    monkeypatch.setattr(sample, "warm_up", lambda *a: pytest.fail("the decoders ran before the refusal"))
    exits_with_one_line(capsys, "jaxpar.sample", lambda: sample_main(["--ckpt", str(trained)] + argv),
                        expected, "but this host has 16.0 GiB free; lower --num-samples or --max-new-tokens")
    assert capsys.readouterr().out == ""


def test_a_kv_cache_past_the_free_memory_is_one_line(trained, capsys, monkeypatch):
    """64 samples of 10 tokens need a few MiB (1 MiB of KV cache): with 0.5 MiB free, the compiled decoders' estimate (at
    least the KV cache) refuses them before anything is allocated; with the host's own free memory
    (the control), they are sampled."""
    argv = ["--ckpt", str(trained), "--num-samples", "64", "--max-new-tokens", "10"]
    with monkeypatch.context() as patch:
        patch.setattr(hlo, "host_available_bytes", lambda: 2**19)
        patch.setattr(sample, "warm_up", lambda *a: pytest.fail("the decoders ran before the refusal"))
        exits_with_one_line(capsys, "jaxpar.sample", lambda: sample_main(argv),
                            "64 samples of 10 tokens need about", "(the KV cache and the logits as XLA estimates "
                            "them, on 1 host device, and the tokens), but this host has 0.5 MiB free")
    from jaxpar.inference import sample_memory
    model = sample.load(trained)
    with jax.set_mesh(model.mesh):
        need = sample_memory.device_bytes(model, sample.make_decoders(model, 0.8, 200), 64, 1, True, 1337)
    cache = 64 * model.cfg.model.block_size * cache_bytes_per_token(model.net)
    assert 2**19 < cache <= need
    sample_main(argv)
    assert capsys.readouterr().out.count("---------------") == 63

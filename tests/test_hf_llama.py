"""Hugging Face Llama checkpoints in and out: transformers' logits from the fixtures on one device
and on tp=2, tied and untied, GQA 4/2, llama3 rope scaling, a sharded and a bfloat16 checkpoint;
a bit-exact round trip; exactly HF's names, shapes and dtypes; and every refusal as one line.

The fixtures (tests/fixtures/hf_llama_*, made by scripts/fixtures/hf_fixtures.py make --family llama with real
transformers 5.23) are random LlamaForCausalLMs with vocab 101. Tolerance: logits within rtol 1e-5
plus atol 1e-5 of transformers' float32 ones (they are of order 1 to 6).
"""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import mesh_overrides, tiny_config
from helpers import cached_logits, logits_of, tensors_of
from helpers import placed as placed_on

from jaxpar.core.errors import UserError
from jaxpar.eval import main as eval_main
from jaxpar.formats.hf_files import save_weights
from jaxpar.inference import evaluate, export, sample
from jaxpar.inference.loading import load_hf
from jaxpar.models import hf
from jaxpar.models.decode import empty_cache
from jaxpar.models.transformer import build_model
from jaxpar.prepare import main as prepare_main
from jaxpar.sample import main as sample_main
from jaxpar.train import main as train_main

FIXTURES = Path(__file__).parent / "fixtures"
TRAINED = "tiny_llama"  # configs/tiny_llama.toml after 2 steps (conftest.TRAINED_RUNS)
TIED, LLAMA3, BF16 = (FIXTURES / f"hf_llama_{name}" for name in ("tied", "untied_llama3", "bf16"))
RTOL = ATOL = 1e-5


def placed(hf_dir: Path, spec: str = "dp=1"):
    """(cfg, vocab_size, mesh, param shardings) for the model in hf_dir on the mesh `spec`, ZeRO off."""
    return placed_on(spec, 0, hf_dir)


@pytest.mark.parametrize("hf_dir, spec", [(TIED, "dp=1"), (TIED, "tp=2"), (LLAMA3, "dp=1"),
                                          (LLAMA3, "tp=2"), (BF16, "dp=2")])
def test_hf_llama_gives_transformers_logits(hf_dir, spec):
    cfg, vocab, mesh, shardings = placed(hf_dir, spec)
    m = cfg.model
    assert (m.family, m.n_head, m.kv_heads, vocab) == ("llama", 4, 2, 101)
    assert m.tie_embeddings == (hf_dir != LLAMA3) and m.rope_type == ("llama3" if hf_dir == LLAMA3 else "default")
    params = hf.load_hf_params(hf_dir, cfg.model, vocab, shardings)
    assert all(a.dtype == np.float32 for a in jax.tree.leaves(params))  # bf16 files too
    ids, expected = np.load(hf_dir / "input_ids.npy"), np.load(hf_dir / "logits.npy")
    np.testing.assert_allclose(logits_of(cfg, vocab, mesh, params, ids), expected, RTOL, ATOL)
    if spec == "dp=1":  # the KV-cache forward pass, at every position at once and then token by token
        np.testing.assert_allclose(cached_logits(cfg, vocab, mesh, params, ids), expected, RTOL, ATOL)
        np.testing.assert_allclose(cached_logits(cfg, vocab, mesh, params, ids, 9), expected[:, 9:], RTOL, ATOL)
        assert empty_cache(build_model(cfg, vocab), 2).k.shape == (2, 2, 2, m.block_size, 16 if hf_dir == LLAMA3 else 8)


def test_llama3_scaling_matters():
    """Default RoPE frequencies miss transformers' logits by far more than the tolerance."""
    cfg, vocab, mesh, shardings = placed(LLAMA3)
    params = hf.load_hf_params(LLAMA3, cfg.model, vocab, shardings)
    cfg.model.rope_type = "default"
    ids, expected = np.load(LLAMA3 / "input_ids.npy"), np.load(LLAMA3 / "logits.npy")
    assert np.abs(logits_of(cfg, vocab, mesh, params, ids) - expected).max() > 100 * ATOL


@pytest.mark.parametrize("hf_dir", [TIED, LLAMA3])
def test_export_is_what_save_pretrained_writes_and_round_trips(tmp_path, hf_dir):
    cfg, vocab, _, shardings = placed(hf_dir)
    params = hf.load_hf_params(hf_dir, cfg.model, vocab, shardings)
    exported, original = hf.hf_state_dict(params, cfg.model, vocab), tensors_of(hf_dir)
    assert sorted(exported) == sorted(original)
    for name, array in original.items():
        assert (exported[name].shape, exported[name].dtype) == (array.shape, array.dtype), name
        np.testing.assert_array_equal(exported[name], array, err_msg=name)
    config = json.loads((hf_dir / "config.json").read_text())
    written = hf.hf_config(cfg.model, vocab, eot_id=0)
    for key in ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "hidden_size",
                "num_key_value_heads", "intermediate_size", "head_dim", "vocab_size", "rms_norm_eps",
                "tie_word_embeddings", "rope_parameters", "hidden_act", "attention_bias", "mlp_bias"):
        assert written[key] == config[key], key
    out = tmp_path / "hf"  # jaxpar -> HF (sharded) -> jaxpar, bit for bit
    out.mkdir()
    assert len(save_weights(exported, out, max_shard_bytes=30_000)) > 2
    (out / "config.json").write_text(json.dumps(written))
    again_cfg = tiny_config(**{"train.zero": 0})
    assert hf.apply_hf_config(again_cfg, out, {}) == vocab and again_cfg.model == cfg.model
    again = hf.load_hf_params(out, again_cfg.model, vocab, shardings)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(again), jax.device_get(params))


def test_bfloat16_export_has_bfloat16_tensors():
    cfg, vocab, _, shardings = placed(BF16)
    params = hf.load_hf_params(BF16, cfg.model, vocab, shardings)
    exported = hf.hf_state_dict(params, cfg.model, vocab, dtype=tensors_of(BF16)["model.norm.weight"].dtype)
    for name, array in tensors_of(BF16).items():  # bf16 -> float32 master weights -> bf16: exact
        assert exported[name].dtype == array.dtype and np.array_equal(exported[name], array), name


def test_transformers_4_rope_fields_read_as_5s(tmp_path):
    config = json.loads((LLAMA3 / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config |= {"rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}
    old = copy_with(tmp_path, LLAMA3, config)
    assert hf.model_overrides_from_hf(old) == hf.model_overrides_from_hf(LLAMA3)


def copy_with(tmp_path: Path, hf_dir: Path, config: dict) -> Path:
    out = tmp_path / "hf"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(hf_dir, out)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("change, expected", [
    ({"model_type": "mistral", "sliding_window": 4096}, "has sliding_window=4096"),
    ({"model_type": "qwen2"}, "has Qwen2's biases on q, k and v"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "has rope type 'yarn'"),
    ({"hidden_act": "gelu"}, "has hidden_act 'gelu'"),
    ({"attention_bias": True}, "has attention_bias=true"),
    ({"model_type": "falcon"}, "jaxpar loads gpt2 (GPT2LMHeadModel), llama (LlamaForCausalLM), qwen3"),
])
def test_unsupported_architectures_are_one_line(tmp_path, change, expected):
    config = json.loads((TIED / "config.json").read_text()) | change
    with pytest.raises(UserError) as error:
        hf.model_overrides_from_hf(copy_with(tmp_path, TIED, config))
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_a_missing_shard_is_named(tmp_path):
    out = copy_with(tmp_path, LLAMA3, json.loads((LLAMA3 / "config.json").read_text()))
    (out / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(UserError, match="names the shard model-00002-of-00003.safetensors, which is not"):
        hf.model_overrides_from_hf(out)


def test_tp_that_does_not_divide_the_kv_heads_is_refused():
    cfg = tiny_config(**mesh_overrides("tp=4"))
    with pytest.raises(UserError, match="tp=4 does not divide n_kv_head=2 of the model in .*; choose tp "
                       "from the divisors of 2, and put the other devices on dp"):
        hf.apply_hf_config(cfg, TIED, {})


# ---- the commands: export, sample --hf, eval --hf; resuming with the other family ----

def test_export_in_bfloat16_and_in_shards_loads_back(trained, tmp_path):
    model = sample.load(trained)
    vocab = model.vocab_size
    _, files = export.export(trained, tmp_path / "bf16", dtype="bfloat16")
    assert files == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    tensors = tensors_of(tmp_path / "bf16")
    assert {str(a.dtype) for a in tensors.values()} == {"bfloat16"} and "lm_head.weight" in tensors
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 8, 32)  # 2 KV heads
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    _, files = export.export(trained, tmp_path / "shards", max_shard_bytes=20_000)
    assert "model.safetensors.index.json" in files and "model-00002-of-00006.safetensors" in files
    cfg, loaded_vocab, _, shardings = placed(tmp_path / "shards")
    assert cfg.model.max_positions == 32  # max_position_embeddings, from the run's block_size
    assert loaded_vocab == vocab and dataclasses.replace(cfg.model, max_positions=0) == model.cfg.model
    loaded = hf.load_hf_params(tmp_path / "shards", cfg.model, vocab, shardings)
    params = jax.tree.map(np.array, model.params)  # writable copies
    for name in ("wte", "lm_head"):  # padding rows are not exported
        params[name][vocab:] = 0
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(loaded), params)


def test_sample_and_eval_use_an_hf_directory_as_it_is(trained, tmp_path, capsys):
    """The export of a run, with --hf, samples the run's greedy text and evaluates to its loss,
    on one device and on tp=2."""
    export.export(trained, tmp_path / "hf")
    greedy = ["--temperature", "0", "--prompt", "ROMEO:", "--max-new-tokens", "12"]
    texts = []
    for source in (["--ckpt", str(trained)], ["--hf", str(tmp_path / "hf")],
                   ["--hf", str(tmp_path / "hf"), "--mesh", "tp=2"]):
        sample_main(source + greedy)
        texts.append(capsys.readouterr().out)
    assert texts[0].startswith("ROMEO:") and texts[0] == texts[1] == texts[2]
    # The loss over the same tokens: the checkpoint on one device, the export with --hf on tp=2.
    tokens = np.random.default_rng(0).integers(0, sample.load(trained).tokenizer.vocab_size, 32 * 8 + 1)
    losses = [evaluate.evaluate(sample.load(trained), tokens)["loss"],
              evaluate.evaluate(load_hf(tmp_path / "hf", "tp=2", block_size=32), tokens)["loss"]]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


def test_eval_hf_runs_on_prepared_data_and_needs_it(trained, tmp_path, capsys):
    export.export(trained, tmp_path / "hf")
    text = tmp_path / "text.txt"
    text.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 40)
    prepare_main([str(text), "--out", str(tmp_path / "data"), "--tokenizer", str(tmp_path / "hf" / "tokenizer.json")])
    capsys.readouterr()
    eval_main(["--hf", str(tmp_path / "hf"), "--data", str(tmp_path / "data"), "--mesh", "dp=2"])
    result = json.loads(capsys.readouterr().out)
    assert result["hf"] == str(tmp_path / "hf") and result["blocks"] > 0 and 0 < result["loss"] < 10
    with pytest.raises(SystemExit):
        eval_main(["--hf", str(tmp_path / "hf")])
    assert "--hf needs --data" in capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [
    (["--hf", str(TIED)], "has no tokenizer.json, which jaxpar.sample needs"),
    (["--hf", str(TIED), "--mesh", "tp=4"], "tp=4 does not divide n_kv_head=2"),
    (["--ckpt", "x", "--hf", str(TIED)], "not allowed with argument"),
])
def test_sample_hf_refusals_are_one_line(capsys, argv, expected):
    with pytest.raises(SystemExit) as exit_info:
        sample_main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and expected in err and len(err.splitlines()) == 1, err


def test_resuming_a_checkpoint_of_the_other_family_is_one_line(trained, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--config", "tiny", "--mesh", "dp=8", "--out", str(trained), "--steps", "3"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert "holds a model.family=llama model, and this run asks for gpt2" in err

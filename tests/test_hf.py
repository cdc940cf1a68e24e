"""Hugging Face GPT-2 checkpoints in and out: the fixture's logits on any mesh and ZeRO stage, a
bit-exact round trip, the exact names/shapes/dtypes save_pretrained writes, the export command,
and every refusal as one line.

The fixture (tests/fixtures/hf_gpt2_tiny, made by scripts/fixtures/hf_fixtures.py make --family gpt2 with real
transformers) is a random GPT2LMHeadModel with vocab 101, so wte's padding to 128 rows is
exercised. Tolerance: logits within rtol 1e-5 plus atol 1e-5 of transformers' float32 ones (they
are of order 1; the largest difference measured was 3e-6).
"""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import mesh_overrides, tiny_config
from helpers import logits_of
from helpers import placed as helpers_placed
from safetensors import safe_open
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from jaxpar.core.errors import UserError
from jaxpar.data.loader import load_dataset
from jaxpar.data.tokenizer import ByteTokenizer, CharTokenizer
from jaxpar.export import main as export_main
from jaxpar.formats.hf_files import write_manifest
from jaxpar.inference import export, sample
from jaxpar.models import hf
from jaxpar.models.decode import empty_cache, forward
from jaxpar.models.transformer import abstract_model, build_model
from jaxpar.nn.layers import padded_vocab
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.checkpoints.checkpoint import CHECKPOINTS, Checkpoints, make_meta
from jaxpar.training.step.build import build

FIXTURE = Path(__file__).parent / "fixtures" / "hf_gpt2_tiny"
TRAINED = "tiny"  # the tiny model (tanh GELU) after 3 steps (conftest.TRAINED_RUNS)
RTOL = ATOL = 1e-5


def placed(spec: str = "dp=1", zero: int = 0, hf_dir=FIXTURE, **overrides):
    return helpers_placed(spec, zero, hf_dir, **overrides)


def host(params) -> dict:
    return jax.tree.map(np.array, params)  # writable copies


@pytest.mark.parametrize("spec, zero", [("dp=1", 0), ("dp=2,tp=2", 0), ("dp=2,tp=2", 3)])
def test_hf_checkpoint_gives_transformers_logits_on_any_mesh(spec, zero):
    cfg, vocab, mesh, shardings = placed(spec, zero)
    assert (vocab, cfg.model.gelu, cfg.model.n_layer, cfg.model.block_size) == (101, "tanh", 2, 32)
    params = hf.load_hf_params(FIXTURE, cfg.model, vocab, shardings)
    for array, where in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)):
        assert array.sharding == where
    if zero == 3:  # placement: the big weights are split over 'data' as well as 'tensor'
        assert "data" in str(params["blocks"]["qkv"]["kernel"].sharding.spec)
        assert "data" in str(params["wte"].sharding.spec)
    ids = np.load(FIXTURE / "input_ids.npy")
    expected = np.load(FIXTURE / "logits.npy")
    np.testing.assert_allclose(logits_of(cfg, vocab, mesh, params, ids), expected, RTOL, ATOL)
    if spec == "dp=1":
        # Sampling's forward pass (with its KV cache) honours model.gelu as well.
        model = build_model(cfg, vocab)
        with jax.set_mesh(mesh):
            decoded, _ = jax.jit(lambda p, t: forward(model, p, t, empty_cache(model, 2), 0))(params, ids)
        np.testing.assert_allclose(np.asarray(decoded)[..., :vocab], expected, RTOL, ATOL)
        # The tanh GELU matters: the exact one misses by 1e-3, 100x the tolerance.
        cfg.model.gelu = "exact"
        assert np.abs(logits_of(cfg, vocab, mesh, params, ids) - expected).max() > 30 * ATOL


def test_padding_rows_of_wte_are_zero():
    cfg, vocab, _, shardings = placed()
    wte = np.asarray(hf.load_hf_params(FIXTURE, cfg.model, vocab, shardings)["wte"])
    assert wte.shape == (padded_vocab(101), 32) and not wte[vocab:].any() and wte[:vocab].any()


def fixture_tensors() -> dict:
    with safe_open(FIXTURE / "model.safetensors", framework="numpy") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_state_dict_is_what_save_pretrained_writes():
    cfg, vocab, _, shardings = placed()
    exported = hf.hf_state_dict(hf.load_hf_params(FIXTURE, cfg.model, vocab, shardings), cfg.model, vocab)
    original = fixture_tensors()
    assert sorted(exported) == sorted(original)
    for name, array in original.items():
        assert (exported[name].shape, exported[name].dtype) == (array.shape, array.dtype), name
        np.testing.assert_array_equal(exported[name], array, err_msg=name)
    config = json.loads((FIXTURE / "config.json").read_text())
    written = hf.hf_config(cfg.model, vocab, eot_id=100)
    for key in ("model_type", "architectures", "n_layer", "n_head", "n_embd", "n_positions",
                "vocab_size", "activation_function", "layer_norm_epsilon", "bos_token_id",
                "eos_token_id", "tie_word_embeddings", "n_inner", "scale_attn_weights"):
        assert written[key] == config[key], key


def write_hf_dir(path: Path, tensors: dict, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return path


def random_params(cfg, vocab: int) -> dict:
    """Params of the model's shapes, every element random (biases and scales too), in numpy:
    quicker than compiling the model's init."""
    _, shapes, _ = abstract_model(cfg, vocab)
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32), shapes)


@pytest.mark.parametrize("gelu", ["exact", "tanh"])
def test_jaxpar_to_hf_to_jaxpar_is_bit_exact(tmp_path, gelu):
    cfg = tiny_config(**{"model.gelu": gelu})
    vocab = 65
    mesh = build_mesh(cfg, jax.devices()[:1])
    shardings = build(cfg, mesh, vocab=vocab).shardings
    params = random_params(cfg, vocab)
    hf_dir = write_hf_dir(tmp_path / "hf", hf.hf_state_dict(params, cfg.model, vocab),
                          hf.hf_config(cfg.model, vocab, None))
    loaded_cfg = tiny_config()
    assert hf.apply_hf_config(loaded_cfg, hf_dir, {}) == vocab
    assert loaded_cfg.model == cfg.model
    loaded = host(hf.load_hf_params(hf_dir, loaded_cfg.model, vocab, shardings.params))
    params["wte"][vocab:] = 0  # padding rows are not exported, and come back as zeros
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_names_without_the_transformer_prefix_and_a_tied_lm_head_load(tmp_path):
    tensors = {name.removeprefix("transformer."): a for name, a in fixture_tensors().items()}
    tensors["lm_head.weight"] = tensors["wte.weight"]
    config = json.loads((FIXTURE / "config.json").read_text())
    bare = write_hf_dir(tmp_path / "bare", tensors, config)
    cfg, vocab, _, shardings = placed()
    jax.tree.map(np.testing.assert_array_equal, host(hf.load_hf_params(bare, cfg.model, vocab, shardings)),
                 host(hf.load_hf_params(FIXTURE, cfg.model, vocab, shardings)))
    tensors["lm_head.weight"] = tensors["wte.weight"] + 1
    untied = write_hf_dir(tmp_path / "untied", tensors, config)
    with pytest.raises(UserError, match="lm_head.weight differs from wte.weight"):
        hf.load_hf_params(untied, cfg.model, vocab, shardings)


def copy_fixture(tmp_path: Path, **config_changes) -> Path:
    out = tmp_path / "hf"
    shutil.copytree(FIXTURE, out)
    config = json.loads((out / "config.json").read_text()) | config_changes
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_model_overrides_from_hf():
    overrides, vocab = hf.model_overrides_from_hf(FIXTURE)
    assert vocab == 101 and overrides == {
        "model.n_layer": 2, "model.n_head": 4, "model.n_embd": 32, "model.block_size": 32,
        "model.family": "gpt2", "model.bias": True, "model.gelu": "tanh"}


@pytest.mark.parametrize("change, expected", [
    ({"model_type": "falcon", "architectures": ["FalconForCausalLM"]},
     "describes a model_type 'falcon' model (FalconForCausalLM); jaxpar loads gpt2 (GPT2LMHeadModel), "
     "llama (LlamaForCausalLM), qwen3"),
    ({"scale_attn_by_inverse_layer_idx": True}, "has scale_attn_by_inverse_layer_idx=true"),
    ({"scale_attn_weights": False}, "has scale_attn_weights=false"),
    ({"n_inner": 100}, "has n_inner=100"),
    ({"layer_norm_epsilon": 1e-6}, "has layer_norm_epsilon=1e-06"),
    ({"activation_function": "relu"}, "has activation_function 'relu'"),
    ({"tie_word_embeddings": False}, "has tie_word_embeddings=false"),
])
def test_unsupported_configs_are_refused(tmp_path, change, expected):
    with pytest.raises(UserError, match=None) as error:
        hf.model_overrides_from_hf(copy_fixture(tmp_path, **change))
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_gelu_and_exact_activations_map(tmp_path):
    for activation, kind in [("gelu", "exact"), ("gelu_pytorch_tanh", "tanh")]:
        shutil.rmtree(tmp_path / "hf", ignore_errors=True)
        overrides, _ = hf.model_overrides_from_hf(copy_fixture(tmp_path, activation_function=activation))
        assert overrides["model.gelu"] == kind


def test_missing_directory_and_files_are_named(tmp_path):
    with pytest.raises(UserError, match="directory '.*nowhere' not found"):
        hf.model_overrides_from_hf(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no config.json"):
        hf.model_overrides_from_hf(tmp_path / "empty")
    hf_dir = copy_fixture(tmp_path)
    (hf_dir / "model.safetensors").rename(hf_dir / "pytorch_model.bin")
    with pytest.raises(UserError, match="has no model.safetensors or model.safetensors.index.json; "
                                        "it has pytorch_model.bin"):
        hf.model_overrides_from_hf(hf_dir)


def test_conflicting_override_names_both_values():
    cfg = tiny_config(**{"model.n_layer": 6})
    with pytest.raises(UserError) as error:
        hf.apply_hf_config(cfg, FIXTURE, {"model.n_layer": "6"})
    assert str(error.value) == (f"model.n_layer=6 conflicts with n_layer=2 in {FIXTURE}/config.json;"
                                " drop the override")
    with pytest.raises(UserError, match="model.gelu=exact conflicts with activation_function=gelu_new"):
        hf.apply_hf_config(tiny_config(), FIXTURE, {"model.gelu": "exact"})
    # An override that agrees is fine, as is one of a field the checkpoint does not set.
    cfg = tiny_config(**{"model.dtype": "bfloat16"})
    hf.apply_hf_config(cfg, FIXTURE, {"model.n_head": "4", "model.dtype": "bfloat16"})
    assert (cfg.model.n_head, cfg.model.dtype) == (4, "bfloat16")


def test_n_head_that_tp_cannot_split_is_refused():
    cfg = tiny_config(**mesh_overrides("tp=3"))
    with pytest.raises(UserError, match=r"tp=3 does not divide n_head=4 of the model in .*config.json"):
        hf.apply_hf_config(cfg, FIXTURE, {})


def test_weights_that_disagree_with_the_config_are_named(tmp_path):
    hf_dir = copy_fixture(tmp_path, n_positions=64)
    cfg = tiny_config()
    vocab = hf.apply_hf_config(cfg, hf_dir, {})
    _, _, _, shardings = placed(hf_dir=hf_dir)
    with pytest.raises(UserError, match=r"transformer.wpe.weight has shape \(32, 32\), but its "
                                        r"config.json implies \(64, 32\)"):
        hf.load_hf_params(hf_dir, cfg.model, vocab, shardings)


# ---- python -m jaxpar.export ----

def test_export_writes_what_transformers_loads(trained, tmp_path, capsys):
    out = tmp_path / "hf"
    export_main(["--ckpt", str(trained), "--out", str(out)])
    assert f"step 3 of {trained} -> {out}" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "jaxpar_export.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    with safe_open(out / "model.safetensors", framework="numpy") as f:
        assert f.metadata() == {"format": "pt"} and sorted(f.keys()) == sorted(fixture_tensors())
    model = sample.load(trained)
    vocab = model.tokenizer.vocab_size
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["activation_function"], config["n_positions"]) == (
        vocab, "gelu_new", 32)
    cfg, loaded_vocab, _, shardings = placed(hf_dir=out)
    assert loaded_vocab == vocab and cfg.model == model.cfg.model
    loaded = host(hf.load_hf_params(out, cfg.model, vocab, shardings))
    params = host(model.params)
    params["wte"][vocab:] = 0  # padding rows are not exported
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
    # The tokenizer files: AutoTokenizer reads tokenizer.json through tokenizer_config.json.
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "First Citizen:\nBefore we proceed"
    assert tokenizer.encode(text).ids == model.tokenizer.encode(text).tolist()
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer_config["model_max_length"] == 32


def test_tokenizer_config_names_the_end_of_text_token_where_there_is_one():
    files = export.tokenizer_files(ByteTokenizer(), block_size=32)
    config = json.loads(files["tokenizer_config.json"])
    assert config["eos_token"] == config["bos_token"] == config["unk_token"] == "<|endoftext|>"
    assert Tokenizer.from_str(files["tokenizer.json"]).token_to_id("<|endoftext|>") == 256
    assert "eos_token" not in json.loads(
        export.tokenizer_files(CharTokenizer("ab"), 32)["tokenizer_config.json"])


def test_export_replaces_an_earlier_export_only_with_force(trained, tmp_path, capsys):
    """An earlier export: its manifest, and the one file it lists (the rest: tests/test_export_faults.py)."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    write_manifest(out, ["config.json"])
    with pytest.raises(SystemExit) as exit_info:
        export_main(["--ckpt", str(trained), "--out", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"jaxpar.export: error: --out '{out}' holds an earlier export; pass --force to "
                   "replace it, or another directory\n")
    export_main(["--ckpt", str(trained), "--out", str(out), "--force"])
    assert json.loads((out / "config.json").read_text()) and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary folder left behind


def assert_one_line_exit_2(capsys, argv, expected):
    with pytest.raises(SystemExit) as exit_info:
        export_main(argv)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("jaxpar.export: error: ") and expected in err, err


def test_export_of_a_run_without_checkpoint_is_one_line(tmp_path, capsys):
    assert_one_line_exit_2(capsys, ["--ckpt", str(tmp_path), "--out", str(tmp_path / "hf")],
                           f"no checkpoints in '{tmp_path}'")
    assert not (tmp_path / "hf").exists()


def test_export_of_a_model_without_biases_is_refused(tmp_path, capsys):
    """A checkpoint of a bias=false model, saved as training saves one (export reads only the
    params and meta, so the optimizer state is left out)."""
    cfg = tiny_config(**{"model.bias": "false"})
    tokenizer = load_dataset(cfg.data, cfg.model.block_size).tokenizer
    checkpoints = Checkpoints(tmp_path / "run" / CHECKPOINTS)
    checkpoints.save(0, random_params(cfg, tokenizer.vocab_size), {"left_out": np.zeros(())},
                     make_meta(cfg, tokenizer, 0))
    checkpoints.wait()
    checkpoints.close()
    assert_one_line_exit_2(capsys, ["--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf")],
                           "this model was trained with model.bias=false")
    assert not (tmp_path / "hf").exists()

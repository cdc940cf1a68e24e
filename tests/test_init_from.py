"""`--init-from HF_DIR` (train.init_from): a run that starts from the Hugging Face GPT-2 in
tests/fixtures/hf_gpt2_tiny (vocab 101, tanh GELU), on the built-in corpus at character level
(65 tokens, so the model's 101 rows hold them). The GPT-2 presets in configs/.

The train state before any update holds exactly the fixture's weights (bit-identical to
hf.load_hf_params) and zero Adam moments, on 1 device and on dp=2,tp=2. Step 0's loss equals
the cross-entropy, computed here in float64 numpy, of the logits of the fixture's weights on step
0's batch; those logits come from jaxpar's forward, which reproduces the fixture's transformers
logits (checked here too, rtol and atol 1e-5 as in tests/test_hf.py). Tolerance: losses within
rtol 1e-5, as in tests/test_equivalence.py.
"""

import math
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import fails_with

from jaxpar.core.config import load_config
from jaxpar.data.loader import batch_offsets, load_dataset
from jaxpar.data.prepare import prepare
from jaxpar.inference import sample
from jaxpar.models import hf
from jaxpar.nn.layers import padded_vocab
from jaxpar.parallel.mesh import build_mesh
from jaxpar.train import parse_args, run
from jaxpar.training.run import setup
from jaxpar.training.step.build import build

FIXTURE = Path(__file__).parent / "fixtures" / "hf_gpt2_tiny"
LOSS_RTOL = 1e-5
HF_RTOL = HF_ATOL = 1e-5
STEPS = 2
SPECS = ["dp=1", "dp=2,tp=2"]


def config(spec: str, out: Path):
    """The config `python -m jaxpar.train --config tiny --init-from FIXTURE --mesh spec` runs."""
    cfg, out_dir, _ = parse_args(["--config", "tiny", "--init-from", str(FIXTURE), "--mesh", spec,
                                  "--steps", str(STEPS), "--train.eval_every=0", "--out", str(out)])
    assert out_dir == out and not out.exists()
    return cfg


def devices(cfg):
    return jax.devices()[:cfg.mesh.dp * cfg.mesh.tp * cfg.mesh.pp]


def test_the_model_takes_the_checkpoints_shape(tmp_path):
    cfg = config("dp=1", tmp_path / "run")
    m = cfg.model
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size, m.bias, m.gelu, m.vocab_size) == (
        2, 4, 32, 32, True, "tanh", 101)
    assert cfg.train.init_from == str(FIXTURE)


@pytest.fixture(scope="module")
def hf_loss(tmp_path_factory):
    """Step 0's loss of the fixture's weights on step 0's batch, in float64 numpy."""
    cfg = config("dp=1", tmp_path_factory.mktemp("reference") / "run")
    mesh = build_mesh(cfg, devices(cfg))
    built = build(cfg, mesh, vocab=101)
    model, shardings = built.model, built.shardings
    params = hf.load_hf_params(FIXTURE, cfg.model, 101, shardings.params)
    forward = jax.jit(model)
    with jax.set_mesh(mesh):
        fixture_logits = forward(params, np.load(FIXTURE / "input_ids.npy"))
    np.testing.assert_allclose(np.asarray(fixture_logits)[..., :101],
                               np.load(FIXTURE / "logits.npy"), HF_RTOL, HF_ATOL)

    train = np.asarray(load_dataset(cfg.data, 32).train)
    offsets = batch_offsets(cfg.train.seed, "train", 0, cfg.train.batch_size, len(train), 32)
    window = train[offsets[:, None] + np.arange(33)].astype(np.int32)
    inputs, targets = window[:, :-1], window[:, 1:]
    with jax.set_mesh(mesh):
        logits = np.asarray(forward(params, inputs), np.float64)[..., :101]
    top = logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return float((log_z - picked).mean())


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    out = tmp_path_factory.mktemp("init") / "run"
    cfg = config("dp=1", out)
    return out, run(cfg, out, devices(cfg), progress=False)


@pytest.mark.parametrize("spec", SPECS)
def test_the_state_before_any_update_holds_the_checkpoints_weights(spec, tmp_path):
    cfg = config(spec, tmp_path / "run")
    dataset = load_dataset(cfg.data, cfg.model.block_size)
    mesh = build_mesh(cfg, devices(cfg))
    with jax.set_mesh(mesh):
        p = setup.set_up(build(cfg, mesh, dataset.tokenizer), dataset, None, fresh=False)
        expected = hf.load_hf_params(FIXTURE, cfg.model, 101, p.built.shardings.params)
    assert p.start == 0 and int(p.state.step) == 0
    assert p.state.params["wte"].shape == (padded_vocab(101), 32)
    for (path, got), want, where in zip(jax.tree_util.tree_leaves_with_path(p.state.params),
                                        jax.tree.leaves(expected),
                                        jax.tree.leaves(p.built.shardings.params)):
        assert got.sharding == where, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                      err_msg=jax.tree_util.keystr(path))
    moments = [a for a in jax.tree.leaves(p.state.opt_state) if a.ndim > 0]
    assert moments and not any(np.asarray(a).any() for a in moments)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("spec", SPECS)
def test_step_0s_loss_is_the_checkpoints(spec, hf_loss, one_device, tmp_path):
    if spec == "dp=1":
        result = one_device[1]
    else:
        cfg = config(spec, tmp_path / "run")
        result = run(cfg, None, devices(cfg), progress=False)
        np.testing.assert_allclose([result.losses[s] for s in range(STEPS)],
                                   [one_device[1].losses[s] for s in range(STEPS)], rtol=LOSS_RTOL)
    assert result.info["vocab_size"] == 101
    np.testing.assert_allclose(result.losses[0], hf_loss, rtol=LOSS_RTOL)
    # Not what a random init gives: the fixture's weights (initializer_range 0.2) are far from it.
    assert abs(result.losses[0] - math.log(101)) > 0.1


def test_the_checkpoint_keeps_the_gpt2s_shape_and_the_datas_tokenizer(one_device):
    out, _ = one_device
    model = sample.load(out)
    assert model.step == STEPS and model.vocab_size == 101
    assert (model.tokenizer.kind, model.tokenizer.vocab_size) == ("char", 65)
    assert model.cfg.model.gelu == "tanh" and model.cfg.train.init_from == str(FIXTURE)
    assert model.params["wte"].shape == (padded_vocab(101), 32)


@pytest.fixture(scope="module")
def bytes_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("bytes")
    (root / "text.txt").write_text("To be, or not to be, that is the question.\n" * 100)
    prepare([str(root / "text.txt")], root / "data", "bytes")
    return root / "data"


@pytest.mark.parametrize("argv, expected", [
    (["--model.n_layer=3"],
     f"model.n_layer=3 conflicts with n_layer=2 in {FIXTURE}/config.json; drop the override"),
    (["--model.n_embd", "64"],
     f"model.n_embd=64 conflicts with n_embd=32 in {FIXTURE}/config.json"),
    (["--model.gelu=exact"], "model.gelu=exact conflicts with activation_function=gelu_new"),
    (["--model.vocab_size=200"],
     f"model.vocab_size=200 conflicts with vocab_size=101 of the model in {FIXTURE}; drop the "
     "override"),
    (["--mesh", "tp=8"], "tp=8 does not divide n_head=4 of the model in"),
    (["--mesh", "dp=8", "--data.path={bytes}"],
     "model.vocab_size=101 is smaller than the data's vocabulary of 257 tokens"),
])
def test_a_conflict_with_the_checkpoint_is_one_line(capsys, tmp_path, bytes_data, argv, expected):
    argv = [a.replace("{bytes}", str(bytes_data)) for a in argv]
    fails_with(capsys, tmp_path, ["--config", "tiny", "--init-from", str(FIXTURE), *argv], expected)


def test_a_missing_checkpoint_directory_is_one_line(capsys, tmp_path):
    fails_with(capsys, tmp_path, ["--config", "tiny", "--init-from", str(tmp_path / "nowhere")],
               f"Hugging Face checkpoint directory '{tmp_path / 'nowhere'}' not found")


def test_weights_holding_a_nan_are_named_before_anything_is_written(capsys, tmp_path):
    """A NaN in one of the fixture's tensors: the run stops before step 0 naming that weight (as
    `eval --hf` does), not at step 0's loss with advice to lower train.lr; nothing is written.
    A control: the fixture itself starts (the tests above)."""
    import shutil

    from safetensors.numpy import load_file, save_file
    hf_dir = tmp_path / "hf"
    shutil.copytree(FIXTURE, hf_dir)
    tensors = load_file(hf_dir / "model.safetensors")
    tensors["transformer.ln_f.weight"][3] = np.nan
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    fails_with(capsys, tmp_path, ["--config", "tiny", "--init-from", str(hf_dir), "--mesh", "dp=8"],
               f"the weights in '{hf_dir}' hold NaN or infinite values (params['ln_f']['scale']); ")


@pytest.mark.parametrize("name, n_layer, n_head, n_embd", [
    ("gpt2", 12, 12, 768), ("gpt2-medium", 24, 16, 1024), ("gpt2-large", 36, 20, 1280),
    ("gpt2-xl", 48, 25, 1600)])
def test_gpt2_presets_have_hugging_faces_shapes(name, n_layer, n_head, n_embd):
    m = load_config(name, {}).model
    assert (m.n_layer, m.n_head, m.n_embd) == (n_layer, n_head, n_embd)
    assert (m.vocab_size, m.block_size, m.gelu, m.bias) == (50257, 1024, "tanh", True)
    assert m.n_embd % m.n_head == 0
    # What export would write for it is a config.json that --init-from reads back as this shape.
    cfg = load_config(name, {})
    exported = hf.hf_config(cfg.model, 50257, 50256)
    assert (exported["n_layer"], exported["n_head"], exported["n_embd"], exported["n_positions"],
            exported["vocab_size"], exported["activation_function"]) == (
        n_layer, n_head, n_embd, 1024, 50257, "gelu_new")


def test_a_preset_with_another_vocabulary_takes_the_checkpoints(tmp_path):
    """configs/gpt2.toml says vocab_size 50257; the fixture's GPT-2 has 101, and no override was
    given, so the checkpoint's wins, as its shape does."""
    cfg, _, _ = parse_args(["--config", "gpt2", "--init-from", str(FIXTURE), "--dry-run"])
    assert cfg.model.vocab_size == 101 and cfg.model.n_layer == 2

"""Rare values refused in one line that names what the user set and the fix: a seed out of the
generators' range, a config-file value of the wrong kind, mixture weights that overflow or get no
row, DeepSeek's heads checked by their own keys (and an odd unrotated width computed), YaRN's keys
by their rope_type, a DeepSeek config.json field that is null, a mesh too large to start on the
host; and Ctrl-C in jaxpar.sample and jaxpar.eval, exit 130 without a traceback.

Every check here happens before JAX compiles anything: the tests call the entry points in-process.
"""

import os
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from helpers import hf_dir_with, plain_mla

import jaxpar.eval as eval_command
import jaxpar.sample as sample_command
from jaxpar.core.config import SEED_MAX, load_config
from jaxpar.core.errors import UserError
from jaxpar.core.execution import ExecutionPlan
from jaxpar.models import hf
from jaxpar.models.deepseek.model import latent_attention
from jaxpar.models.llama.model import Layer
from jaxpar.models.transformer import build_model
from jaxpar.parallel import mesh
from jaxpar.parallel.mesh import force_host_devices, parse_mesh_spec
from jaxpar.planning import hardware

DEEPSEEK = "tiny_deepseek"
HF_DEEPSEEK = Path(__file__).parent / "fixtures" / "hf_deepseek_v3"


def refused(config: str, **overrides) -> str:
    with pytest.raises(UserError) as error:
        tiny_config(config, **overrides)
    return str(error.value)


@pytest.mark.parametrize("seed", [-1, 10**23, SEED_MAX + 1])
def test_a_seed_out_of_the_generators_range_is_one_line(seed):
    assert refused("tiny", **{"train.seed": seed}) == (
        f"train.seed (--seed) must be from 0 to 4294967295, got {seed}: numpy's generators take no negative "
        "seed, and JAX's keys keep 32 bits; choose one in that range")
    assert tiny_config("tiny", **{"train.seed": SEED_MAX}).train.seed == SEED_MAX


@pytest.mark.parametrize("text, expected", [
    ("[optimizer]\nlr = [1e-3]\n", "optimizer.lr expects float, got [0.001] (a TOML array); give it a single number"),
    ("[train]\nlr = [1e-3]\n", "train.lr expects float, got [0.001] (a TOML array); give it a single number"),
    ("[model]\nn_layer = [2]\n", "model.n_layer expects int, got [2] (a TOML array); give it a single integer"),
    ("[model]\nn_layer = {layers = 2}\n", "model.n_layer expects int, got {'layers': 2} (a TOML table)"),
    ("[train]\nseed = 1979-05-27\n", "train.seed expects int, got datetime.date(1979, 5, 27); give it a single integer"),
    ("[log]\nwandb = true\n", "log.wandb expects str, got True; give it a single string"),
    ("[eval]\ntasks = [\"hellaswag\"]\n", "eval.tasks expects str, got ['hellaswag'] (a TOML array)"),
])
def test_a_config_file_value_of_the_wrong_kind_is_one_line(tmp_path, text, expected):
    (tmp_path / "run.toml").write_text(text)
    with pytest.raises(UserError) as error:
        load_config(str(tmp_path / "run.toml"), {})
    assert str(error.value).startswith(expected), error.value


def test_a_toml_list_of_dense_layers_is_their_indices(tmp_path):
    (tmp_path / "run.toml").write_text('[model]\nfamily = "llama"\nn_experts = 4\ndense_layers = [0, 2]\n')
    assert load_config(str(tmp_path / "run.toml"), {}).model.dense_layers == "0,2"


@pytest.mark.parametrize("mix, block, expected", [
    ("a=D:1e308,b=D:1e308", 1000, ("data.mix's weights (up to 1e+308) add up past the largest float; divide "
                                   "them all by one factor: only their ratios count")),
    ("a=D:1,b=D:1e-9", 1000, ("data.mix source 'b' has weight 1e-09, too small for one row in each block of "
                              "data.mix_block=1000, so it would never be sampled; give it at least 0.000501, or "
                              "leave it out")),
    ("a=D:1,b=D:1,c=D:1", 2, ("data.mix_block=2 rows a block cannot hold a row of each of data.mix's 3 sources, "
                              "so source 'c' is never sampled; raise data.mix_block (default 1000)")),
])
def test_mixture_weights_that_overflow_or_get_no_row_are_one_line(mix, block, expected):
    assert refused("tiny", **{"data.mix": mix, "data.mix_block": block}) == expected
    # the weight said gets a row: the control
    tiny_config("tiny", **{"data.mix": "a=D:1,b=D:0.000501"})


@pytest.mark.parametrize("overrides, expected", [
    ({"model.qk_rope_head_dim": 3}, "model.qk_rope_head_dim=3 is odd, and rotary positions rotate pairs of dims"),
    ({"model.kv_lora_rank": 0}, "model.kv_lora_rank must be >= 1, got 0"),
    ({"model.routed_scaling_factor": 0}, "model.routed_scaling_factor must be > 0, got 0.0"),
    ({"model.rope_beta_fast": 0}, "model.rope_beta_fast must be > 0, got 0.0"),
    ({"model.rope_type": "yarn", "model.rope_factor": 0},
     "model.rope_factor must be > 0 for yarn rope scaling, got 0.0; choose another, or drop it (default 8.0)"),
    ({"model.rope_type": "yarn", "model.rope_theta": 1}, "model.rope_theta must not be 1 for yarn rope scaling"),
])
def test_deepseek_checks_name_its_own_keys(overrides, expected):
    assert refused(DEEPSEEK, **overrides).startswith(expected)


@pytest.mark.parametrize("overrides, expected", [
    ({"model.head_dim": 9}, "model.head_dim=9 is odd, and rotary positions rotate pairs of dims; choose an even one"),
    ({"model.head_dim": -2}, "model.head_dim must be >= 0, got -2"),
])
def test_llama_head_checks_name_the_key_set(overrides, expected):
    assert refused("tiny_llama", **overrides) == expected


def test_deepseek_takes_odd_unrotated_widths_and_computes_them():
    """MLA concatenates and projects the unrotated dims as they are: 7 of them (and 5-wide values)
    pass the checks, n_embd need not split into the heads, and latent attention matches the plain
    per-head computation (tests/test_deepseek.py's) at those widths."""
    cfg = tiny_config(DEEPSEEK, **{"model.qk_nope_head_dim": 7, "model.v_head_dim": 5})
    tiny_config(DEEPSEEK, **{"model.n_embd": 30})
    shapes = build_model(cfg, 65, None, ExecutionPlan()).shapes()["lead_blocks"]
    rng = np.random.default_rng(0)  # layer 0's attention; scores and outputs of order 1
    layer_p = {name: jax.tree.map(lambda s, norm="norm" in name: np.ones(s.shape[1:], np.float32) if norm
                                  else rng.normal(0, 0.2, s.shape[1:]).astype(np.float32), w)
               for name, w in shapes.items() if name.startswith(("attn", "q_", "kv_"))}
    x = rng.normal(size=(2, 8, cfg.model.n_embd)).astype(np.float32)
    layer = Layer(ExecutionPlan(), layer_p, jax.tree.map(lambda _: None, layer_p), cfg.model, jnp.float32)
    got = np.asarray(latent_attention(layer, jnp.asarray(x), (None, None))[0]) - x
    want = plain_mla(jax.tree.map(lambda a: np.asarray(a, np.float64), layer_p), x.astype(np.float64), cfg.model)
    assert np.max(np.abs(want)) > 0.5
    np.testing.assert_allclose(got, want, atol=1e-5 * np.max(np.abs(want)), rtol=0)


@pytest.mark.parametrize("change, expected", [
    ({"routed_scaling_factor": None}, "routed_scaling_factor must be a finite number, got null"),
    ({"n_group": None}, "n_group must be an integer, got null"),
    ({"first_k_dense_replace": None}, "first_k_dense_replace must be an integer, got null"),
    ({"q_lora_rank": "16"}, 'q_lora_rank must be an integer, got "16"'),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                          "beta_fast": "32"}}, 'rope_parameters.beta_fast must be a finite number, got "32"'),
])
def test_a_null_or_mistyped_deepseek_config_field_is_named(tmp_path, change, expected):
    hf_dir = hf_dir_with(tmp_path, HF_DEEPSEEK, **change)
    with pytest.raises(UserError) as error:
        hf.model_overrides_from_hf(hf_dir)
    assert str(error.value).startswith(f"'{hf_dir / 'config.json'}': {expected}; "), error.value
    # The control: q_lora_rank null is DeepSeek-V2-Lite's one query projection, as transformers reads it.
    (tmp_path / "control").mkdir()
    overrides, _ = hf.model_overrides_from_hf(hf_dir_with(tmp_path / "control", HF_DEEPSEEK, q_lora_rank=None))
    assert overrides["model.q_lora_rank"] == 0


@pytest.fixture
def unforced_host(monkeypatch):
    """As in a fresh process: no device count set by the user, and JAX's config not yet started
    (this one's already has the suite's 8 devices); forcing devices fails the test."""
    monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "")

    def update(*args):
        pytest.fail(f"host devices forced: {args}")
    monkeypatch.setattr(mesh, "jax", types.SimpleNamespace(config=types.SimpleNamespace(
        jax_num_cpu_devices=0, update=update)))


def test_a_mesh_too_large_for_the_host_is_refused_before_it_starts(unforced_host):
    cfg = load_config("tiny", parse_mesh_spec("dp=99999"))
    with pytest.raises(UserError) as error:
        force_host_devices(cfg.mesh)
    assert str(error.value).startswith("the mesh dp=99999 asks for 99999 devices in this process, and jaxpar starts "
                                       "at most 4096 CPU host devices")
    assert str(error.value).endswith("; ask for at most 4096, or spread the mesh over processes (dist.num_processes)")
    with pytest.raises(UserError, match="--target cpu:5000 asks for 5000 devices"):
        hardware.cpu_devices(hardware.parse_target("cpu:5000"))


@pytest.mark.parametrize("program, command", [("jaxpar.sample", sample_command), ("jaxpar.eval", eval_command)])
def test_ctrl_c_exits_130_without_a_traceback(capsys, monkeypatch, tmp_path, program, command):
    def interrupt(*args):
        raise KeyboardInterrupt

    def exit_now(code):  # os._exit, as a SystemExit this process survives
        raise SystemExit(code)
    monkeypatch.setattr(command, "load_source", interrupt)
    monkeypatch.setattr(os, "_exit", exit_now)
    try:
        command.main(["--ckpt", str(tmp_path)])
    except KeyboardInterrupt:
        pytest.fail(f"{program}: Ctrl-C escaped as a KeyboardInterrupt traceback")
    except SystemExit as exit_info:
        assert exit_info.code == 130
    else:
        pytest.fail(f"{program} went on after Ctrl-C")
    assert capsys.readouterr().err == f"{program}: interrupted\n"


"""Values that parse but mean nothing are refused in one line: non-finite floats, hyper-parameters
out of their range, a key set under both its names in one source, a config file that is not UTF-8
text, Hugging Face config.json fields of the wrong type, and jaxpar.sample's numeric flags.

Every check here happens before JAX compiles anything: the tests call the entry points in-process.
"""

from pathlib import Path

import pytest
from conftest import tiny_config
from helpers import exits_with_one_line, fails_with, hf_dir_with

from jaxpar.core.config import load_config
from jaxpar.core.errors import UserError
from jaxpar.eval import main as eval_main
from jaxpar.models import hf
from jaxpar.sample import main as sample_main

FIXTURES = Path(__file__).parent / "fixtures"
GPT2, LLAMA3, MIXTRAL = FIXTURES / "hf_gpt2_tiny", FIXTURES / "hf_llama_untied_llama3", FIXTURES / "hf_moe_mixtral"


@pytest.mark.parametrize("argv, expected", [
    (["--optimizer.lr=nan"], "optimizer.lr must be a finite number, got nan"),
    (["--optimizer.lr=inf"], "optimizer.lr must be a finite number, got inf"),
    (["--train.lr=nan"], "train.lr must be a finite number, got nan"),
    (["--optimizer.beta2=1.5"], "optimizer.beta2 must be in [0, 1), got 1.5"),
    (["--train.beta2=1.5"], "train.beta2 must be in [0, 1), got 1.5"),
    (["--train.lr=1e-3", "--optimizer.lr=3e-4"], "train.lr and optimizer.lr are the same key (train.lr is its older "
     "name) and both are set on the command line; keep one"),
    # An XLA option XLA does not know: found by a one-line compile when the plan is made.
    (["--train.xla_options=xla_gpu_enable_cublaslt=true,xla_no_such_option=1"],
     "train.xla_options: No such compile option: 'xla_no_such_option'; name an XLA DebugOptions field"),
])
def test_bad_values_on_the_command_line(capsys, tmp_path, argv, expected):
    fails_with(capsys, tmp_path, ["--config", "tiny", "--mesh", "dp=8"] + argv, expected)


@pytest.mark.parametrize("config, overrides, expected", [
    ("tiny", {"train.beta1": "-0.1"}, "train.beta1 must be in [0, 1), got -0.1"),
    ("tiny", {"optimizer.eps": "0"}, "optimizer.eps must be > 0, got 0.0"),
    ("tiny", {"optimizer.name": "muon", "optimizer.momentum": "1"}, "optimizer.momentum must be in [0, 1), got 1.0"),
    ("tiny", {"optimizer.name": "adafactor", "optimizer.decay_rate": "1.5"},
     "optimizer.decay_rate must be in [0, 1], got 1.5"),
    ("tiny", {"optimizer.name": "adafactor", "optimizer.clip_threshold": "0.5"},
     "optimizer.clip_threshold must be 0 (no clipping) or >= 1, got 0.5"),
    ("tiny", {"model.test_activation_l2": "inf"}, "model.test_activation_l2 must be a finite number, got inf"),
    ("tiny_moe", {"model.router_aux_coef": "nan"}, "model.router_aux_coef must be a finite number, got nan"),
    ("tiny_llama", {"model.rope_type": "default", "model.rope_factor": "-1"},
     "model.rope_factor must be > 0 for llama3 rope scaling, got -1.0"),
    ("tiny", {"model.logits_dtype": "bfloat16"}, "model.logits_dtype must be float32 or model.dtype (float32)"),
    ("tiny", {"model.norm_kernel": "triton"}, "model.norm_kernel must be one of xla, pallas, got 'triton'"),
    ("tiny", {"train.xla_options": "cublaslt"}, "train.xla_options takes NAME=VALUE pairs of XLA options (xla_...)"),
])
def test_values_out_of_range_are_refused(config, overrides, expected):
    with pytest.raises(UserError) as error:
        tiny_config(config, **overrides)
    assert expected in str(error.value)


@pytest.mark.parametrize("text, expected", [
    ("[optimizer]\nlr = nan\n", "optimizer.lr must be a finite number, got nan"),
    ("[train]\nlr = inf\n", "train.lr must be a finite number, got inf"),
    ("[optimizer]\nweight_decay = inf\n", "optimizer.weight_decay must be a finite number, got inf"),
    ("[train]\nlr = 1e-3\n[optimizer]\nlr = 3e-4\n", "train.lr and optimizer.lr are the same key (train.lr is its "
     "older name) and both are set in config file"),
])
def test_bad_values_in_a_config_file(tmp_path, text, expected):
    (tmp_path / "run.toml").write_text(text)
    with pytest.raises(UserError) as error:
        load_config(str(tmp_path / "run.toml"), {})
    assert expected in str(error.value)


def test_older_name_in_the_file_and_key_on_the_command_line_layer(tmp_path):
    """Across sources the command line overrides, under either name; within one, both are refused."""
    (tmp_path / "run.toml").write_text("[train]\nlr = 1e-3\nbeta2 = 0.9\n")
    cfg = load_config(str(tmp_path / "run.toml"), {"optimizer.lr": "3e-4"})
    assert cfg.optimizer.lr == 3e-4 and cfg.optimizer.beta2 == 0.9
    with pytest.raises(UserError, match="train.beta2 and optimizer.beta2 are the same key"):
        load_config(str(tmp_path / "run.toml"), {"optimizer.beta2": "0.95", "train.beta2": "0.95"})


def test_config_file_that_is_not_utf8_is_one_line(capsys, tmp_path):
    (tmp_path / "latin1.toml").write_bytes("[train]\nsteps = 5  # Müller\n".encode("latin-1"))
    fails_with(capsys, tmp_path, ["--config", str(tmp_path / "latin1.toml")],
               f"config file '{tmp_path / 'latin1.toml'}' is not UTF-8 text (byte 22); save it as UTF-8")


def test_config_path_that_is_a_directory_or_unreadable_is_one_line(capsys, tmp_path, monkeypatch):
    fails_with(capsys, tmp_path, ["--config", str(tmp_path)], f"config file '{tmp_path}' is a directory")
    locked = tmp_path / "locked.toml"
    locked.write_text("[train]\nsteps = 5\n")
    real_open = Path.open

    def refuse_locked(path, *args, **kwargs):  # as chmod 000 would, for root too
        if path == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(Path, "open", refuse_locked)
    fails_with(capsys, tmp_path, ["--config", str(locked)],
               f"config file '{locked}' cannot be read (Permission denied)")


# Integers must be JSON integers: 2.0 is refused as 2.5 is (save_pretrained never writes one).
@pytest.mark.parametrize("fixture, change, expected", [
    (GPT2, {"n_layer": "two"}, 'n_layer must be an integer, got "two"'),
    (GPT2, {"n_layer": None}, "n_layer must be an integer, got null"),
    (GPT2, {"n_layer": 2.5}, "n_layer must be an integer, got 2.5"),
    (GPT2, {"n_layer": 2.0}, "n_layer must be an integer, got 2.0"),
    (GPT2, {"n_embd": True}, "n_embd must be an integer, got true"),
    (GPT2, {"layer_norm_epsilon": float("nan")}, "layer_norm_epsilon must be a finite number, got NaN"),
    (LLAMA3, {"tie_word_embeddings": "false"}, 'tie_word_embeddings must be true or false, got "false"'),
    (LLAMA3, {"rms_norm_eps": "1e-5"}, 'rms_norm_eps must be a finite number, got "1e-5"'),
    (LLAMA3, {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": "eight", "low_freq_factor": 1,
                                  "high_freq_factor": 4, "original_max_position_embeddings": 64}},
     'rope_parameters.factor must be a finite number, got "eight"'),
    (MIXTRAL, {"num_local_experts": "4"}, 'num_local_experts must be an integer, got "4"'),
])
def test_hf_config_fields_of_the_wrong_type_are_one_line(tmp_path, fixture, change, expected):
    hf_dir = hf_dir_with(tmp_path, fixture, **change)
    with pytest.raises(UserError) as error:
        hf.model_overrides_from_hf(hf_dir)
    assert str(error.value).startswith(f"'{hf_dir / 'config.json'}': {expected}; ")


def test_each_command_refuses_a_wrongly_typed_hf_config(capsys, tmp_path):
    hf_dir = hf_dir_with(tmp_path, GPT2, n_layer="two")
    expected = f"'{hf_dir / 'config.json'}': n_layer must be an integer, got \"two\""
    fails_with(capsys, tmp_path, ["--config", "tiny", "--init-from", str(hf_dir)], expected)
    exits_with_one_line(capsys, "jaxpar.eval", lambda: eval_main(["--hf", str(hf_dir), "--data", str(tmp_path)]),
                        expected)
    exits_with_one_line(capsys, "jaxpar.sample", lambda: sample_main(["--hf", str(hf_dir)]), expected)


@pytest.mark.parametrize("argv, expected", [
    (["--temperature", "nan"], "--temperature must be a finite number (0: greedy), got nan"),
    (["--temperature", "inf"], "--temperature must be a finite number (0: greedy), got inf"),
    (["--seed", str(2**31)], "--seed must fit in 32 bits (from -2147483648 to 2147483647), got 2147483648"),
])
def test_sample_refuses_non_finite_and_out_of_range_numbers(capsys, tmp_path, argv, expected):
    exits_with_one_line(capsys, "jaxpar.sample", lambda: sample_main(["--ckpt", str(tmp_path / "run")] + argv),
                        expected)

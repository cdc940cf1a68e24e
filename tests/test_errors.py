"""Every bad input gets one line on stderr that names the problem, exit code 2, and no output dir."""

import subprocess
import sys

import pytest
from conftest import fresh_process_env
from helpers import fails_with

from jaxpar.core.config import Config, load_config
from jaxpar.core.errors import UserError
from jaxpar.train import main


@pytest.mark.parametrize("argv, expected", [
    (["--mesh", "dp=2,xp=2"], ["xp=2", "dp, tp, pp"]),
    (["--mesh", "dp=two"], ["integer", "'two'"]),
    (["--mesh", "dp=3"], ["uses 3 devices but 8 are available"]),
    (["--mesh", "dp=-1,tp=-1"], ["at most one mesh axis may be -1"]),
    (["--mesh", "dp=2,tp=2,dp=4"], ["mesh axis dp is given twice"]),
    (["--mesh", "dp=0,tp=8"], ["mesh.dp must be a positive integer"]),
    (["--mesh", "tp=8"], ["tp=8 does not divide model.n_head=4"]),
    (["--mesh", "dp=8", "--train.batch_size=12"], ["dp=8 does not divide the batch of 12"]),
    (["--mesh", "pp=8"], ["pp=8 does not divide model.n_layer=2"]),
    (["--mesh", "dp=4,pp=2", "--pipeline.microbatches=4"], ["do not split into dp=4 x 4 microbatches"]),
    (["--mesh", "tp=4,pp=2", "--train.batch_size=3"], ["cannot split 3 sequences", "pipeline.microbatches"]),
    (["--mesh", "dp=4,pp=2", "--pipeline.microbatches=1"], ["1f1b needs at least pp=2 microbatches"]),
    (["--mesh", "dp=4,pp=2", "--pipeline.schedule=dualpipev", "--model.n_layer=4"],
     ["dualpipev needs at least 2*pp=4 microbatches"]),
    (["--mesh", "dp=4,pp=2", "--pipeline.schedule=zigzag"], ["pipeline.schedule must be one of gpipe, 1f1b"]),
    (["--mesh", "dp=4,pp=2", "--pipeline.schedule=interleaved"], ["interleaved needs --pipeline.virtual >= 2"]),
    (["--mesh", "dp=4,pp=2", "--pipeline.schedule=interleaved", "--pipeline.virtual=2"],
     ["pp=2 x 2 layer chunks a stage (pipeline.virtual, or the schedule's own) do not divide model.n_layer=2"]),
])
def test_bad_mesh(capsys, tmp_path, argv, expected):
    fails_with(capsys, tmp_path, ["--config", "tiny"] + argv, *expected)


@pytest.mark.parametrize("argv, expected", [
    (["--model.n_layer=0"], ["model.n_layer must be positive, got 0"]),
    (["--steps", "0"], ["train.steps must be positive"]),
    (["--train.batch_size=-4"], ["train.batch_size must be positive"]),
    (["--train.adam_eps=-1e-8"], ["train.adam_eps must be > 0, got -1e-08"]),
    (["--train.lr=-1e-3"], ["train.lr must be >= 0, got -0.001"]),
    (["--train.min_lr=-1"], ["train.min_lr must be >= 0, got -1.0"]),
    (["--model.foo=1"], ["unknown config key 'model.foo'", "model.n_layer", "train.lr"]),
    (["--train.lr=fast"], ["train.lr expects float, got 'fast'"]),
    (["--model.n_head=3"], ["model.n_embd=32 must be divisible by model.n_head=3"]),
    (["--bogus"], ["unrecognised argument '--bogus'"]),
    (["--steps"], ["expected one argument"]),
])
def test_bad_config_value(capsys, tmp_path, argv, expected):
    fails_with(capsys, tmp_path, ["--config", "tiny"] + argv, *expected)


@pytest.mark.parametrize("argv, expected", [
    (["--model.n_kv_head=3"], ["model.n_kv_head=3 must divide model.n_head=4"]),
    (["--mesh", "dp=2,tp=4"], ["tp=4 does not divide model.n_kv_head=2", "dp", "--zero 3"]),
    (["--model.n_embd=36", "--model.n_head=4", "--model.mlp_dim=64"], ["each head's width, model.n_embd / model.n_head = 36/4 = 9, is odd"]),
    (["--model.family=mamba"], ["model.family must be one of gpt2, llama, deepseek, got 'mamba'"]),
    (["--model.gelu=tanh"], ["model.gelu is a gpt2-only setting", "model.family=llama"]),
    (["--model.bias=false"], ["model.bias is a gpt2-only setting"]),
    (["--model.rope_type=yarn"], ["model.rope_type must be one of default, llama3, got 'yarn'"]),
])
def test_bad_llama_config(capsys, tmp_path, argv, expected):
    fails_with(capsys, tmp_path, ["--config", "tiny_llama"] + argv, *expected)


def test_llama_keys_on_a_gpt2_model_are_refused(capsys, tmp_path):
    fails_with(capsys, tmp_path, ["--config", "tiny", "--model.n_kv_head=2"],
               "model.n_kv_head is a llama/deepseek-only setting, and this model is model.family=gpt2")


def test_a_saved_config_with_every_familys_keys_still_loads():
    """Checkpoints saved while every family's keys were one flat [model] section hold them all; a
    GPT-2's loads as a GPT-2 (n_experts, which every model answers, included). The control: the
    same key set on the command line is refused."""
    saved = Config().to_dict()
    saved["model"] |= {"n_kv_head": 0, "n_experts": 0, "rope_theta": 10000.0}
    cfg = Config.from_dict(saved)
    assert (cfg.model.family, cfg.model.n_experts, hasattr(cfg.model, "rope_theta")) == ("gpt2", 0, False)
    with pytest.raises(UserError, match="model.n_experts is a llama/deepseek-only setting"):
        load_config(None, {"model.n_experts": "0"})


def test_missing_config_file(capsys, tmp_path):
    fails_with(capsys, tmp_path, ["--config", str(tmp_path / "nope.toml")], "nope.toml", "not found")


def test_unknown_key_in_config_file(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlearning_rate = 1e-3\n")
    fails_with(capsys, tmp_path, ["--config", str(bad)], "unknown config key 'train.learning_rate'")


@pytest.mark.parametrize("content, expected", [
    (None, ["not found"]),
    (b"", ["is empty"]),
    (b"To be, or not to be" * 3, ["too short", "block_size=32"]),
    (b"\xff\xfe caf\xe9 " * 1000, ["not UTF-8"]),
])
def test_bad_data_file(capsys, tmp_path, content, expected):
    path = tmp_path / "data.txt"
    if content is not None:
        path.write_bytes(content)
    fails_with(capsys, tmp_path, ["--config", "tiny", f"--data.path={path}"], *expected)


def test_a_directory_that_was_not_prepared_is_named_as_such(capsys, tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    fails_with(capsys, tmp_path, ["--config", "tiny", f"--data.path={folder}"],
               "meta.json' not found", "run python -m jaxpar.prepare")


@pytest.mark.parametrize("below", ["", "run"])
def test_an_out_dir_that_is_or_is_inside_a_file_is_named_as_such(capsys, tmp_path, below):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    out = a_file / below if below else a_file
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", "tiny", "--out", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("is a file, not a directory; pass a directory"), err
    assert (f"inside '{a_file}'" in err) == bool(below)
    assert a_file.read_text() == "mine"


def test_cli_process_exits_2_with_one_line(tmp_path):
    """The real entry point, in a fresh process: exit code 2 and a single line, nothing written."""
    env = fresh_process_env()
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "jaxpar.train", "--mesh", "dp=2,tp=3",
                           "--config", "tiny", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("jaxpar.train: error: tp=3 does not divide model.n_head=4; "
                                   "choose tp from the divisors of n_head")
    assert not out.exists()


def test_a_step_too_big_for_memory_is_refused_before_anything_is_written(capsys, tmp_path,
                                                                        monkeypatch):
    """XLA's memory estimate of the compiled step (attention's block_size^2 scores per head and
    sequence: 2,150 GiB over the 8 devices) against a host with 64 GiB free."""
    monkeypatch.setattr("jaxpar.parallel.hlo.host_available_bytes", lambda: 64 * 2**30)
    fails_with(capsys, tmp_path, ["--config", "tiny", "--mesh", "dp=8",
                                  "--model.block_size=60000"],
               "the train step needs", "XLA's estimate", "lower train.micro_batch, model.block_size")


def test_the_memory_check_counts_each_host_device_against_the_hosts_ram(monkeypatch):
    import jax

    from jaxpar.core.errors import UserError
    from jaxpar.parallel.hlo import check_fits_in_memory
    monkeypatch.setattr("jaxpar.parallel.hlo.host_available_bytes", lambda: 64 * 2**30)
    two_cpus = jax.local_devices(backend="cpu")[:2]
    check_fits_in_memory({"peak_memory_bytes": 32 * 2**30}, two_cpus)  # 64 GiB: just fits
    with pytest.raises(UserError, match=r"needs 66\.0 GiB \(XLA's estimate\) but this host "
                                        r"has free 64\.0 GiB"):
        check_fits_in_memory({"peak_memory_bytes": 33 * 2**30}, two_cpus)


def test_xla_out_of_memory_becomes_one_line_and_other_errors_pass_through():
    import jax

    from jaxpar.core.errors import UserError, out_of_memory_as_user_error
    message = "INTERNAL: Error dispatching computation: Out of memory allocating 819200 bytes."
    with pytest.raises(UserError, match=r"^out of memory allocating 819200 bytes; lower --x$"):
        with out_of_memory_as_user_error("lower --x"):
            raise jax.errors.JaxRuntimeError(message)
    for other in (jax.errors.JaxRuntimeError("INTERNAL: a compiler bug"), MemoryError()):
        with pytest.raises(type(other)):
            with out_of_memory_as_user_error("lower --x"):
                raise other

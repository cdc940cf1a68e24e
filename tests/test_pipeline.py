"""Pipelined training equal to one device, with every schedule (their tables: test_schedule_tables.py).

Equivalence tolerances, as in test_equivalence: losses within rtol 1e-5; each final param within
1e-5 of that tensor's largest magnitude.
"""

import jax
import numpy as np
import pytest
from conftest import mesh_overrides, tiny_config
from helpers import LOSS_RTOL, STEPS, assert_same_training, train

from jaxpar.parallel.schedules import make_schedule
from jaxpar.train import run


# Equivalence with one device, on the tiny config (2 layers: one per stage at pp=2).
@pytest.fixture(scope="module")
def one_device():
    return train(**{"train.zero": 0})


# dp=2,tp=2,pp=2 runs the pipe with data and tensor beside it (its rows split over 'data' by hand,
# as dp=2,pp=2's are); the layouts it contains, pp=2 alone among them, are marked slow. GPipe's
# table runs on four stages below (and on dp=2,tp=2,pp=2 with -m slow).
@pytest.mark.parametrize("spec, schedule", [
    *(pytest.param("pp=2", schedule, marks=pytest.mark.slow) for schedule in ("1f1b", "gpipe")),
    *(pytest.param(spec, "1f1b", marks=pytest.mark.slow) for spec in ("dp=2,pp=2", "tp=2,pp=2")),
    ("dp=2,tp=2,pp=2", "1f1b"), pytest.param("dp=2,tp=2,pp=2", "gpipe", marks=pytest.mark.slow)])
def test_pipeline_matches_one_device(spec, schedule):
    """Training, and evaluation through the forward-only table, as on one device."""
    assert_same_training(train(spec, evaluate=True, **{"train.zero": 0, "pipeline.schedule": schedule}),
                         train(evaluate=True))


@pytest.mark.parametrize("stage", [1, 2])
def test_pipeline_with_zero_matches_one_device(one_device, stage):
    assert_same_training(train("dp=2,pp=2", **{"train.zero": stage}), one_device)


# pp=4 needs 4 layers (one per stage); interleaved at pp=2 two chunks of one layer per stage.
FOUR_LAYERS = {"model.n_layer": 4, "train.zero": 0}
INTERLEAVED = {"pipeline.schedule": "interleaved", "pipeline.virtual": 2}
ZB_H1 = {"pipeline.schedule": "zb-h1"}


@pytest.fixture(scope="module")
def four_layers():
    return train(**FOUR_LAYERS)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_four_stages_match_one_device(four_layers, schedule):
    assert_same_training(train("pp=4", **FOUR_LAYERS, **{"pipeline.schedule": schedule}), four_layers)


@pytest.mark.parametrize("spec, schedule, zero", [("dp=2,tp=2,pp=2", INTERLEAVED, 0), ("dp=2,pp=2", ZB_H1, 1)],
                         ids=["interleaved-dp2-tp2-pp2", "zb-h1-dp2-pp2-zero1"])
def test_interleaved_and_zb_h1_match_one_device(four_layers, spec, schedule, zero):
    assert_same_training(train(spec, **{**FOUR_LAYERS, "train.zero": zero}, **schedule), four_layers)


def test_interleaved_on_four_stages_matches_one_device():
    """pp=4, V=2: 8 layers in 8 chunks; stage s holds layers s and s+4."""
    eight = {"model.n_layer": 8, "train.zero": 0}
    assert_same_training(train("pp=4", **eight, **INTERLEAVED), train(**eight))


def test_an_interleaved_checkpoint_resumes_on_one_device(four_layers, tmp_path):
    """Checkpoints hold the layers in layer order whatever the schedule: stopped after step 5 on
    pp=2 interleaved, the run resumes on one device and goes on as one device would."""
    def config(spec, **overrides):
        return tiny_config(**mesh_overrides(spec), **FOUR_LAYERS, **overrides, **{"train.steps": STEPS})
    run(config("pp=2", **INTERLEAVED), tmp_path, jax.devices()[:2], progress=False, stop_at=5)
    resumed = run(config("dp=1"), tmp_path, jax.devices()[:1], progress=False)
    assert resumed.info["resumed_from"] == 5
    np.testing.assert_allclose([resumed.losses[s] for s in range(5, STEPS)],
                               [four_layers.losses[s] for s in range(5, STEPS)], rtol=LOSS_RTOL)


DROPOUT = {"model.dropout": 0.1, **FOUR_LAYERS}


@pytest.fixture(scope="module")
def four_layers_with_dropout():
    return train(**DROPOUT, **{"train.grad_accum": 4})


# 1F1B's dropout keys take the path ZB-H1's do (which reruns them for W as well): marked slow.
@pytest.mark.parametrize("schedule", [pytest.param({}, marks=pytest.mark.slow), INTERLEAVED, ZB_H1],
                         ids=["1f1b", "interleaved", "zb-h1"])
def test_pipeline_with_dropout_and_grad_accum_matches_microbatched_one_device(
        four_layers_with_dropout, schedule):
    """pp=2: microbatch k of round r gets the dropout masks of pass 2r+k on one device; each
    chunk, and ZB-H1's B and W, rerun their layers with the masks of the forward."""
    pipelined = train("pp=2", **DROPOUT, **schedule, **{"train.grad_accum": 2, "pipeline.microbatches": 2})
    assert_same_training(pipelined, four_layers_with_dropout)


def test_dry_run_shows_the_stage_buffers_of_the_schedule(capsys):
    """ZB-H1 holds each input until W: at pp=2 with M=4, the table's 2 inputs and 2 gradients."""
    from jaxpar.train import main
    main(["--config", "tiny", "--mesh", "tp=4,pp=2", "--pipeline.schedule=zb-h1", "--pipeline.microbatches=4",
          "--dry-run"])
    schedule = make_schedule("zb-h1", 2, 4)
    out = capsys.readouterr().out
    assert f"stage buffers ({schedule.input_slots}+{schedule.grad_slots} held)" in out
    assert "activations (1-layer chunk)" in out and "temporaries" in out


# DualPipeV: two chunks a stage, so 2*pp layers; its M at least 2*pp. The batch of 10 makes M=5 on
# pp=2, a count that is not a multiple of pp. Each reference is one device on the same model and batch.
DUALPIPEV = {"pipeline.schedule": "dualpipev"}
ODD_M = {"model.n_layer": 4, "train.batch_size": 10, "pipeline.microbatches": 5}
# DeepSeek's first layer is dense and runs ahead of the stages: one more layer.
ODD_M_LEAD = {**ODD_M, "model.n_layer": 5}


def same_model(overrides: dict) -> dict:
    return {k: v for k, v in overrides.items() if k.startswith("model.") or k == "train.batch_size"}


@pytest.mark.parametrize("config, spec, overrides", [
    ("tiny", "pp=2", ODD_M),
    ("tiny", "pp=4", {"model.n_layer": 8, "pipeline.microbatches": 8}),
    pytest.param("tiny", "pp=4", {"model.n_layer": 8, "train.batch_size": 9, "pipeline.microbatches": 9},
                 marks=pytest.mark.slow),
    ("tiny", "dp=2,pp=2", {"model.n_layer": 4, "pipeline.microbatches": 4, "train.zero": 1}),
    ("tiny", "dp=2,pp=2", {"model.n_layer": 4, "pipeline.microbatches": 4, "train.zero": 3}),
    ("tiny_llama", "pp=2", ODD_M),
    ("tiny_moe", "pp=2", ODD_M),
    ("tiny_deepseek", "pp=2", ODD_M_LEAD),
    *(pytest.param(config, "pp=4", {"model.n_layer": 8 + lead, "pipeline.microbatches": 8}, marks=pytest.mark.slow)
      for config, lead in (("tiny_llama", 0), ("tiny_moe", 0), ("tiny_deepseek", 1))),
])
def test_dualpipev_matches_one_device(config, spec, overrides):
    reference = train(config=config, **{"train.zero": 0, **same_model(overrides)})
    assert_same_training(train(spec, config=config, **overrides, **DUALPIPEV), reference)


def test_dualpipev_resumes_a_1f1b_checkpoint(four_layers, tmp_path):
    """Checkpoints hold the layers in model order whatever the placement: stopped after step 5 on
    1F1B, the run resumes under DualPipeV's V and goes on as one device would."""
    def config(**overrides):
        return tiny_config(**mesh_overrides("pp=2"), **FOUR_LAYERS, **overrides, **{"train.steps": STEPS})
    run(config(**{"pipeline.schedule": "1f1b"}), tmp_path, jax.devices()[:2], progress=False, stop_at=5)
    resumed = run(config(**DUALPIPEV, **{"pipeline.microbatches": 4}), tmp_path, jax.devices()[:2], progress=False)
    assert resumed.info["resumed_from"] == 5
    np.testing.assert_allclose([resumed.losses[s] for s in range(5, STEPS)],
                               [four_layers.losses[s] for s in range(5, STEPS)], rtol=LOSS_RTOL)

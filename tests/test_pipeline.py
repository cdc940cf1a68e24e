"""Pipelined training equal to one device under every registered schedule (tests/layouts.py's
suite; their tables: test_schedule_tables.py), and what a schedule changes besides: checkpoints
that resume under another placement, dropout masks with gradient accumulation, the dry run's
stage buffers.

Equivalence tolerances, as in test_equivalence: losses within rtol 1e-5; each final param within
1e-5 of that tensor's largest magnitude.
"""

import jax
import numpy as np
import pytest
from conftest import mesh_overrides, tiny_config
from helpers import LOSS_RTOL, STEPS, assert_same_training, train
from layouts import check, schedule_cases

from jaxpar.parallel.schedules import make_schedule
from jaxpar.train import run


@pytest.mark.parametrize("case", schedule_cases())
def test_schedule_matches_one_device(case):
    """Each registered schedule on its fewest layers, training and (where evaluated) evaluation
    through the forward-only table as on one device."""
    check(case)


# Four layers: at pp=2, two chunks of one layer a stage (interleaved, DualPipeV's V) or one of two.
FOUR_LAYERS = {"model.n_layer": 4, "train.zero": 0}
INTERLEAVED = {"pipeline.schedule": "interleaved", "pipeline.virtual": 2}
ZB_H1 = {"pipeline.schedule": "zb-h1"}
DUALPIPEV = {"pipeline.schedule": "dualpipev"}


@pytest.fixture(scope="module")
def four_layers():
    return train(**FOUR_LAYERS)


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

"""Pipeline schedules as tables, and pipelined training equal to one device.

Equivalence tolerances, as in test_equivalence: losses within rtol 1e-5; each final param within
1e-5 of that tensor's largest magnitude.
"""

import pytest

from jaxpar.orders import BACKWARD, FORWARD, SCHEDULES, Op
from jaxpar.schedule import Schedule, main as schedule_main
from test_equivalence import assert_same_training, train

SHAPES = [(1, 1), (2, 2), (2, 4), (3, 5), (4, 4), (4, 8), (4, 16), (8, 8)]


def every_schedule():
    return [Schedule(name, pp, M) for name in SCHEDULES for pp, M in SHAPES]


@pytest.mark.parametrize("schedule", every_schedule(), ids=str)
def test_each_op_runs_once_per_stage(schedule):
    for stage in range(schedule.pp):
        ops = [row[stage] for row in schedule.table if row[stage] is not None]
        expected = [Op(kind, k) for kind in (FORWARD, BACKWARD) for k in range(schedule.microbatches)]
        assert sorted(ops, key=lambda op: (op.kind, op.microbatch)) == expected


@pytest.mark.parametrize("schedule", every_schedule(), ids=str)
def test_dependencies_are_respected(schedule):
    tick = schedule.tick_of
    for k in range(schedule.microbatches):
        for s in range(schedule.pp):
            assert tick(BACKWARD, k, s) > tick(FORWARD, k, s)
            if s > 0:
                assert tick(FORWARD, k, s) > tick(FORWARD, k, s - 1)
            if s < schedule.pp - 1:
                assert tick(BACKWARD, k, s) > tick(BACKWARD, k, s + 1)


@pytest.mark.parametrize("schedule", every_schedule(), ids=str)
def test_bubble_fraction_is_the_textbook_one(schedule):
    pp, M = schedule.pp, schedule.microbatches
    assert schedule.ticks == 2 * (M + pp - 1)
    assert schedule.bubble_fraction == pytest.approx((pp - 1) / (M + pp - 1))


@pytest.mark.parametrize("pp, M", SHAPES)
def test_1f1b_keeps_at_most_pp_microbatches_in_flight(pp, M):
    one_f_one_b, gpipe = Schedule("1f1b", pp, M), Schedule("gpipe", pp, M)
    assert max(one_f_one_b.in_flight(s) for s in range(pp)) <= pp
    assert one_f_one_b.input_slots <= pp  # the activation memory the executor allocates
    assert max(gpipe.in_flight(s) for s in range(pp)) == M
    assert gpipe.input_slots == (M if pp > 1 else 1)


def test_executor_arrays_route_every_message():
    """What stage s sends at tick t is stored by its neighbour at t, in the slot it reads later."""
    schedule = Schedule("1f1b", 4, 8)
    arrays = schedule.executor_arrays()
    for t, row in enumerate(schedule.table):
        for s, op in enumerate(row):
            sent_forward = op is not None and op.kind == FORWARD and s < 3
            sent_backward = op is not None and op.kind == BACKWARD and s > 0
            if sent_forward:
                read_tick = schedule.tick_of(FORWARD, op.microbatch, s + 1)
                assert arrays["store_input"][t, s + 1] == arrays["input_slot"][read_tick, s + 1]
            if sent_backward:
                read_tick = schedule.tick_of(BACKWARD, op.microbatch, s - 1)
                assert arrays["store_grad"][t, s - 1] == arrays["grad_slot"][read_tick, s - 1]
    assert (arrays["store_input"][:, 0] == -1).all() and (arrays["store_grad"][:, 3] == -1).all()


def test_schedule_picture(tmp_path, capsys):
    png = tmp_path / "s.png"
    schedule_main(["--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--out", str(png)])
    out = capsys.readouterr().out
    assert "bubble 27.3%" in out and "stage 3:" in out and png.stat().st_size > 0


# Equivalence with one device, on the tiny config (2 layers: one per stage at pp=2).
@pytest.fixture(scope="module")
def one_device():
    return train(**{"train.zero": 0})


@pytest.mark.parametrize("spec, schedule", [
    ("pp=2", "1f1b"), ("pp=2", "gpipe"), ("dp=2,pp=2", "1f1b"), ("tp=2,pp=2", "1f1b"),
    ("dp=2,tp=2,pp=2", "1f1b"), ("dp=2,tp=2,pp=2", "gpipe")])
def test_pipeline_matches_one_device(one_device, spec, schedule):
    assert_same_training(train(spec, **{"train.zero": 0, "pipeline.schedule": schedule}), one_device)


@pytest.mark.parametrize("stage", [1, 2])
def test_pipeline_with_zero_matches_one_device(one_device, stage):
    assert_same_training(train("dp=2,pp=2", **{"train.zero": stage}), one_device)


# pp=4 needs 4 layers (one per stage).
FOUR_LAYERS = {"model.n_layer": 4, "train.zero": 0}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_four_stages_match_one_device(schedule):
    reference = train(**FOUR_LAYERS)
    assert_same_training(train("pp=4", **FOUR_LAYERS, **{"pipeline.schedule": schedule}), reference)


def test_pipeline_with_dropout_and_grad_accum_matches_microbatched_one_device():
    """Microbatch k of the pipeline gets the same dropout masks as pass k on one device."""
    common = {"model.dropout": 0.1, "train.zero": 0}
    reference = train(**common, **{"train.grad_accum": 4})
    pipelined = train("pp=2", **common, **{"train.grad_accum": 2, "pipeline.microbatches": 2})
    assert_same_training(pipelined, reference)

"""The interleaved 1F1B and ZB-H1 tables, tested on the tables themselves (jaxpar.parallel.orders)."""

import pytest

from jaxpar.core.config import load_config
from jaxpar.core.errors import UserError
from jaxpar.parallel.orders import BACKWARD, FORWARD, WEIGHT, Op
from jaxpar.parallel.schedule import Schedule
from jaxpar.schedule import main as schedule_main

INTERLEAVED = [(2, 2, 2), (2, 4, 2), (2, 6, 3), (4, 4, 2), (4, 8, 2), (4, 8, 3), (4, 16, 4), (8, 8, 2)]
ZB_H1 = [(1, 1), (2, 1), (2, 2), (2, 8), (3, 5), (3, 9), (4, 4), (4, 7), (4, 8), (4, 16), (8, 8), (8, 16)]


def interleaved():
    return [Schedule("interleaved", pp, M, V) for pp, M, V in INTERLEAVED]


def zb_h1():
    return [Schedule("zb-h1", pp, M) for pp, M in ZB_H1]


def ops_of(schedule, stage):
    return sorted((op for row in schedule.table if (op := row[stage]) is not None),
                  key=lambda op: (op.kind, op.chunk, op.microbatch))


@pytest.mark.parametrize("schedule", interleaved(), ids=str)
def test_interleaved_runs_each_op_once_per_stage_and_chunk(schedule):
    expected = [Op(kind, k, c) for kind in (FORWARD, BACKWARD) for c in range(schedule.virtual)
                for k in range(schedule.microbatches)]
    for stage in range(schedule.pp):
        assert ops_of(schedule, stage) == expected


@pytest.mark.parametrize("schedule", interleaved(), ids=str)
def test_interleaved_dependencies_hold(schedule):
    """Global chunk g = c*pp + s: F runs up the chunks, B down, each after its own F."""
    pp, V, tick = schedule.pp, schedule.virtual, schedule.tick_of
    order = [(c, s) for c in range(V) for s in range(pp)]  # the model's layers, first to last
    for k in range(schedule.microbatches):
        for (c, s), (c_next, s_next) in zip(order, order[1:]):
            assert tick(FORWARD, k, s_next, c_next) > tick(FORWARD, k, s, c)
            assert tick(BACKWARD, k, s, c) > tick(BACKWARD, k, s_next, c_next)
        for c, s in order:
            assert tick(BACKWARD, k, s, c) > tick(FORWARD, k, s, c)


@pytest.mark.parametrize("schedule", interleaved(), ids=str)
def test_interleaved_bubble_is_megatrons(schedule):
    pp, M, V = schedule.pp, schedule.microbatches, schedule.virtual
    assert schedule.ticks == 2 * (V * M + pp - 1)  # each tick one chunk's F or B
    assert schedule.bubble_fraction == pytest.approx((pp - 1) / (V * M + pp - 1))
    assert schedule.bubble_fraction < Schedule("1f1b", pp, M).bubble_fraction


@pytest.mark.parametrize("schedule", interleaved(), ids=str)
def test_interleaved_holds_megatrons_warmup_plus_one_inputs(schedule):
    """Stage s holds at most 2(pp-1-s) + (V-1)pp + 1 chunk inputs: its warm-up forwards and the
    steady state's one more: more than 1F1B's pp - s, each the size of a 1F1B stage input."""
    pp, M, V = schedule.pp, schedule.microbatches, schedule.virtual
    for s in range(pp):
        bound = min(2 * (pp - 1 - s) + (V - 1) * pp + 1, V * M)
        assert schedule.in_flight(s) == bound


@pytest.mark.parametrize("schedule", zb_h1(), ids=str)
def test_zb_h1_runs_each_f_b_w_once_per_stage(schedule):
    expected = [Op(kind, k) for kind in (FORWARD, BACKWARD, WEIGHT) for k in range(schedule.microbatches)]
    for stage in range(schedule.pp):
        assert ops_of(schedule, stage) == expected


@pytest.mark.parametrize("schedule", zb_h1(), ids=str)
def test_zb_h1_dependencies_hold(schedule):
    """B(k) needs F(k) and B(k) on the next stage; W(k) needs B(k); F(k) needs F(k) upstream."""
    tick, pp = schedule.tick_of, schedule.pp
    for k in range(schedule.microbatches):
        for s in range(pp):
            assert tick(BACKWARD, k, s) > tick(FORWARD, k, s)
            assert tick(WEIGHT, k, s) > tick(BACKWARD, k, s)
            if s > 0:
                assert tick(FORWARD, k, s) > tick(FORWARD, k, s - 1)
            if s < pp - 1:
                assert tick(BACKWARD, k, s) > tick(BACKWARD, k, s + 1)


@pytest.mark.parametrize("schedule", zb_h1(), ids=str)
def test_zb_h1_keeps_1f1b_memory_and_a_smaller_bubble(schedule):
    """An input is held from F until W (which rereads it): at most pp per stage, 1F1B's bound.
    The ideal ZB-H1 takes 3M + pp - 1 ticks (bubble (pp-1)/(3M+pp-1)); the greedy placement
    comes within 2 ticks of it. 1F1B with W right after B takes 3M + 2(pp-1)."""
    pp, M = schedule.pp, schedule.microbatches
    assert max(schedule.in_flight(s) for s in range(pp)) <= pp
    ideal = 3 * M + pp - 1
    assert ideal <= schedule.ticks <= ideal + 2
    if M >= pp >= 4:
        assert schedule.ticks < 3 * M + 2 * (pp - 1)


def test_new_tables_are_drawn_and_bad_ones_refused(tmp_path, capsys):
    png = tmp_path / "i.png"
    schedule_main(["--schedule", "interleaved", "--pp", "4", "--microbatches", "8", "--out", str(png)])
    assert "V=2" in capsys.readouterr().out and png.stat().st_size > 0
    schedule_main(["--schedule", "zb-h1", "--pp", "4", "--microbatches", "8", "--out", str(png)])
    assert " W7" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        schedule_main(["--schedule", "interleaved", "--pp", "4", "--microbatches", "6"])
    assert exit_info.value.code == 2
    for overrides in ({"pipeline.schedule": "interleaved"},
                      {"pipeline.schedule": "zb-h1", "pipeline.virtual": "2"}):
        with pytest.raises(UserError, match="interleaved needs --pipeline.virtual >= 2"):
            load_config(None, overrides)


def run_symbolically(schedule):
    """Play the executor's arrays with labels for values: every read must find the value it needs.

    A stage input of (microbatch k, chunk c) is ("x", k, c), its output gradient ("g", k, c). Each
    op reads its slots, sends to its neighbour (round the ring between chunks), and the receiver
    stores at the end of the tick in the slot the arrays say; an overwritten slot fails a read.
    """
    arrays, pp, V = schedule.executor_arrays(), schedule.pp, schedule.virtual
    inputs = [[None] * schedule.input_slots for _ in range(pp)]
    grads = [[None] * max(schedule.grad_slots, 1) for _ in range(pp)]
    for t in range(schedule.ticks):
        sent_next, sent_previous = [None] * pp, [None] * pp
        for s in range(pp):
            kind, k, c = (int(arrays[name][t, s]) for name in ("kind", "microbatch", "chunk"))
            if kind == 0:
                continue
            if (s, c) != (0, 0):
                assert inputs[s][arrays["input_slot"][t, s]] == ("x", k, c), (t, s, kind)
            if kind == FORWARD and (s, c) == (pp - 1, V - 1):
                grads[s][arrays["grad_slot"][t, s]] = ("g", k, c)  # the loss's gradient
            elif kind == FORWARD:
                sent_next[s] = ("x", k) + schedule.next_stage(s, c)[1:]
            else:
                assert grads[s][arrays["grad_slot"][t, s]] == ("g", k, c), (t, s, kind)
                if kind == BACKWARD and (s, c) != (0, 0):
                    sent_previous[s] = ("g", k) + schedule.previous_stage(s, c)[1:]
        for s in range(pp):
            for buffers, store, sent, sender in ((inputs, "store_input", sent_next, (s - 1) % pp),
                                                 (grads, "store_grad", sent_previous, (s + 1) % pp)):
                slot = arrays[store][t, s]
                if slot >= 0:
                    assert sent[sender] is not None, (t, s, store)
                    buffers[s][slot] = sent[sender]
                else:  # everything sent is stored by its receiver
                    assert sent[sender] is None, (t, s, store)


@pytest.mark.parametrize("schedule", interleaved() + zb_h1() + [
    Schedule(name, pp, M) for name in ("gpipe", "1f1b", "forward") for pp, M in [(2, 2), (4, 8), (3, 5)]],
    ids=str)
def test_executor_arrays_deliver_every_value_to_its_reader(schedule):
    run_symbolically(schedule)

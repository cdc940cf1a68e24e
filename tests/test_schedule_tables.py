"""Every registered pipeline schedule's table, tested on the table itself (jaxpar.parallel.schedules):
each op runs once, every dependency holds, and the executor's arrays deliver every value to its
reader, for each schedule at the shapes its registry entry can run. A new schedule is tested here
by its entry. Then what each schedule promises: its bubble and its memory."""

import pytest

from jaxpar.core.errors import UserError
from jaxpar.parallel.schedules import SCHEDULES, evaluation, make_schedule
from jaxpar.parallel.schedules.base import SOURCES
from jaxpar.parallel.schedules.ops import BACKWARD, DOWN, FORWARD, INPUT_GRAD, KEPT, UP, WEIGHT, Op
from jaxpar.schedule import main as schedule_main

SHAPES = [(1, 1), (2, 1), (2, 2), (2, 4), (2, 5), (3, 5), (3, 9), (4, 4), (4, 8), (4, 9), (4, 16), (8, 8), (8, 16)]
VIRTUALS = (1, 2, 3)


def tables():
    """Every registered schedule at every shape and pipeline.virtual it accepts, and evaluation's."""
    found = []
    for name in SCHEDULES:
        for pp, M in SHAPES:
            for virtual in VIRTUALS:
                try:
                    found.append(make_schedule(name, pp, M, virtual))
                except UserError:
                    continue
    return found + [evaluation(pp, M) for pp, M in SHAPES[:6]]


def ops_on(schedule, stage):
    return [op for row in schedule.table if (op := row[stage]) is not None]


@pytest.mark.parametrize("schedule", tables(), ids=str)
def test_each_op_runs_once_per_stage_and_chunk(schedule):
    """F once; a backward once, whole (B) or with its W apart (B, then W once)."""
    for stage in range(schedule.pp):
        ops = ops_on(schedule, stage)
        assert len(set(ops)) == len(ops)
        for k in range(schedule.microbatches):
            for c in range(schedule.virtual):
                assert Op(FORWARD, k, c) in ops
                if schedule.trains:
                    assert (Op(BACKWARD, k, c) in ops) != (Op(INPUT_GRAD, k, c) in ops)
                    assert (Op(WEIGHT, k, c) in ops) == (Op(INPUT_GRAD, k, c) in ops)


@pytest.mark.parametrize("schedule", tables(), ids=str)
def test_every_dependency_holds(schedule):
    """Global chunk g's F after g-1's; its B after g+1's B (the last chunk's, after its own F); W
    after its B; in model order whatever the placement."""
    place, tick = schedule.placement, schedule.tick_of
    for k in range(schedule.microbatches):
        for g in range(place.chunks):
            s, c = place.home(g)
            if g > 0:
                assert tick(FORWARD, k, s, c) > tick(FORWARD, k, *place.home(g - 1))
            if not schedule.trains:
                continue
            after = tick(BACKWARD, k, *place.home(g + 1)) if g + 1 < place.chunks else tick(FORWARD, k, s, c)
            assert tick(BACKWARD, k, s, c) > after
            if Op(WEIGHT, k, c) in ops_on(schedule, s):
                assert tick(WEIGHT, k, s, c) > tick(BACKWARD, k, s, c)


def run_symbolically(schedule):
    """Play the executor's arrays with labels for values: every read must find the value it needs.

    A stage input of (microbatch k, local chunk c) is ("x", k, c), its output gradient ("g", k, c).
    Each op reads its slots and sends its output as `send` says (down, up, or kept); the receiver
    stores at the end of the tick in the slot its arrays name; an overwritten slot fails a read,
    and so does a value sent that nobody stores.
    """
    arrays, pp, place = schedule.executor_arrays(), schedule.pp, schedule.placement
    inputs = [[None] * schedule.input_slots for _ in range(pp)]
    grads = [[None] * max(schedule.grad_slots, 1) for _ in range(pp)]
    first, last = (0, 0), place.last
    for t in range(schedule.ticks):
        out = [None] * pp
        for s in range(pp):
            kind, k, c = (int(arrays[name][t, s]) for name in ("kind", "microbatch", "chunk"))
            if kind == 0:
                continue
            if (s, c) != first:
                assert inputs[s][arrays["input_slot"][t, s]] == ("x", k, c), (t, s, kind)
            if kind == FORWARD and (s, c) == last and schedule.trains:
                grads[s][arrays["grad_slot"][t, s]] = ("g", k, c)  # the loss's gradient
            elif kind == FORWARD:
                to = place.next(s, c)
                out[s] = None if to is None else (to[0], ("x", k, to[1]))
            else:
                assert grads[s][arrays["grad_slot"][t, s]] == ("g", k, c), (t, s, kind)
                to = place.previous(s, c) if kind != WEIGHT else None
                out[s] = None if to is None else (to[0], ("g", k, to[1]))
        deliver(schedule, arrays, t, out, inputs, grads)


def deliver(schedule, arrays, t, out, inputs, grads):
    pp, ring = schedule.pp, schedule.placement.wraps
    sent = {s: (int(arrays["send"][t, s]), out[s]) for s in range(pp) if out[s] is not None}
    for s, (direction, (to, _)) in sent.items():
        step = {DOWN: 1, UP: -1, KEPT: 0}[direction]
        assert to == (s + step) % pp if ring else to == s + step, (t, s, direction, to)
    for s in range(pp):
        for direction, source in SOURCES.items():
            sender = {DOWN: s - 1, UP: s + 1, KEPT: s}[direction] % pp
            slot = arrays[f"{source}_slot"][t, s]
            message = sent.get(sender)
            arriving = message is not None and message[0] == direction and message[1][0] == s
            assert (slot >= 0) == arriving, (t, s, source)
            if arriving:
                (grads if arrays[f"{source}_grad"][t, s] else inputs)[s][slot] = message[1][1]


@pytest.mark.parametrize("schedule", tables(), ids=str)
def test_executor_arrays_deliver_every_value_to_its_reader(schedule):
    run_symbolically(schedule)


def test_the_symbolic_run_fails_on_a_slot_overwritten_too_soon():
    """Control: a table whose input slots are squeezed into one fails its reads."""
    schedule = make_schedule("gpipe", 2, 4)
    squeezed = schedule.executor_arrays()
    squeezed["below_slot"][squeezed["below_slot"] > 0] = 0
    squeezed["input_slot"][:] = 0
    schedule.__dict__["executor_arrays"] = lambda: squeezed
    with pytest.raises(AssertionError):
        run_symbolically(schedule)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, M", [(2, 2), (2, 4), (3, 5), (4, 8), (8, 8)])
def test_gpipe_and_1f1b_take_the_textbook_bubble(name, pp, M):
    schedule = make_schedule(name, pp, M)
    assert schedule.ticks == 2 * (M + pp - 1)
    assert schedule.bubble_fraction == pytest.approx((pp - 1) / (M + pp - 1))
    assert max(schedule.in_flight(s) for s in range(pp)) == (M if name == "gpipe" else min(pp, M))


@pytest.mark.parametrize("pp, M, V", [(2, 2, 2), (2, 6, 3), (4, 8, 2), (4, 8, 3), (8, 8, 2)])
def test_interleaved_takes_megatrons_bubble_and_warmup(pp, M, V):
    """Stage s holds at most 2(pp-1-s) + (V-1)pp + 1 chunk inputs: its warm-up forwards and one more."""
    schedule = make_schedule("interleaved", pp, M, V)
    assert schedule.ticks == 2 * (V * M + pp - 1)
    assert schedule.bubble_fraction == pytest.approx((pp - 1) / (V * M + pp - 1))
    for s in range(pp):
        assert schedule.in_flight(s) == min(2 * (pp - 1 - s) + (V - 1) * pp + 1, V * M)


@pytest.mark.parametrize("pp, M", [(2, 8), (3, 9), (4, 8), (4, 16), (8, 16)])
def test_zb_h1_keeps_1f1b_memory_and_a_smaller_bubble(pp, M):
    """The ideal ZB-H1 takes 3M + pp - 1 ticks; the greedy placement comes within 2 of it."""
    schedule = make_schedule("zb-h1", pp, M)
    assert max(schedule.in_flight(s) for s in range(pp)) <= pp
    assert 3 * M + pp - 1 <= schedule.ticks <= 3 * M + pp + 1
    assert schedule.rerun_factors == (3.0, 2.0)


@pytest.mark.parametrize("pp, M", [(2, 4), (2, 5), (4, 8), (4, 9), (8, 16)])
def test_dualpipev_places_its_chunks_in_a_v_and_fills_the_bubble(pp, M):
    """Stage 0 embeds and computes the loss, the turn at the bottom is kept on stage pp-1 (nothing
    crosses to another stage there), and its bubble is below 1F1B's on the same M."""
    schedule = make_schedule("dualpipev", pp, M)
    assert schedule.virtual == 2 and schedule.placement.last == (0, 1)
    assert schedule.placement.home(pp - 1) == (pp - 1, 0) and schedule.placement.home(pp) == (pp - 1, 1)
    arrays = schedule.executor_arrays()
    assert (arrays["kept_slot"][:, :pp - 1] < 0).all() and (arrays["kept_slot"][:, pp - 1] >= 0).any()
    assert schedule.bubble_fraction < make_schedule("1f1b", pp, M).bubble_fraction
    ops = [op.kind for row in schedule.table for op in row if op is not None]
    assert ops.count(WEIGHT) == ops.count(INPUT_GRAD) > 0 and ops.count(BACKWARD) > 0


@pytest.mark.parametrize("name, pp, M, virtual, message", [
    ("1f1b", 4, 3, 1, "1f1b needs at least pp=4 microbatches"),
    ("interleaved", 4, 6, 2, "interleaved needs microbatches in whole groups of pp=4"),
    ("interleaved", 2, 4, 1, "interleaved needs --pipeline.virtual >= 2"),
    ("zb-h1", 2, 4, 2, "zb-h1 runs one layer chunk per stage"),
    ("dualpipev", 4, 7, 1, "dualpipev needs at least 2*pp=8 microbatches"),
    ("dualpipev", 2, 4, 3, "dualpipev runs two layer chunks a stage"),
    ("nope", 2, 4, 1, "pipeline.schedule must be one of gpipe, 1f1b, interleaved, zb-h1, dualpipev"),
])
def test_a_schedule_refuses_what_it_cannot_run_in_one_line(name, pp, M, virtual, message):
    with pytest.raises(UserError) as error:
        make_schedule(name, pp, M, virtual)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_tables_are_drawn_and_a_bad_one_refused(tmp_path, capsys):
    png = tmp_path / "s.png"
    schedule_main(["--schedule", "dualpipev", "--pp", "4", "--microbatches", "8", "--out", str(png)])
    out = capsys.readouterr().out
    assert "dualpipev: pp=4, V=2, 8 microbatches" in out and " W7.0" in out and png.stat().st_size > 0
    schedule_main(["--pp", "4", "--microbatches", "8", "--out", str(png)])  # the default, 1F1B
    assert "bubble 27.3%" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        schedule_main(["--schedule", "interleaved", "--pp", "4", "--microbatches", "6"])
    assert exit_info.value.code == 2

"""Schedule IR values, compact forms, grid, serialization, and the validator's failures."""

import subprocess
import sys

import pytest

import scheduler
from scheduler import (
    Compute,
    Payload,
    Phase,
    Recv,
    Schedule,
    ScheduleError,
    Send,
    SendSemantics,
    one_f_one_b,
    parse_action,
    schedule_from_orders,
    validate_schedule,
)

pytestmark = pytest.mark.unit

F, B = Phase.FORWARD, Phase.BACKWARD


@pytest.mark.parametrize(
    "action, text",
    [
        (Compute(0, F, 3), "F3"),
        (Compute(2, B, 0), "B0"),
        (Send(0, F, 3, 1), "S3F->1"),
        (Send(2, B, 3, 1), "S3B->1"),
        (Recv(1, F, 3, 0), "R3F<-0"),
        (Recv(1, B, 3, 2), "R3B<-2"),
        (Send(0, F, 3, 3), "S3F->3"),
    ],
)
def test_compact_form_round_trips_and_repr_evaluates(action, text):
    assert str(action) == text
    assert parse_action(text, action.stage) == action
    assert eval(repr(action), vars(scheduler)) == action


def test_schedule_repr_evaluates_and_phase_has_two_members():
    s = one_f_one_b(3, 2, skips=[(0, 2)])
    assert eval(repr(s), vars(scheduler)) == s
    assert list(Phase) == [F, B]


def test_actions_are_frozen_hashable_values():
    a = Compute(1, F, 2)
    assert a == Compute(stage=1, phase=F, microbatch=2)
    assert len({a, Compute(1, F, 2)}) == 1
    with pytest.raises(AttributeError):
        a.microbatch = 3


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Compute(-1, F, 0), "stage"),
        (lambda: Compute(0, F, -2), "microbatch"),
        (lambda: Compute(0, "F", 0), "phase"),
        (lambda: Send(1, F, 0, 0), "higher"),
        (lambda: Send(0, B, 0, 1), "lower"),
        (lambda: Recv(1, F, 0, 2), "higher"),
        (lambda: Send(1, F, 0, 1), "higher"),
    ],
)
def test_actions_reject_bad_fields(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_payload_pairs_send_and_recv():
    send, recv = Send(0, F, 3, 2), Recv(2, F, 3, 0)
    assert send.payload == recv.payload == Payload(F, 3, 0, 2)
    assert send.payload.is_skip
    assert send.payload.producer == Compute(0, F, 3)
    assert send.payload.consumer == Compute(2, F, 3)


def test_parse_rejects_garbage():
    with pytest.raises(ValueError, match="not an action"):
        parse_action("X3", 0)


def test_schedule_checks_ownership_and_ranges():
    good = one_f_one_b(2, 2)
    streams = list(good.streams)
    streams[0] = (*streams[0], Compute(1, F, 0))
    with pytest.raises(ValueError, match="belongs to stage 1"):
        Schedule("x", 2, 2, tuple(streams), good.clock_table)
    with pytest.raises(ValueError, match="microbatch 5"):
        Schedule("x", 2, 2, ((Compute(0, F, 5),), ()), ())
    with pytest.raises(ValueError, match="n_stages"):
        Schedule("x", 0, 2, (), ())
    with pytest.raises(ValueError, match="n_microbatches"):
        Schedule("x", 1, 0, ((),), ())
    with pytest.raises(ValueError, match="clock 0 has 1 cells"):
        Schedule("x", 2, 1, ((), ()), ((None,),))


def test_stage_actions_and_in_flight():
    s = one_f_one_b(2, 3)
    assert s.stage_actions(0) == ["F0", "F1", "B0", "F2", "B1", "B2"]
    assert s.stage_actions(1) == ["F0", "B0", "F1", "B1", "F2", "B2"]
    assert s.in_flight(0) == (1, 2, 1, 2, 1, 0)
    assert s.peak_activations == (2, 1)


def test_grid_marks_a_cell_and_str_shows_it():
    s = one_f_one_b(2, 2)
    text = s.grid(mark=(1, 1))
    assert ">>" in text and "[F0]" in text
    marked = [line for line in text.splitlines() if line.startswith(">>")]
    assert marked == [">>  1  F1      [F0]"]
    assert str(s).splitlines()[1].split() == ["clk", "stage0", "stage1"]


def test_msgpack_round_trip():
    s = one_f_one_b(4, 6, skips=[(0, 3)])
    assert Schedule.from_msgpack(s.to_msgpack()) == s
    bad = s.to_dict() | {"schema": 99}
    with pytest.raises(ValueError, match="schema"):
        Schedule.from_dict(bad)


def _replace_stream(schedule, stage, stream):
    streams = list(schedule.streams)
    streams[stage] = tuple(parse_action(t, stage) if isinstance(t, str) else t for t in stream)
    return Schedule(schedule.name, schedule.n_stages, schedule.n_microbatches, tuple(streams), schedule.clock_table)


def _error(schedule, **kwargs):
    with pytest.raises(ScheduleError) as info:
        validate_schedule(schedule, **kwargs)
    message = str(info.value)
    assert ">>" in message and "[" in message, message
    return info.value, message


def test_missing_send_is_reported_on_the_grid():
    s = one_f_one_b(2, 1)
    broken = _replace_stream(s, 0, ["F0", "R0B<-1", "B0"])
    err, message = _error(broken)
    assert "never sends 0F:0->1" in message
    assert (err.clock, err.stage) == (0, 0)
    assert ">>  0  [F0]" in message


def test_compute_before_its_receive_is_reported():
    s = one_f_one_b(2, 1)
    broken = _replace_stream(s, 1, ["F0", "R0F<-0", "B0", "S0B->0"])
    _, message = _error(broken)
    assert "runs F0 before receiving 0F:0->1" in message


def test_send_to_an_undeclared_skip_is_rejected():
    s = one_f_one_b(3, 1)
    broken = _replace_stream(s, 0, [*map(str, s.streams[0][:2]), "S0F->2", *map(str, s.streams[0][2:])])
    _, message = _error(broken)
    assert "S0F->2" in message and "declared skip" in message


def test_receive_ordered_before_its_send_deadlocks():
    s = one_f_one_b(2, 1)
    broken = _replace_stream(s, 0, ["R0B<-1", "F0", "S0F->1", "B0"])
    err, message = _error(broken)
    assert "deadlock" in message and "stage 0 blocks on R0B<-1" in message


def test_dependency_violation_in_clock_table():
    s = one_f_one_b(2, 1)
    (f0, _), (_, g0), (_, g1), (b0, _) = s.clock_table
    table = ((f0, g0), (None, g1), (b0, None))
    broken = Schedule(s.name, 2, 1, s.streams, tuple(table))
    err, message = _error(broken)
    assert "F0 on stage 0 finishes only at clock 0" in message
    assert (err.clock, err.stage) == (0, 1)


def test_clock_table_must_match_streams():
    s = one_f_one_b(2, 2)
    table = tuple(reversed(s.clock_table))
    _, message = _error(Schedule(s.name, 2, 2, s.streams, table))
    assert "clock table runs" in message


def test_incomplete_order_is_rejected():
    with pytest.raises(ScheduleError, match="never runs B1"):
        validate_schedule(schedule_from_orders("x", [["F0", "F1", "B0"]], 2))


def test_backward_before_forward_is_rejected():
    b0, f0 = Compute(0, B, 0), Compute(0, F, 0)
    with pytest.raises(ScheduleError, match="runs B0 before F0"):
        validate_schedule(Schedule("x", 1, 1, ((b0, f0),), ((b0,), (f0,))))
    with pytest.raises(ScheduleError, match="needs F0 on stage 0"):
        schedule_from_orders("x", [["B0", "F0"]], 1)


def test_infeasible_compute_order_raises_while_building():
    with pytest.raises(ScheduleError, match="deadlock") as info:
        schedule_from_orders("x", [["F0", "B0", "F1", "B1"], ["F1", "F0", "B0", "B1"]], 2)
    assert ">>" in str(info.value)


def test_max_in_flight_limit():
    s = one_f_one_b(3, 6)
    assert validate_schedule(s, max_in_flight=3) == (3, 2, 1)
    with pytest.raises(ScheduleError, match="over max_in_flight=2"):
        validate_schedule(s, max_in_flight=[2, 2, 1])


def test_rendezvous_sends_deadlock_generated_1f1b_streams():
    """The generated streams assume buffered sends; blocking ones deadlock (documented)."""
    validate_schedule(one_f_one_b(3, 6), sends=SendSemantics.BUFFERED)
    err, message = _error(one_f_one_b(3, 6), sends=SendSemantics.RENDEZVOUS)
    assert "deadlock with rendezvous sends" in message
    validate_schedule(one_f_one_b(3, 1), sends=SendSemantics.RENDEZVOUS)


def test_error_grid_is_windowed_for_wide_pipelines():
    s = one_f_one_b(40, 80)
    broken = _replace_stream(s, 20, [a for a in s.streams[20] if str(a) != "S5F->21"])
    _, message = _error(broken)
    assert "stage20" in message and "stage0 " not in message and len(message.splitlines()) < 40


def test_pure_layer_imports_no_runtime_libraries():
    code = (
        "import sys, scheduler, scheduler.simulate, scheduler.validate, scheduler.grid;"
        "bad = {'ray', 'torch', 'cupy'} & {m.split('.')[0] for m in sys.modules};"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

"""Timing simulator: hand-computed cases, the no-communication limit, and the eager-1F1B target.

Recorded figures for the issue's target (4 stages, 8 microbatches, forward 1.0 s, backward 2.0 s,
0.5 s per transfer both ways, overlap=True): no communication 33.0 s, 1F1B 41.0 s, eager 1F1B
36.0 s (1.091x the no-communication time), GPipe 36.0 s.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import (
    Compute,
    EventKind,
    Schedule,
    ScheduleError,
    eager_one_f_one_b,
    gpipe,
    one_f_one_b,
    schedule_from_orders,
    simulate,
)

pytestmark = pytest.mark.unit

GENERATORS = [gpipe, one_f_one_b, eager_one_f_one_b]


def _spans(result, stage):
    return [(e.label, e.start_s, e.end_s) for e in result.events[stage]]


def test_one_stage_runs_back_to_back():
    r = simulate(one_f_one_b(1, 3), forward_s=1.0, backward_s=2.0, transfer_s=5.0)
    assert r.iteration_s == 9.0
    assert r.bubble_fraction == 0.0
    assert r.idle_waiting_s == (0.0,)
    assert r.busy_s == (9.0,)
    assert _spans(r, 0)[:3] == [("F0", 0.0, 1.0), ("B0", 1.0, 3.0), ("F1", 3.0, 4.0)]


def test_two_stages_with_overlapped_transfers():
    r = simulate(one_f_one_b(2, 2), forward_s=1.0, backward_s=2.0, transfer_s=0.5)
    assert _spans(r, 0) == [
        ("F0", 0.0, 1.0),
        ("S0F->1", 1.0, 1.5),
        ("F1", 1.0, 2.0),
        ("S1F->1", 2.0, 2.5),
        ("B0", 5.0, 7.0),
        ("B1", 8.0, 10.0),
    ]
    assert _spans(r, 1) == [
        ("F0", 1.5, 2.5),
        ("B0", 2.5, 4.5),
        ("S0B->0", 4.5, 5.0),
        ("F1", 4.5, 5.5),
        ("B1", 5.5, 7.5),
        ("S1B->0", 7.5, 8.0),
    ]
    assert r.iteration_s == 10.0
    assert r.idle_waiting_s == (4.0, 1.5)
    assert r.bubble_fraction == pytest.approx(1 - 12 / 20)
    assert r.send_s == (1.0, 1.0)
    assert simulate(one_f_one_b(2, 2), forward_s=1.0, backward_s=2.0, transfer_s=0).iteration_s == 9.0


def test_two_stages_without_overlap_sends_occupy_the_sender():
    r = simulate(one_f_one_b(2, 2), forward_s=1.0, backward_s=2.0, transfer_s=0.5, overlap=False)
    assert _spans(r, 0)[:4] == [("F0", 0.0, 1.0), ("S0F->1", 1.0, 1.5), ("F1", 1.5, 2.5), ("S1F->1", 2.5, 3.0)]
    assert _spans(r, 1)[3] == ("F1", 5.0, 6.0)
    assert r.iteration_s == 10.5


def test_per_stage_and_per_boundary_durations():
    r = simulate(
        gpipe(3, 1),
        forward_s=[1.0, 2.0, 3.0],
        backward_s=(4.0, 5.0, 6.0),
        transfer_s=[0.1, 0.2],
        backward_transfer_s=[0.3, 0.4],
    )
    assert r.iteration_s == pytest.approx(1 + 0.1 + 2 + 0.2 + 3 + 6 + 0.4 + 5 + 0.3 + 4)


def test_transfers_on_one_link_serialize_in_issue_order():
    r = simulate(gpipe(2, 3), forward_s=1.0, backward_s=1.0, transfer_s=2.0, backward_transfer_s=0.0)
    sends = [(e.start_s, e.end_s) for e in r.events[0] if e.kind is EventKind.SEND]
    assert sends == [(1.0, 3.0), (3.0, 5.0), (5.0, 7.0)]
    forwards = [e.start_s for e in r.events[1] if e.kind is EventKind.FORWARD]
    assert forwards == [3.0, 5.0, 7.0]


def test_skip_transfers_are_added_and_waited_for():
    r = simulate(gpipe(3, 1), forward_s=1.0, backward_s=1.0, transfer_s=0.5, skip_transfer_s={(0, 2): 10.0})
    labels = [e.label for e in r.events[0]]
    assert labels == ["F0", "S0F->1", "S0F->2", "B0"]
    assert _spans(r, 2)[0] == ("F0", 11.0, 12.0)
    assert _spans(r, 0)[-1] == ("B0", 23.0, 24.0)
    assert r.iteration_s == 24.0


def test_schedule_skips_need_a_duration():
    with pytest.raises(ValueError, match=r"skip_transfer_s.*\(0, 2\)"):
        simulate(gpipe(3, 2, skips=[(0, 2)]), forward_s=1.0, backward_s=1.0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"forward_s": -1.0}, ValueError, "forward_s"),
        ({"backward_s": float("nan")}, ValueError, "backward_s"),
        ({"forward_s": [1.0, 1.0]}, ValueError, "forward_s: expected 3"),
        ({"transfer_s": [0.1, 0.1, 0.1]}, ValueError, "transfer_s: expected 2"),
        ({"backward_transfer_s": [-0.1, 0.1]}, ValueError, "backward_transfer_s"),
        ({"transfer_s": "fast"}, TypeError, "transfer_s"),
        ({"skip_transfer_s": {(0, 1): 1.0}}, ValueError, "not a skip"),
    ],
)
def test_bad_durations_name_the_argument(kwargs, error, match):
    args = {"forward_s": 1.0, "backward_s": 2.0, "transfer_s": 0.5} | kwargs
    with pytest.raises(error, match=match):
        simulate(one_f_one_b(3, 4), **args)


def _no_comm_reference(schedule: Schedule, forward_s, backward_s) -> float:
    """Longest path of the compute DAG (stage order + dependencies), independent of the simulator."""
    end: dict[Compute, float] = {}
    orders = [list(schedule.compute_order(s)) for s in range(schedule.n_stages)]
    free = [0.0] * schedule.n_stages
    while any(orders):
        for s, order in enumerate(orders):
            while order and all(d in end for d in schedule.dependencies(order[0])):
                a = order.pop(0)
                start = max([free[s], *(end[d] for d in schedule.dependencies(a))])
                end[a] = free[s] = start + (forward_s[s] if a.phase.value == "F" else backward_s[s])
    return max(end.values())


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6),
    m=st.integers(1, 10),
    which=st.sampled_from(GENERATORS),
    data=st.data(),
)
def test_zero_transfer_equals_the_no_communication_time(n, m, which, data):
    seconds = st.floats(0.1, 5.0, allow_nan=False)
    fwd = data.draw(st.lists(seconds, min_size=n, max_size=n))
    bwd = data.draw(st.lists(seconds, min_size=n, max_size=n))
    schedule = which(n, m)
    expected = _no_comm_reference(schedule, fwd, bwd)
    for overlap in (True, False):
        r = simulate(schedule, forward_s=fwd, backward_s=bwd, transfer_s=0, overlap=overlap)
        assert r.iteration_s == pytest.approx(expected)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 8), m=st.integers(1, 16), which=st.sampled_from(GENERATORS))
def test_uniform_no_comm_iteration_is_m_plus_n_minus_1_steps(n, m, which):
    r = simulate(which(n, m), forward_s=1.0, backward_s=2.0, transfer_s=0.0)
    assert r.iteration_s == pytest.approx((m + n - 1) * 3.0)
    assert r.peak_activations == which(n, m).peak_activations


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(2, 6),
    m=st.integers(1, 10),
    which=st.sampled_from(GENERATORS),
    t=st.floats(0.0, 3.0),
)
def test_blocking_sends_never_help_and_events_are_consistent(n, m, which, t):
    schedule = which(n, m)
    on = simulate(schedule, forward_s=1.0, backward_s=2.0, transfer_s=t)
    off = simulate(schedule, forward_s=1.0, backward_s=2.0, transfer_s=t, overlap=False)
    assert off.iteration_s >= on.iteration_s - 1e-9
    for r in (on, off):
        for stage_events in r.events:
            computes = [e for e in stage_events if e.kind is not EventKind.SEND]
            assert all(a.end_s <= b.start_s + 1e-9 for a, b in zip(computes, computes[1:], strict=False))
        assert 0.0 <= r.bubble_fraction < 1.0


@pytest.mark.parametrize("which", GENERATORS)
def test_the_generated_schedules_run_with_sends_that_meet_their_receives(which):
    """NCCL lanes on GPUs start a transfer only once its receiver reached the compute that reads
    it (``rendezvous``): every generated schedule without skips still runs, never faster than
    blocking sends. (With a skip connection, eager 1F1B gets stuck in this model from 4
    microbatches on 3 stages: sends of one compute are issued one after another here.)"""
    for n in range(1, 7):
        for m in range(1, 13):
            schedule = which(n, m)
            kwargs = {"forward_s": 1.0, "backward_s": 2.0, "transfer_s": 0.3}
            met = simulate(schedule, rendezvous=True, **kwargs)
            blocking = simulate(schedule, overlap=False, **kwargs)
            assert met.iteration_s >= blocking.iteration_s - 1e-9 and not met.overlap


def test_a_schedule_whose_sends_cross_their_readers_is_stuck_with_rendezvous():
    """Stage 1 reads F1 before F0: a blocking send of F0 that must meet its receive waits for
    stage 1 to reach F0, which needs F1, which stage 0 computes only after that send."""
    crossed = schedule_from_orders("crossed", [["F0", "F1", "B0", "B1"], ["F1", "F0", "B0", "B1"]], 2)
    simulate(crossed, forward_s=1.0, backward_s=1.0, transfer_s=0.5, overlap=False)  # runs
    with pytest.raises(ScheduleError, match="stuck at stage 0"):
        simulate(crossed, forward_s=1.0, backward_s=1.0, transfer_s=0.5, rendezvous=True)


def test_target_eager_hides_forward_transfers():
    """4 stages, 8 microbatches, transfer = half a forward: eager <= 1F1B and <= 1.10x no-comm."""
    timings = {"forward_s": 1.0, "backward_s": 2.0}
    no_comm = simulate(one_f_one_b(4, 8), **timings, transfer_s=0.0).iteration_s
    one = simulate(one_f_one_b(4, 8), **timings, transfer_s=0.5)
    eager = simulate(eager_one_f_one_b(4, 8), **timings, transfer_s=0.5)
    print(f"\n4x8 target: no-comm {no_comm:.2f} s, 1F1B {one.iteration_s:.2f} s, eager {eager.iteration_s:.2f} s")
    assert eager.iteration_s <= one.iteration_s
    assert eager.iteration_s <= 1.10 * no_comm
    assert (no_comm, one.iteration_s, eager.iteration_s) == pytest.approx((33.0, 41.0, 36.0))
    assert eager.peak_activations == (7, 5, 3, 1) and one.peak_activations == (4, 3, 2, 1)
    assert sum(eager.idle_waiting_s) < sum(one.idle_waiting_s)


@pytest.mark.sim
def test_large_pipeline_simulates_exactly():
    eager = simulate(eager_one_f_one_b(64, 256), forward_s=1.0, backward_s=2.0, transfer_s=0.5)
    one = simulate(one_f_one_b(64, 256), forward_s=1.0, backward_s=2.0, transfer_s=0.5)
    assert eager.iteration_s == pytest.approx((256 + 63) * 3.0 + 2 * 63 * 0.5)
    assert eager.iteration_s < one.iteration_s
    assert eager.peak_activations[0] == 127 and one.peak_activations[0] == 64

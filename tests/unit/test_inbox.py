"""The ordered inbox of a device actor (``reshard.runtime.device.inbox``), with plain threads: a
controller's calls run in sequence order whatever order they arrive in; a call that gives up its
turn (its deadline passed, or anything else stopped it) is skipped by the calls after it; calls
of different controllers do not wait on each other; an infinite deadline is allowed."""

from __future__ import annotations

import math
import threading

import pytest

from reshard.errors import ReshardTimeout
from reshard.runtime.deadlines import Deadline
from reshard.runtime.device.inbox import CallerForgotten, OrderedInbox
from reshard.runtime.messages import Ticket

pytestmark = pytest.mark.unit

NONE = Deadline(math.inf)


def _enter(inbox, ticket, deadline, order, started=None, release=None, what="call"):
    with inbox.turn(ticket, deadline, what):
        if started is not None:
            started.set()
        if release is not None:
            assert release.wait(30)
        order.append(ticket.seq)


def test_calls_run_in_sequence_order_whatever_order_they_arrive_in():
    inbox, order = OrderedInbox(), []
    threads = [threading.Thread(target=_enter, args=(inbox, Ticket("c", n), NONE, order)) for n in (3, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert order == [1, 2, 3]
    assert [h[1] for h in inbox.state()["recent"]] == [1, 2, 3]


def test_calls_that_never_came_give_up_their_turns_when_a_later_ticket_names_them():
    """Ray failed calls 2 and 3 before they reached the device: call 4 names them and runs at once;
    naming them again (with call 5), or a call that ran (1), changes nothing; a named call that is
    waiting (7, named by 8 while 6 runs) keeps its turn."""
    inbox, order = OrderedInbox(), []
    _enter(inbox, Ticket("c", 1), NONE, order)
    _enter(inbox, Ticket("c", 4, lost=(2, 3)), Deadline.after(30), order)  # without: waits for call 2, times out
    _enter(inbox, Ticket("c", 5, lost=(1, 2, 3)), NONE, order)
    started, release = threading.Event(), threading.Event()
    sixth = threading.Thread(target=_enter, args=(inbox, Ticket("c", 6), NONE, order, started, release))
    sixth.start()
    assert started.wait(30)
    seventh = threading.Thread(target=_enter, args=(inbox, Ticket("c", 7), NONE, order))
    seventh.start()
    while "c#7" not in inbox.state()["waiting"]:
        seventh.join(0.01)  # until it waits for its turn
    eighth = threading.Thread(target=_enter, args=(inbox, Ticket("c", 8, lost=(7,)), NONE, order))
    eighth.start()
    release.set()
    for t in (sixth, seventh, eighth):
        t.join(30)
    assert order == [1, 4, 5, 6, 7, 8]
    recent = inbox.state()["recent"]
    assert [h[1] for h in recent if h[3] == "gave up its turn"] == [2, 3]


def test_a_call_that_gives_up_its_turn_is_skipped():
    inbox, order = OrderedInbox(), []
    started, release = threading.Event(), threading.Event()
    first = threading.Thread(target=_enter, args=(inbox, Ticket("c", 1), NONE, order, started, release))
    first.start()
    assert started.wait(30)
    with pytest.raises(ReshardTimeout, match="still busy with call"):
        _enter(
            inbox, Ticket("c", 2), Deadline.after(1e-9).later(-1), order, what="late call"
        )  # deadline already passed
    third = threading.Thread(target=_enter, args=(inbox, Ticket("c", 3), NONE, order))
    third.start()
    assert inbox.state()["running"]["c"][0] == "call"
    release.set()
    first.join(30)
    third.join(30)
    assert order == [1, 3]
    assert ("c", 2, "late call", "gave up its turn", 0.0) in inbox.state()["recent"]


def test_controllers_do_not_wait_on_each_other():
    inbox, order = OrderedInbox(), []
    started, release = threading.Event(), threading.Event()
    blocked = threading.Thread(target=_enter, args=(inbox, Ticket("a", 1), NONE, order, started, release))
    blocked.start()
    assert started.wait(30)
    _enter(inbox, Ticket("b", 1), NONE, order)  # runs while controller a's call is blocked
    assert order == [1]
    release.set()
    blocked.join(30)
    assert order == [1, 1]


def test_a_call_arriving_after_its_turn_is_refused():
    inbox, order = OrderedInbox(), []
    _enter(inbox, Ticket("c", 1), NONE, order)
    with pytest.raises(RuntimeError, match="arrived after its turn"):
        _enter(inbox, Ticket("c", 1), NONE, order)


def test_a_reserved_controllers_next_call_waits_until_its_state_is_freed():
    inbox, order = OrderedInbox(), []
    _enter(inbox, Ticket("c", 1, caller=("node", "boot", "pidns", 7, 1)), NONE, order)
    assert inbox.callers == {"c": ("node", "boot", "pidns", 7, 1)} and inbox.idle(0.0) == ["c"]
    with inbox.reserve("c") as free:
        assert free and inbox.idle(0.0) == []
        second = threading.Thread(target=_enter, args=(inbox, Ticket("c", 2), NONE, order))
        second.start()
        while ("c", 2) not in {(k.split("#")[0], int(k.split("#")[1])) for k in inbox.state()["waiting"]}:
            second.join(0.01)  # until it waits for its turn
        with inbox.reserve("c") as again:
            assert not again  # one reservation at a time
        assert order == [1]
    second.join(30)
    assert order == [1, 2]


def test_a_controller_with_a_call_running_or_waiting_cannot_be_reserved():
    inbox, order = OrderedInbox(), []
    started, release = threading.Event(), threading.Event()
    running = threading.Thread(target=_enter, args=(inbox, Ticket("c", 1), NONE, order, started, release))
    running.start()
    assert started.wait(30)
    with inbox.reserve("c") as free:
        assert not free
    assert inbox.idle(0.0) == []
    release.set()
    running.join(30)
    assert inbox.idle(0.0) == ["c"]


def test_a_forgotten_controllers_late_calls_are_refused_and_others_go_on():
    inbox, order = OrderedInbox(), []
    _enter(inbox, Ticket("gone", 1, caller=("node", "boot", "pidns", 7, 1)), NONE, order)
    _enter(inbox, Ticket("alive", 1), NONE, order)
    inbox.forget("gone", "its process ended")
    assert inbox.known() == 1 and "gone" not in inbox.callers and inbox.idle(0.0) == ["alive"]
    with pytest.raises(CallerForgotten, match="its process ended"):
        _enter(inbox, Ticket("gone", 2), NONE, order)
    _enter(inbox, Ticket("alive", 2), NONE, order)
    assert order == [1, 1, 2]


def test_a_call_waiting_when_its_controller_is_forgotten_gives_up_at_once():
    inbox, order, raised = OrderedInbox(), [], []

    def late_call():
        try:
            _enter(inbox, Ticket("gone", 2), NONE, order)  # waits for call 1, which never comes
        except CallerForgotten as e:
            raised.append(e)

    waiting = threading.Thread(target=late_call)
    waiting.start()
    while "gone#2" not in inbox.state()["waiting"]:
        waiting.join(0.01)  # until it waits for its turn
    inbox.forget("gone", "its process ended")
    waiting.join(30)
    assert not waiting.is_alive() and order == [] and "its process ended" in str(raised[0])


def test_a_stalled_controller_once_forgotten_lets_its_waiting_calls_go():
    """Call 1 never arrives (its process died before Ray sent it): calls 2 and 3 wait; the
    controller is stalled, can be reserved with its calls waiting, and once forgotten they give
    up and it leaves no order behind."""
    inbox, order, errors = OrderedInbox(), [], []

    def enter(seq):
        try:
            _enter(inbox, Ticket("c", seq, caller=("node", "boot", "pidns", 7, 1)), NONE, order)
        except CallerForgotten as e:
            errors.append(e)

    waiting = [threading.Thread(target=enter, args=(n,)) for n in (2, 3)]
    for t in waiting:
        t.start()
    while len(inbox.state()["waiting"]) < 2:
        waiting[0].join(0.01)  # until both wait for their turn
    assert inbox.stalled() == ["c"] and inbox.idle(0.0) == []
    assert inbox.callers == {"c": ("node", "boot", "pidns", 7, 1)}  # known without its first call
    with inbox.reserve("c") as free:
        assert not free  # calls wait: not without ``waiting``
    with inbox.reserve("c", waiting=True) as free:
        assert free and inbox.stalled() == []
        inbox.forget("c", "its process ended")
    for t in waiting:
        t.join(30)
    assert order == [] and len(errors) == 2 and inbox.known() == 0

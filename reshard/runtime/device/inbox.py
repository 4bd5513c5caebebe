"""Per-caller ordering of a threaded actor's calls.

A device actor serves several threads at once (so that a stuck run never blocks ``stats`` or an
abort, and so that two processes using one mesh never wait on each other), and Ray does not keep a
caller's order for threaded actors. Calls that change state therefore carry a ``Ticket``; the
inbox lets a controller's call with sequence number ``n`` run only after its calls ``1 .. n-1``
finished. A call whose deadline passes while it waits gives up its turn at once (later calls skip
it), so one stuck call delays the others by at most their own deadlines and never wedges them. A
call that Ray failed before it reached the device never comes: the controller names it in its later
tickets (``Ticket.lost``), and its turn is given up then.

Callers. The inbox also keeps where each controller runs (``Ticket.caller``) and when it last called,
so that the device can find the controllers that ended (``reshard.runtime.device.callers``). A
controller's state is freed only while it is ``reserve``d: no call of it runs or waits then, and
its next call waits until the reservation ends. A forgotten controller's later calls are refused.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager

from reshard.errors import ReshardError, ReshardTimeout
from reshard.runtime.deadlines import Deadline
from reshard.runtime.messages import Ticket

WAIT_SLICE_S = 60.0  # a waiting call looks at its deadline at least this often (deadlines may be infinite)
FORGOTTEN_KEEP = 4096  # forgotten controllers remembered, to refuse their late calls (oldest dropped first)


class CallerForgotten(ReshardError):
    """A call from a controller whose process ended: what the device kept for it is gone."""


class OrderedInbox:
    def __init__(self, history: int = 32):
        self._cv = threading.Condition()
        self._next: dict[str, int] = {}  # controller -> the next sequence number to run
        self._skipped: dict[str, set[int]] = {}  # numbers that gave up their turn
        self._running: dict[str, str] = {}  # controller -> what it runs now (for messages)
        self._waiting: dict[tuple[str, int], str] = {}  # calls waiting for their turn
        self._since: dict[str, float] = {}  # controller -> when its running call started
        self._last: dict[str, float] = {}  # controller -> when its last call ended (monotonic)
        self._reserved: set[str] = set()  # controllers whose state is being freed
        self._forgotten: OrderedDict[str, str] = OrderedDict()  # controller -> why
        self.callers: dict[str, tuple] = {}  # controller -> where its process runs (``Ticket.caller``)
        self.history: deque = deque(maxlen=history)  # (controller, seq, what, outcome, seconds)

    def state(self) -> dict:
        """What this device is doing, per controller: the call running (and for how long), the
        calls waiting for their turn, the next number expected, and the recent calls."""
        now = time.time()
        with self._cv:
            return {
                "running": {c: (w, round(now - self._since[c], 3)) for c, w in self._running.items()},
                "waiting": {f"{c}#{n}": w for (c, n), w in self._waiting.items()},
                "next": dict(self._next),
                "recent": list(self.history),
            }

    @contextmanager
    def turn(self, ticket: Ticket, deadline: Deadline, what: str = "call") -> Iterator[None]:
        """Wait for ``ticket``'s turn (until ``deadline``), run the body, pass the turn on."""
        c, seq = ticket.controller, ticket.seq
        with self._cv:
            if c in self._forgotten:
                raise CallerForgotten(f"{what} came from a controller this device forgot: {self._forgotten[c]}")
            if ticket.caller is not None:
                self.callers[c] = ticket.caller
            if ticket.lost:
                self._give_up(c, ticket.lost)
            self._waiting[(c, seq)] = what
            try:
                while True:
                    if c in self._forgotten:  # checked first: a forgotten controller gets no order again
                        raise CallerForgotten(f"{what} came from a controller this device forgot: {self._forgotten[c]}")
                    if self._next.setdefault(c, 1) == seq and c not in self._reserved:
                        break
                    if self._next[c] > seq:
                        raise RuntimeError(f"ordered call {seq} of controller {c} ({what}) arrived after its turn")
                    left = deadline.left()
                    if left <= 0:
                        ahead = self._running.get(c, f"call {self._next[c]}, which has not arrived yet")
                        raise ReshardTimeout(
                            f"{what} waited for its turn until its deadline: this device is still busy with {ahead}"
                        )
                    self._cv.wait(min(left, WAIT_SLICE_S))
            except BaseException:  # it gives up its turn, whatever stopped it: later calls skip it
                if c not in self._forgotten:
                    self._skipped.setdefault(c, set()).add(seq)
                self.history.append((c, seq, what, "gave up its turn", 0.0))
                raise
            finally:
                self._waiting.pop((c, seq), None)
            self._running[c] = what
            self._since[c] = started = time.time()
        outcome = "failed"
        try:
            yield
            outcome = "done"
        finally:
            with self._cv:
                self.history.append((c, seq, what, outcome, round(time.time() - started, 3)))
                self._running.pop(c, None)
                self._last[c] = time.monotonic()
                self._next[c] = seq + 1
                self._pass_skipped(c)

    def _give_up(self, c: str, lost: tuple[int, ...]) -> None:
        """The turns of controller ``c``'s calls ``lost`` (they never reached this device), unless
        they came after all (each number is sent again with later calls: one already run is passed over)."""
        nxt = self._next.setdefault(c, 1)
        running = nxt if c in self._running else None
        skipped = self._skipped.setdefault(c, set())
        gave_up = [n for n in lost if n >= nxt and n != running and n not in skipped and (c, n) not in self._waiting]
        if gave_up:
            skipped.update(gave_up)
            self.history.extend((c, n, "a call that never came", "gave up its turn", 0.0) for n in gave_up)
            if running is None:
                self._pass_skipped(c)

    def _pass_skipped(self, c: str) -> None:
        """Move controller ``c``'s next number past the calls that gave up their turns."""
        skipped = self._skipped.get(c, set())
        nxt = self._next[c]
        while nxt in skipped:
            skipped.discard(nxt)
            nxt += 1
        self._next[c] = nxt
        self._cv.notify_all()

    def idle(self, idle_s: float) -> list[str]:
        """Controllers with no call running or waiting whose last call ended ``idle_s`` ago or more."""
        now = time.monotonic()
        with self._cv:
            busy = set(self._running) | {c for c, _ in self._waiting} | self._reserved
            return [c for c, t in self._last.items() if c not in busy and now - t >= idle_s]

    def stalled(self) -> list[str]:
        """Controllers with calls waiting for their turn and none running (a call before them has
        not arrived)."""
        with self._cv:
            waiting = {c for c, _ in self._waiting}
            return sorted(waiting - set(self._running) - self._reserved)

    @contextmanager
    def reserve(self, controller: str, *, waiting: bool = False) -> Iterator[bool]:
        """Hold ``controller``'s calls back while the body frees its state: yields False (and
        holds nothing) if one of its calls runs now, or waits (unless ``waiting``: calls that wait
        then keep waiting, and give up if the body forgets the controller)."""
        with self._cv:
            busy = controller in self._running or controller in self._reserved
            if busy or (not waiting and any(c == controller for c, _ in self._waiting)):
                free = False
            else:
                self._reserved.add(controller)
                free = True
        try:
            yield free
        finally:
            if free:
                with self._cv:
                    self._reserved.discard(controller)
                    self._cv.notify_all()

    def forget(self, controller: str, reason: str) -> None:
        """Drop ``controller``: its order and process; its later calls are refused, saying ``reason``."""
        with self._cv:
            for table in (self._next, self._skipped, self._last, self.callers):
                table.pop(controller, None)
            self._forgotten[controller] = reason
            while len(self._forgotten) > FORGOTTEN_KEEP:
                self._forgotten.popitem(last=False)
            self._cv.notify_all()  # its calls still waiting give up now

    def known(self) -> int:
        """Controllers this inbox keeps an order for."""
        with self._cv:
            return len(self._next)

"""Holds and releases of shards that garbage collection and pickling ask for.

A handle's finalizer (a dropped ``ShardedTensor``) or pickler (a copy sent to another process) may
run inside any submission of the controller, even while it holds its lock, so it must not submit
itself: the change is queued and a janitor thread submits it, or the next reshard does first
(``flush``). The queue keeps this process's order, so a pickled copy's hold is taken before the
original's release."""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable

JANITOR_IDLE_S = 5.0  # an idle janitor thread ends after this (the next hold starts one)


class HoldQueue:
    """Queued ``(acquire, devices, name, holder)`` changes, submitted in order by ``submit(changes)``."""

    def __init__(self, submit: Callable[[list], None]):
        self._submit = submit
        self._queued: collections.deque = collections.deque()
        self._wake: queue.SimpleQueue = queue.SimpleQueue()  # a token per queued change: wakes the janitor
        self._janitor: threading.Thread | None = None
        self._starting = threading.Lock()
        self._holding = threading.Lock()  # held while queued changes are drained and submitted

    def put(self, acquire: bool, devices, name: str, holder: str) -> None:
        """Queue a change (safe in a finalizer: a deque append and a queue put) and make sure a
        janitor runs."""
        self._queued.append((acquire, tuple(devices), name, holder))
        self._wake.put(None)
        if self._janitor is None or not self._janitor.is_alive():
            with self._starting:
                if self._janitor is None or not self._janitor.is_alive():
                    self._janitor = threading.Thread(target=self._sweep, name="reshard-janitor", daemon=True)
                    self._janitor.start()

    def flush(self) -> None:
        """Submit the queued changes now (in this thread)."""
        with self._holding:
            self._submit(self._drain())

    def _sweep(self) -> None:
        while True:
            try:
                self._wake.get(timeout=JANITOR_IDLE_S)
            except queue.Empty:
                return  # started again by the next put
            self.flush()

    def _drain(self) -> list:
        """The queued changes, oldest first (taken only under ``_holding``: whoever takes them
        submits them before anyone takes later ones, so the queue's order is kept)."""
        out = []
        while self._queued:
            out.append(self._queued.popleft())
        return out

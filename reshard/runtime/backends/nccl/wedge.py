"""The wedge guard: ends the process when a call stays inside NCCL far past its deadline, so Ray
reports the actor dead instead of it hanging."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import threading
import time

log = logging.getLogger(__name__)


WEDGE_GRACE_S = 30.0


WEDGED_EXIT_CODE = 86


def _exit_wedged(what: str) -> None:  # pragma: no cover - ends the process
    log.critical(
        "NCCL call %s is still blocked %.0fs after its deadline: NCCL is wedged in this process; exiting (code %d) "
        "so that the actor is reported dead",
        what,
        WEDGE_GRACE_S,
        WEDGED_EXIT_CODE,
    )
    for h in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            h.flush()
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os._exit(WEDGED_EXIT_CODE)


class WedgeGuard:
    """Watches calls into NCCL: one still inside at ``deadline + grace_s`` calls ``on_wedged(what)``
    (default: exit the process). It only watches; it never touches a communicator.

    Entering and leaving a call costs a dictionary update under a lock (every message goes through
    it); the guard's thread looks at the calls inside a few times per grace period."""

    def __init__(self, grace_s: float = WEDGE_GRACE_S, on_wedged=_exit_wedged):
        self.grace_s = float(grace_s)
        self.on_wedged = on_wedged
        self.look_s = min(1.0, self.grace_s / 4)
        self._lock = threading.Lock()
        self._inside: dict[int, tuple[float, str]] = {}  # token -> (limit, what)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def inside(self, deadline: float, what: str) -> _Inside:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="reshard-nccl-wedge-guard", daemon=True)
                    self._thread.start()
        return _Inside(self, deadline + self.grace_s, what)

    def _run(self) -> None:
        while True:
            time.sleep(self.look_s)
            now = time.monotonic()
            with self._lock:
                late = [(token, what) for token, (limit, what) in self._inside.items() if limit <= now]
                for token, _ in late:
                    del self._inside[token]
            for _, what in late:
                self.on_wedged(what)


class _Inside:
    """One call inside NCCL, from ``__enter__`` to ``__exit__``."""

    __slots__ = ("guard", "limit", "what", "token")

    def __init__(self, guard: WedgeGuard, limit: float, what: str):
        self.guard, self.limit, self.what = guard, limit, what

    def __enter__(self) -> None:
        guard = self.guard
        with guard._lock:
            self.token = next(guard._ids)
            guard._inside[self.token] = (self.limit, self.what)

    def __exit__(self, *exc) -> None:
        guard = self.guard
        with guard._lock:
            guard._inside.pop(self.token, None)

"""The wedge guard: ends the process when a call stays inside NCCL far past its deadline, so Ray
reports the actor dead instead of it hanging."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)


WEDGE_GRACE_S = 30.0


WEDGED_EXIT_CODE = 86


def _exit_wedged(what: str) -> None:  # pragma: no cover - ends the process
    log.critical(
        "NCCL call %s is still blocked %.0fs after its deadline: NCCL is wedged in this process; exiting (code %d) "
        "so that the actor is reported dead", what, WEDGE_GRACE_S, WEDGED_EXIT_CODE,
    )  # fmt: skip
    for h in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            h.flush()
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os._exit(WEDGED_EXIT_CODE)


class WedgeGuard:
    """Watches calls into NCCL: one still inside at ``deadline + grace_s`` calls ``on_wedged(what)``
    (default: exit the process). It only watches; it never touches a communicator."""

    def __init__(self, grace_s: float = WEDGE_GRACE_S, on_wedged=_exit_wedged):
        self.grace_s = float(grace_s)
        self.on_wedged = on_wedged
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._inside: dict[int, str] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def inside(self, deadline: float, what: str) -> Iterator[None]:
        with self._cv:
            token = next(self._ids)
            self._inside[token] = what
            heapq.heappush(self._heap, (deadline + self.grace_s, token))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="reshard-nccl-wedge-guard", daemon=True)
                self._thread.start()
            self._cv.notify()
        try:
            yield
        finally:
            with self._cv:
                self._inside.pop(token, None)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap:
                    self._cv.wait()
                limit, token = self._heap[0]
                if token not in self._inside:
                    heapq.heappop(self._heap)
                    continue
                now = time.monotonic()
                if now < limit:
                    self._cv.wait(limit - now)
                    continue
                heapq.heappop(self._heap)
                what = self._inside.pop(token)
            self.on_wedged(what)

"""How this device's runs that wait for a commit ended, kept for the destinations that decide it.

A reshard into users' tensors commits on every destination once every participant's run
succeeded. The destinations read that from the run results the caller owns, and ask the
participants themselves (``reshard_outcome``) where a result is gone or late: when the caller
dies, Ray drops what it owned at once, and destinations that read before and after its death
would otherwise decide differently. A participant keeps the outcome of its last ``KEEP`` such
runs; one that never ran here is unknown.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple


class Outcome(NamedTuple):
    """``ok``: the run succeeded; else ``reason`` says why not; ``checks``: with ``verify``."""

    ok: bool
    reason: str
    checks: list | None


class RunOutcomes:
    KEEP = 1024  # runs remembered (oldest forgotten first): far more than can await their commits at once

    def __init__(self):
        self._done: OrderedDict[tuple[str, str], Outcome] = OrderedDict()
        self._cv = threading.Condition()

    def record(self, controller: str, run: str, outcome: Outcome) -> None:
        with self._cv:
            self._done[(controller, run)] = outcome
            while len(self._done) > self.KEEP:
                self._done.popitem(last=False)
            self._cv.notify_all()

    def wait(self, controller: str, run: str, timeout_s: float) -> Outcome | None:
        """The outcome of ``run`` once it ended here (None if it did not within ``timeout_s``)."""
        key = (controller, run)
        with self._cv:
            self._cv.wait_for(lambda: key in self._done, max(0.0, timeout_s))
            return self._done.get(key)

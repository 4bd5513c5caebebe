"""Timeouts and deadlines: ``Deadline``, one value with both clocks.

A deadline inside a process is an instant of ``time.monotonic()`` (immune to clock steps); one that
travels to another process is a budget, the seconds left when it was sent, since monotonic clocks of
two processes share no origin and the wall clocks of two machines need not agree. A ``Deadline``
holds the instant and the timeout it was made from (what an error quotes) and gives the budget for
messages; a device turns the budget into a ``Deadline`` from the call's arrival
(``Deadline.from_budget``): a call's time in flight is not counted, a skewed clock does not matter.
Below the entry points, the executor and the backends are handed the instant alone
(``deadline.at``): they only compare it with the clock."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

DEFAULT_TIMEOUT_S = 60.0


def check_timeout(timeout_s) -> float | None:
    """``timeout_s`` validated: a positive finite number, or None (no limit)."""
    if timeout_s is None:
        return None
    if not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool) or not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a positive finite number of seconds or None (no limit), got {timeout_s!r}")
    return float(timeout_s)


@dataclass(frozen=True, slots=True)
class Deadline:
    """When something must be done: ``at``, an instant of this process's monotonic clock
    (``inf``: no limit), and the ``timeout_s`` it was made from (None where it came from another
    process, or without a limit)."""

    at: float
    timeout_s: float | None = None

    @classmethod
    def after(cls, timeout_s: float | None) -> Deadline:
        """The deadline ``timeout_s`` from now (no limit for None)."""
        return cls(math.inf if timeout_s is None else time.monotonic() + timeout_s, timeout_s)

    @classmethod
    def from_budget(cls, budget_s: float) -> Deadline:
        """The deadline of a call from another process, ``budget_s`` from its arrival here."""
        return cls(math.inf if budget_s == math.inf else time.monotonic() + max(0.0, budget_s))

    @property
    def budget(self) -> float:
        """Seconds left (``inf`` without a limit): what travels to other processes."""
        return math.inf if self.at == math.inf else max(0.0, self.at - time.monotonic())

    def left(self) -> float:
        """Seconds left, at least 0 (``inf`` without a limit)."""
        return max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return time.monotonic() >= self.at

    def later(self, seconds: float) -> Deadline:
        """``seconds`` after this deadline (a grace period past it), quoting the same timeout."""
        return Deadline(self.at + seconds, self.timeout_s)

    def or_in(self, seconds: float) -> Deadline:
        """Whichever comes last: this deadline, or ``seconds`` from now."""
        return Deadline(max(self.at, time.monotonic()) + seconds, self.timeout_s)

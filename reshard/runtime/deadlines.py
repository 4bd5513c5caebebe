"""Timeouts and deadlines, and the one conversion between clocks.

A deadline inside a process is a ``time.monotonic()`` value (immune to clock steps); one that
travels to another process is a ``time.time()`` value, since monotonic clocks of two processes (or
machines) share no origin. Every conversion goes through ``wall_of`` and ``monotonic_of``."""

from __future__ import annotations

import math
import time

DEFAULT_TIMEOUT_S = 60.0


def check_timeout(timeout_s) -> float | None:
    """``timeout_s`` validated: a positive finite number, or None (no limit)."""
    if timeout_s is None:
        return None
    if not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool) or not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a positive finite number of seconds or None (no limit), got {timeout_s!r}")
    return float(timeout_s)


def deadline_of(timeout_s: float | None) -> float:
    """The monotonic deadline ``timeout_s`` from now (infinite for None)."""
    return math.inf if timeout_s is None else time.monotonic() + timeout_s


def wall_of(deadline: float) -> float:
    """A monotonic deadline of this process as a wall-clock one (what travels to other processes)."""
    return time.time() + (deadline - time.monotonic())


def monotonic_of(wall_deadline: float) -> float:
    """A wall-clock deadline from another process as a monotonic one of this process."""
    return time.monotonic() + (wall_deadline - time.time())

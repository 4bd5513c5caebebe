"""Which processes that called this device have ended.

Every process that drives devices (a driver, a Ray task or actor pushing weights) is a controller,
and a device keeps state for each: communicators, programs, staging, its call order. A controller
sends with its first call to a device a lease: a list holding an ObjectRef its own process owns.
Ray resolves it while that process lives and raises ``OwnerDiedError`` once it ended (killed or
exited), however it ended; so the device can free what it kept for it, without a message from a
process that may never send one. A lease that cannot be resolved for another reason (a slow or cut
network) proves nothing, and the controller is kept.
"""

from __future__ import annotations

import threading

import ray

PROBE_S = 5.0  # how long one probe waits for Ray to resolve a lease


def new_lease(owner_id: str) -> list:
    """A lease for this process (``Ticket.lease``): keep it referenced for as long as the process lives."""
    return [ray.put(owner_id)]


def ended(leases: dict[str, list], timeout_s: float = PROBE_S) -> list[str]:
    """The controllers among ``leases`` (controller -> lease) whose processes ended."""
    gone = []
    for controller, lease in leases.items():
        try:
            ray.get(lease[0], timeout=timeout_s)
        except ray.exceptions.OwnerDiedError:
            gone.append(controller)
        except Exception:  # a timeout or a cut: not proof that it ended
            continue
    return gone


class Watch:
    """A daemon thread that calls ``check()`` every ``interval_s`` until ``stop()``."""

    def __init__(self, check, interval_s: float, name: str):
        self._check = check
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._check()
            except Exception:  # noqa: S112 - a failed pass is retried at the next interval
                continue

    def stop(self) -> None:
        self._stop.set()

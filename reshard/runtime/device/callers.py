"""Which processes that called this device have ended.

Every process that drives devices (a driver, a Ray task or actor pushing weights) is a controller,
and a device keeps state for each: communicators, programs, staging, its call order. A controller
sends with every call to a device where its process runs (``reshard.runtime.processes``): its Ray node,
the kernel's boot id and PID namespace, its pid and the pid's start time. A device that shares the
kernel and PID namespace with it reads ``/proc`` to learn whether that very process still runs (a
reused pid has another start time); one elsewhere learns it only when the caller's Ray node is
gone. So a device frees what it kept for a caller without a message from a process that may never
send one, and without holding anything of the caller's (a Ray object it owned would keep a
short-lived task's worker alive). A caller on another node that is still alive is kept (its
staging is still given back when idle).
"""

from __future__ import annotations

import threading

import ray

from reshard.runtime.processes import boot_id, pid_namespace, start_time


def ended(callers: dict[str, tuple]) -> list[str]:
    """The controllers among ``callers`` (controller -> ``processes.process_of_this``) whose processes ended."""
    here = (boot_id(), pid_namespace())
    alive_nodes: set | None = None
    gone = []
    for controller, (node, boot, pidns, pid, start) in callers.items():
        if (boot, pidns) == here and boot is not None and pidns is not None:
            if start_time(pid) != start:
                gone.append(controller)
            continue
        if alive_nodes is None:
            alive_nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        if node not in alive_nodes:
            gone.append(controller)
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

"""Which processes that called this device have ended.

Every process that drives devices (a driver, a Ray task or actor pushing weights) is a controller,
and a device keeps state for each: communicators, programs, staging, its call order. A controller
sends with every call to a device where its process runs (``process_of_this``): its Ray node,
the kernel's boot id and PID namespace, its pid and the pid's start time. A device that shares the
kernel and PID namespace with it reads ``/proc`` to learn whether that very process still runs (a
reused pid has another start time); one elsewhere learns it only when the caller's Ray node is
gone. So a device frees what it kept for a caller without a message from a process that may never
send one, and without holding anything of the caller's (a Ray object it owned would keep a
short-lived task's worker alive). A caller on another node that is still alive is kept (its
staging is still given back when idle).
"""

from __future__ import annotations

import functools
import os
import threading

import ray


def process_of_this() -> tuple:
    """Where this process runs (``Ticket.caller``): ``(node id, boot id, PID namespace, pid, start)``."""
    pid = os.getpid()
    return (ray.get_runtime_context().get_node_id(), _boot_id(), _pid_namespace(), pid, _start_time(pid))


def ended(callers: dict[str, tuple]) -> list[str]:
    """The controllers among ``callers`` (controller -> ``process_of_this``) whose processes ended."""
    here = (_boot_id(), _pid_namespace())
    alive_nodes: set | None = None
    gone = []
    for controller, (node, boot, pidns, pid, start) in callers.items():
        if (boot, pidns) == here and boot is not None and pidns is not None:
            if _start_time(pid) != start:
                gone.append(controller)
            continue
        if alive_nodes is None:
            alive_nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        if node not in alive_nodes:
            gone.append(controller)
    return gone


@functools.cache
def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


@functools.cache
def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # field 22, counted after the command name


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

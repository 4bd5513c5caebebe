"""Where a process runs, told to the devices it calls (``Ticket.caller``) so that a device can tell
when it ended (``reshard.runtime.device.callers``): its Ray node, the kernel's boot id and PID
namespace, its pid and the pid's start time (a reused pid has another)."""

from __future__ import annotations

import functools
import os

import ray


def process_of_this() -> tuple:
    """Where this process runs (``Ticket.caller``): ``(node id, boot id, PID namespace, pid, start)``."""
    pid = os.getpid()
    return (ray.get_runtime_context().get_node_id(), boot_id(), pid_namespace(), pid, start_time(pid))


@functools.cache
def boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


@functools.cache
def pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # field 22, counted after the command name

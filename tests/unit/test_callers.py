"""How a device tells that a process that called it ended (``reshard.runtime.device.callers``), for
callers on its own machine: by pid and the pid's start time, never by holding anything of theirs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from reshard.runtime import processes
from reshard.runtime.device import callers

pytestmark = pytest.mark.unit


def _process(pid: int, start=None) -> tuple:
    start = processes.start_time(pid) if start is None else start
    return ("this node", processes.boot_id(), processes.pid_namespace(), pid, start)


def test_a_caller_on_this_machine_ends_with_its_process():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        known = {"me": _process(os.getpid()), "child": _process(child.pid)}
        assert callers.ended(known) == []
    finally:
        child.stdin.close()
        child.wait(30)
    assert callers.ended(known) == ["child"]


def test_a_pid_another_process_took_over_counts_as_ended():
    here = _process(os.getpid())
    assert callers.ended({"earlier": _process(os.getpid(), start=here[4] - 1)}) == ["earlier"]

"""The multihost chaos tier: faults between emulated hosts (``net_harness.py``). Each segment of
the run gets a fresh emulated cluster (a node loss takes a host away for the rest of its segment);
without root or namespaces the tier skips with the reason ``bench.emulate.available()`` gives."""

from __future__ import annotations

_SUMMARY: list[str] = []


def pytest_terminal_summary(terminalreporter):
    if _SUMMARY:
        terminalreporter.section("multihost chaos")
        for line in _SUMMARY:
            terminalreporter.write_line(line)

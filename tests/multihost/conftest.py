"""The multihost tier: Ray nodes on emulated hosts (network namespaces with shaped NICs,
``bench.emulate``). One cluster serves the tier; it has package scope so that it goes down as soon
as the tier's last test is done, not at the end of the whole session. Without root or namespaces
every test skips with the reason ``bench.emulate.available()`` gives.

Tests send code to a driver inside the head namespace as scenarios (``scenarios.py``), and read
raw network figures with the cluster's own probes; the figures are printed in the summary.
"""

from __future__ import annotations

import pytest

from bench import emulate

HOSTS = 4
NIC_GBIT = 1.0
_FIGURES: dict[str, str] = {}


@pytest.fixture(scope="package")
def cluster():
    """4 emulated hosts, 1 Gbit/s NICs, a Ray node with 1 CPU on each; checked to leave nothing."""
    ok, why = emulate.available()
    if not ok:
        pytest.skip(f"multihost: {why}")
    c = emulate.EmulatedCluster(hosts=HOSTS, nic_gbit=NIC_GBIT, cpus_per_host=1)
    with c:
        _FIGURES["bring-up"] = f"{c.timings['up_s']:.1f} s for {HOSTS} hosts (Ray {c.timings['ray_s']:.1f} s)"
        yield c
    _FIGURES["teardown"] = f"{c.timings['down_s']:.1f} s"
    assert emulate.leftovers(c.token) == (), "the tier's cluster left resources behind"
    assert c.pids() == (), "processes survived in the tier's namespaces"


@pytest.fixture(scope="package")
def figures() -> dict[str, str]:
    """Measured figures to print in the terminal summary (name -> text)."""
    return _FIGURES


def pytest_terminal_summary(terminalreporter):
    if _FIGURES:
        terminalreporter.section("multihost figures")
        for name, text in _FIGURES.items():
            terminalreporter.write_line(f"{name}: {text}")

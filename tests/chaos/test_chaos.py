"""The chaos tier: a seeded sequence of reshards and model syncs (into pool devices and into
attached actors) with faults injected before, during and at the commit of steps
(``chaos_harness``), every invariant checked after every step.

``RESHARD_CHAOS_STEPS`` (default 64: every fault combination on both transports at least once, within a
few minutes on 2 cores), ``RESHARD_CHAOS_SEED`` and ``RESHARD_CHAOS_REPORT`` (a JSON file for the
summary and every step's record) set up longer runs; RELIABILITY.md has the figures.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import pytest
from chaos_harness import COMBOS, TRANSPORTS, Chaos, Kind

from bench.provenance import header, tier_command

pytestmark = pytest.mark.chaos

STEPS = int(os.environ.get("RESHARD_CHAOS_STEPS", "64"))
SEED = int(os.environ.get("RESHARD_CHAOS_SEED", "20261123"))


@pytest.mark.timeout(300 + 3 * STEPS)  # a step takes about 1.4 s; a long run outlasts the default
def test_chaos(ray_cluster):
    chaos = Chaos(SEED)
    try:
        chaos.run(STEPS, progress=_progress if os.environ.get("RESHARD_CHAOS_VERBOSE") else None)
    finally:
        chaos.close()
    summary = chaos.summary()
    path = os.environ.get("RESHARD_CHAOS_REPORT")
    if path:
        with open(path, "w") as f:
            report = {**header(tier_command(), []), "summary": summary, "steps": [asdict(r) for r in chaos.records]}
            json.dump(report, f, indent=1, default=str)
    injected = {(r.fault, r.phase, r.shared_memory) for r in chaos.records}
    expected = {(f.value, p.value, s) for f, p in COMBOS for s in TRANSPORTS}
    if STEPS >= 2 * len(expected):
        assert expected <= injected, f"fault combinations never injected: {sorted(expected - injected)}"
        assert set(summary["steps_by_kind"]) >= {k.value for k in Kind}, summary["steps_by_kind"]
        assert any(k.endswith("attached") for k in summary["steps_by_kind"]), summary["steps_by_kind"]
    assert summary["faults_injected"] >= STEPS // 2 - 2
    assert not chaos.violations, "\n".join(f"step {v.step}: {v.invariant}: {v.detail}" for v in chaos.violations)
    assert summary["livelocks"] == 0


def _progress(i, record):
    print(
        f"step {i}: {record.kind}: {record.fault} {record.phase} {'pull' if record.shared_memory else 'gloo'} "
        f"-> {record.outcome} in {record.seconds:.2f}s probe {record.probe_s} {record.message[:160]}",
        flush=True,
    )

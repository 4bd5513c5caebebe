"""Caller kills at commit time: a trainer actor pushes whole state dicts into outputs
(``reshard(tree, ..., out=outputs, async_op=True)``) and is killed at chosen points of many syncs;
after every sync, every output on every device holds one version, old or new, the same for every
tensor of the tree (never a split model), and a sync nobody killed lands.

Kill points, in a seeded order, each reached through an event (a hook in a destination device
that tells a ``Beacon`` it is there and holds until let go):

- ``SUBMITTED``: at once, once the push returned (its calls are out);
- ``RUN``: while a destination's run holds after its ops (no commit has started);
- ``COMMIT_BEFORE``: while a destination holds at the start of its commit, before it decides;
- ``COMMIT_AFTER``: once one destination committed, the other not yet.

The last two are faults during commits. ``RESHARD_COMMIT_CHAOS_STEPS`` (default 16) and
``RESHARD_CHAOS_SEED`` set longer runs; ``RESHARD_COMMIT_CHAOS_REPORT`` writes a JSON report.
"""

from __future__ import annotations

import enum
import json
import os
import random
import time

import numpy as np
import pytest
import ray
from chaos_harness import Beacon, gone

from bench.provenance import header, tier_command
from reshard import DeviceMesh, Layout, Shard, distribute, reshard

pytestmark = pytest.mark.chaos

STEPS = int(os.environ.get("RESHARD_COMMIT_CHAOS_STEPS", "16"))
SEED = int(os.environ.get("RESHARD_CHAOS_SEED", "20261123"))
TIMEOUT_S = 10.0  # each sync's timeout_s
WAIT_S = 300.0  # how long the test waits for an event before it calls the step hung
SHAPES = {"embed": (64, 16), "layers.0.w": (16, 48), "layers.0.b": (48,), "layers.1.w": (48, 16), "head": (16, 8)}


class Point(enum.Enum):
    NONE = "none"
    SUBMITTED = "caller killed once the push was submitted"
    RUN = "caller killed while a destination's run holds"
    COMMIT_BEFORE = "caller killed while a destination holds before its commit decides"
    COMMIT_AFTER = "caller killed once one destination committed"


AT_COMMIT = (Point.COMMIT_BEFORE, Point.COMMIT_AFTER)


@ray.remote(num_cpus=0)
class _Trainer:
    """Pushes weights from a process of its own (it owns its syncs)."""

    def push(self, tree, src_mesh, dst_mesh, out) -> bool:
        self.work = reshard(tree, src_mesh, _layouts(dst_mesh), out=out, async_op=True, timeout_s=TIMEOUT_S)
        return True

    def wait(self) -> None:
        self.work.wait()


def _layouts(mesh):
    return lambda path, t: Layout(mesh, (Shard(len(t.shape) - 1),))


def _tree(version: int) -> dict:
    """Version ``version`` of the weights: every element of tensor i is ``1000 * version + i``."""
    return {k: np.full(s, 1000.0 * version + i, dtype=np.float32) for i, (k, s) in enumerate(SHAPES.items())}


def _arm(ctx, beacon, key: str, hold: str | None) -> None:
    """Tell ``beacon`` when this device's next commit is over (``<key>:done``); ``hold`` ("run",
    "before", "after"): at that point of the next sync, say ``<key>:held`` and wait for ``<key>:go``."""

    def wait_there():
        ray.get(beacon.set.remote(f"{key}:held"))
        ray.get(beacon.wait.remote([f"{key}:go"], WAIT_S))

    def after_run(runs):
        ctx.after_run = None
        wait_there()

    def commit(stage, run):
        if stage == hold:
            wait_there()
        if stage == "after":
            ctx.commit_hook = None
            ray.get(beacon.set.remote(f"{key}:done:{ctx.device}"))

    ctx.commit_hook = commit
    ctx.after_run = after_run if hold == "run" else None


def _versions(out) -> set[float]:
    """Every (tensor, device) shard's version; a shard of mixed values counts as NaN."""
    seen = set()
    for i, t in enumerate(out.values()):
        for shard in t.local_shards(timeout_s=60).values():
            values = np.unique(shard)
            seen.add((float(values[0]) - i) / 1000.0 if len(values) == 1 else float("nan"))
    return seen


def _settled(mesh, d: int, beacon, done: str) -> bool:
    """Once device ``d``'s commit is over (``done``), or it has no call left to run (a dead
    caller's commit gives up its turn when the device forgets the caller: its process ended before
    an earlier call of it arrived); False if neither within ``WAIT_S``."""
    actor = mesh._records[d].actor
    until = time.monotonic() + WAIT_S
    while time.monotonic() < until:
        if ray.get(beacon.wait.remote([done], 1.0)) == done:
            return True
        calls = ray.get(actor.reshard_stats.remote(), timeout=60)["calls"]
        if not calls["waiting"] and not calls["running"]:
            return True
    return False


@pytest.mark.timeout(300 + 2 * STEPS)  # a long run outlasts the default
def test_caller_kills_at_commit_time_never_split_a_model(ray_cluster):
    rng = random.Random(SEED)
    points = [p for _ in range(-(-STEPS // len(Point))) for p in Point]
    rng.shuffle(points)
    points = points[:STEPS]
    a = DeviceMesh.create((2,), backend="gloo", startup_timeout_s=300, caller_check_s=1.0)
    b = DeviceMesh.create((2,), backend="gloo", startup_timeout_s=300, caller_check_s=1.0)
    beacon = ray.remote(num_cpus=0)(Beacon).remote()
    out = distribute(_tree(0), _layouts(b))
    trainer = _Trainer.remote()
    records, violations, current = [], [], 0
    try:
        for step, point in enumerate(points):
            key = f"commit-chaos-{step}"
            version = step + 1
            hold_at = {Point.RUN: "run", Point.COMMIT_BEFORE: "before", Point.COMMIT_AFTER: "after"}.get(point)
            holder = rng.randrange(2)
            for d in range(2):
                b.call(_arm, beacon, key, hold_at if d == holder else None, devices=[d])
            src = distribute(_tree(version), _layouts(a))
            t0 = time.monotonic()
            assert ray.get(trainer.push.remote(src, a, b, out), timeout=WAIT_S)
            if point is not Point.NONE:
                if point is not Point.SUBMITTED:
                    assert ray.get(beacon.wait.remote([f"{key}:held"], WAIT_S)) == f"{key}:held", (
                        f"step {step}: never held"
                    )
                ray.kill(trainer)
                gone(trainer)
                ray.get(beacon.set.remote(f"{key}:go"))
            for d in range(2):
                assert _settled(b, d, beacon, f"{key}:done:{b.device_ids[d]}"), f"step {step}: device {d} never settled"
            if point is Point.NONE:
                ray.get(trainer.wait.remote(), timeout=WAIT_S)
            seen = _versions(out)
            landed = seen == {float(version)}
            if len(seen) != 1 or not seen <= {float(current), float(version)}:
                violations.append(f"step {step} ({point.value}): versions {sorted(seen)}, before {current}")
            elif point is Point.NONE and not landed:
                violations.append(f"step {step}: a sync nobody killed did not land (versions {sorted(seen)})")
            records.append(
                {
                    "step": step,
                    "point": point.value,
                    "holder": holder,
                    "landed": landed,
                    "seconds": time.monotonic() - t0,
                }
            )
            if os.environ.get("RESHARD_CHAOS_VERBOSE"):
                print(records[-1], flush=True)
            current = version if landed else current
            if point is not Point.NONE:
                trainer = _Trainer.remote()
            ray.get(beacon.forget.remote(key))
    finally:
        ray.kill(beacon)
        ray.kill(trainer)
        a.shutdown()
        b.shutdown()
    kills = sum(r["point"] != Point.NONE.value for r in records)
    summary = {
        "steps": len(records),
        "caller_kills": kills,
        "commit_time_faults": sum(r["point"] in {p.value for p in AT_COMMIT} for r in records),
        "landed": sum(r["landed"] for r in records),
        "violations": violations,
        "seed": SEED,
        "max_step_s": max((r["seconds"] for r in records), default=0.0),
    }
    path = os.environ.get("RESHARD_COMMIT_CHAOS_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({**header(tier_command(), []), "summary": summary, "steps": records}, f, indent=1)
    assert not violations, "\n".join(violations)
    assert {r["point"] for r in records} == {p.value for p in Point} or STEPS < len(Point)

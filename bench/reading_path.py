"""The files one reshard runs through, driver to bytes: ``python -m bench path``.

Every module of ``reshard/``, ``scheduler/`` and ``topology/`` whose code runs during one call of
``reshard``, on the driver and on the device actors, found by profiling (``sys.setprofile``) the
driver's thread and every thread that serves calls in the device actors: as many calls as an actor
serves at once hold its threads together at a barrier, each installing the profiler on its own. A
reshard between two meshes of two devices each, on this machine, measured twice:

- cold: the first reshard of its shapes and layouts (it plans, compiles and connects);
- warm: the same reshard again (programs cached on the devices, communicators connected),
  the path of a training loop's every step;

each with the shared-memory pulls of one machine (the default) and without them (the network
path, as between hosts). The devices' files are collected between two ordered calls that run
on them before and after the reshard; those calls use the same entry files as the reshard.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

from bench.provenance import header

ROOTS = ("reshard", "scheduler", "topology")
_SEEN: set[str] = set()
_BARRIERS: dict[int, threading.Barrier] = {}
_LOCK = threading.Lock()


def _project_file(filename: str, base: str) -> str | None:
    if not filename.startswith(base):
        return None
    rel = os.path.relpath(filename, base)
    return rel if rel.split(os.sep, 1)[0] in ROOTS else None


def _profile(frame, event, arg):
    if event == "call":
        _SEEN.add(frame.f_code.co_filename)


def _arm(actor, parties: int) -> int:
    """On a device actor (``__ray_call__``, ``parties`` at once): profile this thread, once all
    ``parties`` calls hold a thread each. Returns the thread's id."""
    with _LOCK:
        barrier = _BARRIERS.setdefault(parties, threading.Barrier(parties))
    sys.setprofile(_profile)
    barrier.wait(timeout=60)
    return threading.get_ident()


def _arm_devices(meshes) -> None:
    import ray

    from reshard.runtime.driver.mesh import MAX_CONCURRENCY

    for mesh in meshes:
        for actor in mesh.actors:
            threads = ray.get([actor.__ray_call__.remote(_arm, MAX_CONCURRENCY) for _ in range(MAX_CONCURRENCY)])
            assert len(set(threads)) == MAX_CONCURRENCY, "the calls did not hold every serving thread"


def _take(ctx=None) -> list[str]:
    out = sorted(_SEEN)
    _SEEN.clear()
    return out


def _files(names, base: str) -> list[str]:
    return sorted({f for n in names if (f := _project_file(n, base)) is not None})


def measure(shared_memory: bool) -> dict:
    import numpy as np

    from reshard import DeviceMesh, Layout, Shard, distribute, reshard

    base = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    a, b = DeviceMesh.create((2,)), DeviceMesh.create((2,))
    _arm_devices((a, b))
    try:
        x = distribute(np.arange(64 * 32, dtype=np.float32).reshape(64, 32), Layout(a, [Shard(0)]))
        dst = Layout(b, [Shard(1)])
        out = {}
        for step in ("cold", "warm"):
            a.call(_take)
            b.call(_take)
            _take()
            y = reshard(x, a, dst, shared_memory=shared_memory)
            driver = _files(_take(), base)
            devices = {f for m in (a, b) for names in m.call(_take) for f in _files(names, base)}
            assert np.array_equal(y.to_numpy(), x.to_numpy()), "the reshard moved the wrong bytes"
            y.free()
            out[step] = {"driver": driver, "devices": sorted(devices), "all": sorted(set(driver) | devices)}
        return out
    finally:
        a.shutdown()
        b.shutdown()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench path", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the lists to this file")
    args = parser.parse_args(argv)
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    sys.setprofile(_profile)
    try:
        result = {"pulls": measure(True), "network": measure(False)}
    finally:
        ray.shutdown()
    for path, steps in result.items():
        for step, sides in steps.items():
            print(
                f"{path:8} {step}: {len(sides['all'])} files ({len(sides['driver'])} on the driver, "
                f"{len(sides['devices'])} on the devices)"
            )
            runtime = [f for f in sides["all"] if f.startswith(os.path.join("reshard", "runtime"))]
            print(f"  {len(runtime)} of them in reshard/runtime: {' '.join(runtime)}")
            print(f"  the others: {' '.join(f for f in sides['all'] if f not in runtime)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**header("python -m bench path", argv), **result}, f, indent=1)
    return 0

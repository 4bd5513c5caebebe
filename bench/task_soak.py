"""Task soak: many short-lived processes each push a state dict into the same device tensors; what
the devices keep for them should stay flat.

``python -m bench.task_soak [--tasks 200] [--every 20] [--out FILE.json]``

Four device actors hold a small model's weights (``out=``, two meshes of two devices). Each of
``--tasks`` Ray tasks runs in a worker process of its own (``max_calls=1``: the process exits after
the task), becomes a controller of those devices, pushes the state dict with ``reshard(...,
out=...)`` over gloo (communicators, staging, programs on every device) and ends. Every
``--every`` tasks, once every device has learned from Ray that those processes ended
(``DeviceOptions.caller_check_s``), each device reports its controllers, communicators, staging,
open descriptors and resident memory; the driver checks the weights bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from bench.provenance import header

CHECK_S = 1.0  # how often the devices look at their callers here (the default is 10 s)
SETTLE_S = 120.0  # the longest a sample waits for the devices to forget the ended tasks


def _state(ctx) -> dict:
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {
        "device": ctx.device,
        "controllers": len(ctx.controllers),
        "communicators": sum(len(s.groups) for s in ctx.controllers.values()),
        "staging_bytes": sum(s.staging.nbytes for s in ctx.controllers.values()),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_kib": rss,
    }


def _model(rng: np.random.Generator) -> dict:
    """A small transformer block's weights (float32)."""
    shapes = {
        "embed": (512, 64),
        "qkv": (64, 192),
        "proj": (64, 64),
        "up": (64, 256),
        "down": (256, 64),
        "norm": (64,),
        "head": (64, 512),
    }
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def run(tasks: int, every: int, seed: int = 0) -> dict:
    import ray

    from reshard import DeviceMesh, Layout, Replicate, Shard, distribute, reshard

    @ray.remote(num_cpus=0, max_calls=1)
    def push(tree, src_mesh, layouts, out) -> int:
        reshard(tree, src_mesh, layouts, out=out, shared_memory=False)
        return os.getpid()

    own_ray = not ray.is_initialized()
    if own_ray:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    pool = DeviceMesh.create((4,), backend="gloo", startup_timeout_s=300, caller_check_s=CHECK_S)
    src_mesh = DeviceMesh.from_devices(pool.device_ids[:2], (2,))
    dst_mesh = DeviceMesh.from_devices(pool.device_ids[2:], (2,))
    try:
        rng = np.random.default_rng(seed)
        model = _model(rng)
        src = distribute(model, Layout(src_mesh, (Shard(0),)))
        layouts = {
            k: Layout(dst_mesh, (Shard(v.ndim - 1),) if v.ndim > 1 else (Replicate(),)) for k, v in model.items()
        }
        out = distribute({k: np.zeros_like(v) for k, v in model.items()}, layouts)
        samples = [{"tasks": 0, "devices": pool.call(_state)}]
        pids: set[int] = set()
        mismatches = 0
        t0 = time.monotonic()
        for done in range(1, tasks + 1):
            pids.add(ray.get(push.remote(src, src_mesh, layouts, out), timeout=300))
            if done % every == 0 or done == tasks:
                mismatches += sum(not np.array_equal(out[k].to_numpy(), v) for k, v in model.items())
                samples.append({"tasks": done, "settle_s": _settle(pool), "devices": pool.call(_state)})
        elapsed = time.monotonic() - t0
        return {
            "tasks": tasks,
            "processes": len(pids),
            "elapsed_s": round(elapsed, 1),
            "mismatches": mismatches,
            "caller_check_s": CHECK_S,
            "samples": samples,
            "summary": summarize(samples),
        }
    finally:
        for m in (src_mesh, dst_mesh, pool):
            m.shutdown()
        if own_ray:
            ray.shutdown()


def _settle(pool) -> float | None:
    """Seconds until every device keeps state for this driver alone (None: not within SETTLE_S)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < SETTLE_S:
        if all(n == 1 for n in pool.call(lambda ctx: len(ctx.controllers))):
            return round(time.monotonic() - t0, 2)
        time.sleep(CHECK_S / 2)
    return None


def summarize(samples: list[dict]) -> dict:
    """Per device: the range of each figure over the samples after the first push."""
    out = {}
    for k, first in enumerate(samples[0]["devices"]):
        rows = [s["devices"][k] for s in samples[1:]]
        out[first["device"]] = {
            key: [min(r[key] for r in rows), max(r[key] for r in rows)]
            for key in ("controllers", "communicators", "staging_bytes", "fds", "rss_kib")
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.task_soak", description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=200)
    ap.add_argument("--every", type=int, default=20, help="sample after this many tasks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON file (default bench/results/task-soak-<time>.json)")
    args = ap.parse_args(argv)
    argv = list(argv) if argv is not None else sys.argv[1:]
    result = {**header("python -m bench.task_soak", argv), **run(args.tasks, args.every, args.seed)}
    out = args.out or os.path.join("bench", "results", f"task-soak-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    print(f"wrote {out}")
    settled = all(s.get("settle_s") is not None for s in result["samples"][1:])
    return 0 if settled and not result["mismatches"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

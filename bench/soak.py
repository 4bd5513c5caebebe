"""Soak: many reshards and distribute/free cycles on one set of device actors, with each actor's
resident memory and open descriptors sampled as it goes; both should stay flat after warm-up.

``python -m bench.soak [--reshards 1000] [--cycles 300] [--every 50] [--out FILE.json] [--png FILE]``

Four device actors (one ``DeviceMesh``) and views over them; a fixed set of cases (layouts, sizes
up to 1 MiB, dtypes, shared-memory pulls and gloo only) is run round-robin. Every result is checked
bit-exact on a sample of steps and then dropped, alternately by ``free()`` and by garbage collection
(its release goes out asynchronously); the distribute/free cycles are spread over the run. Every
``--every`` operations, after ``reshard.runtime.settle``, each actor reports its VmRSS (read from
``/proc/self/status`` through ``DeviceMesh.call``) and ``stats()`` (open descriptors, live shards,
pooled bytes, peer mappings, staging). The report fits a line to each actor's RSS and descriptors
after warm-up and gives the drift over the run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from bench.provenance import header

WARMUP_FRACTION = 0.2


@dataclass(frozen=True, slots=True)
class Case:
    src: tuple[int, ...]  # flat indices of the pool
    src_shape: tuple[int, ...]
    src_spec: str
    dst: tuple[int, ...]
    dst_shape: tuple[int, ...]
    dst_spec: str
    shape: tuple[int, ...]
    dtype: str
    shared_memory: bool


CASES = (
    Case((0, 1), (2,), "S0", (2, 3), (2,), "S1", (256, 512), "float32", True),
    Case((0, 1), (2,), "S0", (2, 3), (2,), "S1", (256, 512), "float32", False),
    Case((0, 1, 2, 3), (2, 2), "S0 S1", (1, 2, 3), (3,), "R", (96, 80), "int64", True),
    Case((0, 1, 2, 3), (2, 2), "S0 R", (3, 2, 1, 0), (2, 2), "R S1", (512, 128), "float16", False),
    Case((2,), (1,), "R", (0, 1), (2,), "S0", (1000, 33), "int8", True),
    Case((1, 3), (2,), "R", (0, 2), (2,), "R", (64, 64, 8), "float64", False),
)


def placements(spec: str):
    from reshard import Replicate, Shard

    return tuple(Replicate() if p == "R" else Shard(int(p[1:])) for p in spec.split())


def random_array(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(rng.bytes(n), dtype=np.uint8).view(dtype).reshape(shape).copy()


def _vm_rss_kib(ctx=None) -> int:
    """This process's resident memory (run in an actor through ``DeviceMesh.call``, or here)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def sample(pool, op: int) -> dict:
    from reshard.runtime import settle

    gc.collect()
    settle(pool)
    rss = pool.call(_vm_rss_kib)
    stats = pool.stats()
    return {
        "op": op,
        "driver_rss_kib": _vm_rss_kib(),
        "devices": [
            {
                "device": s["device"],
                "rss_kib": r,
                "fds": s["fds"],
                "shards": len(s["buffers"]),
                "shard_bytes": s["buffer_bytes"],
                "pool_bytes": s["pool_bytes"],
                "peer_maps": s["peer_maps"],
                "staging_bytes": s["staging_bytes"],
            }
            for s, r in zip(stats, rss, strict=True)
        ],
    }


def run(reshards: int, cycles: int, every: int, seed: int = 0) -> dict:
    import ray

    from reshard import DeviceMesh, Layout, distribute, reshard

    rng = np.random.default_rng(seed)
    own_ray = not ray.is_initialized()
    if own_ray:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    pool = DeviceMesh.create((2, 2), backend="gloo", startup_timeout_s=300)
    views: dict = {}

    def view(indices, shape):
        key = (tuple(indices), tuple(shape))
        if key not in views:
            views[key] = DeviceMesh.from_devices([pool.device_ids[i] for i in indices], shape)
        return views[key]

    try:
        sources = []
        for c in CASES:
            x = random_array(rng, c.shape, c.dtype)
            src = view(c.src, c.src_shape)
            t = distribute(x, Layout(src, placements(c.src_spec)))
            sources.append((c, x, t, Layout(view(c.dst, c.dst_shape), placements(c.dst_spec))))
        samples = [sample(pool, 0)]
        mismatches = 0
        cycles_done = 0
        total = reshards + cycles
        t0 = time.monotonic()
        op = 0
        for i in range(reshards):
            c, x, t, dst_layout = sources[i % len(sources)]
            y = reshard(t, t.mesh, dst_layout, shared_memory=c.shared_memory)
            if i % 7 == 0 and not np.array_equal(y.to_numpy().view(np.uint8), x.view(np.uint8)):
                mismatches += 1
            if i % 2:
                y.free()
            del y
            op += 1
            while cycles_done < cycles and cycles_done * reshards < (i + 1) * cycles:
                c = CASES[cycles_done % len(CASES)]
                z = distribute(
                    random_array(rng, c.shape, c.dtype), Layout(view(c.src, c.src_shape), placements(c.src_spec))
                )
                if cycles_done % 2:
                    z.free()
                del z
                cycles_done += 1
                op += 1
                if op % every == 0:
                    samples.append(sample(pool, op))
            if op % every == 0 and samples[-1]["op"] != op:
                samples.append(sample(pool, op))
        if samples[-1]["op"] != op:
            samples.append(sample(pool, op))
        elapsed = time.monotonic() - t0
        for _, _, t, _ in sources:
            t.free()
        return {
            "reshards": reshards,
            "cycles": cycles_done,
            "ops": op,
            "elapsed_s": round(elapsed, 1),
            "mismatches": mismatches,
            "samples": samples,
            "summary": summarize(samples, total),
        }
    finally:
        for v in views.values():
            v.shutdown()
        pool.shutdown()
        if own_ray:
            ray.shutdown()


def summarize(samples: list[dict], total_ops: int) -> dict:
    """Per device, after warm-up: RSS and descriptor range and fitted drift per 1,000 operations."""
    warm = [s for s in samples if s["op"] >= WARMUP_FRACTION * total_ops]
    out = {"warmup_ops": int(WARMUP_FRACTION * total_ops), "samples_after_warmup": len(warm), "devices": {}}
    for k, first in enumerate(warm[0]["devices"]):
        ops = np.array([s["op"] for s in warm], dtype=float)
        rss = np.array([s["devices"][k]["rss_kib"] for s in warm], dtype=float) / 1024
        fds = np.array([s["devices"][k]["fds"] for s in warm], dtype=float)
        out["devices"][first["device"]] = {
            "rss_mib_min": round(rss.min(), 1),
            "rss_mib_max": round(rss.max(), 1),
            "rss_mib_per_1000_ops": round(_slope(ops, rss) * 1000, 2),
            "fds_min": int(fds.min()),
            "fds_max": int(fds.max()),
            "fds_per_1000_ops": round(_slope(ops, fds) * 1000, 2),
        }
    ops = np.array([s["op"] for s in warm], dtype=float)
    drv = np.array([s["driver_rss_kib"] for s in warm], dtype=float) / 1024
    out["driver"] = {
        "rss_mib_min": round(drv.min(), 1),
        "rss_mib_max": round(drv.max(), 1),
        "rss_mib_per_1000_ops": round(_slope(ops, drv) * 1000, 2),
    }
    return out


def _slope(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.polyfit(x, y, 1)[0]) if len(x) > 1 and np.ptp(x) > 0 else 0.0


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    ops = [s["op"] for s in samples]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for k, d in enumerate(samples[0]["devices"]):
        ax1.plot(ops, [s["devices"][k]["rss_kib"] / 1024 for s in samples], label=f"device {d['device']}")
        ax2.plot(ops, [s["devices"][k]["fds"] for s in samples], label=f"device {d['device']}")
    warm = result["summary"]["warmup_ops"]
    for ax, what in ((ax1, "actor RSS (MiB)"), (ax2, "open descriptors")):
        ax.axvline(warm, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("operations (reshards + distribute/free cycles)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    fig.suptitle(
        f"soak: {result['reshards']} reshards + {result['cycles']} distribute/free cycles (warm-up dotted)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    ap.add_argument("--reshards", type=int, default=1000)
    ap.add_argument("--cycles", type=int, default=300, help="distribute/free cycles spread over the run")
    ap.add_argument("--every", type=int, default=50, help="sample every this many operations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON file (default bench/results/soak-<time>.json)")
    ap.add_argument("--png", default=None, help="a figure of RSS and descriptors over the run")
    args = ap.parse_args(argv)
    result = {**header("python -m bench.soak", sys.argv[1:] if argv is None else argv)}
    result.update(run(args.reshards, args.cycles, args.every, args.seed))
    out = args.out or os.path.join("bench", "results", f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    if args.png:
        plot(result, args.png)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    print(f"wrote {out}" + (f" and {args.png}" if args.png else ""))
    return 1 if result["mismatches"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

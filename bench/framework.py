"""``python -m bench framework``: a weight sync out of tensors a framework allocated, beside the same
sync out of tensors the library allocated, on an embedded local Ray cluster, in one run.

Two trainer actors hold a GPT-2-shaped state dict (``bench.weights.gpt2``; 20 layers by default,
69 MiB of float32 in 244 tensors), FSDP-sharded ``Shard(0)``, three times: in torch's own
memory (``torch.empty``, as FSDP2 and every framework allocates), in torch's memory moved into
shared memory when shared (``share_state_dict(..., reback=True)``: torch's ``share_memory_()``,
in place), and in the library's (``reshard_device.empty``: shared memory); each shared with
``share_state_dict`` and adopted on the driver. Two inference actors want it tensor-parallel
(Megatron's dims, as ``bench weights``). All four are the user's own actors, attached with
``DeviceMesh.from_actors``.

Methods, timed in rounds whose order rotates, each output freed and settled untimed after its run,
each method's first output compared bit for bit with the source arrays: ``library`` (the tree
out of library memory: pulls from shared memory), ``framework`` (out of torch's memory: pulls by
cross-memory attach, ``reshard.runtime.device.cross_memory``), ``framework-reback`` (out of torch's
memory re-backed: pulls from the mapped file), ``framework-gloo`` (out of torch's
memory with ``shared_memory=False``: every byte through loopback gloo, what framework tensors got
before cross-memory reads). The target: framework / library <= 1.3x (framework-reback / library
beside it). JSON goes to
``bench/results/framework-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402

from bench.local import recorded_run, stats_of  # noqa: E402
from bench.weights import gpt2, placements  # noqa: E402
from reshard.runtime import DeviceRole  # noqa: E402

ROOT = Path(__file__).resolve().parent
METHODS = ("library", "framework", "framework-reback", "framework-gloo")
TARGET = 1.3  # framework / library


@ray.remote(num_cpus=0)
class Holder(DeviceRole):
    """A user's actor (a trainer or an inference worker) that is also a device."""

    def load(self, shards: dict, memory: str) -> dict:
        """Keep ``shards`` in ``memory`` ("framework": torch's; "reback": torch's, moved into shared
        memory when shared; "library": the device's) and share them; returns the tree of names."""
        import torch

        ctx = self.reshard_device
        state = {}
        for k, a in shards.items():
            made = ctx.empty if memory == "library" else torch.empty
            state[k] = made(a.shape, dtype=torch.float32)
            state[k].copy_(torch.from_numpy(a))
        self.__dict__.setdefault("state", {})[memory] = state
        return ctx.share_state_dict(state, prefix=f"{memory}.", reback=memory == "reback")

    def read(self, names: list) -> list:
        return [self.reshard_device.local(n).numpy().copy() for n in names]


def _moves(tree, src_mesh, dst_layouts, shared_memory: bool) -> dict:
    """How the compiled batch moves the tree: its pulls and its messages."""
    from reshard.ir.program import MESSAGE_OPS, Pull
    from reshard.runtime import lowered_batch

    batch = lowered_batch(tree, src_mesh, dst_layouts, shared_memory=shared_memory)
    ops = [op for p in batch.program.devices for part in p.parts for op in part.program.all_ops]
    return {
        "pull_ops": sum(isinstance(op, Pull) for op in ops),
        "message_ops": sum(isinstance(op, MESSAGE_OPS) for op in ops),
    }


def run(args) -> dict:
    from reshard import DeviceMesh, Layout, reshard
    from reshard.ir.regions import layout_regions
    from reshard.runtime import adopt, settle

    model = gpt2(layers=args.layers)
    trainers = [Holder.remote() for _ in range(2)]
    infer = [Holder.remote() for _ in range(2)]
    t_mesh = DeviceMesh.from_actors(trainers, (2,), startup_timeout_s=args.timeout_s)
    i_mesh = DeviceMesh.from_actors(infer, (2,), startup_timeout_s=args.timeout_s)
    try:
        src = Layout(t_mesh, placements("fsdp", None))
        dst = {k: Layout(i_mesh, placements("tp", model.tp_dims[k])) for k in model.arrays}
        trees = {}
        for memory in ("library", "framework", "reback"):
            per_rank = [{} for _ in trainers]
            for k, a in model.arrays.items():
                for rank, box in enumerate(layout_regions(src, a.shape)):
                    per_rank[rank][k] = np.ascontiguousarray(a[tuple(slice(lo, hi) for lo, hi in box)])
            names = ray.get(
                [h.load.remote(s, memory) for h, s in zip(trainers, per_rank, strict=True)], timeout=args.timeout_s
            )[0]
            trees[memory] = adopt(src, names, timeout_s=args.timeout_s)
        runs = {
            "library": (trees["library"], True),
            "framework": (trees["framework"], True),
            "framework-reback": (trees["reback"], True),
            "framework-gloo": (trees["framework"], False),
        }
        samples: dict[str, list[float]] = {m: [] for m in METHODS}
        verified: dict[str, bool] = {}

        def once(m: str) -> float:
            tree, pulls = runs[m]
            t0 = time.perf_counter()
            out = reshard(tree, t_mesh, dst, shared_memory=pulls, timeout_s=args.timeout_s)
            dt = time.perf_counter() - t0
            if m not in verified:
                verified[m] = _bit_exact(out, dst, model.arrays, infer, args.timeout_s)
            for t in out.values():
                t.free()
            settle(i_mesh, timeout_s=args.timeout_s)
            return dt

        for m in METHODS:
            once(m)  # untimed: compiles, warms the pools
        for r in range(args.repeats):
            order = METHODS[r % len(METHODS) :] + METHODS[: r % len(METHODS)]
            for m in order:
                samples[m].append(once(m))
        stats = {m: stats_of(s) for m, s in samples.items()}
        lib = stats["library"]["median"]
        ratio = stats["framework"]["median"] / lib
        return {
            "model": {"name": "gpt2", "layers": args.layers, "tensors": len(model.arrays), "bytes": model.size_bytes},
            "case": "FSDP Shard(0) over 2 trainer actors -> tensor parallel 2 inference actors (attached)",
            "methods": {m: {**stats[m], "verified": verified.get(m, False)} for m in METHODS},
            "moves": {m: _moves(runs[m][0], t_mesh, dst, runs[m][1]) for m in METHODS},
            "ratios": {
                "framework/library": ratio,
                "framework-reback/library": stats["framework-reback"]["median"] / stats["library"]["median"],
                "framework-gloo/framework": stats["framework-gloo"]["median"] / stats["framework"]["median"],
            },
            "targets": {
                name: {"goal": f"<= {TARGET}x", "value": r, "met": r <= TARGET}
                for name, r in (
                    ("framework/library", ratio),
                    ("framework-reback/library", stats["framework-reback"]["median"] / lib),
                )
            },
        }
    finally:
        t_mesh.shutdown()
        i_mesh.shutdown()
        for h in (*trainers, *infer):
            ray.kill(h)


def _bit_exact(out: dict, dst: dict, arrays: dict, infer, timeout_s: float) -> bool:
    from reshard.ir.regions import layout_regions

    names = list(arrays)
    for rank, h in enumerate(infer):
        got = ray.get(h.read.remote([out[k].name for k in names]), timeout=timeout_s)
        for k, g in zip(names, got, strict=True):
            box = layout_regions(dst[k], arrays[k].shape)[rank]
            want = arrays[k][tuple(slice(lo, hi) for lo, hi in box)]
            if g.shape != want.shape or not np.array_equal(g.view(np.uint32), want.view(np.uint32)):
                return False
    return True


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench framework", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=20, help="GPT-2 blocks (20: 69 MiB in 244 tensors)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds (each runs every method once)")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--out", help="JSON path (default bench/results/framework-<timestamp>.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    data, path = recorded_run("framework", argv, args.out, lambda: run(args))
    for m in METHODS:
        s = data["methods"][m]
        print(
            f"{m:16s} median {s['median'] * 1e3:8.1f} ms  (p25 {s['p25'] * 1e3:.1f}, p75 {s['p75'] * 1e3:.1f})"
            f"  bit-exact {s['verified']}  {data['moves'][m]}"
        )
    for name, t in data["targets"].items():
        print(f"{name} {t['value']:.2f}x (goal {t['goal']}: {'met' if t['met'] else 'NO'})")
    print(f"framework-gloo/framework {data['ratios']['framework-gloo/framework']:.2f}x")
    print(f"wrote {path.relative_to(ROOT.parent) if path.is_relative_to(ROOT.parent) else path}")
    return 0 if all(data["methods"][m]["verified"] for m in METHODS) else 1


__all__ = ["main"]

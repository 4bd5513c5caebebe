"""Co-located actors: raw gloo (TCP loopback) versus a shared-memory hand-off; memory-copy costs.

``python -m bench.shm_probe [--size 64MiB] [--receivers 3] [--repeats 5]``

One sender actor and ``--receivers`` receiver actors of the pool, all on this machine. Per round:

* gloo: the sender sends the whole buffer to every receiver (raw ``ProcessGroupGloo``, all
  posted at once, as ``bench.ceiling``), each receiver into a fresh buffer;
* shm: the sender copies its buffer into a ``/dev/shm`` segment (one gather copy, which is also
  what a non-contiguous box needs), then every receiver copies it into a fresh buffer; the
  hand-off is ordered by the two Ray calls, whose time is excluded (in-actor times only).

It prints in-actor times and GB/s (bytes delivered to receivers / time), to size what an intra-node
shared-memory path in the runtime would gain over gloo on loopback. Not used by ``reshard``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from bench.cases import fmt_size, parse_size  # noqa: E402

_SEGS: dict = {}


def _segment(path: str, nbytes: int):
    import torch

    seg = _SEGS.get(path)
    if seg is None:
        seg = _SEGS[path] = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    return seg


def shm_write(ctx, path: str, nbytes: int, reuse: bool) -> float:
    import torch

    src = _SEGS.get(("src", nbytes))
    if src is None:
        src = _SEGS[("src", nbytes)] = torch.ones(nbytes, dtype=torch.uint8)
    t0 = time.perf_counter()
    if not reuse:
        _SEGS.pop(path, None)
    _segment(path, nbytes).copy_(src)
    return time.perf_counter() - t0


def shm_read(ctx, path: str, nbytes: int, reuse: bool) -> float:
    import torch

    t0 = time.perf_counter()
    if not reuse:
        _SEGS.pop(path, None)
        _SEGS.pop(("dst", nbytes), None)
    dst = _SEGS.get(("dst", nbytes))
    if dst is None:
        dst = torch.empty(nbytes, dtype=torch.uint8)
        if reuse:
            _SEGS[("dst", nbytes)] = dst
    dst.copy_(_segment(path, nbytes))
    return time.perf_counter() - t0


def copy_probe(ctx, nbytes: int, repeats: int) -> dict:
    """In one actor: copy ``nbytes`` into a fresh buffer (first touch: page faults, zeroing) versus
    into a reused one, and a strided half-width 2-D copy (what staging and local COPY ops do)."""
    import statistics

    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    keep = torch.empty(nbytes, dtype=torch.uint8)
    keep.copy_(src)
    half = nbytes // 2
    side = 1 << 12
    rows = half // (side // 2) if half >= side else 1
    out = {"fresh": [], "reused": [], "strided": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.empty(nbytes, dtype=torch.uint8).copy_(src)
        out["fresh"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        keep.copy_(src)
        out["reused"].append(time.perf_counter() - t0)
        view = src[: rows * side].view(rows, side)[:, : side // 2]
        dst = keep[: rows * (side // 2)].view(rows, side // 2)
        t0 = time.perf_counter()
        dst.copy_(view)
        out["strided"].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in out.items()}


def shm_drop(ctx, path: str) -> None:
    _SEGS.pop(path, None)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.shm_probe", description=__doc__.splitlines()[0])
    p.add_argument("--size", default="64MiB")
    p.add_argument("--receivers", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)

    import ray

    from bench import ceiling
    from bench.local import Suite

    nbytes = parse_size(args.size)
    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        started = True
    suite = Suite(argparse.Namespace(timeout=300.0, dtype="uint8"), None)
    try:
        k = args.receivers
        acts = [suite.pool.actor(i) for i in range(k + 1)]
        sender, receivers = acts[0], acts[1:]
        key = f"shm-probe/{k}"
        sends = [(r, r, nbytes) for r in range(1, k + 1)]
        recvs = {r: [(0, r, nbytes)] for r in range(1, k + 1)}
        ray.get([sender.call.remote(ceiling.setup, key, suite.store.port, 0, k + 1, sends, [])]
                + [a.call.remote(ceiling.setup, key, suite.store.port, r, k + 1, [], recvs[r])
                   for r, a in enumerate(receivers, 1)])  # fmt: skip
        gloo, shm, shm_reuse = [], [], []
        path = f"/dev/shm/bench-shm-probe-{os.getpid()}"
        try:
            for i in range(args.repeats + 1):
                refs = [sender.call.remote(ceiling.transfer, key, sends, [])]
                refs += [a.call.remote(ceiling.transfer, key, [], recvs[r]) for r, a in enumerate(receivers, 1)]
                t = ray.get(refs)
                for reuse, out in ((False, shm), (True, shm_reuse)):
                    w = ray.get(sender.call.remote(shm_write, path, nbytes, reuse))
                    rd = ray.get([a.call.remote(shm_read, path, nbytes, reuse) for a in receivers])
                    if not reuse:
                        ray.get(sender.call.remote(shm_drop, path))
                    if i:  # round 0 warms up
                        out.append(w + max(rd))
                if i:
                    gloo.append(max(t))
        finally:
            ray.get([a.call.remote(shm_drop, path) for a in acts])
        delivered = nbytes * k
        g = statistics.median(gloo)
        print(f"{fmt_size(nbytes)} from 1 actor to {k} co-located actors (in-actor time, median of {args.repeats}):")
        print(f"  raw gloo (TCP loopback), fresh receive buffers : {g * 1e3:7.1f} ms  {delivered / g / 1e9:5.2f} GB/s")
        for what, vals in (("fresh segment and buffers", shm), ("reused segment and buffers", shm_reuse)):
            s = statistics.median(vals)
            print(f"  shared memory, {what:26}       : {s * 1e3:7.1f} ms  {delivered / s / 1e9:5.2f} GB/s"
                  f"  ({g / s:.1f}x gloo)")  # fmt: skip
        ray.get([a.call.remote(ceiling.teardown, key) for a in acts])
        c = ray.get(sender.call.remote(copy_probe, nbytes, args.repeats))
        print(f"memory copies of {fmt_size(nbytes)} inside one actor (median of {args.repeats}):")
        print(f"  into a fresh buffer  : {c['fresh'] * 1e3:7.1f} ms  {nbytes / c['fresh'] / 1e9:5.2f} GB/s")
        print(f"  into a reused buffer : {c['reused'] * 1e3:7.1f} ms  {nbytes / c['reused'] / 1e9:5.2f} GB/s")
        print(f"  strided 2-D half     : {c['strided'] * 1e3:7.1f} ms  {nbytes / 2 / c['strided'] / 1e9:5.2f} GB/s")
    finally:
        suite.close()
        if started:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m bench.fresh_memory``: what a fresh destination shard costs before the first byte
lands, by kind of memory, beside one copy of the same bytes between resident buffers.

Kinds: ``memfd`` (what CPU devices allocate shards in: shared memory, so peers can pull from it;
pages made with ``MADV_POPULATE_WRITE``), ``anon`` (private anonymous memory, populated the same
way) and ``anon_huge`` (the same with ``MADV_HUGEPAGE``: transparent huge pages where the kernel
gives them). The kernel's transparent huge page settings for anonymous and shared memory are
printed: shared memory gets huge pages only where ``shmem_enabled`` allows them.

Beside them, what a device does instead for a new destination shard (``reshard.runtime.device.shards``,
assembly): the bytes copied into a warm private buffer, then written into a fresh memfd block
through the file (``SharedShards.adopt``), against making a memfd block's pages and copying into
it, as before.
"""

from __future__ import annotations

import argparse
import mmap
import os
import time
from pathlib import Path

import numpy as np

from bench.cases import fmt_size, parse_size
from reshard.runtime.device.shared_memory import SharedShards

POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
THP = Path("/sys/kernel/mm/transparent_hugepage")


def memfd(n: int) -> mmap.mmap:
    fd = os.memfd_create("fresh-memory", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, n)
        m = mmap.mmap(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    m.madvise(POPULATE_WRITE)
    return m


def anon(n: int, huge: bool = False) -> mmap.mmap:
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE)
    m.madvise(POPULATE_WRITE)
    return m


KINDS = {"memfd": memfd, "anon": anon, "anon_huge": lambda n: anon(n, huge=True)}


def measure(nbytes: int, repeats: int) -> dict:
    """Fastest of ``repeats`` per kind: allocation (pages made) and the first copy into it (ms)."""
    src = np.ones(nbytes, np.uint8)
    out = {}
    for kind, make in KINDS.items():
        alloc, copy = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            m = make(nbytes)
            t1 = time.perf_counter()
            a = np.frombuffer(m, np.uint8)
            a[:] = src
            copy.append(time.perf_counter() - t1)
            alloc.append(t1 - t0)
            del a
            m.close()
        out[kind] = {"alloc_ms": 1e3 * min(alloc), "copy_ms": 1e3 * min(copy)}
    dst = np.zeros(nbytes, np.uint8)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst[:] = src
        times.append(time.perf_counter() - t0)
    out["resident_copy_ms"] = 1e3 * min(times)
    out["assembled_ms"] = 1e3 * _assembled(src, dst, repeats)
    return out


def _assembled(src: np.ndarray, warm: np.ndarray, repeats: int) -> float:
    """Fastest time to copy ``src`` into the warm buffer and write it into a fresh shared block."""
    shards = SharedShards()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        warm[:] = src
        block = shards.adopt(warm)
        times.append(time.perf_counter() - t0)
        del block
    return min(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fresh_memory", description=__doc__.splitlines()[0])
    p.add_argument("--size", type=parse_size, default=64 << 20, help="bytes per shard (default 64MiB)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    for name in ("enabled", "shmem_enabled"):
        path = THP / name
        print(f"transparent_hugepage/{name}: {path.read_text().strip() if path.exists() else 'n/a'}")
    r = measure(args.size, args.repeats)
    print(f"{fmt_size(args.size)}: one copy between resident buffers {r.pop('resident_copy_ms'):.1f} ms")
    assembled = r.pop("assembled_ms")
    for kind, v in r.items():
        print(f"  {kind:10s} pages made {v['alloc_ms']:6.1f} ms, first copy into it {v['copy_ms']:5.1f} ms")
    memfd = r["memfd"]["alloc_ms"] + r["memfd"]["copy_ms"]
    print(
        f"a new shared shard: pages made then copied into {memfd:.1f} ms; assembled (copied into a warm "
        f"buffer, written into fresh shared memory through the file) {assembled:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

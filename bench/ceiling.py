"""The raw-gloo ceiling: the same bytes between the same actors, with no planner and no runtime.

These functions run inside the device actors through the runtime's ``call(fn, *args)`` extension
point (``fn(ctx, *args)``); they ignore ``ctx`` and keep their own state in this module, so the
ceiling never touches the runtime's communicators, buffers or staging. Per case the driver hosts
one ``TCPStore``; every actor of the case joins one raw ``ProcessGroupGloo`` (a world over exactly
those actors). A measured round posts every send and every receive of the actor at once
(``isend``-style: gloo work objects) and waits for all of them: each (sender, receiver) pair moves
its whole byte count as one contiguous message (no staging, no local copies), into one receive
buffer per actor that is allocated and touched once in ``setup`` and reused by every round (so the
ceiling pays no page faults: the runtime's pool of freed shards avoids them too). The same round
``fresh`` receives into new anonymous memory instead (mapped inside the timed region, unmapped
after it): what a destination kept alive costs any method, the ceiling for outputs kept alive.
"""

from __future__ import annotations

import mmap
import time
from datetime import timedelta

_GROUPS: dict[str, object] = {}
_BUFFERS: dict[str, tuple[list, list]] = {}


def setup(ctx, key: str, store_port: int, rank: int, world: int, sends, recvs, timeout_s: float = 120.0) -> int:
    """Join the raw group ``key`` as ``rank`` and allocate this actor's send buffers.

    ``sends``/``recvs``: lists of ``(peer_rank, tag, nbytes)``. Returns the bytes this actor sends.
    """
    import torch
    import torch.distributed as dist

    if key not in _GROUPS:
        store = dist.TCPStore("127.0.0.1", store_port, world, is_master=False, timeout=timedelta(seconds=timeout_s))
        prefix = dist.PrefixStore(f"bench-ceiling/{key}", store)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1", lazy_init=True)]
        _GROUPS[key] = dist.ProcessGroupGloo(prefix, rank, world, opts)
    send_bufs = [torch.ones(n, dtype=torch.uint8) for _, _, n in sends]  # touched: pages are resident
    whole = torch.ones(sum(n for _, _, n in recvs), dtype=torch.uint8)
    offsets = [0]
    for _, _, n in recvs:
        offsets.append(offsets[-1] + n)
    recv_bufs = [whole[lo:hi] for lo, hi in zip(offsets, offsets[1:], strict=False)]
    _BUFFERS[key] = (send_bufs, recv_bufs)
    return sum(n for _, _, n in sends)


def transfer(ctx, key: str, sends, recvs, fresh: bool = False) -> float:
    """Post every send and receive of this actor at once, wait for all; return in-actor seconds.

    Each message goes into its contiguous slice of the actor's one resident receive buffer (send
    and receive buffers were made, and touched, by ``setup``), or with ``fresh`` of a receive
    buffer mapped now (its pages are made as the bytes land).
    """
    import torch

    pg = _GROUPS[key]
    send_bufs, recv_bufs = _BUFFERS[key]
    t0 = time.perf_counter()
    if fresh and recvs:
        whole = torch.frombuffer(mmap.mmap(-1, sum(n for _, _, n in recvs)), dtype=torch.uint8)
        recv_bufs = list(torch.split(whole, [n for _, _, n in recvs]))
    works = [pg.recv([buf], peer, tag) for (peer, tag, _), buf in zip(recvs, recv_bufs, strict=True)]
    works += [pg.send([buf], peer, tag) for (peer, tag, _), buf in zip(sends, send_bufs, strict=True)]
    for w in works:
        w.wait()
    return time.perf_counter() - t0


def release(ctx, key: str) -> None:
    """Free this actor's buffers of group ``key``; the group stays for the next size."""
    _BUFFERS.pop(key, None)


def teardown(ctx, key: str) -> None:
    _BUFFERS.pop(key, None)
    _GROUPS.pop(key, None)


# ------------------------------------------------------------------ driver side


class RawTransfer:
    """Driver handle on one raw-gloo transfer: ``pairs`` maps (sender, receiver) global device ids
    to bytes; ``call_each({device: (fn, args, kwargs)}, timeout_s)`` runs functions on the devices
    (the runtime's ordered ``call``). ``setup()`` (untimed) joins the group and allocates send
    buffers; each ``run(fresh)`` is one timed round (seconds on the driver) and appends the slowest
    actor's in-actor time to ``in_actor`` (``in_actor_fresh``); ``release()`` frees the buffers."""

    def __init__(self, name: str, pairs: dict, call_each, store_port: int, timeout_s: float = 300.0):
        self.rank = {d: i for i, d in enumerate(sorted({d for p in pairs for d in p}))}
        self.key = f"{name}/" + "-".join(map(str, self.rank))
        self.sends: dict[int, list] = {d: [] for d in self.rank}
        self.recvs: dict[int, list] = {d: [] for d in self.rank}
        for tag, ((s, r), n) in enumerate(sorted(pairs.items())):
            self.sends[s].append((self.rank[r], tag, n))
            self.recvs[r].append((self.rank[s], tag, n))
        self.call_each = call_each
        self.port = store_port
        self.timeout_s = timeout_s
        self.in_actor: list[float] = []
        self.in_actor_fresh: list[float] = []

    def setup(self) -> None:
        world = len(self.rank)
        self.call_each(
            {
                d: (setup, (self.key, self.port, r, world, self.sends[d], self.recvs[d]), {})
                for d, r in self.rank.items()
            },
            self.timeout_s,
        )

    def run(self, fresh: bool = False) -> float:
        t0 = time.perf_counter()
        inner = self.call_each(
            {d: (transfer, (self.key, self.sends[d], self.recvs[d], fresh), {}) for d in self.rank}, self.timeout_s
        )
        dt = time.perf_counter() - t0
        (self.in_actor_fresh if fresh else self.in_actor).append(max(inner.values()))
        return dt

    def release(self) -> None:
        self.call_each({d: (release, (self.key,), {}) for d in self.rank}, 30.0)

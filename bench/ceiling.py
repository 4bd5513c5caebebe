"""The raw-gloo ceiling: the same bytes between the same actors, with no planner and no runtime.

These functions run inside the device actors through the runtime's ``call(fn, *args)`` extension
point (``fn(ctx, *args)``); they ignore ``ctx`` and keep their own state in this module, so the
ceiling never touches the runtime's communicators, buffers or staging. Per case the driver hosts
one ``TCPStore``; every actor of the case joins one raw ``ProcessGroupGloo`` (a world over exactly
those actors). A measured round posts every send and every receive of the actor at once
(``isend``-style: gloo work objects) and waits for all of them: each (sender, receiver) pair moves
its whole byte count as one contiguous message, the best case for gloo on loopback.
"""

from __future__ import annotations

import time
from datetime import timedelta

_GROUPS: dict[str, object] = {}
_BUFFERS: dict[str, tuple[list, list]] = {}


def noop(ctx) -> None:
    """The empty call: measures one Ray round trip to the actor."""
    return None


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
    _BUFFERS[key] = (send_bufs, [])
    return sum(n for _, _, n in sends)


def transfer(ctx, key: str, sends, recvs) -> float:
    """Post every send and receive of this actor at once, wait for all; return in-actor seconds.

    Receive buffers are allocated fresh (``torch.empty``) each round, as a reshard must allocate
    its destination; send buffers were made by ``setup``.
    """
    import torch

    pg = _GROUPS[key]
    send_bufs, _ = _BUFFERS[key]
    t0 = time.perf_counter()
    recv_bufs = [torch.empty(n, dtype=torch.uint8) for _, _, n in recvs]
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

"""Measured link figures: probe the links between the meshes' nodes with short real transfers, and
plan with what was measured.

``probe_links(*meshes)`` picks one device actor per Ray node the meshes use and measures, through
the meshes' own backend (the communicators the runtime sets up, run through its ordered ``call``):

- every node's NIC rate: the nodes pair up round-robin (each round a set of disjoint pairs, all
  pairs of a round at once); the two devices of a pair first exchange one element (so both start
  together), then ``size_bytes`` in both directions at once (full duplex), ``repeats`` times; a
  direction's rate is the bytes over the receiver's time for them (best of the repeats). A
  node's rate is the lower of its best sending and its best receiving rate, each the best over
  all its partners: a slow partner does not make a fast node look slow;
- the rate between two devices of one node (two devices of the first node that has two), one
  direction at a time, alone (what a relay inside a node moves; the lower of the two directions);
- the latency of one message: half the median round trip of ``pings`` one-element ping-pongs, over
  the network and inside a node.

The result (``topology.cluster.LinkFigures``) is recorded in this process
(``topology.runtime.record_links``), per set of nodes. From then on ``Runtime.planning_cluster``
(what ``reshard(strategy="auto")`` plans for) builds its cluster with it for any reshard whose
devices sit on probed nodes (``Cluster.from_links``: one NIC rate per host, the intra-node rate,
the latencies), and ``Cluster.from_ray()`` describes those nodes with it. Unprobed nodes keep the
guessed figures (``topology.cluster.GUESSED_GLOO``).
"""

from __future__ import annotations

import statistics
import time

from reshard.runtime.deadlines import Deadline
from reshard.runtime.driver.controller import runtime
from topology.links import LinkFigures
from topology.runtime import record_links

PROBE_CHANNEL = "probe"
DEFAULT_SIZE_BYTES = 16 << 20
DEFAULT_REPEATS = 2
DEFAULT_PINGS = 20


def probe_links(
    *meshes,
    size_bytes: int = DEFAULT_SIZE_BYTES,
    repeats: int = DEFAULT_REPEATS,
    pings: int = DEFAULT_PINGS,
    timeout_s: float = 120.0,
    cache: bool = True,
) -> LinkFigures:
    """Measure the links between the Ray nodes of ``meshes``: a round trip (``pings``) and a
    stream of ``size_bytes`` (``repeats`` times) between every pair, within ``timeout_s``; record
    the result for planning unless ``cache=False``. Returns the ``LinkFigures``."""
    from reshard.runtime.driver.mesh import DeviceMesh

    if not meshes or not all(isinstance(m, DeviceMesh) for m in meshes):
        raise TypeError(f"probe_links needs one or more DeviceMesh, got {meshes!r}")
    for name, value in (("size_bytes", size_bytes), ("repeats", repeats), ("pings", pings)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"probe_links {name} must be a positive int, got {value!r}")
    for m in meshes:
        m.check_open()
    if len({m.backend for m in meshes}) > 1:
        raise ValueError(f"probe_links: the meshes use different backends {sorted({m.backend for m in meshes})}")
    by_node: dict[str, list[int]] = {}
    for m in meshes:
        for rec in m.records:
            devices = by_node.setdefault(rec.node_id, [])
            if rec.id not in devices:
                devices.append(rec.id)
    nodes = sorted(by_node)
    first = {n: by_node[n][0] for n in nodes}
    deadline = Deadline.after(timeout_s)
    rates: dict[tuple[str, str], float] = {}
    net_rtts: list[float] = []
    for pairs in _rounds(nodes):
        got = _measure([(first[a], first[b]) for a, b in pairs], size_bytes, repeats, pings, deadline)
        for a, b in pairs:
            rates[(b, a)] = size_bytes / got[first[a]]["recv_s"]
            rates[(a, b)] = size_bytes / got[first[b]]["recv_s"]
            net_rtts += got[first[a]]["rtt_s"] + got[first[b]]["rtt_s"]
    nic = []
    for n in nodes:
        sends = [r for (a, _), r in rates.items() if a == n]
        recvs = [r for (_, b), r in rates.items() if b == n]
        nic.append(min(max(sends), max(recvs)) / 1e9 if sends and recvs else None)
    intra = latency_intra = None
    pair = next(((ds[0], ds[1]) for n in nodes if len(ds := by_node[n]) >= 2), None)
    if pair is not None:
        one_way = [_measure([p], size_bytes, repeats, pings, deadline, one_way=True) for p in (pair, pair[::-1])]
        intra = size_bytes / max(got[r]["recv_s"] for got, r in zip(one_way, pair[::-1], strict=True)) / 1e9
        latency_intra = statistics.median([t for got in one_way for d in pair for t in got[d]["rtt_s"]]) / 2 * 1e6
    links = LinkFigures(
        tuple(nodes),
        tuple(nic),
        intra,
        statistics.median(net_rtts) / 2 * 1e6 if net_rtts else None,
        latency_intra,
        size_bytes,
        meshes[0].backend if meshes[0].backend in ("gloo", "nccl") else "gloo",
    )
    if cache:
        record_links(links)
    return links


def _rounds(nodes: list[str]) -> list[list[tuple[str, str]]]:
    """Round-robin pairings (the circle method): every two nodes meet once, each round disjoint."""
    ring = list(nodes) + ([None] if len(nodes) % 2 else [])
    n = len(ring)
    out = []
    for _ in range(n - 1):
        pairs = [(ring[i], ring[n - 1 - i]) for i in range(n // 2)]
        out.append([(a, b) for a, b in pairs if a is not None and b is not None])
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return [r for r in out if r]


def _measure(
    pairs: list[tuple[int, int]],
    size_bytes: int,
    repeats: int,
    pings: int,
    deadline: Deadline,
    *,
    one_way: bool = False,
) -> dict:
    """Run ``_exchange`` on both devices of every pair at once; ``{device: its timings}``. One way:
    only the first device of a pair sends its bytes."""
    rt = runtime()
    keys = rt.ensure_groups([p for p in pairs], channel=PROBE_CHANNEL, timeout_s=_left(deadline))
    try:
        calls = {}
        for a, b in pairs:
            group = tuple(sorted((a, b)))
            for me, peer in ((a, b), (b, a)):
                args = (group, group.index(peer), size_bytes, repeats, pings, _left(deadline))
                calls[me] = (_exchange, args, {"send": me == a or not one_way, "recv": me == b or not one_way})
        return rt.dispatch.call(calls, _left(deadline), "probe_links")
    finally:
        rt.communicators.forget(keys)


def _left(deadline: Deadline) -> float:
    left = deadline.left()
    if left <= 0:
        from reshard.errors import ReshardTimeout

        raise ReshardTimeout("probe_links ran out of time; give it a larger timeout_s or a smaller size_bytes")
    return left


def _exchange(
    ctx, group, peer: int, size_bytes: int, repeats: int, pings: int, timeout_s: float, *, send=True, recv=True
) -> dict:
    """On a device actor: ping-pong ``pings`` times with ``peer`` (rank in ``group``), then
    ``repeats`` times, after a one-element handshake, move ``size_bytes`` to the peer (``send``)
    and from it (``recv``) at once. Returns the round trips and the best time to receive the
    peer's bytes (inf when not receiving)."""
    import torch

    comm = ctx.communicator(group, PROBE_CHANNEL)
    deadline = Deadline.after(timeout_s)
    first = comm.rank < peer
    one = torch.ones(1, dtype=torch.uint8, device=ctx.torch_device)
    got = torch.zeros(1, dtype=torch.uint8, device=ctx.torch_device)
    outbox = torch.ones(size_bytes if send else 1, dtype=torch.uint8, device=ctx.torch_device)
    inbox = torch.zeros(size_bytes if recv else 1, dtype=torch.uint8, device=ctx.torch_device)

    def left() -> float:
        """What is left of the probe's deadline; also the budget of the operations issued next."""
        comm.timeout_s = max(deadline.left(), 1e-3)
        return comm.timeout_s

    rtts = []
    for i in range(pings + 2):
        t0 = time.perf_counter()
        if first:
            comm.isend(one, peer).wait(left())
            comm.irecv(got, peer).wait(left())
        else:
            comm.irecv(got, peer).wait(left())
            comm.isend(one, peer).wait(left())
        if i >= 2 and first:
            rtts.append(time.perf_counter() - t0)
    best = float("inf")
    for _ in range(repeats):
        with ctx.backend.grouped(timeout_s=left()):  # both at once (NCCL: one group call, else a deadlock)
            r, s = comm.irecv(got, peer), comm.isend(one, peer)
        r.wait(left())
        s.wait(left())
        t0 = time.perf_counter()
        with ctx.backend.grouped(timeout_s=left()):
            r = comm.irecv(inbox, peer) if recv else None
            s = comm.isend(outbox, peer) if send else None
        if r is not None:
            r.wait(left())
            best = min(best, time.perf_counter() - t0)
        if s is not None:
            s.wait(left())
    return {"recv_s": best, "rtt_s": rtts}

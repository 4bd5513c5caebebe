"""A flow-level network simulator for ordered transfer programs on a ``Cluster``.

Input (neutral: this module knows nothing of plans or layouts): an ordered list of
``SimTransfer`` (kind COPY / P2P / BROADCAST / PULL, root device, receiver devices, size in bytes), a
device -> host map and a ``topology.Cluster``. Output: a frozen ``SimResult`` with the makespan,
every transfer's start and end, and per-host NIC bytes and busy time.

Model
-----
Resources. Each host has a NIC send port and a NIC receive port of its own rate each (full duplex;
``cluster.nic_Bps_of(host)``: the same for every host of a uniform cluster). Each device has an
intra-host send port and receive port of ``cluster.intra_host_GBps`` each (NVLink/NVSwitch; shared
memory for CPU devices). Network traffic of a device goes through its
host's NIC and does not touch its intra-host ports (GPUDirect RDMA).

Flows. A transfer becomes one or more flows; a flow moves bytes at one rate through every resource
it uses (a pipelined flow uses all of its hops at once). Rates are max-min fair: concurrent flows
share every port by progressive filling (water-filling), recomputed at each event, so a port is
never oversubscribed and no flow is slowed without a bottleneck. A flow first waits its latency
(no bandwidth used), then joins the sharing; it ends when its bytes are through.

- COPY on device d: one flow through d's intra-host send and receive ports; no latency.
- PULL root -> receivers (one host, shared memory): each receiver copies the bytes out of the
  root's memory, one flow through the root's intra-host send port and its own receive port, no
  latency. It starts once the receiver is free and the bytes are there: at once (``after`` None:
  the root's source shard), or once the root's part of transfer ``after`` (the receive that
  brought them: a relay) is done. The root takes no part: it neither waits nor is kept busy.
- P2P a -> b: one flow, through a's and b's intra-host ports (same host, latency
  ``intra_host_latency_us``) or through host(a)'s NIC send and host(b)'s NIC receive ports
  (``latency_us``).
- BROADCAST, backend "nccl": a pipelined ring (NCCL_ALGO=Ring, NCCL_PROTO=Simple as Alpa ran it).
  The ring visits the root, the other group members on the root's host, then every other host once
  with its members contiguous (NCCL's topology search keeps the devices of a host adjacent); hosts in
  order of first appearance among the receivers, devices in the order given. It is one flow through
  every hop's ports at once: each host NIC on the ring sends and receives the bytes once, however
  many receivers. Its latency is the sum of the hop latencies plus ``NCCL_BROADCAST_OVERHEAD_US``
  (a collective's launch and the rendezvous of all ranks); its byte count is the size plus the
  pipeline fill: with chunk c = min(size, ``NCCL_CHUNK_BYTES``) and per-hop chunk times
  c / (the slower of the hop's two ports), a pipeline of chunks takes size / rate plus the sum of the hop
  times but the slowest, which joins the latency. So tiny messages and two-rank groups cost more
  as broadcasts than as P2P (NCCL issue 674 reports far worse for both; we charge only this
  modest, documented overhead).
- BROADCAST, backend "gloo": what ``gloo::broadcast`` does (gloo/broadcast.cc): a binomial tree,
  store and forward. Ranks are the group's devices sorted by id (how the runtime builds groups); with
  virtual rank v = (rank - root) mod n, in round i every v < 2^i that holds the data sends the whole
  buffer to v + 2^i. Sends are asynchronous, so the root's log2(n) sends run concurrently and share
  its port; a non-root forwards only after its receive completed. Each edge is a P2P flow.

Order. Every device executes its transfers in the global list order, one at a time, blocking (the
lowering's rule, which also makes the program deadlock free); with ``window`` > 1 it issues them in
windows, as the runtime's executor does (``reshard.passes.sequencing``): up to ``window`` consecutive
messages (P2P, BROADCAST), with the local transfers (COPY, PULL of a source shard) among them, and
waits for all of them before the next window. A window holds small messages of at most
``window_bytes`` together or one bigger message, per direction of the device's link, where only a
forward (a root sending what it received) and a P2P receive take one direction each: a device
forwards a slice while the next comes in (duplex); a root sending its own bytes and a broadcast
receiver (it may forward) take both. A window closes before a transfer that reads on this device
what the window wrote (``SimTransfer.reads_landed``: a relay's root, a receiver that combines), a
PULL of a relay has a window of its own, and a device that relays (the root of a pulled relay, or
of a message that reads what it received) takes at most one message per direction per window, so
that each slice lands, and is forwarded or pulled, as early as it can. The latencies of a window's
messages overlap. With ``local_beside`` (CPU devices: the runtime's helper thread), a device that
reads nothing it received (no relay, no combine) runs its local transfers (COPY, PULL) in a lane of
their own beside its messages, sources first, then relays in the order their bytes arrive. A
transfer is no barrier: each of its flows starts once every device it uses has finished its earlier
transfers (a forward in a tree also waits for the receive that brings its bytes), and a device is
free again once ITS flows of the transfer are done. So both ends of a P2P start and end together; an
NCCL ring (one flow through every member: a collective launch) starts when all members are free and
holds them until it drains; in a gloo binomial tree (``gloo::broadcast``: no barrier, each member
receives from its parent, then posts its forwards and returns once they completed) the root's send
to a member goes as soon as the two are free, and a leaf that received goes on with its next
transfer while the tree still sends elsewhere. Measured on 4 emulated hosts (1 Gbit/s NICs, 2
devices each, the broadcast strategies' shard -> replicate case at 64 MiB: four 5-member trees one
after another), gloo ran 0.80-0.82x of what the older rule (every member starts and stays busy until
the whole tree ends) predicted, and 0.94-1.00x of this one. With gloo windows of 4 messages of at
most 1 MiB (the same hosts, every strategy and case at 64 and 256 MiB: bench/MULTIHOST.md), all 48
measurements were within 10 % of this model; with duplex windows 47 of 48 (the 48th, two samples
of 0.44 and 0.30 s, measured 0.29 s re-run alone against 0.29 s simulated).

Accounting. ``HostStats.send_bytes``/``recv_bytes`` count the bytes each NIC carries (pipeline fill
excluded); ``send_busy_s``/``recv_busy_s`` the time the port carried at least one flow.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from topology.cluster import Cluster
from topology.links import broadcast_model, check_backend

NCCL_CHUNK_BYTES = 512 * 1024  # Simple protocol: a 4 MiB channel buffer in 8 steps
NCCL_BROADCAST_OVERHEAD_US = 10.0
EXACT_FLOWS = 64  # max-min is recomputed exactly over up to this many connected flows


class SimKind(enum.IntEnum):
    COPY = 0
    P2P = 1
    BROADCAST = 2
    PULL = 3


@dataclass(frozen=True, slots=True)
class SimTransfer:
    """``size_bytes`` from device ``root`` to ``receivers`` (COPY: ``receivers == (root,)``)."""

    kind: SimKind
    root: int
    receivers: tuple[int, ...]
    size_bytes: int
    after: int | None = None  # PULL: the earlier transfer that brings the root its bytes (None: it holds them)
    reads_landed: tuple[int, ...] = ()  # devices on which it reads what their earlier transfers wrote

    def __post_init__(self):
        if self.size_bytes < 0:
            raise ValueError(f"transfer size must be >= 0 bytes, got {self.size_bytes}")
        if self.kind is SimKind.COPY and self.receivers != (self.root,):
            raise ValueError(f"a COPY stays on its device, got {self.root} -> {self.receivers}")
        if self.kind is SimKind.P2P and (len(self.receivers) != 1 or self.receivers[0] == self.root):
            raise ValueError(f"a P2P goes to exactly one other device, got {self.root} -> {self.receivers}")
        if self.kind in (SimKind.BROADCAST, SimKind.PULL) and (
            not self.receivers or self.root in self.receivers or len(set(self.receivers)) != len(self.receivers)
        ):
            raise ValueError(
                f"a {self.kind.name} needs distinct receivers other than its root, got {self.root} -> {self.receivers}"
            )

    @property
    def devices(self) -> tuple[int, ...]:
        """The devices that run the transfer in their order (a PULL's root does not)."""
        if self.kind is SimKind.COPY:
            return (self.root,)
        return self.receivers if self.kind is SimKind.PULL else (self.root, *self.receivers)


@dataclass(frozen=True, slots=True)
class HostStats:
    host: int
    send_bytes: int
    recv_bytes: int
    send_busy_s: float
    recv_busy_s: float


@dataclass(frozen=True, slots=True)
class SimResult:
    """Times in seconds from the first issue. ``start_s[i]``/``end_s[i]`` belong to transfer ``i``."""

    makespan_s: float
    start_s: tuple[float, ...]
    end_s: tuple[float, ...]
    hosts: tuple[HostStats, ...]
    backend: str

    def host(self, host: int) -> HostStats:
        for h in self.hosts:
            if h.host == host:
                return h
        raise KeyError(f"host {host} takes no part in the simulated program")

    @property
    def network_bytes(self) -> int:
        """Bytes all NICs sent."""
        return sum(h.send_bytes for h in self.hosts)


class _Flow:
    __slots__ = (
        "transfer",
        "size",
        "res",
        "latency",
        "devices",
        "children",
        "remaining",
        "rate",
        "t_last",
        "version",
        "waiting",
    )

    def __init__(self, transfer: int, size: float, res: tuple[int, ...], latency: float, devices: tuple[int, ...]):
        self.transfer = transfer
        self.size = size
        self.res = res
        self.latency = latency
        self.devices = devices  # the devices it keeps busy
        self.children: list[_Flow] = []
        self.remaining = size
        self.rate = 0.0
        self.t_last = 0.0
        self.version = 0
        self.waiting = 0  # devices still busy elsewhere, plus an unfinished parent flow


_ACTIVATE, _DONE = 0, 1


def simulate_transfers(
    transfers: Sequence[SimTransfer],
    device_hosts: Mapping[int, int],
    cluster: Cluster,
    *,
    backend: str | None = None,
    window: int = 1,
    window_bytes: float = math.inf,
    local_beside: bool = False,
) -> SimResult:
    """Simulate ``transfers`` issued in this order on ``cluster``, each device issuing up to
    ``window`` messages of at most ``window_bytes`` together; ``local_beside``: a device that
    reads nothing it received runs its local transfers beside its messages (see the module
    docstring)."""
    backend = cluster.backend if backend is None else backend
    check_backend("simulated", backend)
    backend = broadcast_model(backend)
    if window < 1:
        raise ValueError(f"window must be >= 1 transfers in flight per device, got {window}")
    transfers = tuple(transfers)
    for i, t in enumerate(transfers):
        if t.after is not None and (t.kind is not SimKind.PULL or not 0 <= t.after < i):
            raise ValueError(f"transfer {i}: only a PULL waits for an earlier transfer, got after={t.after}")
    devices = sorted({d for t in transfers for d in (t.root, *t.receivers)})
    missing = [d for d in devices if d not in device_hosts]
    if missing:
        raise ValueError(f"device_hosts has no host for devices {missing[:8]}")
    hosts = sorted({device_hosts[d] for d in devices} | set(device_hosts.values()))
    if hosts and not 0 <= hosts[0] <= hosts[-1] < cluster.num_hosts:
        raise ValueError(
            f"device_hosts uses hosts {hosts[0]}..{hosts[-1]} but cluster {cluster.name!r} has hosts "
            f"0..{cluster.num_hosts - 1}; simulate on a cluster that holds every host"
        )
    host_index = {h: i for i, h in enumerate(hosts)}
    dev_index = {d: i for i, d in enumerate(devices)}
    nh = len(hosts)
    # resources: host h send 2i, recv 2i+1; device d intra send 2nh+2j, recv 2nh+2j+1
    cap = [rate for h in hosts for rate in (cluster.nic_Bps_of(h),) * 2] + [cluster.intra_host_Bps] * (2 * len(devices))
    host_of = {d: host_index[device_hosts[d]] for d in devices}
    net_lat = cluster.latency_us * 1e-6
    intra_lat = cluster.intra_host_latency_us * 1e-6
    send_bytes = [0] * nh
    recv_bytes = [0] * nh

    def hop(a: int, b: int, size: int) -> tuple[tuple[int, int], float]:
        ha, hb = host_of[a], host_of[b]
        if ha == hb:
            return (2 * nh + 2 * dev_index[a], 2 * nh + 2 * dev_index[b] + 1), intra_lat
        send_bytes[ha] += size
        recv_bytes[hb] += size
        return (2 * ha, 2 * hb + 1), net_lat

    def expand(i: int, t: SimTransfer) -> list[_Flow]:
        """The transfer's root flows (each with its dependent children)."""
        s = t.size_bytes
        if t.kind is SimKind.COPY:
            j = 2 * nh + 2 * dev_index[t.root]
            return [_Flow(i, s, (j, j + 1), 0.0, (lane(t.root, t),))]
        if t.kind is SimKind.P2P:
            ports, lat = hop(t.root, t.receivers[0], s)
            return [_Flow(i, s, ports, lat, t.devices)]
        if t.kind is SimKind.PULL:
            if any(host_of[r] != host_of[t.root] for r in t.receivers):
                raise ValueError(f"transfer {i}: a PULL stays on one host, got {t.root} -> {t.receivers}")
            root = 2 * nh + 2 * dev_index[t.root]
            return [_Flow(i, s, (root, 2 * nh + 2 * dev_index[r] + 1), 0.0, (lane(r, t),)) for r in t.receivers]
        if backend == "nccl":
            ring = _ring_order(t.root, t.receivers, host_of)
            res: list[int] = []
            lat = NCCL_BROADCAST_OVERHEAD_US * 1e-6
            chunk = min(s, NCCL_CHUNK_BYTES)
            hop_times = []
            for a, b in zip(ring[:-1], ring[1:], strict=True):
                r, hop_lat = hop(a, b, s)
                res += r
                lat += hop_lat
                hop_times.append(chunk / min(cap[r[0]], cap[r[1]]))
            # pipeline fill: every hop but the slowest forwards one chunk before the stream is steady
            fill = sum(hop_times) - max(hop_times)
            return [_Flow(i, s, tuple(res), lat + fill, t.devices)]
        return _binomial_tree(i, t, s, hop)

    n = len(transfers)
    flows_left = [0] * n
    busy_with: list[dict[int, int]] = [{} for _ in range(n)]  # transfer -> device -> its flows not done
    needs: list[dict[int, list[_Flow]] | None] = [None] * n  # transfer -> device -> flows waiting for it
    start = [-1.0] * n
    end = [0.0] * n
    relaying = {
        t.root
        for t in transfers
        if (t.kind is SimKind.PULL and t.after is not None)
        or (t.kind in (SimKind.P2P, SimKind.BROADCAST) and t.root in t.reads_landed)
    }
    in_order = relaying | {d for t in transfers for d in t.reads_landed}

    def lane(d: int, t: SimTransfer) -> int:
        """The queue ``d`` runs ``t`` in: its own, or (``local_beside``) its local lane, ~d."""
        local = t.kind in (SimKind.COPY, SimKind.PULL)
        return ~d if local_beside and local and d not in in_order else d

    queues: dict[int, list[int]] = {d: [] for d in devices}
    for i, t in enumerate(transfers):
        for d in t.devices:
            queues.setdefault(lane(d, t), []).append(i)
    for d in queues:
        if d < 0:  # sources first, then relays by the transfer that brings their bytes
            queues[d].sort(key=lambda i: -1 if (after := transfers[i].after) is None else after)
    windows = {
        d: _issue_windows(q, d, transfers, window if d >= 0 else 1, window_bytes, d in relaying)
        for d, q in queues.items()
    }
    pos = dict.fromkeys(queues, 0)  # transfers of the device's queue issued
    open_ = dict.fromkeys(queues, 0)  # of them, not done yet
    landed: set[tuple[int, int]] = set()  # (transfer, device): the device's part of the transfer is done
    awaiting: dict[tuple[int, int], list[_Flow]] = {}  # (transfer, root) -> PULL flows waiting for it
    res_flows: list[set[_Flow]] = [set() for _ in cap]
    busy = [0.0] * (2 * nh)
    busy_since: list[float | None] = [None] * (2 * nh)
    heap: list = []
    seq = 0

    def push(time: float, kind: int, flow: _Flow) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (time, seq, kind, flow, flow.version))

    def ready(f: _Flow, now: float) -> None:
        f.waiting -= 1
        if f.waiting == 0:
            if start[f.transfer] < 0:
                start[f.transfer] = now
            push(now + f.latency, _ACTIVATE, f)

    def arrive(device: int, now: float) -> None:
        """``device`` is free for its next window of transfers: the flows that waited for it may go."""
        q = queues[device]
        if pos[device] >= len(q):
            return
        size = windows[device][pos[device]]
        open_[device] = size
        for i in q[pos[device] : pos[device] + size]:
            t = transfers[i]
            waits = needs[i]
            if waits is None:
                roots = expand(i, t)
                flows_left[i] = _count(roots, busy_with[i])
                source = None if t.after is None or (t.after, t.root) in landed else (t.after, t.root)
                waits = needs[i] = _waits(roots, source is not None)
                if source is not None:
                    awaiting.setdefault(source, []).extend(roots)
            for f in waits.pop(device, ()):
                ready(f, now)
        pos[device] += size

    def finish(f: _Flow, now: float) -> None:
        for c in f.children:
            ready(c, now)
        i = f.transfer
        flows_left[i] -= 1
        if flows_left[i] == 0:
            end[i] = now
        for d in f.devices:
            busy_with[i][d] -= 1
            if busy_with[i][d] == 0:
                landed.add((i, d))
                for pull in awaiting.pop((i, d), ()):
                    ready(pull, now)
                open_[d] -= 1
                if open_[d] == 0:
                    arrive(d, now)

    for d in queues:
        arrive(d, 0.0)

    now = 0.0
    while heap:
        now = heap[0][0]
        horizon = now + 1e-9 * max(now, 1e-6)  # events this close are simultaneous
        changed: set[int] = set()
        while heap and heap[0][0] <= horizon:
            _, _, kind, f, version = heapq.heappop(heap)
            if kind == _ACTIVATE:
                if f.size <= 0:
                    finish(f, now)
                    continue
                f.remaining, f.rate, f.t_last = f.size, 0.0, now
                for r in f.res:
                    res_flows[r].add(f)
                changed.update(f.res)
            elif version == f.version:
                for r in f.res:
                    res_flows[r].discard(f)
                changed.update(f.res)
                f.version += 1
                finish(f, now)
        if not changed:
            continue
        _reallocate(changed, res_flows, cap, now, push)
        for r in changed:
            if r < 2 * nh:
                if res_flows[r] and busy_since[r] is None:
                    busy_since[r] = now
                elif not res_flows[r] and busy_since[r] is not None:
                    busy[r] += now - busy_since[r]
                    busy_since[r] = None
    if any(flows_left) or any(pos[d] < len(q) or open_[d] for d, q in queues.items()):
        raise AssertionError("simulation stalled: a transfer never started (the program order has a cycle)")
    stats = tuple(
        HostStats(h, send_bytes[i], recv_bytes[i], busy[2 * i], busy[2 * i + 1]) for h, i in host_index.items()
    )
    return SimResult(max(end, default=0.0), tuple(start), tuple(end), stats, backend)


def _issue_windows(
    queue: list[int], device: int, transfers: Sequence[SimTransfer], window: int, window_bytes: float, single: bool
) -> dict[int, int]:
    """{position in ``device``'s queue where a window starts: its length} (module docstring)."""
    if window == 1:
        return dict.fromkeys(range(len(queue)), 1)
    out: dict[int, int] = {}
    start = messages = 0
    moved, carried = [0, 0], [0, 0]  # bytes and messages per direction (out, in) in the window
    wrote = alone = False
    for k, i in enumerate(queue):
        t = transfers[i]
        message = t.kind in (SimKind.P2P, SimKind.BROADCAST)
        directions = _directions(t, device) if message else ()
        waits = t.kind is SimKind.PULL and t.after is not None
        full = message and (
            messages >= window
            or any(carried[d] and (single or moved[d] + t.size_bytes > window_bytes) for d in directions)
        )
        if k > start and (alone or waits or full or (wrote and device in t.reads_landed)):
            out[start] = k - start
            start, messages, wrote = k, 0, False
            moved, carried = [0, 0], [0, 0]
        messages += message
        for d in directions:
            moved[d] += t.size_bytes
            carried[d] += 1
        wrote = wrote or device in t.receivers  # a COPY's receiver is its root
        alone = waits
    if queue:
        out[start] = len(queue) - start
    return out


def _directions(t: SimTransfer, device: int) -> tuple[int, ...]:
    """The directions of ``device``'s link a message takes up in a window: 0 out, 1 in. A P2P's
    receiver takes in, a forward (its root reads what it received) out; a root sending its own
    bytes and a broadcast receiver (it may forward) take both."""
    if device != t.root:
        return (1,) if t.kind is SimKind.P2P else (1, 0)
    return (0,) if device in t.reads_landed else (0, 1)


def _waits(roots: list[_Flow], sourced: bool = False) -> dict[int, list[_Flow]]:
    """Device -> the flows of a transfer that wait for it to be free; sets every flow's ``waiting``:
    its devices, plus its parent flow (a forward waits for the receive that brings its bytes), plus
    one when ``sourced`` (a PULL waiting for the transfer that brings its root the bytes)."""
    out: dict[int, list[_Flow]] = {}
    stack = [(f, 0) for f in roots]
    while stack:
        f, parent = stack.pop()
        f.waiting = len(f.devices) + parent + sourced
        for d in f.devices:
            out.setdefault(d, []).append(f)
        stack += [(c, 1) for c in f.children]
    return out


def _count(flows: list[_Flow], per_device: dict[int, int]) -> int:
    """How many flows ``flows`` hold with their children; adds each device's count to ``per_device``."""
    total = 0
    for f in flows:
        for d in f.devices:
            per_device[d] = per_device.get(d, 0) + 1
        total += 1 + _count(f.children, per_device)
    return total


def _ring_order(root: int, receivers: tuple[int, ...], host_of: Mapping[int, int]) -> list[int]:
    by_host: dict[int, list[int]] = {host_of[root]: [root]}
    for r in receivers:
        by_host.setdefault(host_of[r], []).append(r)
    return [d for ds in by_host.values() for d in ds]


def _binomial_tree(i: int, t: SimTransfer, size: int, hop) -> list[_Flow]:
    ranks = sorted(t.devices)
    n = len(ranks)
    root_rank = ranks.index(t.root)

    def device(v: int) -> int:
        return ranks[(v + root_rank) % n]

    incoming: dict[int, _Flow] = {}
    roots: list[_Flow] = []
    bits = max(1, (n - 1).bit_length())
    for step in range(bits):  # in round ``step`` every v < 2^step sends to v + 2^step
        for v in range(min(1 << step, n)):
            w = v + (1 << step)
            if w >= n:
                continue
            res, lat = hop(device(v), device(w), size)
            f = _Flow(i, size, res, lat, (device(v), device(w)))
            incoming[w] = f
            (incoming[v].children if v else roots).append(f)
    return roots


def _reallocate(changed: set[int], res_flows: list[set[_Flow]], cap: list[float], now: float, push) -> None:
    """Max-min fair rates, by progressive filling, for the flows that a change of ``changed`` affects.

    Exact over the flows connected (through shared ports) to a changed port while there are at most
    ``EXACT_FLOWS`` of them; beyond that over the flows on the changed ports only, the others keeping
    their rates (a feasible, slightly conservative allocation that keeps large programs fast).
    """
    comp: set[_Flow] = set()
    seen = set(changed)
    stack = list(changed)
    while stack and len(comp) <= EXACT_FLOWS:
        r = stack.pop()
        for f in res_flows[r]:
            if f not in comp:
                comp.add(f)
                for r2 in f.res:
                    if r2 not in seen:
                        seen.add(r2)
                        stack.append(r2)
    exact = not stack and len(comp) <= EXACT_FLOWS
    if not exact:
        comp = {f for r in changed for f in res_flows[r]}
    if not comp:
        return
    rem: dict[int, float] = {}
    cnt: dict[int, int] = {}
    for f in comp:
        if f.rate:
            f.remaining -= f.rate * (now - f.t_last)
        f.t_last = now
        for r in f.res:
            cnt[r] = cnt.get(r, 0) + 1
    for r in cnt:
        rem[r] = cap[r]
        if not exact and r not in changed:
            rem[r] -= sum(f.rate for f in res_flows[r] if f not in comp)
    heap = [(rem[r] / c, r) for r, c in cnt.items()]
    heapq.heapify(heap)
    fixed: set[_Flow] = set()
    while heap:
        share, r = heapq.heappop(heap)
        c = cnt[r]
        if c == 0 or share != rem[r] / c:
            continue
        rate = max(share, 1.0)
        for f in res_flows[r]:
            if f in fixed or f not in comp:
                continue
            fixed.add(f)
            for r2 in f.res:
                rem[r2] -= share
                cnt[r2] -= 1
                if r2 != r and cnt[r2] > 0:
                    heapq.heappush(heap, (rem[r2] / cnt[r2], r2))
            if rate != f.rate:
                f.rate = rate
                f.version += 1
                push(now + max(f.remaining, 0.0) / rate, _DONE, f)

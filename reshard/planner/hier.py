"""``auto``'s host-level greedy: which hosts and devices send each unit task, in what shape.

- Host level first. A receiver that holds its box copies it; a receiver on a host where some
  device holds the box gets it over the intra-host links from that device; only hosts without a
  holder take the box over the network, and each of them takes it exactly once: one NCCL ring
  broadcast enters the host once and fans out over its intra-host links (gloo: one send to an entry
  device, then an intra-host broadcast from it, a relay).
- Per unit task, the sender hosts and the delivery shape are chosen greedily (largest tasks
  first) to keep the most loaded NIC direction of any host as light as possible: a "ring" (one
  broadcast through all receiving hosts: each NIC carries the bytes once, receiving hosts forward,
  the most send-loaded of them last) or a "star" (one broadcast or send per receiving host: no
  forwarding, the sender carries the bytes once per host). A task whose holders sit on several
  hosts is split (along its longest dim) among them so that several NICs send at once, sized by
  water-filling their send loads. A latency estimate joins the score, so tiny tasks prefer stars
  and one receiver gets a SEND, never a two-rank broadcast.
- Loads are times: a NIC's bytes over its own rate, expressed as bytes at the fastest NIC's rate
  (``Context.weight``: 1.0 for every host of a uniform cluster), so slow hosts get less work.
- Within a host, the sending device is the one that has sent the least so far (devices run their
  transfers one at a time), then the one already used for the same receivers (fewer groups); the
  "serial" variant instead sends everything a host sends from one device where the boxes allow,
  so that the device order itself keeps the host's NIC on schedule at run time. A receiver that
  sends over the network itself would hold up the transfer into its host: it gets the box later,
  relayed over the intra-host links by a device that took it off the network.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from reshard.ir.plan import TransferKind
from reshard.ir.regions import Box, box_volume
from reshard.planner.order import Item
from reshard.planner.problem import Problem
from topology.links import broadcast_model
from topology.simulator import NCCL_BROADCAST_OVERHEAD_US, NCCL_CHUNK_BYTES

SPLIT_MIN_BYTES = 1 << 20  # a task is split among holder hosts only into pieces at least this big
MAX_SPLIT = 8  # ... and among at most this many hosts
CANDIDATE_HOSTS = 4  # sender hosts tried per task (the least loaded holders)
MODES = ("ring", "star")


class Context:
    """What every pass over one problem shares: the host map, the cluster's figures, and each
    host's ``weight`` (the fastest NIC's rate over its own)."""

    def __init__(self, problem: Problem):
        cluster = problem.cluster
        self.problem = problem
        self.hosts = problem.hosts
        self.item = problem.itemsize
        self.gloo = broadcast_model(cluster.backend) == "gloo"
        self.lat_s = cluster.latency_us * 1e-6
        self.intra_lat_s = cluster.intra_host_latency_us * 1e-6
        self.nic = cluster.nic_Bps
        self.intra = cluster.intra_host_Bps
        self.weight = {h: self.nic / cluster.nic_Bps_of(h) for h in set(self.hosts.values())}
        self.shared = not set(problem.src.mesh.device_ids).isdisjoint(problem.dst.mesh.device_ids)
        self._by_host: dict[tuple[int, ...], dict[int, list[int]]] = {}

    def by_host(self, devices: tuple[int, ...]) -> dict[int, list[int]]:
        """``devices`` grouped by host, hosts and devices in order of appearance (cached)."""
        out = self._by_host.get(devices)
        if out is None:
            out = self._by_host[devices] = {}
            for d in devices:
                out.setdefault(self.hosts[d], []).append(d)
        return out


@dataclass(frozen=True, slots=True)
class _Network:
    """A task's network part: its holders by host and its receivers on hosts without a holder."""

    work: int
    task: int
    holders: dict[int, list[int]]
    remote: dict[int, list[int]]


@dataclass(frozen=True, slots=True)
class _Placed:
    """A piece of a task placed on a sending device, with its receivers grouped by host."""

    task: int
    box: Box
    size: int
    src: int
    mode: str
    per_host: list[list[int]]


def plan_items(
    ctx: Context, *, split: bool, modes: tuple[str, ...] = MODES, serial: bool = False
) -> tuple[list[Item], set[str]]:
    """The items of every task, before ordering, and the shapes the greedy used ("split", "ring",
    "star"). ``split``: tasks may be split among holder hosts; ``modes``: the delivery shapes
    allowed; ``serial``: one sending device per host where the boxes allow."""
    return _Pass(ctx, split, modes, serial).run()


class _Pass:
    """One run of the greedy: NIC loads per host and direction, device loads, chosen senders."""

    def __init__(self, ctx: Context, split: bool, modes: tuple[str, ...], serial: bool):
        self.ctx = ctx
        self.split = split
        self.modes = modes
        self.serial = serial
        self.send: dict[int, float] = defaultdict(float)  # NIC send load per host
        self.recv: dict[int, float] = defaultdict(float)  # NIC receive load per host
        self.peak = 0.0  # the most loaded NIC direction so far
        # network time each device spends (received, known upfront, and sent so far): devices run
        # their transfers one at a time, so senders are picked among the least busy holders
        self.busy: dict[int, float] = defaultdict(float)
        self.sent: dict[int, float] = defaultdict(float)  # network bytes each device sends
        self.roots: dict[tuple, int] = {}  # (host, receivers) -> the device that sent them last
        self.exits: dict[int, int] = {}  # serial: host -> its sending device
        self.shapes: set[str] = set()
        tasks = ctx.problem.tasks
        total = sum(t.size_bytes for t in tasks) or 1
        self.quantum = total * 1e-4 / max(1, len(set(ctx.hosts.values())))

    def run(self) -> tuple[list[Item], set[str]]:
        local, network, intra = self._classify()
        self._serve_intra(intra, local)
        network.sort(key=lambda x: (-x.work, x.task))  # largest work first; ties by task index
        placed = [p for entry in network for p in self._place(entry)]
        return self._build(placed, local), self.shapes

    def _classify(self) -> tuple[list[Item], list[_Network], list[tuple[int, int, list[int]]]]:
        """Local copies, the network part of every task, and the receivers on holder hosts; charges
        every receiver's incoming network bytes to its device."""
        ctx = self.ctx
        local: list[Item] = []
        network: list[_Network] = []
        intra: list[tuple[int, int, list[int]]] = []
        incoming: dict[tuple[int, ...], int] = defaultdict(int)  # network bytes per receiver tuple
        for i, task in enumerate(ctx.problem.tasks):
            size = task.size_bytes
            by_host = ctx.by_host(task.senders)
            receivers = task.receivers
            if ctx.shared and not set(task.senders).isdisjoint(receivers):
                holders = set(task.senders)
                local += [Item(TransferKind.COPY, task.box, r, (r,), i, size, False) for r in receivers if r in holders]
                receivers = tuple(r for r in receivers if r not in holders)
                if not receivers:
                    continue
            by_dst = ctx.by_host(receivers)
            remote = {h: rs for h, rs in by_dst.items() if h not in by_host}
            if len(remote) < len(by_dst):
                intra += [(i, h, rs) for h, rs in by_dst.items() if h in by_host]
            if remote:
                network.append(_Network(size * len(remote), i, by_host, remote))
                incoming[tuple(d for rs in remote.values() for d in rs)] += size
        for devices, size in incoming.items():
            for r in devices:
                self.busy[r] += size * ctx.weight[ctx.hosts[r]]
        return local, network, intra

    def _serve_intra(self, intra: list[tuple[int, int, list[int]]], out: list[Item]) -> None:
        """Receivers on a holder's host get the box from the least busy holder there."""
        ctx = self.ctx
        for i, h, receivers in intra:
            task = ctx.problem.tasks[i]
            src = min(ctx.by_host(task.senders)[h], key=lambda d: (self.busy[d], d))
            self.busy[src] += task.size_bytes * 0.01  # intra-host bytes are cheap, but spread them too
            _deliver(ctx, out, i, task.box, task.size_bytes, src, receivers, [], network=False)

    def _place(self, entry: _Network) -> list[_Placed]:
        """Choose the task's shape and sender hosts, then a sending device per piece; charge loads."""
        ctx = self.ctx
        task = ctx.problem.tasks[entry.task]
        remote = entry.remote
        if len(remote) == 1:
            remote_hosts = list(remote)
        else:
            remote_hosts = sorted(remote, key=lambda h: (self.send[h], h))  # ring: the most send-loaded last
        mode, alloc = self._choose(task.size_bytes, entry.holders, remote, remote_hosts)
        mult = 1 if mode == "ring" else len(remote)
        if len(remote) == 1:
            receivers_key = tuple(remote[remote_hosts[0]])
        else:
            receivers_key = tuple(d for h in remote_hosts for d in remote[h])
        out = []
        for h, box in _cut(task.box, alloc):
            piece = task.size_bytes if len(alloc) == 1 else box_volume(box) * ctx.item
            src = self._sender(h, entry.holders[h], receivers_key)
            self._charge(h, src, piece, mult, mode, remote, remote_hosts)
            out.append(_Placed(entry.task, box, piece, src, mode, [remote[r] for r in remote_hosts]))
        return out

    def _choose(
        self, size: int, by_host: dict[int, list[int]], remote: dict[int, list[int]], remote_hosts: list[int]
    ) -> tuple[str, dict[int, float]]:
        """(mode, sender host -> bytes) with the best ``_score``."""
        if len(by_host) == 1 and len(remote) == 1:  # one way only
            return "star", {next(iter(by_host)): size}
        best = None
        # the few least loaded holder hosts are the candidates (many hosts may hold a box)
        near = sorted(by_host, key=lambda h: (self.send[h], h))
        for mode in self.modes if len(remote) > 1 else ("star",):
            mult = 1 if mode == "ring" else len(remote)
            options: list[dict[int, float]] = [{h: size} for h in near[:CANDIDATE_HOSTS]]
            if self.split and len(near) > 1 and size >= 2 * SPLIT_MIN_BYTES:
                loads = {h: self.send[h] for h in near[:MAX_SPLIT]}
                shares = _waterfill(loads, self.ctx.weight, size, mult, max(SPLIT_MIN_BYTES, size / MAX_SPLIT))
                if len(shares) > 1:
                    options.append(shares)
            for alloc in options:
                score = self._score(alloc, mode, remote, remote_hosts)
                if best is None or score < best[0]:
                    best = (score, mode, alloc)
        assert best is not None
        _, mode, alloc = best
        if len(alloc) > 1:
            self.shapes.add("split")
        self.shapes.add(mode)
        return mode, alloc

    def _score(
        self, alloc: dict[int, float], mode: str, remote: dict[int, list[int]], remote_hosts: list[int]
    ) -> tuple[int, int, int, float]:
        """(max NIC load after, max over the touched NICs, pieces, sum of squares): smaller is better.

        Loads are times as bytes at the fastest NIC's rate; a latency estimate, as bytes such a NIC
        could have moved meanwhile, joins them.
        """
        ctx, send, recv, weight = self.ctx, self.send, self.recv, self.ctx.weight
        touched: dict[tuple[int, int], float] = {}
        mult = 1 if mode == "ring" else len(remote)
        for h, p in alloc.items():
            touched[(0, h)] = touched.get((0, h), send[h]) + p * mult * weight[h]
            for r in remote:
                touched[(1, r)] = touched.get((1, r), recv[r]) + p * weight[r]
            if mode == "ring":
                for r in remote_hosts[:-1]:
                    touched[(0, r)] = touched.get((0, r), send[r]) + p * weight[r]
        local = max(touched.values())
        glob = max(local, self.peak)
        receivers = sum(len(rs) for rs in remote.values())
        chunk = min(max(alloc.values()), NCCL_CHUNK_BYTES)
        intra_hops = receivers - len(remote)
        if mode == "ring":
            latency = NCCL_BROADCAST_OVERHEAD_US * 1e-6 + len(remote) * ctx.lat_s + intra_hops * ctx.intra_lat_s
            latency += (len(remote) - 1) * chunk / ctx.nic + intra_hops * chunk / ctx.intra
        else:
            latency = ctx.lat_s
            if receivers > len(remote):
                per_host = receivers // len(remote)
                latency += NCCL_BROADCAST_OVERHEAD_US * 1e-6 + (per_host - 1) * (ctx.intra_lat_s + chunk / ctx.intra)
        penalty = latency * len(alloc) * ctx.nic / self.quantum
        sumsq = sum(v * v for v in touched.values())
        return (round(glob / self.quantum + penalty), round(local / self.quantum + penalty), len(alloc), sumsq)

    def _sender(self, h: int, holders: list[int], receivers_key: tuple[int, ...]) -> int:
        """The device of host ``h`` that sends a piece to ``receivers_key``."""
        src = self.exits.get(h) if self.serial else None
        if src is None or src not in holders:
            sticky = self.roots.get((h, receivers_key))
            src = min(holders, key=lambda d: (self.busy[d], d != sticky, d))
            if self.serial:
                self.exits.setdefault(h, src)
        self.roots[(h, receivers_key)] = src
        return src

    def _charge(
        self, h: int, src: int, piece: int, mult: int, mode: str, remote: dict[int, list[int]], remote_hosts: list[int]
    ) -> None:
        """Add a piece sent from ``src`` on host ``h`` to the device and NIC loads."""
        weight = self.ctx.weight
        self.busy[src] += piece * mult * weight[h]
        self.sent[src] += piece * mult
        self.send[h] += piece * mult * weight[h]
        self.peak = max(self.peak, self.send[h])
        for r in remote:
            self.recv[r] += piece * weight[r]
            self.peak = max(self.peak, self.recv[r])
        if mode == "ring":
            for r in remote_hosts[:-1]:
                self.send[r] += piece * weight[r]
                self.peak = max(self.peak, self.send[r])

    def _build(self, placed: list[_Placed], local: list[Item]) -> list[Item]:
        """The items of the placed pieces, then the local ones. A receiver that sends over the
        network itself would hold up the transfer into its host until its own sends are done: it
        gets the box afterwards, over the intra-host links from a device that took it off the
        network (a relay)."""
        ctx = self.ctx
        items: list[Item] = []
        for p in placed:
            split_hosts = [_entries(rs, self.sent) if ctx.shared else (rs, []) for rs in p.per_host]
            if p.mode == "ring":
                _ring(ctx, items, p.task, p.box, p.size, p.src, split_hosts)
            else:
                for first, late in split_hosts:
                    _deliver(ctx, items, p.task, p.box, p.size, p.src, first, late)
        base = len(items)
        for it in local:
            if it.after is not None:
                it.after += base
        return items + local


def _entries(receivers: list[int], sent: dict[int, float]) -> tuple[list[int], list[int]]:
    """(receivers the network delivers to, receivers served by an intra-host relay afterwards)."""
    first = [r for r in receivers if not sent.get(r)]
    if not first:
        first = [min(receivers, key=lambda r: (sent[r], r))]
    return first, [r for r in receivers if r not in first]


def _waterfill(
    loads: dict[int, float], weight: dict[int, float], size: int, mult: int, min_piece: float
) -> dict[int, float]:
    """Split ``size`` among hosts so that ``load + share * mult * weight`` is as even as possible."""
    active = sorted(loads, key=lambda h: (loads[h], h))
    while True:
        level = 0.0
        # find the water level over the k least loaded hosts
        for k in range(len(active), 0, -1):
            chosen = active[:k]
            level = (sum(loads[h] / weight[h] for h in chosen) + size * mult) / sum(1 / weight[h] for h in chosen)
            if level >= loads[chosen[-1]]:
                break
        shares = {h: (level - loads[h]) / (mult * weight[h]) for h in chosen if level > loads[h]}
        small = [h for h, s in shares.items() if s < min_piece]
        if not small or len(shares) == 1:
            return shares if shares else {active[0]: float(size)}
        active = [h for h in active if h not in small] or active[:1]


def _cut(box: Box, alloc: dict[int, float]) -> list[tuple[int, Box]]:
    """Split ``box`` along its longest dim into pieces proportional to ``alloc`` (host -> bytes)."""
    if len(alloc) == 1:
        return [(next(iter(alloc)), box)]
    dim = max(range(len(box)), key=lambda d: (box[d][1] - box[d][0], -d))
    lo, hi = box[dim]
    total = sum(alloc.values())
    out = []
    acc = 0.0
    start = lo
    for h in sorted(alloc):
        acc += alloc[h]
        stop = lo + round((hi - lo) * acc / total)
        if stop > start:
            out.append((h, box[:dim] + ((start, stop),) + box[dim + 1 :]))
            start = stop
    return out


def _deliver(
    ctx: Context,
    out: list[Item],
    task: int,
    box: Box,
    size: int,
    src: int,
    first: list[int],
    late: list[int],
    *,
    network: bool = True,
) -> None:
    """``src`` -> ``first`` (receivers on one host): a SEND or a broadcast; then a relay inside the
    host to ``late``. Over gloo the network carries the box to one device, which relays the rest."""
    ports = ((0, ctx.hosts[src]), (1, ctx.hosts[first[0]])) if network else ()
    if len(first) == 1 or (network and ctx.gloo):
        out.append(Item(TransferKind.SEND, box, src, (first[0],), task, size, network, ports))
        late = first[1:] + late
    else:
        out.append(Item(TransferKind.BROADCAST, box, src, tuple(first), task, size, network, ports))
    _relay(out, task, box, size, first[0], late, len(out) - 1)


def _ring(
    ctx: Context,
    out: list[Item],
    task: int,
    box: Box,
    size: int,
    src: int,
    per_host: list[tuple[list[int], list[int]]],
) -> None:
    """One broadcast entering every receiving host once, then relays inside the hosts. Over gloo
    (a binomial tree, not a ring) the broadcast reaches one device per host."""
    if ctx.gloo:
        per_host = [(first[:1], first[1:] + late) for first, late in per_host]
    receivers = tuple(d for first, _ in per_host for d in first)
    h_src = ctx.hosts[src]
    hosts = [ctx.hosts[first[0]] for first, _ in per_host]
    ports = ((0, h_src), *((1, h) for h in hosts), *((0, h) for h in hosts[:-1]))
    kind = TransferKind.SEND if len(receivers) == 1 else TransferKind.BROADCAST
    out.append(Item(kind, box, src, receivers, task, size, True, ports))
    feed = len(out) - 1
    for first, late in per_host:
        _relay(out, task, box, size, first[0], late, feed)


def _relay(out: list[Item], task: int, box: Box, size: int, entry: int, late: list[int], feed: int) -> None:
    if late:
        kind = TransferKind.SEND if len(late) == 1 else TransferKind.BROADCAST
        out.append(Item(kind, box, entry, tuple(late), task, size, False, (), feed))

"""``auto``: the topology-aware planner. It minimizes the simulated makespan on the cluster.

``auto`` builds several candidate plans and keeps the one ``topology.simulator`` finds fastest on
the problem's cluster (default: ``Cluster.for_meshes``), so it is never slower there than any
candidate, and the baselines of ``reshard.baselines`` (and ``send_recv``) are candidates. Its own
candidates ("hier") go past the baselines' weaknesses:

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
- Within a host, the sending device is the one that has sent the least so far (devices run their
  transfers one at a time), then the one already used for the same receivers (fewer groups); the
  "serial" candidates instead send everything a host sends from one device where the boxes allow,
  so that the device order itself keeps the host's NIC on schedule at run time. A receiver that
  sends over the network itself would hold up the transfer into its host: it gets the box later,
  relayed over the intra-host links by a device that took it off the network.
- Order: transfers are packed first-fit into rounds in which every device takes part in at most
  one transfer, network transfers first, largest first. "color" first edge-colors the transfers
  between one sending and one receiving host on the bipartite graph of NIC ports (Koenig: as many
  colors as the busiest port has transfers), so that a round has every NIC direction carry one
  transfer; "nic" packs greedily under the same rule, "lpt" without it, "task" in task order. A
  relay goes in a round after the transfer that feeds it. Every device issues its transfers in
  round order: one global order, hence deadlock free.

Candidates are simulated within a planning-time budget (``SIMULATION_BUDGET`` transfers in all,
baselines while ``MAX_BASELINE_WORK`` allows); past ``MAX_SIMULATED_TRANSFERS`` ``auto`` returns
the "serial/color" candidate unsimulated: one sending device per host where the box allows, so
that device-order serialization keeps every NIC on the color schedule.
Everything is deterministic (no unseeded randomness; ties break on device ids).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from reshard.plan import Transfer, TransferKind
from reshard.regions import Box, box_volume
from reshard.strategies import STRATEGIES, Problem, register
from topology.cluster import Cluster
from topology.simulator import NCCL_BROADCAST_OVERHEAD_US, NCCL_CHUNK_BYTES, SimKind, SimTransfer, simulate_transfers

MAX_SIMULATED_TRANSFERS = 4000  # beyond it the serial/color plan is returned unsimulated
SIMULATION_BUDGET = 24000  # transfers simulated per planning call, over all candidates
MAX_BASELINE_WORK = 50_000  # baselines join the candidates while sum(senders * receivers) stays below
SPLIT_MIN_BYTES = 1 << 20  # a task is split among holder hosts only into pieces at least this big
MAX_SPLIT = 8  # ... and among at most this many hosts
CANDIDATE_HOSTS = 4  # sender hosts tried per task (the least loaded holders)
_SIM_KIND = {TransferKind.COPY: SimKind.COPY, TransferKind.SEND: SimKind.P2P, TransferKind.BROADCAST: SimKind.BROADCAST}
BASELINES = ("broadcast_order", "broadcast_size", "broadcast", "allgather", "send_recv")


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    transfers: tuple[Transfer, ...]
    makespan_s: float | None  # None when not simulated


@register("auto")
def plan_auto(problem: Problem) -> tuple[Transfer, ...]:
    """The fastest (simulated) of the candidate plans; see the module docstring."""
    return choose(problem)[0].transfers


def choose(problem: Problem) -> tuple[Candidate, list[Candidate]]:
    """(the chosen candidate, every candidate simulated), in evaluation order."""
    from reshard.cost import device_hosts, resolve_cluster

    cluster = resolve_cluster(problem.cluster, problem.src, problem.dst)
    hosts = device_hosts(problem.src, problem.dst)
    ctx = _Context(problem, cluster, hosts)
    serial, shapes = _hier(ctx, split=True, serial=True)
    first = ("serial/color", _order(serial, "color"))
    if len(first[1]) > MAX_SIMULATED_TRANSFERS:
        c = Candidate(first[0], first[1], None)
        return c, [c]
    items, _ = _hier(ctx, split=True)
    makers = [
        ("hier/color", lambda: _order(items, "color")),
        ("hier/lpt", lambda: _order(items, "lpt")),
        ("serial/lpt", lambda: _order(serial, "lpt")),
        ("hier/nic", lambda: _order(items, "nic")),
        ("hier/task", lambda: _order(items, "task")),
    ]
    if "split" in shapes:  # else identical to hier
        makers.append(("whole/color", lambda: _order(_hier(ctx, split=False)[0], "color")))
    if "ring" in shapes:
        makers.append(("star/color", lambda: _order(_hier(ctx, split=True, modes=("star",))[0], "color")))
    work = sum(len(t.senders) * len(t.receivers) for t in problem.tasks)
    if work <= MAX_BASELINE_WORK:
        makers[1:1] = [(name, lambda name=name: STRATEGIES[name](problem)) for name in BASELINES]
    seen: set[tuple[Transfer, ...]] = set()
    evaluated: list[Candidate] = []
    budget = SIMULATION_BUDGET
    for name, make in [(first[0], lambda: first[1]), *makers]:
        transfers = make()
        if transfers in seen or len(transfers) > budget:
            continue
        seen.add(transfers)
        budget -= len(transfers)
        sim = simulate_transfers(ctx.sim_form(transfers), hosts, cluster)
        evaluated.append(Candidate(name, transfers, sim.makespan_s))
    best = min(evaluated, key=lambda c: (c.makespan_s * (1 - 1e-9), _groups(c.transfers), len(c.transfers)))
    return best, evaluated


def _groups(transfers: tuple[Transfer, ...]) -> int:
    return len({tuple(sorted(t.group)) for t in transfers if t.kind is not TransferKind.COPY})


# ---------------------------------------------------------------------------------------------
# hier: host-level load balancing


@dataclass(slots=True)
class _Item:
    """A transfer before ordering; ``after`` is the item that must deliver ``src`` its box first."""

    kind: TransferKind
    box: Box
    src: int
    dsts: tuple[int, ...]
    task: int
    size: int
    network: bool
    ports: tuple[tuple[int, int], ...] = ()  # (0, host) NIC send, (1, host) NIC receive
    after: int | None = None
    devices: tuple[int, ...] = field(default=())


class _Context:
    def __init__(self, problem: Problem, cluster: Cluster, hosts: dict[int, int]):
        self.problem = problem
        self.cluster = cluster
        self.hosts = hosts
        self.item = problem.itemsize
        self.gloo = cluster.backend == "gloo"
        self.lat_s = cluster.latency_us * 1e-6
        self.intra_lat_s = cluster.intra_host_latency_us * 1e-6
        self.nic = cluster.nic_Bps
        self.intra = cluster.intra_host_Bps

    def sim_form(self, transfers: tuple[Transfer, ...]) -> list[SimTransfer]:
        return [SimTransfer(_SIM_KIND[t.kind], t.src, t.dsts, box_volume(t.box) * self.item) for t in transfers]


def _hier(ctx: _Context, *, split: bool, modes=("ring", "star"), serial=False) -> tuple[list[_Item], set[str]]:
    """Transfers of every task, before ordering: sender hosts and delivery shapes chosen greedily
    (largest tasks first) against the NIC loads so far; ``serial``: one sending device per host."""
    problem, hosts = ctx.problem, ctx.hosts
    tasks = problem.tasks
    send: dict[int, float] = defaultdict(float)
    recv: dict[int, float] = defaultdict(float)
    peak = 0.0  # the most loaded NIC direction so far
    # bytes each device moves over the network (received, known upfront, and sent so far): devices
    # run their transfers one at a time, so senders are picked among the least busy holders
    busy: dict[int, float] = defaultdict(float)
    shared = not set(problem.src.mesh.device_ids).isdisjoint(problem.dst.mesh.device_ids)
    roots: dict[tuple, int] = {}
    exits: dict[int, int] = {}
    sent: dict[int, float] = defaultdict(float)  # network bytes each device sends
    plan = []
    shapes: set[str] = set()  # "split", "ring", "star": what the greedy used
    local_items: list[_Item] = []
    network = []
    total = sum(t.size_bytes for t in tasks) or 1
    quantum = total * 1e-4 / max(1, len(set(hosts.values())))

    owners: dict[tuple[int, ...], dict[int, list[int]]] = {}  # senders -> host -> holders there
    spread: dict[tuple[int, ...], dict[int, list[int]]] = {}  # receivers -> host -> receivers there
    incoming: dict[tuple[int, ...], int] = defaultdict(int)  # network bytes per receiver tuple
    intra_work = []
    for i, task in enumerate(tasks):
        size = task.size_bytes
        by_host = owners.get(task.senders)
        if by_host is None:
            by_host = owners[task.senders] = _by_host(task.senders, hosts)
        if shared and not set(task.senders).isdisjoint(task.receivers):
            holders = set(task.senders)
            for r in task.receivers:
                if r in holders:
                    local_items.append(_Item(TransferKind.COPY, task.box, r, (r,), i, size, False))
            receivers = tuple(r for r in task.receivers if r not in holders)
            if not receivers:
                continue
        else:
            receivers = task.receivers
        by_dst = spread.get(receivers)
        if by_dst is None:
            by_dst = spread[receivers] = _by_host(receivers, hosts)
        remote = {h: rs for h, rs in by_dst.items() if h not in by_host}
        if len(remote) < len(by_dst):
            intra_work += [(i, h, rs) for h, rs in by_dst.items() if h in by_host]
        if remote:
            network.append((size * len(remote), i, by_host, remote))
            incoming[tuple(d for rs in remote.values() for d in rs)] += size
    for receivers, size in incoming.items():
        for r in receivers:
            busy[r] += size
    for i, h, receivers in intra_work:
        task = tasks[i]
        src = min(owners[task.senders][h], key=lambda d: (busy[d], d))
        busy[src] += task.size_bytes * 0.01  # intra-host bytes are cheap, but spread them too
        _deliver(ctx, local_items, i, task.box, task.size_bytes, src, receivers, [], network=False)

    network.sort(key=lambda x: (-x[0], x[1]))  # largest work first; ties by task index
    for _, i, by_host, remote in network:
        task = tasks[i]
        size = task.size_bytes
        if len(remote) == 1:
            remote_hosts = list(remote)
        else:
            remote_hosts = sorted(remote, key=lambda h: (send[h], h))  # ring: the most send-loaded last
        if len(by_host) == 1 and len(remote) == 1:  # one way only
            mode, alloc = "star", {next(iter(by_host)): size}
        else:
            best = None
            # the few least loaded holder hosts are the candidates (many hosts may hold a box)
            near = sorted(by_host, key=lambda h: (send[h], h))
            for mode in modes if len(remote) > 1 else ("star",):
                mult = 1 if mode == "ring" else len(remote)
                options = [{h: size} for h in near[:CANDIDATE_HOSTS]]
                if split and len(near) > 1 and size >= 2 * SPLIT_MIN_BYTES:
                    loads = {h: send[h] for h in near[:MAX_SPLIT]}
                    shares = _waterfill(loads, size, mult, max(SPLIT_MIN_BYTES, size / MAX_SPLIT))
                    if len(shares) > 1:
                        options.append(shares)
                for alloc in options:
                    score = _score(ctx, alloc, mode, remote, remote_hosts, send, recv, peak, quantum)
                    if best is None or score < best[0]:
                        best = (score, mode, alloc)
            _, mode, alloc = best
            if len(alloc) > 1:
                shapes.add("split")
            shapes.add(mode)
        mult = 1 if mode == "ring" else len(remote)
        receivers_key = (
            tuple(remote[remote_hosts[0]]) if len(remote) == 1 else tuple(d for h in remote_hosts for d in remote[h])
        )
        for h, box in _cut(task.box, alloc):
            piece = size if len(alloc) == 1 else box_volume(box) * ctx.item
            holders_here = by_host[h]
            src = exits.get(h) if serial else None
            if src is None or src not in holders_here:
                sticky = roots.get((h, receivers_key))
                src = min(holders_here, key=lambda d: (busy[d], d != sticky, d))
                if serial:
                    exits.setdefault(h, src)
            roots[(h, receivers_key)] = src
            busy[src] += piece * mult
            sent[src] += piece * mult
            send[h] += piece * mult
            peak = max(peak, send[h])
            for r in remote:
                recv[r] += piece
                peak = max(peak, recv[r])
            if mode == "ring":
                for r in remote_hosts[:-1]:
                    send[r] += piece
                    peak = max(peak, send[r])
            plan.append((i, box, piece, src, mode, [remote[r] for r in remote_hosts]))

    # Build the transfers. A receiver that sends over the network itself would hold up the
    # transfer into its host until its own sends are done: it gets the box afterwards, over the
    # intra-host links from a device that took it off the network (a relay).
    items: list[_Item] = []
    for i, box, piece, src, mode, per_host in plan:
        split_hosts = [_entries(receivers, sent) if shared else (receivers, []) for receivers in per_host]
        if mode == "ring":
            _ring(ctx, items, i, box, piece, src, split_hosts)
        else:
            for first, late in split_hosts:
                _deliver(ctx, items, i, box, piece, src, first, late)
    base = len(items)
    for it in local_items:
        if it.after is not None:
            it.after += base
    items += local_items
    for it in items:
        it.devices = (it.src,) if it.kind is TransferKind.COPY else (it.src, *it.dsts)
    return items, shapes


def _by_host(devices: tuple[int, ...], hosts: dict[int, int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in devices:
        out.setdefault(hosts[d], []).append(d)
    return out


def _entries(receivers: list[int], sent: dict[int, float]) -> tuple[list[int], list[int]]:
    """(receivers the network delivers to, receivers served by an intra-host relay afterwards)."""
    first = [r for r in receivers if not sent.get(r)]
    if not first:
        first = [min(receivers, key=lambda r: (sent[r], r))]
    return first, [r for r in receivers if r not in first]


def _score(ctx, alloc, mode, remote, remote_hosts, send, recv, peak, quantum):
    """(max NIC load after, max over the touched NICs, pieces, sum of squares): smaller is better.

    Loads are in bytes; a latency estimate, as bytes the NIC could have moved meanwhile, joins them.
    """
    touched: dict[tuple[int, int], float] = {}
    mult = 1 if mode == "ring" else len(remote)
    for h, p in alloc.items():
        touched[(0, h)] = touched.get((0, h), send[h]) + p * mult
        for r in remote:
            touched[(1, r)] = touched.get((1, r), recv[r]) + p
        if mode == "ring":
            for r in remote_hosts[:-1]:
                touched[(0, r)] = touched.get((0, r), send[r]) + p
    local = max(touched.values())
    glob = max(local, peak)
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
    penalty = latency * len(alloc) * ctx.nic / quantum
    sumsq = sum(v * v for v in touched.values())
    return (round(glob / quantum + penalty), round(local / quantum + penalty), len(alloc), sumsq)


def _waterfill(loads: dict[int, float], size: int, mult: int, min_piece: float) -> dict[int, float]:
    """Split ``size`` among hosts so that ``load + share * mult`` is as even as possible."""
    active = sorted(loads, key=lambda h: (loads[h], h))
    while True:
        level = 0.0
        # find the water level over the k least loaded hosts
        for k in range(len(active), 0, -1):
            chosen = active[:k]
            level = (sum(loads[h] for h in chosen) + size * mult) / k
            if level >= loads[chosen[-1]]:
                break
        shares = {h: (level - loads[h]) / mult for h in chosen if level > loads[h]}
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
    ctx: _Context,
    out: list[_Item],
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
        out.append(_Item(TransferKind.SEND, box, src, (first[0],), task, size, network, ports))
        late = first[1:] + late
    else:
        out.append(_Item(TransferKind.BROADCAST, box, src, tuple(first), task, size, network, ports))
    _relay(out, task, box, size, first[0], late, len(out) - 1)


def _ring(
    ctx: _Context,
    out: list[_Item],
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
    out.append(_Item(kind, box, src, receivers, task, size, True, ports))
    feed = len(out) - 1
    for first, late in per_host:
        _relay(out, task, box, size, first[0], late, feed)


def _relay(out: list[_Item], task: int, box: Box, size: int, entry: int, late: list[int], feed: int) -> None:
    if late:
        kind = TransferKind.SEND if len(late) == 1 else TransferKind.BROADCAST
        out.append(_Item(kind, box, entry, tuple(late), task, size, False, (), feed))


# ---------------------------------------------------------------------------------------------
# ordering: first-fit rounds


def _order(items: list[_Item], how: str) -> tuple[Transfer, ...]:
    """Pack ``items`` into rounds (first fit) and emit them round by round.

    ``how``: "lpt" (network transfers first, largest first; a device is in one transfer per round),
    "nic" (the same, and every NIC direction carries one network transfer per round), "color"
    (network transfers between one sending and one receiving host are first edge-colored on the
    bipartite graph of NIC ports, which needs only as many rounds as the busiest port has transfers,
    then packed in color order like "nic"), "task" (unit task order).
    """
    n = len(items)
    if how == "task":
        seq = sorted(range(n), key=lambda j: (items[j].task, not items[j].network, j))
    elif how == "color":
        color = _edge_colors(items)
        seq = sorted(range(n), key=lambda j: (not items[j].network, color.get(j, n), -items[j].size, items[j].task, j))
    else:
        seq = sorted(range(n), key=lambda j: (not items[j].network, -items[j].size, items[j].task, j))
    use_ports = how in ("nic", "color")
    busy: dict[object, int] = defaultdict(int)  # device or NIC port -> bitset of occupied rounds
    round_of = [0] * n
    placed = [False] * n
    pending = seq
    while pending:
        later = []
        for j in pending:
            it = items[j]
            floor = 0
            if it.after is not None:
                if not placed[it.after]:
                    later.append(j)
                    continue
                floor = round_of[it.after] + 1
            keys = it.devices + it.ports if use_ports and it.network else it.devices
            occupied = 0
            for key in keys:
                occupied |= busy[key]
            free = ~(occupied >> floor)
            r = floor + (free & -free).bit_length() - 1
            bit = 1 << r
            for key in keys:
                busy[key] |= bit
            round_of[j] = r
            placed[j] = True
        if len(later) == len(pending):
            raise AssertionError("relay items wait on each other")
        pending = later
    rank = {j: k for k, j in enumerate(seq)}
    order = sorted(range(n), key=lambda j: (round_of[j], rank[j]))
    return tuple(Transfer(items[j].kind, items[j].box, items[j].src, items[j].dsts, items[j].task) for j in order)


def _edge_colors(items: list[_Item]) -> dict[int, int]:
    """Colors of the network items that use exactly one NIC send port and one receive port, such
    that no port has two items of one color, with as many colors as the busiest port has items
    (bipartite: Koenig's theorem). An item takes the first color free at both of its ports; when
    none is, the two colors free at either end are swapped along an alternating path."""
    edges = [j for j, it in enumerate(items) if it.network and len(it.ports) == 2]
    edges.sort(key=lambda j: (-items[j].size, j))  # heavy items first: they open the long rounds
    degree: dict[tuple[int, int], int] = defaultdict(int)
    for j in edges:
        for port in items[j].ports:
            degree[port] += 1
    colors = max(degree.values(), default=0)
    used: dict[tuple[int, int], int] = defaultdict(int)  # port -> bitset of its colors
    at: dict[tuple[int, int], dict[int, int]] = defaultdict(dict)  # port -> color -> item
    color: dict[int, int] = {}

    def lowest_free(mask: int) -> int:
        free = ~mask
        return (free & -free).bit_length() - 1

    def put(j: int, c: int) -> None:
        color[j] = c
        for port in items[j].ports:
            used[port] |= 1 << c
            at[port][c] = j

    for j in edges:
        u, v = items[j].ports
        c = lowest_free(used[u] | used[v])
        if c < colors:
            put(j, c)
            continue
        a, b = lowest_free(used[u]), lowest_free(used[v])
        # a is free at u, b at v; flip the a/b path that leaves v on color a (it never reaches u)
        path = []
        x, c = v, a
        while c in at[x]:
            e = at[x][c]
            path.append(e)
            p, q = items[e].ports
            x = q if p == x else p
            c = b if c == a else a
        for e in path:
            for port in items[e].ports:
                used[port] &= ~(1 << color[e])
                del at[port][color[e]]
        for e in path:
            put(e, b if color[e] == a else a)
        put(j, a)
    return color

"""Ordering ``auto``'s transfers: first-fit rounds, optionally on an edge coloring of the NIC ports.

Every device issues its transfers in round order: one global order, hence deadlock free. Where
devices forward a slice while the next comes in (``duplex``: gloo's issue windows,
``reshard.passes.sequencing``), a relay's forward and a receive of its device share a round.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from reshard.ir.plan import Transfer, TransferKind
from reshard.ir.regions import Box

ORDERS = ("color", "nic", "lpt", "task")


@dataclass(slots=True)
class Item:
    """A transfer before ordering; ``after`` is the item that must deliver ``src`` its box first.

    ``ports`` are the NIC ports a network item uses: (0, host) sends, (1, host) receives.
    """

    kind: TransferKind
    box: Box
    src: int
    dsts: tuple[int, ...]
    task: int
    size: int
    network: bool
    ports: tuple[tuple[int, int], ...] = ()
    after: int | None = None

    @property
    def devices(self) -> tuple[int, ...]:
        return (self.src,) if self.kind is TransferKind.COPY else (self.src, *self.dsts)


def order_items(items: list[Item], how: str, *, duplex: bool = False) -> tuple[Transfer, ...]:
    """Pack ``items`` into rounds (first fit) and emit them round by round, relays first in a
    round (a device's forward of what it already holds goes before its next receive).

    ``how``: "lpt" (network transfers first, largest first; a device is in one transfer per round),
    "nic" (the same, and every NIC direction carries one network transfer per round), "color"
    (network transfers between one sending and one receiving host are first edge-colored on the
    bipartite graph of NIC ports, which needs only as many rounds as the busiest port has transfers,
    then packed in color order like "nic"), "task" (unit task order). A relay goes in a round after
    the item that feeds it. ``duplex``: a device may forward (a relay) and receive in one round.
    """
    if how not in ORDERS:
        raise ValueError(f"unknown order {how!r}; choose one of {', '.join(ORDERS)}")
    n = len(items)
    if how == "task":
        seq = sorted(range(n), key=lambda j: (items[j].task, not items[j].network, j))
    elif how == "color":
        color = _edge_colors(items)
        seq = sorted(range(n), key=lambda j: (not items[j].network, color.get(j, n), -items[j].size, items[j].task, j))
    else:
        seq = sorted(range(n), key=lambda j: (not items[j].network, -items[j].size, items[j].task, j))
    use_ports = how in ("nic", "color")
    devices = [_link_keys(it) if duplex else it.devices for it in items]
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
            keys = devices[j] + it.ports if use_ports and it.network else devices[j]
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
    order = sorted(range(n), key=lambda j: (round_of[j], items[j].after is None, rank[j]))
    return tuple(Transfer(items[j].kind, items[j].box, items[j].src, items[j].dsts, items[j].task) for j in order)


def _link_keys(it: Item) -> tuple[tuple[int, int], ...]:
    """The directions of the devices' links an item takes up: (device, 0) out, (device, 1) in. A
    relay's root forwards (out) and a send's receiver receives (in); a root sending its own bytes,
    a broadcast receiver (it may forward) and a local item take their device whole, as the
    runtime's windows do (``reshard.passes.sequencing``)."""
    whole = ((it.src, 0), (it.src, 1))
    if it.kind in (TransferKind.COPY, TransferKind.SCALE):
        return whole
    src = ((it.src, 0),) if it.after is not None else whole
    if it.kind is TransferKind.SEND:
        return (*src, (it.dsts[0], 1))
    return (*src, *((d, k) for d in it.dsts for k in (1, 0)))


def _edge_colors(items: list[Item]) -> dict[int, int]:
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

"""Reshard plans: which device sends which box to whom, in one global order."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from reshard.dtypes import itemsize
from reshard.ir.cost import lower_bound_s, resolve_cluster
from reshard.ir.layout import Layout
from reshard.ir.placement import ReduceOp
from reshard.ir.program import Buffer
from reshard.ir.regions import Box, box_volume, contains, device_regions
from reshard.ir.target import WINDOW_BYTES, target_for, window_ops_for
from reshard.ir.tasks import UnitTask
from topology.cluster import Cluster
from topology.mesh import device_hosts
from topology.simulator import SimKind, SimResult, SimTransfer, simulate_transfers


class TransferKind(enum.IntEnum):
    """How a ``Transfer`` moves its box: a local copy, a point-to-point send, a broadcast over its
    group, or the scaling of a reduced box (a Partial average)."""

    COPY = 0  # the receiver already holds the box in its source shard: a local copy
    SEND = 1  # point-to-point from ``src`` to the one device in ``dsts``
    BROADCAST = 2  # one broadcast over the group (src, *dsts)
    SCALE = 3  # ``src`` divides its (reduced) box by the number of contributions (Partial avg)


@dataclass(frozen=True, slots=True)
class Transfer:
    """Move ``box`` from device ``src`` to devices ``dsts``.

    ``src`` reads the box from ``read``; by default from its source shard when it holds it there,
    otherwise from its destination shard, which an earlier transfer of the plan must have filled (a
    relay). Receivers write it into ``write`` (their destination shard, or their scratch buffer
    while they combine contributions of a Partial source), combining it with what is there when
    ``reduce`` (the source layout's reduce op).
    """

    kind: TransferKind
    box: Box
    src: int
    dsts: tuple[int, ...]
    task: int
    reduce: bool = False
    read: Buffer | None = None
    write: Buffer = Buffer.DST

    def __post_init__(self):
        if not self.dsts:
            raise ValueError(f"transfer of {self.box} from {self.src} has no receivers")
        if self.kind in (TransferKind.COPY, TransferKind.SCALE) and self.dsts != (self.src,):
            raise ValueError(f"a {self.kind.name} stays on one device, got {self.src} -> {self.dsts}")
        if self.reduce and self.kind is TransferKind.BROADCAST:
            raise ValueError("contributions are combined point to point, not by broadcast")
        if self.write is Buffer.SRC:
            raise ValueError(f"transfer of {self.box}: source shards are never written")
        if self.kind is TransferKind.SEND and (len(self.dsts) != 1 or self.dsts[0] == self.src):
            raise ValueError(f"a SEND goes to exactly one other device, got {self.src} -> {self.dsts}")
        if self.kind is TransferKind.BROADCAST and (self.src in self.dsts or len(set(self.dsts)) != len(self.dsts)):
            raise ValueError(f"a BROADCAST group must be distinct devices, got {self.src} -> {self.dsts}")

    @property
    def group(self) -> tuple[int, ...]:
        """Participating devices, sender first."""
        return (self.src,) if self.kind in (TransferKind.COPY, TransferKind.SCALE) else (self.src, *self.dsts)

    def __str__(self) -> str:
        box = "[" + ", ".join(f"{lo}:{hi}" for lo, hi in self.box) + "]"
        how = " (reduce)" if self.reduce else ""
        bufs = ""
        if self.read is not None or self.write is not Buffer.DST:
            bufs = f" {self.read.name.lower() if self.read is not None else ''}->{self.write.name.lower()}"
        return f"{self.kind.name.lower()}{how} {box} {self.src} -> {list(self.dsts)}{bufs}"


_SIM_KIND = {
    TransferKind.COPY: SimKind.COPY,
    TransferKind.SEND: SimKind.P2P,
    TransferKind.BROADCAST: SimKind.BROADCAST,
    TransferKind.SCALE: SimKind.COPY,
}


def sim_transfers(
    transfers: Iterable[Transfer],
    itemsize: int,
    pulled: Mapping[int, int | None] | None = None,
    *,
    src_regions: Mapping[int, Box] | None = None,
) -> list[SimTransfer]:
    """``transfers`` in the simulator's neutral form (``topology.simulator``), in the same order;
    those whose index is in ``pulled`` run as pulls out of the sender's memory (``reshard.passes.pulls``),
    after the transfer ``pulled`` names (a relay's) or at once (None). With ``src_regions`` (each
    source device's box), also say on which devices each reads what earlier transfers wrote
    (``SimTransfer.reads_landed``, which closes an issue window)."""
    pulled = pulled or {}
    transfers = tuple(transfers)
    landed = [()] * len(transfers) if src_regions is None else _reads_landed(transfers, src_regions)
    return [
        SimTransfer(SimKind.PULL, t.src, t.dsts, box_volume(t.box) * itemsize, pulled[i], landed[i])
        if i in pulled
        else SimTransfer(_SIM_KIND[t.kind], t.src, t.dsts, box_volume(t.box) * itemsize, reads_landed=landed[i])
        for i, t in enumerate(transfers)
    ]


def _reads_landed(transfers: tuple[Transfer, ...], src_regions: Mapping[int, Box]) -> list[tuple[int, ...]]:
    """Per transfer, the devices on which it reads what an earlier transfer wrote: a root that
    forwards what it does not hold in its source shard (a relay) or scales a box, receivers that
    combine into their target."""
    out: list[tuple[int, ...]] = []
    for t in transfers:
        if t.read is None:
            region = src_regions.get(t.src)
            root = region is None or not contains(region, t.box)
        else:
            root = t.kind is TransferKind.SCALE or t.read is not Buffer.SRC
        out.append(((t.src,) if root else ()) + (t.dsts if t.reduce else ()))
    return out


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    """A planned reshard: the unit tasks and the transfers that serve them, in issue order.

    ``hosts`` is the device -> host map the plan was made for, as sorted (device, host) pairs over
    both meshes: the meshes' host ids unless the planner was given others (``plan_reshard(hosts=)``).
    Built without it, a plan takes the meshes' host ids.
    """

    shape: tuple[int, ...]
    dtype: str
    src: Layout
    dst: Layout
    strategy: str
    tasks: tuple[UnitTask, ...]
    transfers: tuple[Transfer, ...]
    hosts: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        given = dict(self.hosts) if self.hosts else None
        hosts = tuple(sorted(device_hosts(self.src.mesh, self.dst.mesh, hosts=given).items()))
        if self.hosts and hosts != self.hosts:
            raise ValueError(
                f"plan hosts must be sorted (device, host) pairs over exactly the devices of both meshes, "
                f"got {self.hosts}"
            )
        object.__setattr__(self, "hosts", hosts)

    @property
    def host_map(self) -> dict[int, int]:
        """``hosts`` as a dict: global device id -> host id."""
        return dict(self.hosts)

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def reduce_op(self) -> ReduceOp | None:
        """How contributions combine (the source's Partial op), None for a source without Partial axes."""
        return self.src.reduce_op

    @property
    def size_bytes(self) -> int:
        return box_volume(tuple((0, n) for n in self.shape)) * self.itemsize

    def transfer_bytes(self, transfer: Transfer) -> int:
        return box_volume(transfer.box) * self.itemsize

    def simulate(
        self,
        cluster: Cluster | None = None,
        *,
        backend: str | None = None,
        pulled: Mapping[int, int | None] | None = None,
        window: int | None = None,
        window_bytes: int = WINDOW_BYTES,
        local_beside: bool | None = None,
    ) -> SimResult:
        """Simulated execution (``topology.simulator``) on ``cluster`` with the plan's hosts; default
        cluster: ``Cluster.for_hosts`` of them. ``pulled``: the transfers that run as pulls
        (``CompiledReshard.pulled``); ``window``: messages a device issues together, moving at most
        ``window_bytes`` (default: the backend's, ``reshard.ir.target``);
        ``local_beside``: local transfers run beside the messages where nothing reads what they
        write (default: where the backend's target says so: on CPU devices). A ``SimResult`` with ``.makespan_s``."""
        hosts = self.host_map
        cluster = resolve_cluster(cluster, hosts)
        backend = cluster.backend if backend is None else backend
        window = window_ops_for(backend) if window is None else window
        local_beside = target_for(backend).copies_beside_messages if local_beside is None else local_beside
        regions = device_regions(self.src, self.shape) if window > 1 else None
        return simulate_transfers(
            sim_transfers(self.transfers, self.itemsize, pulled, src_regions=regions),
            hosts,
            cluster,
            backend=backend,
            window=window,
            window_bytes=window_bytes,
            local_beside=local_beside,
        )

    def lower_bound_s(self, cluster: Cluster | None = None) -> float:
        """The fluid lower bound of any plan of this reshard on ``cluster`` (see ``reshard.ir.cost``)."""
        hosts = self.host_map
        return lower_bound_s(self.tasks, hosts, resolve_cluster(cluster, hosts))

    def __str__(self) -> str:
        head = (
            f"ReshardPlan {self.strategy}: {self.dtype}{list(self.shape)} {self.src} -> {self.dst}, "
            f"{len(self.tasks)} unit tasks, {len(self.transfers)} transfers"
        )
        return "\n".join([head, *(f"  {i:4d} {t}" for i, t in enumerate(self.transfers))])

"""Reshard plans: which device sends which box to whom, in one global order."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from reshard.layout import Layout
from reshard.regions import Box, box_volume
from reshard.tasks import UnitTask


class TransferKind(enum.IntEnum):
    COPY = 0  # the receiver already holds the box in its source shard: a local copy
    SEND = 1  # point-to-point from ``src`` to the one device in ``dsts``
    BROADCAST = 2  # one broadcast over the group (src, *dsts)


@dataclass(frozen=True, slots=True)
class Transfer:
    """Move ``box`` from device ``src`` to devices ``dsts``.

    ``src`` reads the box from its source shard when it holds it there, otherwise from its
    destination shard, which an earlier transfer of the plan must have filled (a relay).
    """

    kind: TransferKind
    box: Box
    src: int
    dsts: tuple[int, ...]
    task: int

    def __post_init__(self):
        if not self.dsts:
            raise ValueError(f"transfer of {self.box} from {self.src} has no receivers")
        if self.kind is TransferKind.COPY and self.dsts != (self.src,):
            raise ValueError(f"a COPY stays on one device, got {self.src} -> {self.dsts}")
        if self.kind is TransferKind.SEND and (len(self.dsts) != 1 or self.dsts[0] == self.src):
            raise ValueError(f"a SEND goes to exactly one other device, got {self.src} -> {self.dsts}")
        if self.kind is TransferKind.BROADCAST and (self.src in self.dsts or len(set(self.dsts)) != len(self.dsts)):
            raise ValueError(f"a BROADCAST group must be distinct devices, got {self.src} -> {self.dsts}")

    @property
    def group(self) -> tuple[int, ...]:
        """Participating devices, sender first."""
        return (self.src,) if self.kind is TransferKind.COPY else (self.src, *self.dsts)

    def __str__(self) -> str:
        box = "[" + ", ".join(f"{lo}:{hi}" for lo, hi in self.box) + "]"
        return f"{self.kind.name.lower()} {box} {self.src} -> {list(self.dsts)}"


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    """A planned reshard: the unit tasks and the transfers that serve them, in issue order."""

    shape: tuple[int, ...]
    dtype: str
    src: Layout
    dst: Layout
    strategy: str
    tasks: tuple[UnitTask, ...]
    transfers: tuple[Transfer, ...]

    @property
    def itemsize(self) -> int:
        from reshard.dtypes import itemsize

        return itemsize(self.dtype)

    @property
    def size_bytes(self) -> int:
        return box_volume(tuple((0, n) for n in self.shape)) * self.itemsize

    def transfer_bytes(self, transfer: Transfer) -> int:
        return box_volume(transfer.box) * self.itemsize

    def simulate(self, cluster=None, *, backend: str | None = None):
        """Simulated execution on ``cluster`` (a ``topology.Cluster``; default: one derived from the
        meshes' host ids): a ``topology.simulator.SimResult`` with ``.makespan_s``. See ``reshard.cost``."""
        from reshard.cost import simulate_plan

        return simulate_plan(self, cluster, backend=backend)

    def lower_bound_s(self, cluster=None) -> float:
        """The fluid lower bound of any plan of this reshard on ``cluster`` (see ``reshard.cost``)."""
        from reshard.cost import plan_lower_bound_s

        return plan_lower_bound_s(self, cluster)

    def __str__(self) -> str:
        head = (
            f"ReshardPlan {self.strategy}: {self.dtype}{list(self.shape)} {self.src} -> {self.dst}, "
            f"{len(self.tasks)} unit tasks, {len(self.transfers)} transfers"
        )
        return "\n".join([head, *(f"  {i:4d} {t}" for i, t in enumerate(self.transfers))])

"""Unit tasks: the many-to-many multicast that a reshard is.

Every non-empty intersection of a destination region with a source region is one unit task:
that box must travel from any one of its holders (``senders``) to all devices that need it
(``receivers``). Regions of one layout form a partition up to replication, so the tasks of one
destination region tile it exactly once.

A source with ``Partial`` axes holds several contributions of each box: ``contributions`` groups
its senders by the contribution they hold (replicas of one contribution together), and the box's
value is their reduction. A destination with ``Partial`` axes wants the value on the devices at
coordinate 0 of its Partial axes only (the others hold zeros, ``zero_devices``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from itertools import product

from reshard.ir.layout import Layout
from reshard.ir.regions import Box, box_volume, layout_regions


@dataclass(frozen=True, slots=True)
class UnitTask:
    """One box of the global tensor, its candidate senders and its receivers (global device ids);
    ``contributions``: the senders grouped by contribution when the source is Partial, else ``()``."""

    box: Box
    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    size_bytes: int
    contributions: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        if not self.senders or not self.receivers:
            raise ValueError(f"unit task {self.box} needs at least one sender and one receiver")
        if self.contributions and sorted(d for c in self.contributions for d in c) != sorted(self.senders):
            raise ValueError(f"unit task {self.box}: contributions {self.contributions} do not split {self.senders}")

    def __str__(self) -> str:
        box = "[" + ", ".join(f"{lo}:{hi}" for lo, hi in self.box) + "]"
        return f"{box} {self.size_bytes}B {list(self.senders)} -> {list(self.receivers)}"


def plan_unit_tasks(shape: tuple[int, ...], itemsize: int, src: Layout, dst: Layout) -> tuple[UnitTask, ...]:
    """All unit tasks of moving a tensor of ``shape`` from layout ``src`` to ``dst``, in a fixed order."""
    src = src.for_shape(shape)
    dst = dst.for_shape(shape)
    src_holders = _devices_by_region(src, shape)
    dst_holders = _devices_by_region(dst, shape, first_contribution_only=True)
    if any(n == 0 for n in shape):
        return ()
    contributions = {senders: contribution_groups(src, senders) for senders in src_holders.values()}
    # Regions are products of per-dim intervals; overlaps can be found dim by dim.
    pairs_per_dim = []
    for dim in range(len(shape)):
        src_iv = sorted({box[dim] for box in src_holders})
        dst_iv = sorted({box[dim] for box in dst_holders})
        pairs_per_dim.append(_overlapping(src_iv, dst_iv))
    tasks = []
    for combo in product(*pairs_per_dim):
        src_box = tuple(s for s, _, _ in combo)
        dst_box = tuple(d for _, d, _ in combo)
        senders = src_holders.get(src_box)
        receivers = dst_holders.get(dst_box)
        if senders is None or receivers is None:
            continue
        box = tuple(common for _, _, common in combo)
        tasks.append(UnitTask(box, senders, receivers, box_volume(box) * itemsize, contributions.get(senders, ())))
    return tuple(tasks)


def _devices_by_region(layout: Layout, shape, *, first_contribution_only: bool = False) -> dict[Box, tuple[int, ...]]:
    holders: dict[Box, list[int]] = defaultdict(list)
    for flat, (device, box) in enumerate(zip(layout.mesh.device_ids, layout_regions(layout, shape), strict=True)):
        if first_contribution_only and any(layout.contribution(flat)):
            continue
        if box_volume(box):
            holders[box].append(device)
    return {box: tuple(devices) for box, devices in holders.items()}


def contribution_groups(layout: Layout, devices: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """``devices`` (holders of one region of a Partial layout) grouped by the contribution they
    hold, in order of the contribution's coordinates; ``()`` without Partial axes."""
    if not layout.partial_axes:
        return ()
    by: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for d in devices:
        by[layout.contribution(layout.mesh.device_ids.index(d))].append(d)
    return tuple(tuple(by[k]) for k in sorted(by))


def zero_devices(layout: Layout) -> tuple[int, ...]:
    """Devices of a Partial destination layout that hold zeros (not at coordinate 0 of every
    Partial axis)."""
    return tuple(d for flat, d in enumerate(layout.mesh.device_ids) if any(layout.contribution(flat)))


def _overlapping(src_iv, dst_iv):
    """(src interval, dst interval, common interval) for every overlapping pair; inputs sorted."""
    out = []
    j = 0
    for s_lo, s_hi in src_iv:
        while j < len(dst_iv) and dst_iv[j][1] <= s_lo:
            j += 1
        k = j
        while k < len(dst_iv) and dst_iv[k][0] < s_hi:
            d_lo, d_hi = dst_iv[k]
            out.append(((s_lo, s_hi), (d_lo, d_hi), (max(s_lo, d_lo), min(s_hi, d_hi))))
            k += 1
    return out

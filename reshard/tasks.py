"""Unit tasks: the many-to-many multicast that a reshard is.

Every non-empty intersection of a destination region with a source region is one unit task:
that box must travel from any one of its holders (``senders``) to all devices that need it
(``receivers``). Regions of one layout form a partition up to replication, so the tasks of one
destination region tile it exactly once.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from itertools import product

from reshard.layout import Layout
from reshard.regions import Box, box_volume, layout_regions


@dataclass(frozen=True, slots=True)
class UnitTask:
    """One box of the global tensor, its candidate senders and its receivers (global device ids)."""

    box: Box
    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    size_bytes: int

    def __post_init__(self):
        if not self.senders or not self.receivers:
            raise ValueError(f"unit task {self.box} needs at least one sender and one receiver")

    def __str__(self) -> str:
        box = "[" + ", ".join(f"{lo}:{hi}" for lo, hi in self.box) + "]"
        return f"{box} {self.size_bytes}B {list(self.senders)} -> {list(self.receivers)}"


def plan_unit_tasks(shape: tuple[int, ...], itemsize: int, src: Layout, dst: Layout) -> tuple[UnitTask, ...]:
    """All unit tasks of moving a tensor of ``shape`` from layout ``src`` to ``dst``, in a fixed order."""
    src_holders = _devices_by_region(src, shape)
    dst_holders = _devices_by_region(dst, shape)
    if any(n == 0 for n in shape):
        return ()
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
        tasks.append(UnitTask(box, senders, receivers, box_volume(box) * itemsize))
    return tuple(tasks)


def _devices_by_region(layout: Layout, shape) -> dict[Box, tuple[int, ...]]:
    holders: dict[Box, list[int]] = defaultdict(list)
    for device, box in zip(layout.mesh.device_ids, layout_regions(layout, shape), strict=True):
        if box_volume(box):
            holders[box].append(device)
    return {box: tuple(devices) for box, devices in holders.items()}


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

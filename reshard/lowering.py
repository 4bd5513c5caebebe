"""Lowering: a plan becomes one program per device (``reshard.program``).

Every device gets the ops of the plan's transfers it takes part in, in the plan's global transfer
order, so two groups never wait on each other in opposite orders; its groups are connected in
order of first use. A slice that is strided in its buffer passes through the device's staging
buffer (one op at a time here, so every staged op uses offset 0). Order and overlap beyond that
are decided later (``reshard.sequencing``).
"""

from __future__ import annotations

from reshard.dtypes import itemsize
from reshard.plan import ReshardPlan, TransferKind
from reshard.program import Broadcast, Buffer, Copy, DeviceProgram, Op, Program, Recv, Send, first_use_groups
from reshard.regions import Box, box_shape, box_volume, contains, is_contiguous, layout_regions, relative


def lower_plan(plan: ReshardPlan) -> Program:
    """One program per device of the source and destination meshes."""
    src_regions = dict(zip(plan.src.mesh.device_ids, layout_regions(plan.src, plan.shape), strict=True))
    dst_regions = dict(zip(plan.dst.mesh.device_ids, layout_regions(plan.dst, plan.shape), strict=True))
    ops: dict[int, list[Op]] = {d: [] for d in (*plan.src.mesh.device_ids, *plan.dst.mesh.device_ids)}
    staging: dict[int, int] = dict.fromkeys(ops, 0)
    item = itemsize(plan.dtype)

    def read_of(device: int, box: Box) -> tuple[Buffer, Box, bool]:
        region = src_regions.get(device)
        if region is not None and contains(region, box):
            local = relative(box, region)
            return Buffer.SRC, local, not is_contiguous(local, box_shape(region))
        region = dst_regions.get(device)
        if region is None or not contains(region, box):
            raise ValueError(f"device {device} holds {box} in neither its source nor its destination shard")
        local = relative(box, region)
        return Buffer.DST, local, not is_contiguous(local, box_shape(region))

    def write_of(device: int, box: Box) -> tuple[Box, bool]:
        region = dst_regions.get(device)
        if region is None or not contains(region, box):
            raise ValueError(f"device {device} receives {box} outside its destination shard {region}")
        local = relative(box, region)
        return local, not is_contiguous(local, box_shape(region))

    def stage(device: int, strided: bool, box: Box) -> int | None:
        if not strided:
            return None
        staging[device] = max(staging[device], box_volume(box) * item)
        return 0

    for step, t in enumerate(plan.transfers):
        if t.kind is TransferKind.COPY:
            buffer, read, _ = read_of(t.src, t.box)
            write, _ = write_of(t.src, t.box)
            ops[t.src].append(Copy(step, buffer, read, write))
            continue
        buffer, read, strided = read_of(t.src, t.box)
        at = stage(t.src, strided, t.box)
        if t.kind is TransferKind.SEND:
            ops[t.src].append(Send(step, t.group, buffer, read, at))
        else:
            ops[t.src].append(Broadcast(step, t.group, buffer, read, None, at))
        for r in t.dsts:
            write, strided = write_of(r, t.box)
            at = stage(r, strided, t.box)
            if t.kind is TransferKind.SEND:
                ops[r].append(Recv(step, t.group, write, at))
            else:
                ops[r].append(Broadcast(step, t.group, None, None, write, at))

    programs = tuple(
        DeviceProgram(
            d,
            box_shape(src_regions[d]) if d in src_regions else None,
            box_shape(dst_regions[d]) if d in dst_regions else None,
            tuple(ops[d]),
            staging[d],
            first_use_groups(ops[d]),
        )
        for d in sorted(ops)
    )
    return Program(plan.dtype, plan.shape, programs)

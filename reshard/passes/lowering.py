"""Lowering: a plan becomes one program per device (``reshard.ir.program``).

Every device gets the ops of the plan's transfers it takes part in, in the plan's global transfer
order, so two groups never wait on each other in opposite orders; its groups are connected in
order of first use. A slice that is strided in its buffer passes through the device's staging
buffer (one op at a time here, so every staged op uses offset 0), and so does every received
contribution that is combined into a box. Order and overlap beyond that are decided later
(``reshard.passes.sequencing``). Contributions combine by the source's reduce op (``avg`` by summing, then
``Scale``).
"""

from __future__ import annotations

from reshard.dtypes import itemsize
from reshard.ir.placement import ReduceOp
from reshard.ir.plan import ReshardPlan, TransferKind
from reshard.ir.program import (
    Broadcast,
    Buffer,
    Copy,
    DeviceProgram,
    Op,
    Program,
    Recv,
    Scale,
    Send,
    first_use_groups,
)
from reshard.ir.regions import Box, box_shape, box_volume, contains, device_regions, is_contiguous, relative
from reshard.ir.tasks import zero_devices


def lower_plan(plan: ReshardPlan) -> Program:
    """One program per device of the source and destination meshes."""
    src_regions = device_regions(plan.src, plan.shape)
    dst_regions = device_regions(plan.dst, plan.shape)
    ops: dict[int, list[Op]] = {d: [] for d in (*plan.src.mesh.device_ids, *plan.dst.mesh.device_ids)}
    staging: dict[int, int] = dict.fromkeys(ops, 0)
    tmp: set[int] = set()
    item = itemsize(plan.dtype)
    op = plan.reduce_op
    combine = ReduceOp.SUM if op is ReduceOp.AVG else op
    regions = {Buffer.SRC: src_regions, Buffer.TMP: src_regions, Buffer.DST: dst_regions}

    def local(device: int, buffer: Buffer, box: Box, what: str) -> tuple[Box, bool]:
        region = regions[buffer].get(device)
        if region is None or not contains(region, box):
            raise ValueError(f"device {device} {what} {box} outside its {buffer.name.lower()} buffer ({region})")
        if buffer is Buffer.TMP:
            tmp.add(device)
        box = relative(box, region)
        return box, not is_contiguous(box, box_shape(region))

    def read_of(device: int, box: Box, buffer: Buffer | None) -> tuple[Buffer, Box, bool]:
        if buffer is None:
            region = src_regions.get(device)
            buffer = Buffer.SRC if region is not None and contains(region, box) else Buffer.DST
        return (buffer, *local(device, buffer, box, "reads"))

    def write_of(device: int, box: Box, target: Buffer) -> tuple[Box, bool]:
        return local(device, target, box, "writes")

    def stage(device: int, strided: bool, box: Box) -> int | None:
        if not strided:
            return None
        staging[device] = max(staging[device], box_volume(box) * item)
        return 0

    for step, t in enumerate(plan.transfers):
        reduce = combine if t.reduce else None
        if t.kind is TransferKind.SCALE:
            write, _ = write_of(t.src, t.box, Buffer.DST)
            ops[t.src].append(Scale(step, write, len(plan.tasks[t.task].contributions)))
            continue
        buffer, read, strided = read_of(t.src, t.box, t.read)
        if t.kind is TransferKind.COPY:
            write, _ = write_of(t.src, t.box, t.write)
            ops[t.src].append(Copy(step, buffer, read, write, t.write, reduce))
            continue
        at = stage(t.src, strided, t.box)
        if t.kind is TransferKind.SEND:
            ops[t.src].append(Send(step, t.group, buffer, read, at))
        else:
            ops[t.src].append(Broadcast(step, t.group, buffer, read, None, at))
        for r in t.dsts:
            write, strided = write_of(r, t.box, t.write)
            at = stage(r, strided or reduce is not None, t.box)
            if t.kind is TransferKind.SEND:
                ops[r].append(Recv(step, t.group, write, at, t.write, reduce))
            else:
                ops[r].append(Broadcast(step, t.group, None, None, write, at))

    zeros = set(zero_devices(plan.dst.for_shape(plan.shape)))
    programs = tuple(
        DeviceProgram(
            d,
            box_shape(src_regions[d]) if d in src_regions else None,
            box_shape(dst_regions[d]) if d in dst_regions else None,
            tuple(ops[d]),
            staging[d],
            first_use_groups(ops[d]),
            tmp=d in tmp,
            zero_dst=d in zeros,
        )
        for d in sorted(ops)
    )
    return Program(plan.dtype, plan.shape, programs)

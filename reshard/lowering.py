"""Lowering: a plan becomes one program per device, each an ordered list of ops.

Every device runs its ops in the plan's global transfer order, so two groups never wait on each
other in opposite orders. Ops name devices by global id and buffers by local slices; the
executor only interprets them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from reshard.plan import ReshardPlan, TransferKind
from reshard.regions import Box, box_shape, box_volume, contains, is_contiguous, layout_regions, relative


class OpKind(enum.IntEnum):
    COPY = 0  # read SRC slice, write DST slice on this device
    SEND = 1  # read, send to group[1]
    RECV = 2  # receive from group[0], write
    BROADCAST = 3  # broadcast over group from group[0]; the root reads, the others write
    PULL = 4  # copy ``read`` of group[0]'s SRC shard into this device's DST slice ``write``, through
    #           shared memory (group is (holder, self); the holder runs no op, see ``reshard.pulls``)


class Buffer(enum.IntEnum):
    SRC = 0  # this device's shard of the source tensor
    DST = 1  # this device's shard of the destination tensor


@dataclass(frozen=True, slots=True)
class Op:
    """One step of one device. ``read``/``write`` are local slices of SRC/DST buffers.

    ``stage`` says that the slice is not contiguous in its buffer, so the executor passes the
    data through its staging buffer.
    """

    kind: OpKind
    step: int
    group: tuple[int, ...]
    shape: tuple[int, ...]
    read_buffer: Buffer | None = None
    read: Box | None = None
    write: Box | None = None
    stage: bool = False

    @property
    def numel(self) -> int:
        return box_volume(tuple((0, n) for n in self.shape))

    def to_obj(self) -> list:
        return [
            int(self.kind), self.step, list(self.group), list(self.shape),
            None if self.read_buffer is None else int(self.read_buffer),
            None if self.read is None else [list(iv) for iv in self.read],
            None if self.write is None else [list(iv) for iv in self.write],
            self.stage,
        ]  # fmt: skip

    @classmethod
    def from_obj(cls, obj) -> Op:
        kind, step, group, shape, rbuf, read, write, stage = obj
        return cls(
            OpKind(kind), step, tuple(group), tuple(shape),
            None if rbuf is None else Buffer(rbuf),
            None if read is None else tuple(tuple(iv) for iv in read),
            None if write is None else tuple(tuple(iv) for iv in write),
            stage,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class DeviceProgram:
    """What one device runs: its ops in global order, its buffer shapes and its staging size."""

    device: int
    src_shape: tuple[int, ...] | None  # None: the device holds no source shard
    dst_shape: tuple[int, ...] | None  # None: the device receives no destination shard
    ops: tuple[Op, ...]
    staging_numel: int

    def to_obj(self) -> list:
        shapes = [None if s is None else list(s) for s in (self.src_shape, self.dst_shape)]
        return [self.device, *shapes, [op.to_obj() for op in self.ops], self.staging_numel]

    @classmethod
    def from_obj(cls, obj) -> DeviceProgram:
        device, src, dst, ops, staging = obj
        shapes = [None if s is None else tuple(s) for s in (src, dst)]
        return cls(device, *shapes, tuple(Op.from_obj(o) for o in ops), staging)


@dataclass(frozen=True, slots=True)
class Program:
    """The lowered plan: one program per participating device."""

    dtype: str
    shape: tuple[int, ...]
    devices: tuple[DeviceProgram, ...]

    def for_device(self, device: int) -> DeviceProgram:
        for p in self.devices:
            if p.device == device:
                return p
        raise KeyError(f"device {device} takes no part in this program")

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Distinct communicator groups (ordered device tuples) the program uses."""
        seen = {}
        for p in self.devices:
            for op in p.ops:
                if op.kind in (OpKind.SEND, OpKind.RECV, OpKind.BROADCAST):
                    seen.setdefault(_group_key(op), None)
        return tuple(seen)


def _group_key(op: Op) -> tuple[int, ...]:
    """Communicators are keyed by sorted device tuple: a pair or broadcast set shares one."""
    return tuple(sorted(op.group))


def lower_plan(plan: ReshardPlan) -> Program:
    """One program per device of the source and destination meshes."""
    src_regions = dict(zip(plan.src.mesh.device_ids, layout_regions(plan.src, plan.shape), strict=True))
    dst_regions = dict(zip(plan.dst.mesh.device_ids, layout_regions(plan.dst, plan.shape), strict=True))
    ops: dict[int, list[Op]] = {d: [] for d in (*plan.src.mesh.device_ids, *plan.dst.mesh.device_ids)}
    staging: dict[int, int] = dict.fromkeys(ops, 0)

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

    for step, t in enumerate(plan.transfers):
        shape = box_shape(t.box)
        numel = box_volume(t.box)
        if t.kind is TransferKind.COPY:
            rbuf, read, _ = read_of(t.src, t.box)
            write, _ = write_of(t.src, t.box)
            ops[t.src].append(Op(OpKind.COPY, step, (t.src,), shape, rbuf, read, write))
            continue
        rbuf, read, stage = read_of(t.src, t.box)
        root_kind = OpKind.SEND if t.kind is TransferKind.SEND else OpKind.BROADCAST
        ops[t.src].append(Op(root_kind, step, t.group, shape, rbuf, read, None, stage))
        if stage:
            staging[t.src] = max(staging[t.src], numel)
        peer_kind = OpKind.RECV if t.kind is TransferKind.SEND else OpKind.BROADCAST
        for r in t.dsts:
            write, stage = write_of(r, t.box)
            ops[r].append(Op(peer_kind, step, t.group, shape, None, None, write, stage))
            if stage:
                staging[r] = max(staging[r], numel)

    programs = tuple(
        DeviceProgram(
            d,
            box_shape(src_regions[d]) if d in src_regions else None,
            box_shape(dst_regions[d]) if d in dst_regions else None,
            tuple(ops[d]),
            staging[d],
        )
        for d in sorted(ops)
    )
    return Program(plan.dtype, plan.shape, programs)

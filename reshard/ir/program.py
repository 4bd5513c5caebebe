"""Programs: what every device runs in one reshard, as data.

A ``Program`` holds one ``DeviceProgram`` per participating device. A device program says

- ``connect``: the communicator groups to set up before the first op, in an order all members
  share (eager connection setup of overlapping groups in different orders deadlocks);
- ``ops``: its ops in execution order, issued in ``windows`` (the ops of a window are issued
  together, then waited for; no windows: one op at a time);
- ``background``: local ops that run on a helper thread while ``ops`` run (joined at the end);
- ``staging_bytes``: the one staging buffer its strided slices pass through (each such op names
  its byte offset in it).

Ops are a small tagged union: ``Copy``, ``Pull``, ``Scale`` and ``Publish`` are local (a pull reads a
peer's source shard through shared memory, or a box of its destination shard once the peer has
published it: a relay inside one machine); ``Send``, ``Recv`` and ``Broadcast`` are messages over a
group, named root first. Receiving ops may combine (``reduce``) what arrives with what their target box
holds: contributions of a Partial source, combined in the destination shard or in a scratch buffer
(``Buffer.TMP``, the shape of the source shard). Every op carries the plan step it serves (the
global issue order), devices by global id and buffers by local boxes. Lowering
(``reshard.passes.lowering``), pulls (``reshard.passes.pulls``) and sequencing (``reshard.passes.sequencing``) build
programs, ``reshard.passes.validate`` checks them, and the runtime's executor only interprets them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import cast

from reshard.ir.placement import ReduceOp
from reshard.ir.regions import Box, box_shape, box_volume

Group = tuple[int, ...]


class Buffer(enum.IntEnum):
    SRC = 0  # this device's shard of the source tensor
    DST = 1  # this device's shard of the destination tensor
    TMP = 2  # scratch of the source shard's shape, where a device combines contributions (Partial)


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy box ``read`` of this device's ``buffer`` into box ``write`` of its ``target`` buffer
    (combining with what is there by ``reduce``, when set)."""

    step: int
    buffer: Buffer
    read: Box
    write: Box
    target: Buffer = Buffer.DST
    reduce: ReduceOp | None = None


@dataclass(frozen=True, slots=True)
class Pull:
    """Copy box ``read`` of device ``holder``'s ``buffer`` (shared memory) into box ``write`` of
    this device's ``target`` buffer (combining by ``reduce``, when set). A source shard is whole
    before the reshard starts; a destination shard's box (a relay) is read once the holder's
    ``after``-th ``Publish`` ran."""

    step: int
    holder: int
    read: Box
    write: Box
    target: Buffer = Buffer.DST
    reduce: ReduceOp | None = None
    buffer: Buffer = Buffer.SRC
    after: int = 0

    def __post_init__(self):
        if (self.buffer is Buffer.DST) != (self.after > 0) or self.buffer is Buffer.TMP:
            raise ValueError(f"a pull reads a source shard, or a destination shard after a publication: {self}")


@dataclass(frozen=True, slots=True)
class Publish:
    """Tell the devices that pull from this one that box ``box`` of its destination shard is
    complete: its ``count``-th publication (counted from 1 in each run). It runs once every earlier
    window of this device, and every op before it in its own window, completed (the window's later
    messages are in flight meanwhile); ``step`` is the relay it serves."""

    step: int
    box: Box
    count: int


@dataclass(frozen=True, slots=True)
class Scale:
    """Divide box ``write`` of the destination shard by ``divisor`` (a Partial avg, once summed)."""

    step: int
    write: Box
    divisor: int


@dataclass(frozen=True, slots=True)
class Send:
    """Send box ``read`` of ``buffer`` to ``group[1]``; ``group`` is (this device, peer).
    ``staging``: byte offset in the staging buffer when the slice is strided, else None."""

    step: int
    group: Group
    buffer: Buffer
    read: Box
    staging: int | None = None


@dataclass(frozen=True, slots=True)
class Recv:
    """Receive from ``group[0]`` into box ``write`` of the ``target`` buffer; ``group`` is (peer,
    this device). With ``reduce`` the data lands in staging and is combined into the box."""

    step: int
    group: Group
    write: Box
    staging: int | None = None
    target: Buffer = Buffer.DST
    reduce: ReduceOp | None = None


@dataclass(frozen=True, slots=True)
class Broadcast:
    """One broadcast over ``group`` from ``group[0]``: the root reads box ``read`` of ``buffer``,
    every other member writes box ``write``."""

    step: int
    group: Group
    buffer: Buffer | None = None
    read: Box | None = None
    write: Box | None = None
    staging: int | None = None

    def __post_init__(self):
        if (self.read is None) == (self.write is None):
            raise ValueError(f"a broadcast op either reads (root) or writes (receiver): {self}")


Op = Copy | Pull | Scale | Publish | Send | Recv | Broadcast
"""One step of a device program: a local op (``Copy``, ``Pull``, ``Scale``, ``Publish``) or a
message (``Send``, ``Recv``, ``Broadcast``)."""
LOCAL_OPS = (Copy, Pull, Scale, Publish)
MESSAGE_OPS = (Send, Recv, Broadcast)


def group_of(devices) -> Group:
    """The communicator of a set of devices: their sorted tuple (a device's rank is its index)."""
    return tuple(sorted(int(d) for d in devices))


def op_box(op: Op) -> Box:
    """The box an op moves (what it reads, or for receivers what they write)."""
    if isinstance(op, Recv | Scale):
        return op.write
    if isinstance(op, Publish):
        return op.box
    if isinstance(op, Broadcast):  # exactly one of read and write is set (checked on construction)
        return cast(Box, op.write if op.read is None else op.read)
    return op.read


def op_shape(op: Op) -> tuple[int, ...]:
    return box_shape(op_box(op))


def op_numel(op: Op) -> int:
    return box_volume(op_box(op))


def reads_output(op: Op) -> Buffer | None:
    """The buffer an op reads that ops of the same program write (destination or scratch):
    what it sends or copies from there, the box it combines into, scales or publishes. None: none
    (a pull of a peer's destination shard reads the peer's)."""
    buffer = getattr(op, "buffer", None)
    if buffer in (Buffer.DST, Buffer.TMP) and not isinstance(op, Pull):
        return buffer
    if isinstance(op, Scale | Publish):
        return Buffer.DST
    if isinstance(op, Copy | Pull | Recv) and op.reduce is not None:
        return op.target
    return None


def writes(op: Op) -> tuple[Buffer, Box] | None:
    """The buffer and box an op writes, or None."""
    box = getattr(op, "write", None)
    return None if box is None else (getattr(op, "target", Buffer.DST), box)


@dataclass(frozen=True, slots=True)
class DeviceProgram:
    """What one device runs of a reshard: its ``ops`` in order (local copies and pulls, then
    messages in the global step order), the groups it ``connect``s, its ``staging_bytes``.
    ``src_shape``/``dst_shape``: its source and destination shard shapes, None when it holds no
    such shard."""

    device: int
    src_shape: tuple[int, ...] | None
    dst_shape: tuple[int, ...] | None
    ops: tuple[Op, ...]
    staging_bytes: int = 0
    connect: tuple[Group, ...] = ()
    windows: tuple[int, ...] = ()
    background: tuple[Op, ...] = ()
    tmp: bool = False  # a scratch buffer of ``src_shape`` (Buffer.TMP) for combining contributions
    zero_dst: bool = False  # the destination starts as zeros (a Partial destination's other devices)
    relays: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (holder, its destination shape) it pulls relays from

    def __post_init__(self):
        if self.windows and (sum(self.windows) != len(self.ops) or min(self.windows) < 1):
            raise ValueError(f"device {self.device}: windows {self.windows} do not cover its {len(self.ops)} ops")

    @property
    def issue_windows(self) -> tuple[tuple[Op, ...], ...]:
        """``ops`` cut into their issue windows."""
        if not self.windows:
            return tuple((op,) for op in self.ops)
        out, start = [], 0
        for n in self.windows:
            out.append(self.ops[start : start + n])
            start += n
        return tuple(out)

    @property
    def all_ops(self) -> tuple[Op, ...]:
        return self.ops + self.background

    @property
    def holders(self) -> tuple[int, ...]:
        """Devices whose source shards this device pulls from."""
        return tuple(sorted({op.holder for op in self.all_ops if isinstance(op, Pull) and op.buffer is Buffer.SRC}))

    @property
    def publishes(self) -> bool:
        """Whether peers pull relays out of this device's destination shard."""
        return any(isinstance(op, Publish) for op in self.ops)


@dataclass(frozen=True, slots=True)
class Program:
    """The lowered plan of a ``dtype`` tensor of ``shape``: one program per participating device."""

    dtype: str
    shape: tuple[int, ...]
    devices: tuple[DeviceProgram, ...]

    def for_device(self, device: int) -> DeviceProgram:
        for p in self.devices:
            if p.device == device:
                return p
        raise KeyError(f"device {device} takes no part in this program")

    @property
    def groups(self) -> tuple[Group, ...]:
        """Every communicator the program connects (sorted device tuples), each once."""
        return tuple(dict.fromkeys(g for p in self.devices for g in p.connect))

    @property
    def pull_sources(self) -> dict[int, tuple[int, ...]]:
        """``{device: devices whose source shards it pulls}``, for the devices that pull."""
        return {p.device: p.holders for p in self.devices if p.holders}

    @property
    def relay_sources(self) -> dict[int, tuple[int, ...]]:
        """``{device: devices whose destination shards it pulls relays from}``."""
        return {p.device: tuple(h for h, _ in p.relays) for p in self.devices if p.relays}


def first_use_groups(ops) -> tuple[Group, ...]:
    """The communicators of ``ops`` in order of first use."""
    return tuple(dict.fromkeys(group_of(op.group) for op in ops if isinstance(op, MESSAGE_OPS)))

"""Batch programs: what every device runs to move many tensors in one reshard (a model's state dict).

A batch holds one ``Part`` per tensor a device takes part in: that tensor's ``DeviceProgram``
(``reshard.ir.program``), whose buffers are the tensor's source and destination shards. The messages
of small tensors do not stay in their parts: ``reshard.passes.packing`` packs every slice one device sends
another (or one broadcast group shares) into ``Bucket`` messages, each a run of ``Piece``s laid out
side by side in one byte buffer. A device runs its buckets first, in the batch's global bucket
order, issued in ``windows``; then its parts, one after the other in tensor order, each as a single
reshard runs. Every device's messages thus follow one global order (buckets, then tensor by tensor
in step order), and the batch is deadlock free as each single program is.
"""

from __future__ import annotations

from dataclasses import dataclass

from reshard.ir.program import DeviceProgram, Group
from reshard.ir.regions import Box, box_volume

#: Bucket offsets are multiples of this, so that every piece can be viewed with its own dtype.
PIECE_ALIGN = 16


@dataclass(frozen=True, slots=True)
class Piece:
    """One slice in a bucket: ``box`` of this device's shard of tensor ``tensor`` (its source
    shard on the bucket's sender, its destination shard on a receiver), at byte ``offset`` of the
    bucket; ``step``: the step of the tensor's plan it serves."""

    tensor: int
    step: int
    box: Box
    offset: int
    nbytes: int

    def __post_init__(self):
        if self.offset % PIECE_ALIGN or self.offset < 0 or self.nbytes < 0:
            raise ValueError(f"piece {self}: offset must be a multiple of {PIECE_ALIGN} and sizes >= 0")


@dataclass(frozen=True, slots=True)
class Bucket:
    """One packed message over ``group`` (sender first; two members: a send and a receive, more:
    a broadcast) carrying ``nbytes``. ``pieces``: what this device reads into it (the sender) or
    writes out of it (a receiver); ``staging``: the bucket's byte offset in the device's staging
    buffer; ``step``: its place in the batch's global bucket order."""

    step: int
    group: Group
    pieces: tuple[Piece, ...]
    nbytes: int
    staging: int = 0

    def __post_init__(self):
        if len(set(self.group)) != len(self.group) or len(self.group) < 2:
            raise ValueError(f"bucket {self.step}: group {self.group} needs two or more distinct devices")
        end = max((p.offset + p.nbytes for p in self.pieces), default=0)
        if end > self.nbytes:
            raise ValueError(f"bucket {self.step}: its pieces reach byte {end} of {self.nbytes}")


@dataclass(frozen=True, slots=True)
class Part:
    """Tensor ``tensor`` (of ``dtype``) on one device: its program, less the messages packed."""

    tensor: int
    dtype: str
    program: DeviceProgram


@dataclass(frozen=True, slots=True)
class BatchDeviceProgram:
    """What one device runs in a batch (module docstring). ``connect``: every group of its buckets
    and parts, in an order all members share; ``staging_bytes``: the staging its buckets use
    (windows side by side), its parts reuse the same buffer one after the other."""

    device: int
    parts: tuple[Part, ...]
    buckets: tuple[Bucket, ...] = ()
    windows: tuple[int, ...] = ()
    staging_bytes: int = 0
    connect: tuple[Group, ...] = ()

    def __post_init__(self):
        if self.windows and (sum(self.windows) != len(self.buckets) or min(self.windows) < 1):
            raise ValueError(
                f"device {self.device}: windows {self.windows} do not cover its {len(self.buckets)} buckets"
            )
        tensors = [p.tensor for p in self.parts]
        if tensors != sorted(set(tensors)):
            raise ValueError(f"device {self.device}: parts must be in tensor order, each once: {tensors}")

    @property
    def issue_windows(self) -> tuple[tuple[Bucket, ...], ...]:
        if not self.windows:
            return tuple((b,) for b in self.buckets)
        out, start = [], 0
        for n in self.windows:
            out.append(self.buckets[start : start + n])
            start += n
        return tuple(out)

    @property
    def apart(self) -> tuple[bool, ...]:
        """By window: whether its staging lies apart from the window before's (the first: False);
        ``reshard.passes.packing``'s double buffering makes every one so."""
        windows = self.issue_windows
        out = [False] * len(windows)
        for w in range(1, len(windows)):
            before = [(b.staging, b.staging + b.nbytes) for b in windows[w - 1]]
            out[w] = not any(a < b.staging + b.nbytes and b.staging < e for a, e in before for b in windows[w])
        return tuple(out)

    @property
    def packed_ahead(self) -> tuple[bool, ...]:
        """By window: whether the device may pack it while the window before moves (it sends in
        it, and its staging lies apart from the window before's)."""
        return tuple(
            apart and any(b.group[0] == self.device for b in window)
            for window, apart in zip(self.issue_windows, self.apart, strict=True)
        )

    @property
    def unpacked_behind(self) -> tuple[bool, ...]:
        """By window: whether the device may unpack it while the next window moves (it receives in
        it, and the next window's staging lies apart from its own)."""
        windows, apart = self.issue_windows, self.apart
        return tuple(
            w + 1 < len(windows) and apart[w + 1] and any(b.group[0] != self.device for b in window)
            for w, window in enumerate(windows)
        )

    def part(self, tensor: int) -> Part | None:
        for p in self.parts:
            if p.tensor == tensor:
                return p
        return None

    @property
    def publishes(self) -> bool:
        return any(p.program.publishes for p in self.parts)


@dataclass(frozen=True, slots=True)
class BatchProgram:
    """A batch of tensors of ``shapes`` and ``dtypes`` (by tensor index): one program per device."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    devices: tuple[BatchDeviceProgram, ...]

    def for_device(self, device: int) -> BatchDeviceProgram:
        for p in self.devices:
            if p.device == device:
                return p
        raise KeyError(f"device {device} takes no part in this batch")

    @property
    def groups(self) -> tuple[Group, ...]:
        return tuple(dict.fromkeys(g for p in self.devices for g in p.connect))

    @property
    def buckets(self) -> int:
        """Bucket messages in the batch."""
        return len({b.step for p in self.devices for b in p.buckets})


def piece_bytes(box: Box, item: int) -> int:
    return box_volume(box) * item


def aligned(n: int) -> int:
    return -(-n // PIECE_ALIGN) * PIECE_ALIGN

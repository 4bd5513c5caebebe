"""Packing: the messages of a batch's small tensors become bucket messages (``reshard.ir.batch``).

A tensor is packed when none of its messages moves more than ``bucket_bytes`` and its program only
moves plain slices: every message reads the sender's source shard and lands in the receivers' destination
shards as it is (no message forwards what it received, no Partial contribution combined, no
scaling). A relay inside a machine stays as it is: the relaying device publishes the slice when
its part runs, after all its buckets landed, and its peers pull it in their part of that tensor
(every device runs its parts in tensor order, so nobody waits for a later tensor). Its messages are then
grouped by their group (a sender and a receiver, or a broadcast group), in tensor and step order,
and each group's slices are cut into buckets of at most ``bucket_bytes``; the buckets of all groups
go in one global order of host-disjoint rounds (``_rounds``), so that buckets issued together use
different links. What is left of a
packed tensor's program are its local copies and pulls.

Other tensors keep their programs as compiled: big ones stream as single reshards do, and so do
small ones whose slices depend on each other.

A device issues its buckets in windows (``window_ops`` buckets at most, and per direction of its
link at most ``window_bytes`` together, or one bigger bucket alone), as ``reshard.passes.sequencing``
windows a single program's messages; a window's buckets sit side by side in its staging buffer.
Double-buffered (``double_buffer``, GPU targets), the windows alternate between two regions of the
staging buffer, each bound by half of ``window_staging_bytes``: no window shares a byte of staging
with the one before, so a device may pack a window while the one before it moves, and unpack one
while the next moves.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import replace

from reshard.dtypes import itemsize
from reshard.ir.batch import BatchDeviceProgram, BatchProgram, Bucket, Part, Piece, aligned, piece_bytes
from reshard.ir.program import (
    LOCAL_OPS,
    MESSAGE_OPS,
    Buffer,
    DeviceProgram,
    Group,
    Program,
    Scale,
    group_of,
    op_box,
    op_numel,
    reads_output,
)
from reshard.ir.regions import Box
from reshard.ir.target import BUCKET_BYTES
from reshard.passes.sequencing import IN, OUT, WINDOW_BYTES, WINDOW_STAGING_BYTES


def packable(program: Program, bucket_bytes: int) -> bool:
    """Whether ``program``'s messages may be packed (module docstring): every message reads the
    sender's source shard and lands as it is in a destination shard. Relays through shared memory
    stay: a device publishes what its buckets brought it when its part runs, after every bucket."""
    item = itemsize(program.dtype)
    messages = False
    for p in program.devices:
        if p.tmp:
            return False
        for op in p.all_ops:
            if isinstance(op, Scale) or getattr(op, "reduce", None) is not None:
                return False
            if isinstance(op, MESSAGE_OPS) and (
                reads_output(op) is not None or getattr(op, "buffer", None) is Buffer.DST
            ):
                return False
            if getattr(op, "target", Buffer.DST) is not Buffer.DST:
                return False
            if isinstance(op, MESSAGE_OPS):
                if op_numel(op) * item > bucket_bytes:
                    return False  # a slice that fills a message on its own: the tensor streams
                messages = True
    return messages


def pack_batch(
    programs: Sequence[Program],
    *,
    bucket_bytes: int = BUCKET_BYTES,
    window_ops: int = 1,
    window_bytes: int = WINDOW_BYTES,
    window_staging_bytes: int = WINDOW_STAGING_BYTES,
    double_buffer: bool = False,
    hosts: Mapping[int, int] | None = None,
) -> BatchProgram:
    """One ``BatchProgram`` for the tensors whose single programs are ``programs`` (sequenced, by
    tensor index), with the messages of the packable ones in buckets, their windows double-buffered
    where ``double_buffer`` (module docstring); ``hosts`` maps devices to the hosts whose links the
    buckets share (default: every device its own)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    # tensors of one shape and layouts share one compiled program (``compile``'s cache): each
    # distinct one is judged and stripped once, and its parts keep sharing it (encoded once)
    judged: dict[int, bool] = {}
    stripped: dict[int, DeviceProgram] = {}
    packed = set()
    for t, prog in enumerate(programs):
        ok = judged.get(id(prog))
        if ok is None:
            ok = judged[id(prog)] = packable(prog, bucket_bytes)
        if ok:
            packed.add(t)
    buckets = _buckets(programs, sorted(packed), bucket_bytes, hosts)
    parts: dict[int, list[Part]] = defaultdict(list)
    for t, prog in enumerate(programs):
        for p in prog.devices:
            if not (p.ops or p.background or p.dst_shape is not None):
                continue
            if t in packed:
                if id(p) not in stripped:
                    stripped[id(p)] = _strip(p)
                p = stripped[id(p)]
            parts[p.device].append(Part(t, prog.dtype, p))
    mine: dict[int, list[Bucket]] = defaultdict(list)
    for step, (group, slices, nbytes) in enumerate(buckets):
        for d in group:
            pieces = tuple(Piece(t, s, boxes[d], offset, n) for t, s, boxes, offset, n in slices)
            mine[d].append(Bucket(step, group, pieces, nbytes))
    devices = []
    for d in sorted(set(parts) | set(mine)):
        ordered, windows, staging = _windows(mine[d], d, window_ops, window_bytes, window_staging_bytes, double_buffer)
        connect = [group_of(b.group) for b in ordered]
        for part in parts[d]:
            connect += part.program.connect
        devices.append(
            BatchDeviceProgram(d, tuple(parts[d]), tuple(ordered), windows, staging, tuple(dict.fromkeys(connect)))
        )
    return BatchProgram(tuple(p.shape for p in programs), tuple(p.dtype for p in programs), tuple(devices))


def _strip(p: DeviceProgram) -> DeviceProgram:
    """``p`` without its messages: its local ops, one at a time (nothing left to overlap them with)."""
    local = tuple(op for op in p.all_ops if isinstance(op, LOCAL_OPS))
    return replace(p, ops=local, background=(), windows=(), staging_bytes=0, connect=())


def _buckets(programs: Sequence[Program], packed: list[int], bucket_bytes: int, hosts: Mapping[int, int] | None):
    """The batch's buckets in global order (``_rounds``): ``(group, slices, nbytes)``, each slice
    ``(tensor, step, {device: box}, offset, nbytes)``."""
    streams: dict[Group, list[tuple[int, int, dict[int, Box], int]]] = defaultdict(list)
    alike: dict[tuple[int, str], list] = {}  # tensors that share a program (and dtype) send alike
    for t in packed:
        prog = programs[t]
        key = (id(prog), prog.dtype)
        messages = alike.get(key)
        if messages is None:
            messages = alike[key] = _messages(prog)
        for group, step, boxes, nbytes in messages:
            streams[group].append((t, step, boxes, nbytes))
    chunked = [(group, deque(_chunks(items, bucket_bytes))) for group, items in sorted(streams.items())]
    return _rounds(chunked, hosts or {})


def _messages(prog: Program) -> list[tuple[Group, int, dict[int, Box], int]]:
    """A tensor's messages in step order: ``(group, step, {device: box}, nbytes)``, those of no
    bytes left out."""
    item = itemsize(prog.dtype)
    by_step: dict[int, dict[int, object]] = defaultdict(dict)
    for p in prog.devices:
        for op in p.all_ops:
            if isinstance(op, MESSAGE_OPS):
                by_step[op.step][p.device] = op
    out = []
    for step in sorted(by_step):
        ops = by_step[step]
        group = next(iter(ops.values())).group  # type: ignore[attr-defined]
        boxes = {d: op_box(op) for d, op in ops.items()}  # type: ignore[arg-type]
        nbytes = piece_bytes(next(iter(boxes.values())), item)
        if nbytes:
            out.append((tuple(group), step, boxes, nbytes))
    return out


def _rounds(chunked: list, hosts: Mapping[int, int]) -> list:
    """The buckets of every group in rounds: a round takes the next bucket of each group in turn
    (starting one group later each round) as long as its sender's host sends nothing else in the
    round and its receivers' hosts receive nothing else (the paper's host-disjoint rounds), so that
    the buckets issued together use distinct links; a round takes at least one bucket."""
    out = []
    start = 0
    while any(q for _, q in chunked):
        sending: set[int] = set()
        receiving: set[int] = set()
        n = len(chunked)
        for k in range(n):
            group, q = chunked[(start + k) % n]
            if not q:
                continue
            src = hosts.get(group[0], group[0])
            dst = {hosts.get(d, d) for d in group[1:]} - {src}
            if (src in sending or dst & receiving) and (sending or receiving):
                continue
            slices, nbytes = q.popleft()
            out.append((group, slices, nbytes))
            sending.add(src)
            receiving |= dst
        start += 1
    return out


def _chunks(items, bucket_bytes: int) -> list[tuple[list, int]]:
    """``items`` cut into buckets of at most ``bucket_bytes`` (a slice alone may be bigger), each
    slice at an aligned offset: ``[(slices, nbytes)]``."""
    out: list[tuple[list, int]] = []
    current: list = []
    end = 0
    for t, step, boxes, nbytes in items:
        start = aligned(end)
        if current and start + nbytes > bucket_bytes:
            out.append((current, end))
            current, start = [], 0
        current.append((t, step, boxes, start, nbytes))
        end = start + nbytes
    if current:
        out.append((current, end))
    return out


def _directions(bucket: Bucket, device: int) -> tuple[int, ...]:
    """The directions of the device's link a bucket takes up: a receiver of a send takes in; the
    sender, and every member of a broadcast (gloo forwards along a tree), both (as a single
    program's sends of their own source do, ``reshard.passes.sequencing``)."""
    if len(bucket.group) == 2 and bucket.group[1] == device:
        return (IN,)
    return (OUT, IN)


def _windows(buckets: list[Bucket], device: int, most: int, moved_bound: int, staging_bound: int, double: bool):
    """``(buckets with staging offsets, window lengths or () for one at a time, staging bytes)``;
    ``double``: odd windows lie after the even ones' region (module docstring)."""
    if most == 1 and not double:
        return buckets, (), max((b.nbytes for b in buckets), default=0)
    bound = staging_bound // 2 if double else staging_bound
    out: list[Bucket] = []
    lengths: list[int] = []
    used = 0
    ends = [0, 0]  # the staging each parity of window reaches
    moved = [0, 0]
    carried = [0, 0]
    for b in buckets:
        dirs = _directions(b, device)
        start = aligned(used)
        full = lengths and (
            lengths[-1] >= most
            or start + b.nbytes > max(bound, b.nbytes)
            or any(carried[d] and moved[d] + b.nbytes > moved_bound for d in dirs)
        )
        if full or not lengths:
            lengths.append(0)
            start = used = 0
            moved, carried = [0, 0], [0, 0]
        out.append(replace(b, staging=start))
        used = start + b.nbytes
        parity = (len(lengths) - 1) % 2 if double else 0
        ends[parity] = max(ends[parity], used)
        for d in dirs:
            moved[d] += b.nbytes
            carried[d] += 1
        lengths[-1] += 1
    if not double or len(lengths) < 2:
        return out, tuple(lengths), max(ends)
    shift = aligned(ends[0])
    at = 0
    for w, n in enumerate(lengths):
        if w % 2:
            out[at : at + n] = [replace(b, staging=b.staging + shift) for b in out[at : at + n]]
        at += n
    return out, tuple(lengths), shift + ends[1]

"""Running a batch program (``reshard.ir.batch``): its buckets, then its parts, exactly as written.

A sender copies each piece of a bucket out of its source shard into the bucket's bytes in the
staging buffer and sends them; a receiver receives the bytes there and copies each piece into its
destination shard. Buckets are issued window by window (inside one backend batch when the backend
batches), then waited for in order. Then each part runs as a single program does
(``reshard.runtime.device.executor``), one after the other in tensor order.

``verify``: after the run, a checksum (CRC-32) of every slice the device read to send or pull, and
of every slice it received, as it lies in its destination shard, keyed by tensor and plan step; the
controller compares each received slice with what its sender read. Slices that a Partial source
combines on the way are not checked (no one device read them).
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from reshard.errors import ReshardTimeout
from reshard.ir.batch import BatchDeviceProgram, Bucket
from reshard.ir.program import Broadcast, Buffer, Copy, Pull, Recv, Scale, Send, group_of
from reshard.ir.regions import box_shape
from reshard.runtime import arrays
from reshard.runtime.device.executor import PreparedProgram, Run, begin_run, box_index, prepare, run_windows


@dataclass(frozen=True, slots=True)
class PreparedBucket:
    """A bucket ready to run: its communicator key, the sender's rank, the peer's rank (a
    send/receive; -1 for a broadcast), whether this device sends, and its pieces as
    ``(tensor, index, shape, offset)``."""

    bucket: Bucket
    key: tuple[int, ...]
    root: int
    peer: int
    sends: bool
    pieces: tuple[tuple[int, tuple, tuple[int, ...], int], ...]


@dataclass(frozen=True, slots=True)
class PreparedBatch:
    program: BatchDeviceProgram
    parts: tuple[PreparedProgram, ...]
    windows: tuple[tuple[PreparedBucket, ...], ...]
    metas: dict

    @property
    def device(self) -> int:
        return self.program.device

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        return self.program.connect

    @property
    def staging_bytes(self) -> int:
        """The staging buffer the batch needs: its buckets', then each part's in turn."""
        return max([self.program.staging_bytes, *(p.program.staging_bytes for p in self.parts)])


def prepare_batch(program: BatchDeviceProgram, metas: dict | None = None) -> PreparedBatch:
    d = program.device
    windows = tuple(tuple(_prepare_bucket(b, d) for b in w) for w in program.issue_windows)
    parts = tuple(prepare(p.program, p.dtype) for p in program.parts)
    return PreparedBatch(program, parts, windows, dict(metas or {}))


def _prepare_bucket(b: Bucket, device: int) -> PreparedBucket:
    key = group_of(b.group)
    root = key.index(b.group[0])
    peer = -1
    if len(b.group) == 2:
        peer = key.index(b.group[1] if b.group[0] == device else b.group[0])
    pieces = tuple((q.tensor, box_index(q.box), box_shape(q.box), q.offset) for q in b.pieces)
    return PreparedBucket(b, key, root, peer, b.group[0] == device, pieces)


class BatchRun:
    """One batch run on a device: a ``Run`` per part (by tensor), the communicators, the shared
    staging buffer and deadline; ``after_run(runs)``: a test hook that runs before checksums."""

    def __init__(self, prepared: PreparedBatch, runs: dict[int, Run], groups, staging, deadline: float,
                 before_op=None, batch=None, after_run: Callable | None = None):  # fmt: skip
        self.prepared = prepared
        self.runs = runs
        self.groups = groups
        self.staging = staging
        self.deadline = deadline
        self.before_op = before_op
        self.batch = batch
        self.after_run = after_run
        self.comm_s = 0.0

    def left(self, bucket: Bucket) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ReshardTimeout(
                f"device {self.prepared.device}: its deadline passed before bucket {bucket.step} ({bucket.group})"
            )
        return left


def execute_batch(run: BatchRun, *, verify: bool = False, finish: Callable[[float, str], None] | None = None) -> dict:
    """Run the batch (module docstring). Returns ``{"elapsed_s", "comm_s", "checks"}`` (``checks``:
    ``[(tensor, step, "read" | "wrote", crc)]`` with ``verify``, else None). ``finish(deadline,
    what)``: waits for the work a GPU device queued (``RunStream.finish``)."""
    t0 = time.monotonic()
    ordered = [run.runs[part.tensor] for part in run.prepared.program.parts]
    for r in ordered:
        begin_run(r)
    for window in run.prepared.windows:
        _run_window(run, window)
    for r in ordered:
        run_windows(r)
    if finish is not None:
        finish(run.deadline, f"device {run.prepared.device}: a reshard")
    comm_s = run.comm_s + sum(r.comm_s for r in ordered)
    if run.after_run is not None:
        run.after_run(run.runs)
    checks = checksums(run) if verify else None
    return {"elapsed_s": time.monotonic() - t0, "comm_s": comm_s, "checks": checks}


def _run_window(run: BatchRun, window: tuple[PreparedBucket, ...]) -> None:
    pending = []
    c0 = time.monotonic()
    with run.batch(timeout_s=run.deadline - c0) if run.batch is not None else contextlib.nullcontext():
        for pb in window:
            if run.before_op is not None:
                run.before_op(run, pb.bucket)
            wire = run.staging.view(pb.bucket.staging, "uint8", (pb.bucket.nbytes,))
            comm = run.groups.get(pb.key)
            comm.timeout_s = run.left(pb.bucket)
            if pb.sends:
                _pack(run, pb)
            data = arrays.wire(wire)
            if pb.peer < 0:
                work = comm.ibroadcast(data, pb.root)
            elif pb.sends:
                work = comm.isend(data, pb.peer)
            else:
                work = comm.irecv(data, pb.peer)
            pending.append((pb, work))
    for pb, work in pending:
        work.wait(run.left(pb.bucket))
        if not pb.sends:
            _unpack(run, pb)
    run.comm_s += time.monotonic() - c0


def _pack(run: BatchRun, pb: PreparedBucket) -> None:
    base = pb.bucket.staging
    for tensor, index, shape, offset in pb.pieces:
        r = run.runs[tensor]
        arrays.copy(run.staging.view(base + offset, r.dtype, shape), r.src[index])


def _unpack(run: BatchRun, pb: PreparedBucket) -> None:
    base = pb.bucket.staging
    for tensor, index, shape, offset in pb.pieces:
        r = run.runs[tensor]
        arrays.copy(r.dst[index], run.staging.view(base + offset, r.dtype, shape))


def _crc(a) -> int:
    if arrays.is_device(a):
        a = a.get()  # on the run's stream: after the work that wrote it
    elif not arrays.is_numpy(a):
        a = arrays.as_numpy(a.detach().cpu())
    return zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)


def checksums(run: BatchRun) -> list[tuple[int, int, str, int]]:
    """What this device read and received, slice by slice (module docstring)."""
    out: list[tuple[int, int, str, int]] = []
    for window in run.prepared.windows:
        for pb in window:
            for (tensor, index, _, _), q in zip(pb.pieces, pb.bucket.pieces, strict=True):
                r = run.runs[tensor]
                buffer = r.src if pb.sends else r.dst
                out.append((tensor, q.step, "read" if pb.sends else "wrote", _crc(buffer[index])))
    for tensor, r in run.runs.items():
        prog = r.prepared.program
        if prog.tmp or any(isinstance(op, Scale) or getattr(op, "reduce", None) is not None for op in prog.all_ops):
            continue  # a Partial source: combined on the way (module docstring)
        for step in (*(s for w in r.prepared.windows for s in w), *r.prepared.background):
            op = step.op
            if isinstance(op, Send) or (isinstance(op, Broadcast) and op.read is not None):
                out.append((tensor, op.step, "read", _crc(r.read_buffer(op)[step.read])))
            elif isinstance(op, Pull):
                shard = r.peers[op.holder] if op.buffer is Buffer.SRC else r.relayed(op.holder, op.after)
                out.append((tensor, op.step, "read", _crc(shard[step.read])))
                out.append((tensor, op.step, "wrote", _crc(r.dst[step.write])))
            elif isinstance(op, Copy):
                out.append((tensor, op.step, "read", _crc(r.buffer(op.buffer)[step.read])))
                out.append((tensor, op.step, "wrote", _crc(r.target(step)[step.write])))
            if isinstance(op, Recv) or (isinstance(op, Broadcast) and op.write is not None):
                out.append((tensor, op.step, "wrote", _crc(r.target(step)[step.write])))
    return out


def first_mismatch(checks_by_device: dict) -> tuple[int, int, int, int, set[int]] | None:
    """The first received slice whose checksum is not one its sender read, as ``(tensor, step,
    device, crc, crcs read)``, or None. ``checks_by_device[d]``: device ``d``'s ``checks``."""
    read: dict[tuple[int, int], set[int]] = {}
    wrote: list[tuple[int, int, int, int]] = []
    for d, checks in sorted(checks_by_device.items()):
        for tensor, step, kind, crc in checks or ():
            if kind == "read":
                read.setdefault((tensor, step), set()).add(crc)
            else:
                wrote.append((tensor, step, d, crc))
    for tensor, step, d, crc in wrote:
        if crc not in read.get((tensor, step), {crc}):
            return tensor, step, d, crc, read[(tensor, step)]
    return None

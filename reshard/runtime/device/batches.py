"""Running a batch program (``reshard.ir.batch``): its buckets, then its parts, exactly as written.

A sender copies each piece of a bucket out of its source shard into the bucket's bytes in the
staging buffer and sends them; a receiver receives the bytes there and copies each piece into its
destination shard. Buckets are issued window by window (inside one backend batch when the backend
batches), then waited for in order. Then each part runs as a single program does
(``reshard.runtime.device.executor``), one after the other in tensor order.

The parts whose programs only copy (their messages packed, nothing combined, nothing published
or relayed: a state dict's small tensors, pulls between devices of one machine) run together as
one flat unit, before the other parts: on a GPU device one kernel for all their copies and pulls
(as the pieces of a window are packed, and unpacked, by one kernel: ``box_copies``); on a CPU
device the small ones that only pull out of peers' private memory or receive in buckets as one
block and one table of reads and landings (``host_unit``, bound by ``Binding``), the others' ops
in order with their reads out of peers' private memory gathered into one system call per holder.
On a CPU device, parts that only lend their source shard to buckets (a state dict's sender) get no
``Run``: buckets are packed straight out of the source shards (``BatchRun.sources``), into views
of the staging buffer made once per buffer.

``verify``: after the run, a checksum (CRC-32) of every slice the device read to send or pull, and
of every slice it received, as it lies in its destination shard, keyed by tensor and plan step; the
controller compares each received slice with what its sender read. Slices that a Partial source
combines on the way are not checked (no one device read them).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter

import numpy as np

from reshard.errors import ReshardTimeout
from reshard.ir.batch import BatchDeviceProgram, Bucket
from reshard.ir.program import Broadcast, Buffer, Copy, Pull, Recv, Scale, Send, group_of
from reshard.ir.regions import box_shape
from reshard.runtime import arrays
from reshard.runtime.backends import cuda_streams
from reshard.runtime.device import box_copies
from reshard.runtime.device.cross_memory import Gather, RemoteShard, c_strides
from reshard.runtime.device.executor import PreparedProgram, Run, begin_run, box_index, prepare, run_windows

log = logging.getLogger(__name__)

#: How long a failed run waits for the copies it queued on its side stream.
SIDE_DRAIN_S = 5.0


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
    """A batch program ready to run on its device: its parts prepared (``tensors``, each one's
    tensor; ``index``, tensor -> its part's index), its buckets by window, the staging buffer it
    needs (its buckets', then each part's in turn), which parts only copy (``flat``), the parts
    that write a destination with its shape and dtype (``written``: what a run into users' tensors
    checks them against), the tables a run works out once (``tables``: a GPU device's copy
    tables, a CPU device's units), the windows after which a GPU device packs the next one ahead
    (``pack_ahead``: ``BatchDeviceProgram.packed_ahead`` of the next), and those it unpacks
    while the next one moves (``unpack_behind``: ``BatchDeviceProgram.unpacked_behind``)."""

    program: BatchDeviceProgram
    parts: tuple[PreparedProgram, ...]
    windows: tuple[tuple[PreparedBucket, ...], ...]
    metas: dict
    flat: tuple[int, ...] = ()
    tensors: tuple[int, ...] = ()
    index: dict = field(default_factory=dict, compare=False)
    staging_bytes: int = 0
    tables: dict = field(default_factory=dict, compare=False)
    senders: frozenset = frozenset()
    written: tuple[tuple[int, ...], tuple[tuple[int, ...], ...], tuple[str, ...]] = ((), (), ())
    pack_ahead: tuple[bool, ...] = ()
    unpack_behind: tuple[bool, ...] = ()

    @property
    def overlaps(self) -> bool:
        """Whether a GPU device runs some of its bucket copies on a side stream."""
        return any(self.pack_ahead) or any(self.unpack_behind)

    @property
    def device(self) -> int:
        return self.program.device

    def per_binding(self, kind: str, bound, make, kept: int, same=None):
        """``make()`` for this batch bound as ``bound``, kept in ``tables`` under ``kind`` for
        the ``kept`` latest bindings (a replay binds the same again); where ``same(other, bound)``
        holds for a binding kept, what was made for it is this one's too."""
        key = (kind, id(bound))
        hit = self.tables.get(key)
        if hit is not None and hit[0] is bound:
            return hit[1]
        old = [k for k in self.tables if isinstance(k, tuple) and k[0] == kind]
        shared = [self.tables[k][1] for k in old if same is not None and same(self.tables[k][0], bound)]
        for k in old[: max(0, len(old) + 1 - kept)]:
            del self.tables[k]
        made = shared[0] if shared else make()
        self.tables[key] = (bound, made)
        return made

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        return self.program.connect


def prepare_batch(program: BatchDeviceProgram, metas: dict | None = None) -> PreparedBatch:
    d = program.device
    windows = tuple(tuple(_prepare_bucket(b, d) for b in w) for w in program.issue_windows)
    alike: dict = {}  # (program id, dtype) -> (prepared, only copies, only sends): parts alike share a program
    parts_, flat_, senders = [], [], []
    for i, p in enumerate(program.parts):
        key = (id(p.program), p.dtype)
        hit = alike.get(key)
        if hit is None:
            prepared = prepare(p.program, p.dtype)
            only = _only_copies(prepared)
            hit = alike[key] = (prepared, only, only and _only_sends(prepared))
        parts_.append(hit[0])
        if hit[1]:
            flat_.append(i)
        if hit[2]:
            senders.append(i)
    parts, flat = tuple(parts_), tuple(flat_)
    tensors = tuple(p.tensor for p in program.parts)
    staging = max([program.staging_bytes, *(p.program.staging_bytes for p in parts)])
    index = {t: i for i, t in enumerate(tensors)}
    at = tuple(i for i, p in enumerate(parts) if p.program.dst_shape is not None)
    shapes = tuple(tuple(parts[i].program.dst_shape or ()) for i in at)
    written = (at, shapes, tuple(parts[i].dtype for i in at))
    return PreparedBatch(
        program,
        parts,
        windows,
        dict(metas or {}),
        flat,
        tensors,
        index,
        staging,
        senders=frozenset(senders),
        written=written,
        pack_ahead=program.packed_ahead[1:],
        unpack_behind=program.unpacked_behind,
    )


def _only_copies(p: PreparedProgram) -> bool:
    """Whether a part only copies boxes between its own shards and peers' source shards."""
    prog = p.program
    if prog.tmp or prog.zero_dst or prog.relays or p.publishes or prog.background:
        return False
    for op in prog.ops:
        if (
            not isinstance(op, Copy | Pull)
            or op.reduce is not None
            or getattr(op, "target", Buffer.DST) is not Buffer.DST
        ):
            return False
        if isinstance(op, Pull) and op.buffer is not Buffer.SRC:
            return False
    return True


def _only_sends(p: PreparedProgram) -> bool:
    """Whether a part (one that only copies) has no op of its own and no destination: all it
    does is lend its source shard to the buckets that carry its pieces."""
    prog = p.program
    return not prog.ops and prog.dst_shape is None and prog.src_shape is not None


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
    staging buffer and deadline; ``after_run(runs)``: a test hook that runs before checksums;
    ``unit``, the parts run as one unit (``host_unit.UnitRun``); ``sources``, the source shards of
    the parts that only send, by tensor (they have no ``Run``); ``side_stream``, a GPU device's
    stream beside the run's for the windows it packs ahead and unpacks behind (``PreparedBatch``)."""

    def __init__(
        self,
        prepared: PreparedBatch,
        runs: dict[int, Run],
        groups,
        staging,
        deadline: float,
        before_op=None,
        batch=None,
        after_run: Callable | None = None,
        unit=None,
        sources: dict | None = None,
        side_stream=None,
    ):
        self.prepared = prepared
        self.runs = runs
        self.unit = unit
        self.sources = sources or {}
        self.groups = groups
        self.staging = staging
        self.deadline = deadline
        self.before_op = before_op
        self.batch = batch
        self.after_run = after_run
        self.side_stream = side_stream
        self.packed = -1  # the window packed ahead, on ``side_stream``
        self.behind: dict[int, object] = {}  # window -> the event after its unpack on ``side_stream``
        self.comm_s = 0.0
        self.gpu = arrays.is_device(staging.buf) or any(
            arrays.is_device(r.dst) or arrays.is_device(r.src) for r in runs.values()
        )

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
    index = run.prepared.index
    ordered = sorted(((index[t], r) for t, r in run.runs.items()), key=itemgetter(0))  # the parts not in the unit
    for _, r in ordered:
        begin_run(r)
    try:
        for w, window in enumerate(run.prepared.windows):
            _run_window(run, w, window)
    except BaseException:
        _drain_side(run)
        raise
    if run.behind:  # the unpacks still on the side stream: before anything reads their destinations
        cuda_streams.current_stream().wait_event(cuda_streams.recorded(run.side_stream))
        run.behind.clear()
    if run.unit is not None:
        if run.before_op is not None:
            for i in run.unit.dsts:
                for op in run.prepared.parts[i].program.ops:
                    run.before_op(run, op)
        run.unit.read()
    flat = set(run.prepared.flat)
    if run.gpu and flat:
        _run_flat(run, [run.runs[t] for t in run.prepared.tensors])  # a GPU device has no unit
    elif flat:
        _run_flat_host(run, [r for i, r in ordered if i in flat])
    for i, r in ordered:
        if i not in flat:
            run_windows(r)
    if finish is not None:
        finish(run.deadline, f"device {run.prepared.device}: a reshard")
    comm_s = run.comm_s + sum(r.comm_s for _, r in ordered)
    if run.after_run is not None:
        run.after_run(run.runs)
    checks = checksums(run) if verify else None
    return {"elapsed_s": time.monotonic() - t0, "comm_s": comm_s, "checks": checks}


def _run_window(run: BatchRun, w: int, window: tuple[PreparedBucket, ...]) -> None:
    pending = []
    c0 = time.monotonic()
    tables = _window_tables(run, window) if run.gpu else None
    before = None  # where the next window is packed ahead: the last use of its staging region
    if tables is not None:
        done = [j for j in run.behind if j < w - 1]  # unpacks that may read this window's staging
        if done:
            cuda_streams.current_stream().wait_event(run.behind[max(done)])  # the later covers the others
            for j in done:
                del run.behind[j]
        if run.packed != w:
            tables[0].launch(_bases(run, tables[2]))  # every piece this device sends in the window: one kernel
        if run.side_stream is not None and run.prepared.pack_ahead[w : w + 1] == (True,):
            before = cuda_streams.recorded(cuda_streams.current_stream())
    with run.batch(timeout_s=run.deadline - c0) if run.batch is not None else contextlib.nullcontext():
        for pb in window:
            if run.before_op is not None:
                run.before_op(run, pb.bucket)
            wire = run.staging.view(pb.bucket.staging, "uint8", (pb.bucket.nbytes,))
            comm = run.groups.get(pb.key)
            comm.timeout_s = run.left(pb.bucket)
            if pb.sends and tables is None:
                _pack(run, pb)
            data = arrays.wire(wire)
            if pb.peer < 0:
                work = comm.ibroadcast(data, pb.root)
            elif pb.sends:
                work = comm.isend(data, pb.peer)
            else:
                work = comm.irecv(data, pb.peer)
            pending.append((pb, work))
    if before is not None:
        _pack_ahead(run, w + 1, before)
    landed = run.unit.unit.landed if run.unit is not None else ()
    for pb, work in pending:
        work.wait(run.left(pb.bucket))
        if not pb.sends and tables is None:
            _unpack(run, pb, landed)
    if run.unit is not None:
        run.unit.land(w, run.staging.buf)  # the pieces that landed in the unit's destinations: one copy of rows
    if tables is not None and run.side_stream is not None and run.prepared.unpack_behind[w]:
        _unpack_behind(run, w, window, tables)
    elif tables is not None:
        tables[1].launch(_bases(run, tables[2]))  # every piece it received: one kernel
    run.comm_s += time.monotonic() - c0


# ------------------------------------------------------------------------------------------------
# GPU devices: copies as tables of one kernel each (``box_copies``). A table's rows name buffers by
# index into a list of (tensor, "src" | "dst") or "staging" or (tensor, holder): their addresses are
# read at each run.


def _box_copies(shape_from, box_from, shape_to, box_to, itemsize: int, base_from: int = 0, base_to: int = 0):
    """The copies of box ``box_from`` of a C-ordered buffer of ``shape_from`` into box ``box_to``
    of one of ``shape_to`` (byte offsets from ``base_from`` / ``base_to``)."""
    strides_from, strides_to = c_strides(shape_from, itemsize), c_strides(shape_to, itemsize)
    offset_from = base_from + sum(lo * s for (lo, _), s in zip(box_from, strides_from, strict=True))
    offset_to = base_to + sum(lo * s for (lo, _), s in zip(box_to, strides_to, strict=True))
    return box_copies.describe(box_shape(box_from), itemsize, offset_from, strides_from, offset_to, strides_to)


def _window_tables(run: BatchRun, window: tuple[PreparedBucket, ...]):
    """``(pack table, unpack table, buffers)`` of a window, made once per prepared batch."""
    key = ("window", id(window))
    hit = run.prepared.tables.get(key)
    if hit is not None:
        return hit
    buffers: dict = {"staging": 0}
    pack, unpack = box_copies.Table(), box_copies.Table()
    for pb in window:
        for (tensor, _, shape, offset), q in zip(pb.pieces, pb.bucket.pieces, strict=True):
            r = run.runs[tensor]
            item = arrays.storage(r.dtype).itemsize
            whole = tuple((0, n) for n in shape)
            if pb.sends:
                src = buffers.setdefault((tensor, "src"), len(buffers))
                for c in _box_copies(r.src.shape, q.box, shape, whole, item, 0, pb.bucket.staging + offset):
                    pack.add(src, 0, c)
            else:
                dst = buffers.setdefault((tensor, "dst"), len(buffers))
                for c in _box_copies(shape, whole, r.dst.shape, q.box, item, pb.bucket.staging + offset, 0):
                    unpack.add(0, dst, c)
    hit = run.prepared.tables[key] = (pack, unpack, tuple(buffers))
    return hit


def _drain_side(run: BatchRun) -> None:
    """After a failed window, the side stream's copies done (they write destinations and staging
    that the failure frees), waited for at most ``SIDE_DRAIN_S``: they wait for nothing but the
    run's stream, which a failed NCCL group drains."""
    if run.side_stream is None or not (run.behind or run.packed >= 0):
        return
    try:
        cuda_streams.wait(run.side_stream, time.monotonic() + SIDE_DRAIN_S, "a failed run's side stream")
    except Exception as e:
        log.error("device %s: %s; its copies may still land", run.prepared.device, e)


def _unpack_behind(run: BatchRun, w: int, window: tuple[PreparedBucket, ...], tables) -> None:
    """Window ``w``'s pieces unpacked on the side stream once its messages landed, while the next
    window moves; the run's stream waits for it before the window after next reuses its staging
    (``_run_window``) and before anything after the windows (``execute_batch``)."""
    stream = run.side_stream
    stream.wait_event(cuda_streams.recorded(cuda_streams.current_stream()))
    with stream:
        if run.before_op is not None:
            run.before_op(run, tuple(pb.bucket for pb in window))
        tables[1].launch(_bases(run, tables[2]))
    run.behind[w] = cuda_streams.recorded(stream)


def _pack_ahead(run: BatchRun, w: int, after) -> None:
    """Window ``w`` packed on the side stream while the window before moves: after event ``after``
    (every use of its staging region queued before that window's messages), and before whatever
    the run's stream queues next (its unpack, the next window's messages). A test's ``before_op``
    hook is called on the side stream first, with the window's buckets."""
    window = run.prepared.windows[w]
    pack, _, names = _window_tables(run, window)
    stream = run.side_stream
    stream.wait_event(after)
    with stream:
        if run.before_op is not None:
            run.before_op(run, tuple(pb.bucket for pb in window))
        pack.launch(_bases(run, names))
    cuda_streams.current_stream().wait_event(cuda_streams.recorded(stream))
    run.packed = w


def _run_flat(run: BatchRun, ordered: list[Run]) -> None:
    """The parts that only copy, as one kernel (module docstring)."""
    key = "flat"
    hit = run.prepared.tables.get(key)
    if hit is None:
        buffers: dict = {}
        table = box_copies.Table()
        for i in run.prepared.flat:
            r = ordered[i]
            item = arrays.storage(r.dtype).itemsize
            for op in r.prepared.program.ops:
                if isinstance(op, Pull):
                    src = buffers.setdefault((r.prepared.program.device, i, op.holder), len(buffers))
                    shape_from = r.peers[op.holder].shape
                else:
                    src = buffers.setdefault((i, "src" if op.buffer is Buffer.SRC else "dst"), len(buffers))
                    shape_from = r.buffer(op.buffer).shape
                dst = buffers.setdefault((i, "dst"), len(buffers))
                for c in _box_copies(shape_from, op.read, r.dst.shape, op.write, item):
                    table.add(src, dst, c)
        hit = run.prepared.tables[key] = (table, tuple(buffers))
    table, names = hit
    if run.before_op is not None:
        for i in run.prepared.flat:
            for op in ordered[i].prepared.program.ops:
                run.before_op(ordered[i], op)
    bases = []
    for name in names:
        if len(name) == 3:  # a peer's source shard
            bases.append(ordered[name[1]].peers[name[2]].data.ptr)
        else:
            r = ordered[name[0]]
            bases.append((r.src if name[1] == "src" else r.dst).data.ptr)
    table.launch(bases)


def _run_flat_host(run: BatchRun, flat: list[Run]) -> None:
    """The runs ``flat`` of parts that only copy, on a CPU device: their ops in order, without a
    run of the executor each, and every read out of a peer's private memory gathered (``Gather``:
    one system call per holder for as many as fit)."""
    gather = Gather()
    before = run.before_op
    for r in flat:
        for window in r.prepared.windows:
            for s in window:
                op = s.op
                if before is not None:
                    before(r, op)
                if type(op) is Pull:
                    shard = r.peers[op.holder]
                    if type(shard) is RemoteShard:
                        out = r.dst[s.write]
                        if not gather.add(shard, op.read, out):
                            shard.read_into(s.read, out)
                    else:
                        arrays.copy(r.dst[s.write], shard[s.read])
                else:
                    if op.buffer is Buffer.DST:
                        gather.flush()  # it reads what a gathered read writes
                    s.handler(r, s)
    gather.flush()


def _bases(run: BatchRun, names) -> list[int]:
    out = []
    for name in names:
        if name == "staging":
            out.append(run.staging.buf.data.ptr)
        else:
            r = run.runs[name[0]]
            out.append((r.src if name[1] == "src" else r.dst).data.ptr)
    return out


def _pack(run: BatchRun, pb: PreparedBucket) -> None:
    """The bucket's pieces out of their source shards into its bytes in the staging buffer (the
    pieces' views of it made once per buffer: ``StagingBuffer.views``)."""
    views = run.staging.views(pb, functools.partial(_piece_views, run.prepared, pb))
    sources, runs = run.sources, run.runs
    for (tensor, index, _, _), view in zip(pb.pieces, views, strict=True):
        src = sources.get(tensor)
        if src is None:
            src = runs[tensor].src
        if type(src) is np.ndarray and type(view) is np.ndarray:
            view[...] = src[index]  # of one dtype (both checked against the part's): no cast
        else:
            arrays.copy(view, src[index])


def _piece_views(prepared: PreparedBatch, pb: PreparedBucket, staging) -> list:
    base, parts, index = pb.bucket.staging, prepared.parts, prepared.index
    return [staging.view(base + offset, parts[index[t]].dtype, shape) for t, _, shape, offset in pb.pieces]


def _unpack(run: BatchRun, pb: PreparedBucket, landed) -> None:
    """The bucket's pieces into their parts' destinations, but those in the unit's (``landed``)."""
    base = pb.bucket.staging
    for tensor, index, shape, offset in pb.pieces:
        if tensor in landed:
            continue
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

"""A CPU device's pulls and bucket landings of one batch as one unit: one destination block, one
table of reads.

A state dict of thousands of small tensors between two meshes of one machine is, on each device,
thousands of parts that only pull slices out of peers' private memory. Run part by part, each
costs a ``Run``, a destination allocation, a mapped peer shard per holder and a read per slice:
tens of microseconds of Python per tensor, far more than its bytes. As a unit, the parts get one
destination block (each destination a view of it; the block of an earlier run once its shards are
freed, ``ShardStore.allocate_block``), and the slices they read become the rows of one table
(``Rows``: spans of the holders' shards, the bytes each goes to; runs of a shard a little apart are
read as one span, the gaps into scratch, and so are spans of shards a little apart in their
holder, as small tensors allocated one after another lie), issued in ``process_vm_readv`` calls of
up to ``IOV_MAX`` rows a side; every tenure is checked at once, before the reads and after
(``Binding.settle``), as ``PeerShards`` checks one shard's. The new shards are kept as columns
(``UnitRun.placed``, ``ShardStore.put_run``): no Python loop per shard.

The table is worked out once per prepared batch and binding (``HostUnit``; a replay binds the same
source shards, so only the block's address changes), and a run adds the block's address to it. A
binding that reads what a kept one reads (the same pulls and casts: a sync's first call into other
outputs) takes that one's table.

Pulls out of shards this process maps (a holder's shared block, or a shared-memory file its shard
lies in) are copies between views instead (``MappedPull``: a copy each, the mapping looked up and
its tenure checked as a part's own pull does). A unit with destinations of ``SMALL_SHARD_BYTES``
or more gets its block in shared memory where the device may make one more
(``ShardStore.allocate_block``): each of those new shards names its place in that file, and peers
map it as they map any shared shard; smaller ones are read out of it by the kernel, as out of
private memory (a descriptor without a file: thousands of them cross to the controller each run).

Buckets land in a unit too (between machines, or with shared memory off, a tree's pieces travel
in gloo buckets): the pieces a window's buckets carry into the unit's destinations are rows of a
table as well (``Landing``: a span of the staging buffer, the bytes of the block it goes to), and
``UnitRun.land`` copies them with ``process_vm_readv`` of the device's own memory, ``IOV_MAX``
rows a call, instead of a copy per piece into a destination of its own.

A run that writes ``direct`` into the user's tensors runs its unit the same way, then copies each
destination into its tensor (``Binding.deliver``): one copy of a small tensor costs far less than
the part it replaces.

A part joins the unit when its program only pulls source shards (no local copy, nothing combined,
no relay) or has no op of its own (buckets carry all it receives), its destination is new (or
delivered, as above) and under ``UNIT_MAX_BYTES`` (larger ones are assembled and settled apart:
``ShardStore``), it sends no bucket piece (a sender reads its source shard: a ``Run``), and every
shard it pulls is one of those two kinds. The others run as before (``batches``). A run that
returns checksums (``verify``) or has a test hook that looks at its parts (``after_run``) has no
unit.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from dataclasses import dataclass, field

import numpy as np

from reshard.errors import ReshardError
from reshard.ir.program import Buffer, Pull
from reshard.ir.regions import box_shape
from reshard.runtime import arrays
from reshard.runtime.device.cross_memory import IOV_MAX, available, read_failed, read_rows, runs
from reshard.runtime.device.shards import ASSEMBLY_MIN_BYTES, SMALL_SHARD_BYTES, PlacedShards
from reshard.runtime.device.shared_memory import shard_gone
from reshard.runtime.messages import CROSS_MEMORY

ALIGN = 64  # bytes between destinations in the block
#: Runs of a holder's shard at most this far apart are read as one span, the gap into scratch: the
#: kernel's cost is per row it reads out of the holder (it pins that row's pages), far more than
#: copying a few KiB; a row into this process costs little.
GAP_BYTES = 2048
#: Spans of different shards at most this far apart are read as one (``merge_spans``): a tree's
#: small shards lie a little over ``GAP_BYTES`` apart where a pull skips their neighbours (a
#: row-parallel slice of every third tensor of a MoE expert's three), and a row out of a holder
#: that several devices read at once costs more than copying this much.
SHARD_GAP_BYTES = 4096
SPAN_RUNS = 64  # runs to a span at most
MERGED_ROWS = 512  # local rows to a span merged out of several at most (a span of one has up to 2 x SPAN_RUNS)
CACHED = 4  # units kept per prepared batch (one per binding)
#: Destinations at least this large run as parts of their own: their bytes outweigh a part's cost.
UNIT_MAX_BYTES = ASSEMBLY_MIN_BYTES


@dataclass(frozen=True, eq=False)
class Source:
    """The shards a unit reads out of one holder's process: its tenure board (``(fd, inode)``), the
    cells and tenures to check, and the reads as rows (``Rows``): ``remote`` ``(address,
    length)`` in the holder, ``local`` ``(offset, length)`` in the block (``trash``: in the
    scratch buffer), and ``calls`` ``(first remote row, end, first local row, end, bytes)``;
    ``located``, the local rows at the addresses of the latest block read into (a replay's runs
    land in one block, whose rows are worked out once)."""

    holder: int
    pid: int
    board: tuple[int, int]
    cells: np.ndarray
    tenures: np.ndarray
    remote: np.ndarray
    local: np.ndarray
    trash: np.ndarray
    calls: tuple[tuple[int, int, int, int, int], ...]
    unmerged: Source | None = None
    located: dict = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class MappedPull:
    """A pull out of a shard this process maps (module docstring): box ``read`` of ``holder``'s
    shard named by ``desc`` (viewed as ``storage``) into box ``write`` of the destination ``at``
    (its place in the unit's ``Places``), as index tuples."""

    at: int
    holder: int
    desc: tuple
    storage: np.dtype
    read: tuple[slice, ...]
    write: tuple[slice, ...]


@dataclass(frozen=True, eq=False)
class Landing:
    """The pieces of one issue window's buckets that land in a unit's destinations (``tensors``),
    as rows copied out of the staging buffer into the block: ``remote`` ``(offset in the staging
    buffer, length)`` and ``local`` ``(offset in the block, length)``, one per run of contiguous
    bytes of a piece in its destination (pieces lie in a bucket in C order of their box)."""

    tensors: frozenset
    local: np.ndarray
    remote: np.ndarray
    staging_end: int


@dataclass(frozen=True, eq=False)
class Places:
    """Where a unit's destinations lie, as columns (a run keeps thousands at once:
    ``UnitRun.placed``): ``parts`` (indices), ``tensors`` (batch tensor of each), ``dtypes``,
    ``offsets`` in the block (int64), ``sizes`` (bytes), ``mapped`` (whether peers map it:
    ``SMALL_SHARD_BYTES`` or more), each one's index (``shape_ids``) in ``distinct`` shapes, and
    ``metas`` (what each is a shard of; None: nothing said). Destinations of one shape and storage
    lie one after another at one stride, in part order (``groups``: ``(shape, storage, offset,
    count, stride)`` each, in column order), so a run views each group's at once."""

    parts: tuple[int, ...]
    tensors: tuple[int, ...]
    dtypes: tuple[str, ...]
    offsets: np.ndarray
    sizes: tuple[int, ...]
    groups: tuple[tuple[tuple[int, ...], np.dtype, int, int, int], ...]
    mapped: tuple[bool, ...]
    shape_ids: np.ndarray
    distinct: tuple[tuple[int, ...], ...]
    metas: tuple | None

    @functools.cached_property
    def shapes(self) -> list[tuple[int, ...]]:
        """Each destination's shape (worked out once: every run of the unit checks against them)."""
        return list(map(self.distinct.__getitem__, self.shape_ids.tolist()))

    @functools.cached_property
    def positions(self) -> dict[int, int]:
        """Each destination's position by its batch tensor."""
        return dict(zip(self.tensors, range(len(self.tensors)), strict=True))

    def views(self, block: np.ndarray) -> list:
        """Each destination's view of ``block``, in column order."""
        views: list = []
        for shape, storage, offset, count, stride in self.groups:
            views.extend(_views(block, shape, storage, offset, count, stride))
        return views

    @functools.cached_property
    def extent(self) -> int:
        """The bytes from the block's start to the end of its last destination."""
        return max(o + (n - 1) * stride + s.itemsize * math.prod(shape) for shape, s, o, n, stride in self.groups)


@dataclass(frozen=True, eq=False)
class HostUnit:
    """A batch's parts run as one unit on a CPU device (module docstring): ``places``, where each
    destination lies in the block of ``nbytes``; ``sources``, the reads out of holders' private
    memory; ``mapped``, the copies out of mapped shards, and ``wanted``, their ``(holder, desc,
    storage)`` as ``PeerShards.get_all`` takes them; ``rest``, the indices of the batch's other
    parts, which run as before; ``shared``, whether peers map some destination (the block is then
    made in shared memory where it can be)."""

    places: Places
    nbytes: int
    sources: tuple[Source, ...]
    mapped: tuple[MappedPull, ...]
    wanted: tuple[tuple[int, tuple, np.dtype], ...]
    rest: tuple[int, ...]
    shared: bool
    landings: tuple[Landing | None, ...] = ()
    landed: frozenset = frozenset()


def unit_for(ctx, prepared, bound, req) -> HostUnit | None:
    """The unit of ``prepared`` bound as ``bound`` on this device (cached), or None: none of its
    parts qualifies, or the run needs them one by one (module docstring)."""
    if (
        ctx.cuda_device is not None
        or req.verify
        or ctx.after_run is not None
        or not prepared.flat
        or not (bound.pulls or prepared.windows)
        or not available()
    ):
        return None
    return prepared.per_binding("host unit", bound, lambda: _built(ctx, prepared, bound), CACHED, _same_sources)


def _built(ctx, prepared, bound) -> HostUnit | None:
    ctx.counters["units_built"] = ctx.counters.get("units_built", 0) + 1
    return _build(prepared, bound)


def _same_sources(a, b) -> bool:
    """Whether bindings ``a`` and ``b`` read the same (a unit follows from its pulls and casts
    alone: a replay into other outputs, or a fresh call's, shares it)."""
    return (a.pulls is b.pulls or a.pulls == b.pulls) and a.casts == b.casts


def _build(prepared, bound) -> HostUnit | None:
    sending = {q[0] for window in prepared.windows for pb in window if pb.sends for q in pb.pieces}  # need a Run
    casts = bound.casts or ()
    pulls = bound.pulls or {}
    # parts alike (tensors of one shape and layouts) share a prepared program: what follows from
    # it alone is worked out once (``sized``: storage, bytes, shape; ``alike``: ``_reads``)
    sized: dict = {}
    alike: dict = {}
    kinds: dict = {}  # (shape, storage) -> [(part, bytes, reads)]: each kind's destinations lie together
    for i in prepared.flat:
        part, tensor = prepared.parts[i], prepared.program.parts[i].tensor
        prog = part.program
        if tensor in sending or (i < len(casts) and casts[i] is not None) or prog.dst_shape is None:
            continue
        size = sized.get(id(part))
        if size is None:
            storage = arrays.storage(part.dtype)
            shape = tuple(prog.dst_shape)
            size = sized[id(part)] = ((shape, storage), storage.itemsize * math.prod(shape))
        kind, nbytes = size
        if not 0 < nbytes < UNIT_MAX_BYTES:
            continue
        reads = _reads(prog, pulls.get(tensor) or {}, kind[1].itemsize, alike)
        if reads is not None:
            kinds.setdefault(kind, []).append((i, nbytes, reads))
    if not kinds:
        return None
    order: list[int] = []
    offsets: list[int] = []
    groups: list[tuple] = []
    rows: dict = {}  # (holder, pid, board fd, board inode) -> [cells, tenures, reads, places]
    mapped: list[MappedPull] = []
    offset = 0
    for (shape, storage), members in kinds.items():
        stride = -(-members[0][1] // ALIGN) * ALIGN
        groups.append((shape, storage, offset, len(members), stride))
        for i, _, reads in members:
            for holder, desc, table in reads:
                if type(table) is tuple:  # a mapped shard: (read, write) boxes
                    read, write = (tuple(slice(lo, hi) for lo, hi in box) for box in table)
                    mapped.append(MappedPull(len(order), holder, desc, storage, read, write))
                    continue
                _, pid, fd, inode, cell, tenure, address = desc[:7]
                entry = rows.setdefault((holder, pid, fd, inode), [[], [], [], []])
                entry[0].append(cell)
                entry[1].append(tenure)
                entry[2].append((address, table))
                entry[3].append(offset)
            order.append(i)
            offsets.append(offset)
            offset += stride
    sources = tuple(source_of(key, *entry) for key, entry in rows.items())
    taken = set(order)
    rest = tuple(i for i in range(len(prepared.parts)) if i not in taken)
    sizes = tuple(n for members in kinds.values() for _, n, _ in members)
    tensors = tuple(prepared.tensors[i] for i in order)
    distinct = tuple(dict.fromkeys(shape for shape, _ in kinds))
    shape_id = {shape: k for k, shape in enumerate(distinct)}
    places = Places(
        tuple(order),
        tensors,
        tuple(prepared.parts[i].dtype for i in order),
        np.array(offsets, np.int64),
        sizes,
        tuple(groups),
        tuple(n >= SMALL_SHARD_BYTES for n in sizes),
        np.repeat(np.array([shape_id[shape] for shape, _ in kinds], np.int32), [len(m) for m in kinds.values()]),
        distinct,
        tuple(prepared.metas.get(t) for t in tensors) if prepared.metas else None,
    )
    wanted = tuple((m.holder, m.desc, m.storage) for m in mapped)
    at = {prepared.tensors[i]: k for k, i in enumerate(order)}
    landings = tuple(landing_of(window, prepared, at, places) for window in prepared.windows)
    landed = frozenset(t for landing in landings if landing is not None for t in landing.tensors)
    return HostUnit(places, offset, sources, tuple(mapped), wanted, rest, any(places.mapped), landings, landed)


def landing_of(window, prepared, at: dict, places: Places) -> Landing | None:
    """The pieces of ``window`` (``PreparedBucket``s) received into the unit's destinations
    (``at``: tensor -> its place in ``places``), or None when none is."""
    cut: dict = {}  # (part id, box) -> (offsets, length): pieces alike are cut alike
    runs_, lengths, places_, firsts, tensors = [], [], [], [], set()
    for pb in window:
        if pb.sends:
            continue
        for (tensor, _, _, offset), q in zip(pb.pieces, pb.bucket.pieces, strict=True):
            k = at.get(tensor)
            if k is None:
                continue
            part = prepared.parts[places.parts[k]]
            key = (id(part), q.box)
            hit = cut.get(key)
            if hit is None:
                shape = tuple(part.program.dst_shape)
                if not _within(q.box, shape):
                    raise ReshardError(
                        f"device {part.program.device}: bucket {pb.bucket.step} lands {q.box} in a destination of "
                        f"shape {list(shape)} (program bug)"
                    )
                hit = cut[key] = runs(shape, arrays.storage(part.dtype).itemsize, list(q.box))
            tensors.add(tensor)  # (``_unpack`` passes it over, a piece of no bytes too)
            if hit[1] and len(hit[0]):
                runs_.append(hit[0])
                lengths.append(hit[1])
                places_.append(k)
                firsts.append(pb.bucket.staging + offset)
    if not runs_:
        none = np.zeros((0, 2), np.uint64)
        return Landing(frozenset(tensors), none, none, 0) if tensors else None
    counts = np.fromiter(map(len, runs_), np.int64, len(runs_))
    length = np.repeat(np.array(lengths, np.uint64), counts)
    offsets = np.concatenate(runs_).astype(np.uint64)
    local = np.stack([offsets + np.repeat(places.offsets[places_].astype(np.uint64), counts), length], axis=1)
    within = np.arange(len(offsets), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    spans = np.repeat(np.array(firsts, np.uint64), counts) + within.astype(np.uint64) * length
    return Landing(frozenset(tensors), local, np.stack([spans, length], axis=1), int((spans + length).max()))


def _reads(prog, pulls: dict, itemsize: int, alike: dict):
    """``[(holder, descriptor, Rows or (read, write) boxes)]`` of a part's pulls (boxes: out of a
    shard this process maps), or None when it does more than pull shards. ``alike``: what parts of
    one program object with holders' shards alike share (the ops checked, the rows worked out)."""
    ops = alike.get(id(prog), False)
    if ops is False:
        ops = alike[id(prog)] = _pulls_only(prog)
    if ops is None:
        return None
    descs: list = [pulls.get(op.holder) for op in ops]
    shapes = tuple(map(_shape, descs))
    if None in shapes:
        return None
    private = tuple(len(d) == 9 and d[8] is None for d in descs)  # in the holder's private memory
    key = (id(prog), itemsize, shapes, private)
    tables = alike.get(key)
    if tables is None:
        tables = alike[key] = tuple(
            _table(prog, op, shape, itemsize, p) for op, shape, p in zip(ops, shapes, private, strict=True)
        )
    return [(op.holder, desc, t) for op, desc, t in zip(ops, descs, tables, strict=True)]


def _pulls_only(prog) -> tuple | None:
    """``prog``'s ops when each pulls a source shard as it is (nothing combined), else None."""
    for op in prog.ops:
        if type(op) is not Pull or op.reduce is not None or op.buffer is not Buffer.SRC:
            return None
    return prog.ops


def _table(prog, op, shape, itemsize: int, private: bool):
    """How pull ``op`` of a holder's shard of ``shape`` is read: ``Rows`` out of the holder's
    private memory (by the kernel), or ``(read, write)`` boxes out of a shard this process maps."""
    if not _within(op.read, shape) or not _within(op.write, prog.dst_shape):
        raise ReshardError(
            f"device {prog.device}: step {op.step} reads {op.read} of device {op.holder}'s shard of shape "
            f"{list(shape)} into {op.write} of {list(prog.dst_shape)} (program bug)"
        )
    if private:
        return rows_of(shape, tuple(prog.dst_shape), itemsize, op.read, op.write)
    return (op.read, op.write)


def _shape(desc) -> tuple[int, ...] | None:
    """The shape of the shard ``desc`` names: a ``CROSS_MEMORY`` descriptor or a shared block's
    ``(pid, fd, inode, shape, tenure)``; None for anything else (no descriptor: not pulled here)."""
    if not isinstance(desc, tuple):
        return None
    if len(desc) == 9 and desc[0] == CROSS_MEMORY:
        return tuple(desc[7])
    if len(desc) == 5 and isinstance(desc[3], tuple):
        return desc[3]
    return None


def _within(box, shape) -> bool:
    return len(box) == len(shape) and all(0 <= lo <= hi <= n for (lo, hi), n in zip(box, shape, strict=True))


@dataclass(frozen=True, eq=False)
class Rows:
    """How one pull is read: ``remote`` ``(offset in the holder's shard, length)`` rows, each a
    span of the shard; ``local`` ``(offset in the destination, length)`` rows the spans' bytes go
    to, in order (``trash``: a gap between two runs of a span, read into scratch); ``per_span``,
    how many local rows each span fills."""

    remote: np.ndarray
    local: np.ndarray
    trash: np.ndarray
    per_span: np.ndarray


@functools.lru_cache(maxsize=4096)
def rows_of(src_shape, dst_shape, itemsize: int, read, write) -> Rows:
    """The rows that copy box ``read`` of a C-contiguous array of ``src_shape`` into box ``write``
    of one of ``dst_shape`` (module docstring). The runs of both sides are paired in order (the
    longer ones cut to the other's: both are the box's trailing extents); runs of the source less
    than ``GAP_BYTES`` apart are read as one span, at most ``SPAN_RUNS`` to a span."""
    shape = box_shape(read)
    if shape != box_shape(write):
        raise ReshardError(f"a pull reads box {read} into box {write} of another shape (program bug)")
    if 0 in shape:
        empty = np.zeros((0, 2), np.int64)
        return Rows(empty, empty, np.zeros(0, bool), np.zeros(0, np.int64))
    src, src_len = runs(src_shape, itemsize, list(read))
    dst, dst_len = runs(dst_shape, itemsize, list(write))
    length = min(src_len, dst_len)
    src = _cut(src, src_len, length).astype(np.int64)
    dst = _cut(dst, dst_len, length).astype(np.int64)
    n = len(src)
    gaps = np.append(src[1:] - src[:-1] - length, 0)  # after each run, to the next (C order: never negative)
    starts = np.append(True, gaps[:-1] > GAP_BYTES)
    group = np.cumsum(starts) - 1
    at = np.arange(n) - np.flatnonzero(starts)[group]  # runs since its group began
    starts |= at % SPAN_RUNS == 0
    ends = np.append(starts[1:], True)
    span = np.cumsum(starts) - 1
    first, last = np.flatnonzero(starts), np.flatnonzero(ends)
    remote = np.stack([src[first], src[last] + length - src[first]], axis=1)
    gap_after = ~ends & (gaps > 0)  # a trash row after the run
    local = np.zeros((n, 2, 2), np.int64)
    local[:, 0] = np.stack([dst, np.full(n, length)], axis=1)
    local[:, 1, 1] = gaps
    keep = np.stack([np.ones(n, bool), gap_after], axis=1).ravel()
    trash = np.stack([np.zeros(n, bool), gap_after], axis=1).ravel()[keep]
    per_span = np.bincount(span, weights=1 + gap_after, minlength=len(first)).astype(np.int64)
    return Rows(remote, local.reshape(-1, 2)[keep], trash, per_span)


def _cut(offsets: np.ndarray, length: int, to: int) -> np.ndarray:
    if length == to:
        return offsets
    pieces = np.arange(length // to, dtype=np.uint64) * np.uint64(to)
    return (offsets[:, None] + pieces[None, :]).ravel()


def source_of(key, cells: list, tenures: list, reads: list, places: list) -> Source:
    """The rows of every read out of one holder's process, cut into calls of at most ``IOV_MAX``
    rows a side (at spans' ends). Spans of different shards that lie at most ``SHARD_GAP_BYTES`` apart
    in the holder (small tensors a framework allocated one after another) are read as one, the gap
    into scratch (``merge_spans``); the rows as listed, one span per pull, stay as ``unmerged``,
    read instead if a merged read falls short (a gap that is not mapped)."""
    holder, pid, fd, inode = key
    tables = [t for _, t in reads]
    remote = np.concatenate([t.remote for t in tables]).astype(np.uint64)
    remote[:, 0] += np.repeat(np.array([a for a, _ in reads], np.uint64), [len(t.remote) for t in tables])
    local = np.concatenate([t.local for t in tables]).astype(np.uint64)
    trash = np.concatenate([t.trash for t in tables])
    local[:, 0] += np.repeat(np.array(places, np.uint64), [len(t.local) for t in tables])
    local[trash, 0] = 0  # the scratch buffer's start, added at run time
    per_span = np.concatenate([t.per_span for t in tables])
    board, cells_, tenures_ = (fd, inode), np.array(cells, np.int64), np.array(tenures, np.uint64)
    listed = Source(holder, pid, board, cells_, tenures_, remote, local, trash, _calls(remote, per_span))
    merged = merge_spans(remote, local, trash, per_span)
    if merged is None:
        return listed
    remote, local, trash, per_span = merged
    return Source(holder, pid, board, cells_, tenures_, remote, local, trash, _calls(remote, per_span), listed)


def _calls(remote: np.ndarray, per_span: np.ndarray) -> tuple[tuple[int, int, int, int, int], ...]:
    """``(first span, end, first local row, end, bytes)`` of each call: as many spans as fit
    ``IOV_MAX`` rows on both sides."""
    local_ends = np.concatenate([[0], np.cumsum(per_span)])
    byte_ends = np.concatenate([[0], np.cumsum(remote[:, 1].astype(np.int64))])
    calls, span = [], 0
    while span < len(per_span):
        stop = min(span + IOV_MAX, int(np.searchsorted(local_ends, local_ends[span] + IOV_MAX, side="right")) - 1)
        stop = max(stop, span + 1)
        calls.append((span, stop, int(local_ends[span]), int(local_ends[stop]), int(byte_ends[stop] - byte_ends[span])))
        span = stop
    return tuple(calls)


def merge_spans(remote: np.ndarray, local: np.ndarray, trash: np.ndarray, per_span: np.ndarray):
    """The spans (``remote`` rows, each filling its ``per_span`` local rows) in address order, those
    that start at most ``SHARD_GAP_BYTES`` after the last one ended read as one remote row (a trash row
    for the gap; at most ``MERGED_ROWS`` local rows a merged span, so a call still fits
    ``IOV_MAX``): ``(remote, local, trash, per_span)``, or None when no two spans merge."""
    n = len(remote)
    if n < 2:
        return None
    order = np.argsort(remote[:, 0], kind="stable")
    start = remote[order, 0].astype(np.int64)
    end = start + remote[order, 1].astype(np.int64)
    gap = np.zeros(n, np.int64)
    gap[1:] = start[1:] - np.maximum.accumulate(end)[:-1]  # negative: overlaps what came before
    join = (gap >= 0) & (gap <= SHARD_GAP_BYTES)
    join[0] = False
    rows = per_span[order].astype(np.int64)
    # cut runs of joined spans into pieces of at most MERGED_ROWS local rows, a member's gap row included
    weight = rows + (join & (gap > 0))
    first = np.flatnonzero(~join)
    total = np.cumsum(weight)
    within = total - (total[first] - weight[first])[np.cumsum(~join) - 1]  # rows of its run up to it
    piece = (within - 1) // MERGED_ROWS
    join[1:] &= piece[1:] == piece[:-1]
    if not join.any():
        return None
    extra = join & (gap > 0)  # a trash row for the gap before the span
    first = np.flatnonzero(~join)
    merged = np.stack([start[first], np.maximum.reduceat(end, first) - start[first]], axis=1).astype(np.uint64)
    # the local rows in span order, each merged member's gap row before its own
    out_rows = rows + extra
    out_start = np.cumsum(out_rows) - rows  # where each span's own rows go
    gaps_at = out_start[extra] - 1
    kept = np.delete(np.arange(int(out_rows.sum())), gaps_at)
    listed = np.repeat(np.concatenate([[0], np.cumsum(per_span)])[:-1][order] - out_start, rows) + kept
    new_local = np.zeros((len(kept) + len(gaps_at), 2), np.uint64)
    new_trash = np.ones(len(new_local), bool)
    new_local[kept], new_trash[kept] = local[listed], trash[listed]
    new_local[gaps_at, 1] = gap[extra].astype(np.uint64)  # at the scratch buffer's start
    return merged, new_local, new_trash, np.add.reduceat(out_rows, first)


class UnitRun:
    """One run of a unit on a device: its block, each part's destination a view of it (``views``,
    in the order of ``unit.places``); ``read`` fills them, ``check`` says every shard read is still
    its holder's, ``placed`` names them for the store."""

    def __init__(self, unit: HostUnit, device: int, peers, block: np.ndarray, file: tuple[int, int, int] | None):
        self.unit, self.device, self.peers = unit, device, peers
        self.block, self.file = block, file

    @functools.cached_property
    def views(self) -> list:
        """Made where they are used one by one: a replay's staged results are committed block to
        block (``outputs``)."""
        return self.unit.places.views(self.block)

    @property
    def dsts(self) -> dict:
        """Part index -> its destination."""
        return dict(zip(self.unit.places.parts, self.views, strict=True))

    def placed(self, run: str, staged: bool = False) -> PlacedShards:
        """The destinations as run ``run``'s new shards, named ``shard_name(run, tensor)``, each
        with its address and, for those peers map, ``(fd, inode, offset)`` in the block's
        shared-memory file (else None). ``staged``: results staged for a commit, which nobody
        maps: no views (the store makes them if the commit copies them one by one), no addresses."""
        p = self.unit.places
        if staged:
            no: list = []
            kinds = p.shape_ids, p.distinct, p.shapes
            return PlacedShards(run, None, p.dtypes, p.metas, no, p.sizes, no, p.tensors, *kinds, self.block, p)
        addresses = (p.offsets + self.block.ctypes.data).tolist()
        files: list = [None] * len(addresses)
        if self.file is not None:
            fd, inode, at = self.file
            offsets = p.offsets.tolist()
            files = [(fd, inode, at + o) if m else None for o, m in zip(offsets, p.mapped, strict=True)]
        return PlacedShards(
            run,
            self.views,
            p.dtypes,
            p.metas,
            addresses,
            p.sizes,
            files,
            p.tensors,
            p.shape_ids,
            p.distinct,
            p.shapes,
            self.block,
            p,
        )

    def read(self) -> None:
        at = (_SCRATCH.ctypes.data, self.block.ctypes.data)
        for s in self.unit.sources:
            self._check(s)
            short = _read(s, at)
            if short is not None and s.unmerged is not None:  # a merged gap was not mapped: as listed
                short = _read(s.unmerged, at)
            if short is not None:
                raise read_failed(self.device, s.holder, s.pid, *short)
        if self.unit.mapped:
            views = self.views
            for m, src in zip(self.unit.mapped, self.peers.get_all(self.unit.wanted), strict=True):
                arrays.copy(views[m.at][m.write], src[m.read])

    def land(self, window: int, staging: np.ndarray) -> None:
        """Copy the pieces of issue window ``window`` that landed in ``staging`` (a uint8 array)
        into their destinations (``Landing``): ``process_vm_readv`` of this process's own memory
        as a copy of ``IOV_MAX`` rows a call."""
        landing = self.unit.landings[window] if self.unit.landings else None
        if landing is None:
            return
        if landing.staging_end > staging.nbytes:
            raise ReshardError(
                f"device {self.device}: window {window} lands pieces up to byte {landing.staging_end} of a "
                f"{staging.nbytes}-byte staging buffer (program bug)"
            )
        local, remote = landing.local.copy(), landing.remote.copy()
        local[:, 0] += np.uint64(self.block.ctypes.data)
        remote[:, 0] += np.uint64(staging.ctypes.data)
        pid = os.getpid()
        for k in range(0, len(local), IOV_MAX):
            want = int(local[k : k + IOV_MAX, 1].sum())
            got = read_rows(pid, local[k : k + IOV_MAX], remote[k : k + IOV_MAX])
            if got != want:
                raise ReshardError(
                    f"device {self.device}: copying window {window}'s received pieces into its destinations moved "
                    f"{got} of {want} bytes"
                )

    def check(self) -> None:
        for s in self.unit.sources:
            self._check(s)
        if self.unit.wanted:
            self.peers.check_all(self.unit.wanted)

    def _check(self, s: Source) -> None:
        cells = self.peers.board(s.holder, s.pid, *s.board)
        if not np.array_equal(cells[s.cells], s.tenures):
            raise shard_gone(self.device, s.holder)


def copy_places(dst: np.ndarray, src: np.ndarray, places: Places) -> None:
    """Copy every destination ``places`` lays out in block ``src`` to the same place in block
    ``dst``: a group's at once (one strided copy of its rows), the bytes between them untouched."""
    for shape, storage, offset, count, stride in places.groups:
        size = storage.itemsize * math.prod(shape)
        to, of = (np.ndarray((count, size), np.uint8, block, offset, (stride, 1)) for block in (dst, src))
        np.copyto(to, of)


def _views(block: np.ndarray, shape: tuple[int, ...], storage: np.dtype, offset: int, count: int, stride: int):
    """``count`` C-contiguous arrays of ``shape`` in ``block``, ``stride`` bytes apart from
    ``offset``: the rows of one strided array (numpy makes a row's view far faster than an array
    from a buffer), or one by one where a row would be a scalar (a 0-d shape)."""
    if not shape or count == 1:
        return map(
            np.ndarray,
            itertools.repeat(shape, count),
            itertools.repeat(storage),
            itertools.repeat(block),
            range(offset, offset + count * stride, stride),
        )
    inner = [storage.itemsize] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        inner[k] = inner[k + 1] * shape[k + 1]
    return np.ndarray((count, *shape), storage, block, offset, (stride, *inner))


def _read(s: Source, at: tuple[int, int]) -> tuple[int, int] | None:
    """Read source ``s``'s rows (``at``: the scratch buffer's and the block's addresses); None, or
    ``(got, wanted)`` bytes of the first call that fell short."""
    local = s.located.get(at)
    if local is None:
        local = s.local.copy()
        local[:, 0] += np.where(s.trash, *map(np.uint64, at))
        s.located.clear()
        s.located[at] = local
    for first, end, local_first, local_end, want in s.calls:
        got = read_rows(s.pid, local[local_first:local_end], s.remote[first:end])
        if got != want:
            return got, want
    return None


#: Where the gaps between runs of a span are read to: never read back, so every run shares it.
_SCRATCH = np.empty(max(GAP_BYTES, SHARD_GAP_BYTES), np.uint8)

__all__ = ["HostUnit", "UnitRun", "copy_places", "unit_for"]

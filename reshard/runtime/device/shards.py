"""A device's memory: named shards, who holds them, freed memory kept for reuse.

Ownership. A shard lives while some HOLDER holds it: the handle that created it
(``distribute``/``reshard``), and every copy of that handle made since (pickled into a Ray task or
actor, ``copy.deepcopy``) — each copy holds it under an id of its own and releases it when it is
garbage-collected, so a copy never frees what another handle still uses. A pickled handle holds the
shard under a token until it is unpickled somewhere (the first copy to unpickle it takes over).
``free()`` on any handle drops the shard for all of them. Holder updates travel as ordered calls
(``reshard.runtime.device.inbox``); a release that arrives before its acquire is remembered so the late
acquire is ignored.

Reuse. A dropped shard's memory goes to a pool keyed by byte size (bounded by ``limit_bytes``,
least recently freed evicted first) when nothing else references it, so a new shard of a size
seen before does not page-fault fresh memory in.

Assembly. A run's new destination that will live in fresh shared memory is assembled in a warm
private buffer (``AssemblyBuffer``) and then written into a fresh memfd block through the file in
one pass (``SharedShards.adopt``): making shared pages by faulting them in costs far more than
the copy (``python -m bench.fresh_memory``). A freed shard of the same size (the pool) is reused
in place instead; a run whose destination peers read while it runs (relays) writes it in place.

Aborted runs. When the controller gives up on a run, it names the run's destination shard here
(``tombstone``): the shard is dropped now if it exists, and a run that finishes later drops it
instead of keeping it.

Staged results. A run into the user's tensors (``out=``) keeps its results until its commit copies
them (``staged_results``) and drops them (``free_staged``). Those its unit made (thousands of small
views of one block) are kept as one entry of the run, not as named shards: nobody else reads
them, and a name table entry each, put and popped every replay, was most of a commit's cost. They
are the run's controller's, as its named shards are: let go of with the holds of a process that
ended (``release_where``).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import sys
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from reshard.runtime import arrays
from reshard.runtime.device.shared_memory import HEADER, base_address
from reshard.runtime.messages import shard_name, shard_names

log = logging.getLogger(__name__)

TOMBSTONES = 4096  # names of aborted runs remembered
USER = "user"  # the holder of a user's own tensor, until the user takes it back
RELEASED_TOKENS = 4096  # releases that arrived before their acquire
#: Smallest destination assembled apart: below it, making its few pages costs next to nothing.
ASSEMBLY_MIN_BYTES = 1 << 20
#: CPU shards smaller than this stay in private (pooled) memory where peers can read it by
#: cross-memory attach: a shared block costs a descriptor, a file and a mapping per shard (a
#: 12,000-tensor tree ran out of descriptors), and for a few KiB a kernel copy is as fast. Larger
#: ones do too once the device holds ``SharedShards.max_blocks`` blocks.
SMALL_SHARD_BYTES = 16 << 10
_DROPPED = object()  # what ``ShardStore._put`` returns for a shard of an aborted run


class _StagedUnit(NamedTuple):
    """A run's results its unit made, staged for a commit, as one entry (module docstring):
    ``positions``: tensor (its index in the batch) -> position; each one's view, dtype and
    shape; the block they are views of, and where each lies in it (``layout``: the unit's
    ``host_unit.Places``)."""

    positions: dict[int, int]
    views: list | None  # None: made when first read (``staged_results``)
    dtypes: tuple[str, ...]
    shapes: list[tuple[int, ...]]
    block: np.ndarray | None = None
    layout: Any = None  # the unit's ``host_unit.Places``


_NO_UNIT = _StagedUnit({}, [], (), [])


@dataclass(frozen=True, slots=True)
class PlacedShards:
    """A run's new shards that are views of its unit's block (``host_unit``), as columns: kept all
    at once (``ShardStore.put_run``), named ``shard_name(run, tensor)``. ``metas``: what each is
    a shard of (None: nothing said); ``tensors``: the batch tensor each is of; ``shape_ids``: each
    shape's index in ``distinct``; ``shapes``, each one's."""

    run: str
    views: list | None  # None: staged results, viewed when the commit copies them one by one
    dtypes: tuple[str, ...]
    metas: tuple | list | None
    addresses: list[int]
    sizes: tuple[int, ...]
    files: list
    tensors: tuple[int, ...]
    shape_ids: np.ndarray
    distinct: tuple[tuple[int, ...], ...]
    shapes: list[tuple[int, ...]]
    block: np.ndarray | None = None
    layout: Any = None  # the unit's ``host_unit.Places``

    @property
    def names(self) -> list[str]:
        """Each one's name (made on each use: results staged for a commit need none)."""
        return shard_names(self.run, self.tensors)


def _nbytes(shape, storage: np.dtype) -> int:
    numel = 1
    for n in shape:
        numel *= n
    return numel * storage.itemsize


class BufferPool:
    """Freed numpy shards' memory kept for reuse, keyed by byte size; idle bytes stay within
    ``limit_bytes``. (A GPU device's tensors go back to torch's caching allocator instead.)"""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = int(limit_bytes)
        self.idle: OrderedDict = OrderedDict()  # (nbytes, serial) -> flat uint8 array
        self.by_size: dict[int, list[int]] = {}
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._serial = 0

    def take(self, nbytes: int) -> np.ndarray | None:
        serials = self.by_size.get(nbytes)
        if not serials:
            self.misses += 1
            return None
        serial = serials.pop()
        if not serials:
            del self.by_size[nbytes]
        self.nbytes -= nbytes
        self.hits += 1
        return self.idle.pop((nbytes, serial))

    def put(self, a, refs: int) -> bool:
        """Keep ``a``'s memory if ``a`` is a numpy array that spans all of it and nothing else
        references it or a view of it (``refs``: the caller's own references); evict the oldest
        entries to stay within the bound."""
        if not arrays.is_numpy(a) or not 0 < a.nbytes <= self.limit_bytes or not a.flags.c_contiguous:
            return False
        if sys.getrefcount(a) > refs + 2:
            return False  # the array itself is referenced elsewhere (a torch tensor over it, say)
        owner = a if a.base is None else a.base  # numpy points every view at the memory's owner
        if owner is not a:
            if not isinstance(owner, np.ndarray) or owner.nbytes != a.nbytes or sys.getrefcount(owner) > 3:
                return False  # part of a bigger array, or another view of it is alive
        flat = owner if owner.ndim == 1 and owner.dtype == np.uint8 else owner.reshape(-1).view(np.uint8)
        nbytes = a.nbytes
        self._serial += 1
        self.idle[(nbytes, self._serial)] = flat
        self.by_size.setdefault(nbytes, []).append(self._serial)
        self.nbytes += nbytes
        while self.nbytes > self.limit_bytes:
            (n, serial), _ = self.idle.popitem(last=False)
            lst = self.by_size[n]
            lst.remove(serial)
            if not lst:
                del self.by_size[n]
            self.nbytes -= n
        return True

    def evict(self, which, count: int) -> int:
        """Free up to ``count`` idle entries that ``which(flat)`` accepts, oldest first; returns
        how many went."""
        gone = list(itertools.islice((key for key, flat in self.idle.items() if which(flat)), max(0, count)))
        for nbytes, serial in gone:
            del self.idle[(nbytes, serial)]
            lst = self.by_size[nbytes]
            lst.remove(serial)
            if not lst:
                del self.by_size[nbytes]
            self.nbytes -= nbytes
        return len(gone)

    def clear(self) -> None:
        self.idle.clear()
        self.by_size.clear()
        self.nbytes = 0


class AssemblyBuffer:
    """One private byte buffer per device in which new destinations are assembled, one at a time,
    kept between runs up to ``keep_bytes`` (a destination larger than that, or below
    ``ASSEMBLY_MIN_BYTES``, is written in place)."""

    def __init__(self, keep_bytes: int):
        self.keep_bytes = int(keep_bytes)
        self.buf: np.ndarray | None = None
        self.busy = False

    @property
    def nbytes(self) -> int:
        return 0 if self.buf is None else int(self.buf.nbytes)

    def take(self, nbytes: int) -> np.ndarray | None:
        """``nbytes`` of the buffer (grown if needed), or None: in use, or the size is out of bounds."""
        if self.busy or not ASSEMBLY_MIN_BYTES <= nbytes <= self.keep_bytes:
            return None
        buf = self.buf
        if buf is None or buf.nbytes < nbytes:
            buf = self.buf = None  # free first: never hold two
            buf = self.buf = np.empty(nbytes, dtype=np.uint8)
        self.busy = True
        return buf[:nbytes]

    def give(self) -> None:
        self.busy = False

    def clear(self) -> None:
        self.buf = None
        self.busy = False


class ShardStore:
    """Named shards of one device with their holders (module docstring). Thread-safe."""

    def __init__(self, device: int, device_type: str, pool_bytes: int, shared=None, assembly_bytes: int = 0):
        self.device = device
        self.device_type = device_type  # "cpu": numpy shards; else cupy arrays on that GPU
        self.pool = BufferPool(pool_bytes)
        cpu_shared = shared is not None and device_type == "cpu"
        self.assembly = AssemblyBuffer(assembly_bytes if cpu_shared else 0)
        self._assembling: np.ndarray | None = None  # the destination being assembled
        self._evict_after = -1  # the pool's serial when it last had no idle block to free (``_private``)
        self.shared = shared  # SharedShards (CPU), GpuBlocks (GPU), or None: private memory
        self.shards: dict = {}  # name -> numpy array (CPU) or torch tensor
        self.holders: dict[str, tuple[str, ...]] = {}  # tuples: the collector stops tracking them
        self._released: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self.meta: dict[str, dict] = {}  # name -> what its owner said of it (global shape, placements, ...)
        self.dtypes: dict[str, str] = {}  # name -> dtype name (an array of bit patterns does not say it)
        #: name -> the last reshard that committed into it (``wrote``), or a replay's cell
        self.versions: dict[str, str | list] = {}
        self._versioned = 0  # bumped when entries that may be cells are overwritten or dropped
        self.users: set[str] = set()  # shards that are a user's own tensors: never pooled
        self.blocks: dict[int, tuple] = {}  # id -> a unit's (block, file, bytes asked) (``allocate_block``)
        self.placed: dict[str, int] = {}  # name -> address of a shard that is a view of a unit's block
        self._staged: dict[str, _StagedUnit] = {}  # run -> its unit's staged results
        #: how often a ``watched`` shard left or was replaced: names checked at one count are the
        #: same shards while it stays (``outputs.Outputs.check``: a replay's outputs checked once)
        self.edits = 0
        self.watched: set[str] = set()
        self._lock = threading.RLock()

    def __contains__(self, name: str) -> bool:
        return name in self.shards

    def get(self, name: str):
        return self.shards.get(name)

    def dtype(self, name: str) -> str:
        """The dtype name of shard ``name`` (KeyError: no such shard)."""
        return self.dtypes[name]

    def wrote(self, names, run: str, cell: list | None = None) -> None:
        """Reshard ``run`` committed into the user's shards ``names`` here: readers compare it
        across devices (``version``; a ``direct`` write is not all or nothing, and sets none).
        ``cell``: the names are outputs committed into together at every replay; their entries
        share it (``[run, count]``), so while no other write or drop has touched an entry since
        they were given it, a commit sets one value, not one per name."""
        with self._lock:
            if cell is not None and len(cell) == 2 and cell[1] == self._versioned:
                cell[0] = run
                return
            self._versioned += 1  # the entries overwritten may be another cell's
            value: str | list = run if cell is None else cell
            if cell is not None:
                cell[:] = [run, self._versioned]
            self.versions.update(dict.fromkeys(filter(self.shards.__contains__, names), value))  # no pair each

    def version(self, name: str) -> str | None:
        """The last reshard that committed into shard ``name`` (None: none since it was shared or
        made)."""
        v = self.versions.get(name)
        return v[0] if isinstance(v, list) else v

    def _unversion(self, name: str) -> None:
        if type(self.versions.pop(name, None)) is list:
            self._versioned += 1

    def allocate(self, shape, dtype: str, *, shared: bool = True, mapped: bool = False):
        """A new shard's memory (dtype by name): on a CPU device a numpy array in pooled memory of
        the same byte size, else fresh (shared, unless ``shared`` is False: nobody maps it) memory;
        on a GPU a cupy array. A CPU shard under ``SMALL_SHARD_BYTES`` stays in private memory where
        peers read it by cross-memory attach (no descriptor per small shard), unless ``mapped``:
        peers map it (a relay is published in it)."""
        storage = arrays.storage(dtype)
        if self.device_type != "cpu":
            nbytes = _nbytes(shape, storage)
            if nbytes and shared and self.shared is not None:  # a block of its own: peers on its GPU pull it
                return self.shared.allocate(nbytes).view(storage).reshape(tuple(shape))
            import cupy

            with cupy.cuda.Device(int(self.device_type.partition(":")[2] or 0)):
                return cupy.empty(tuple(shape), dtype=storage)
        nbytes = _nbytes(shape, storage)
        with self._lock:
            # a pooled small shard is private memory: not for one peers must map
            flat = self.pool.take(nbytes) if nbytes and not (mapped and self._private(nbytes)) else None
        if flat is None and nbytes and shared and self.shared is not None and (mapped or not self._private(nbytes)):
            flat = self._shared_or_none(self.shared.allocate, nbytes, shape)
        if flat is None:
            return np.empty(tuple(shape), dtype=storage)
        return flat.view(storage).reshape(tuple(shape))

    def _private(self, nbytes: int) -> bool:
        """A CPU shard kept in private memory: peers can read this process's memory, and the shard
        is small or the device holds as many shared blocks as it may (``SharedShards.has_room``)
        even after freeing the idle ones of its pool (a pool of freed blocks must not keep new
        shards out of shared memory)."""
        shared = self.shared
        if getattr(shared, "private", None) is None:
            return False
        if nbytes < SMALL_SHARD_BYTES:
            return True
        if not shared.has_room() and self._evict_after != self.pool._serial:
            with self._lock:
                want = len(shared.blocks) - shared.max_blocks + 1
                if self.pool.evict(shared.holds_block, want) < want:
                    self._evict_after = self.pool._serial  # none left: look again once the pool changed
        return not shared.has_room()

    def allocate_many(self, specs) -> list:
        """New shards of one call (``(shape, dtype)`` each): on a GPU device whose peers pull through
        CUDA IPC, pieces of one block (one handle for all of them); elsewhere each as
        ``allocate_destination`` makes it."""
        if self.device_type == "cpu" or self.shared is None:
            return [self.allocate_destination(shape, dtype) for shape, dtype in specs]
        storages = [arrays.storage(dtype) for _, dtype in specs]
        sizes = [_nbytes(shape, st) for (shape, _), st in zip(specs, storages, strict=True)]
        kept = [(n, (tuple(shape), st)) for (shape, _), st, n in zip(specs, storages, sizes, strict=True) if n]
        made = iter(self.shared.allocate_many([n for n, _ in kept], [form for _, form in kept]))
        return [
            next(made) if n else self.allocate(shape, dtype) for (shape, dtype), n in zip(specs, sizes, strict=True)
        ]

    def allocate_block(self, nbytes: int, shared: bool) -> tuple[np.ndarray, tuple[int, int, int] | None]:
        """Bytes for one run's unit of destinations, each a view of them (``host_unit``): a block of
        that size and kind whose views are all gone (a run's before, its shards freed), else a fresh
        one; ``shared``: in shared memory if the device may make one more block, returned with
        ``(fd, inode, offset)`` of its file (else None: private memory). Idle blocks of other sizes
        and kinds stay for the calls they fit (fresh memory is slow to fault in), the least recently
        used let go beyond the pool's byte limit."""
        with self._lock:
            found, idle = None, []
            for key in list(self.blocks):
                block, file, size = self.blocks[key]
                if sys.getrefcount(block) > 3:  # this dict's entry, ``block`` and the call's own: views are alive
                    continue
                if found is None and size == nbytes and (file is not None) == shared:
                    found = key
                else:
                    idle.append((key, size))
            spare = sum(size for _, size in idle) - self.pool.limit_bytes
            for key, size in idle:  # oldest first
                if spare <= 0:
                    break
                del self.blocks[key]
                spare -= size
            if found is not None:
                self.pool.hits += 1
                entry = self.blocks[found] = self.blocks.pop(found)  # the most recently used: last
                return entry[0], entry[1]
            self.pool.misses += 1
            block, file = None, None
            if shared and self.shared is not None and self.shared.has_room():
                # a byte more than its views: none fills it, so none is taken for a block of its own
                block = self._shared_or_none(self.shared.allocate, nbytes + 1, (nbytes,))
            if block is None:
                block = np.empty(nbytes, np.uint8)
            else:
                fd, inode, _, _ = self.shared.blocks[base_address(block)]
                file = (fd, inode, HEADER)
            self.blocks[id(block)] = (block, file, nbytes)
            return block, file

    def _idle_blocks(self) -> list[int]:
        return [k for k in self.blocks if sys.getrefcount(self.blocks[k][0]) <= 2]  # the entry's and the call's

    def recycle(self, scratch) -> bool:
        """Give ``scratch`` (memory from ``allocate`` that never became a shard: a run's scratch
        buffer) to the pool, for the next run's scratch or destination of its size; kept only when
        the caller's one reference is the last (``BufferPool.put``). Returns whether it was kept."""
        if scratch is None:
            return False
        with self._lock:
            return self._give_back(scratch, 2)  # this call's reference and the caller's

    def _give_back(self, t, refs: int) -> bool:
        """``t``'s memory to the pool of its kind (``refs``: the caller's references to it; this
        call's own is added)."""
        if self.device_type == "cpu":
            return self.pool.put(t, refs + 1)
        return self.shared is not None and self.shared.release(t)

    def _shared_or_none(self, make, arg, shape):
        """``make(arg)``, a shared block, or None when the process is out of descriptors: the shard
        is then private, moved by the backend (peers cannot pull it). Out of memory raises: so would
        private memory."""
        try:
            return make(arg)
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            log.warning("device %d: shard of %s not in shared memory (%s)", self.device, tuple(shape), e)
            return None

    def allocate_destination(self, shape, dtype: str):
        """A run's new destination: a freed shard's memory of its size if the pool has one, else
        (shared memory, size within bounds) the assembly buffer, which ``settle`` turns into a
        shard; else ``allocate``."""
        storage = arrays.storage(dtype)
        nbytes = _nbytes(shape, storage)
        with self._lock:
            flat = self.pool.take(nbytes) if nbytes else None
            if flat is None and not self._private(nbytes):
                flat = self.assembly.take(nbytes)
                if flat is not None:
                    self._assembling = flat.view(storage).reshape(tuple(shape))
                    return self._assembling
        if flat is not None:
            return flat.view(storage).reshape(tuple(shape))
        return self.allocate(shape, dtype)

    def assembled(self, t) -> bool:
        """Whether ``t`` is the destination being assembled (not yet a shard's own memory)."""
        return t is not None and t is self._assembling

    def settle(self, t):
        """``t``, a run's finished destination, in memory of its own: an assembled one is copied
        into a fresh shared block (``SharedShards.adopt``) and the buffer freed for the next."""
        if not self.assembled(t):
            return t
        flat = t.reshape(-1).view(np.uint8)
        try:
            out = self._shared_or_none(self.shared.adopt, flat, t.shape)
            return (flat.copy() if out is None else out).view(t.dtype).reshape(t.shape)
        finally:
            self.abandon(t)

    def abandon(self, t) -> None:
        """``t`` is no longer being assembled (its run failed, or ``settle`` copied it out): the
        buffer is free for the next destination."""
        with self._lock:
            if self.assembled(t):
                self._assembling = None
                self.assembly.give()

    def begin(self, t) -> tuple | None:
        """Give ``t`` (a run's new destination shard) its tenure now, before it is ``put`` (peers
        pull relays out of it while the run goes on); its descriptor, None if it is not shared."""
        return None if self.shared is None else self.shared.begin(t)

    def end(self, t) -> None:
        """``t`` got a tenure (``begin``) but will not be put: descriptors of it stop mapping."""
        if self.shared is not None:
            self.shared.end(t)

    def put(self, name: str, t, holder: str, dtype: str, meta: dict | None = None, *, begun: bool = False) -> bool:
        """Keep ``t`` (of dtype ``dtype``, by name) as shard ``name`` held by ``holder``; False (and
        ``t`` dropped) when the run that made it was aborted meanwhile. ``meta``: what it is a
        shard of; ``begun``: ``t`` has its tenure already (``begin``)."""
        return self._put(name, t, holder, dtype, meta, begun) is not _DROPPED

    def _put(self, name: str, t, holder: str, dtype: str, meta: dict | None, begun: bool):
        """``put``, returning ``t``'s descriptor (None: peers cannot map it) or ``_DROPPED``."""
        with self._lock:
            if name in self._tombstones:
                self._tombstones.pop(name)
                if begun:
                    self.end(t)
                self._give_back(t, 1)
                return _DROPPED
            self._record(name, t, holder, dtype, meta)
            if self.shared is None:
                return None
            return self.shared.descriptor(t) if begun else self.shared.begin(t)

    def _record(self, name: str, t, holder: str, dtype: str, meta: dict | None) -> None:
        if name in self.shards:
            self._left(name)
            self.placed.pop(name, None)  # no longer that view
        self.shards[name] = t
        self.dtypes[name] = dtype
        self.holders[name] = (holder,)
        if meta:
            self.meta[name] = meta

    def put_run(
        self, run: str, entries, placed: PlacedShards | None = None, *, staged: bool = False
    ) -> tuple[list, object] | None:
        """Keep every ``(name, t, dtype, meta, begun)`` of run ``run`` (held by its own name), and
        ``placed``, its unit's destinations, all at once; or, when the run was aborted meanwhile
        (``tombstone``), none of them (None). Returns each entry's descriptor (None: peers cannot
        map it, or it was aborted by name), and those of ``placed`` (``_put_placed``; None
        without it). ``staged``: results staged for a commit (module docstring), which no peer
        maps: the unit's are kept as one entry, with no tenure and no descriptor."""
        with self._lock:
            if run in self._tombstones:
                self._tombstones.pop(run)
                for _, t, _, _, begun in entries:
                    if begun:
                        self.end(t)
                    self._give_back(t, 2)
                return None
            if self.shared is None or not self._tombstones.keys().isdisjoint(e[0] for e in entries):
                kept = [self._put(name, t, name, dtype, meta, begun) for name, t, dtype, meta, begun in entries]
            else:  # none aborted by name: recorded, then begun at once
                for name, t, dtype, meta, _ in entries:
                    self._record(name, t, name, dtype, meta)
                kept = self.shared.begin_many([e[1] for e in entries], [e[4] for e in entries])
            unit = None if placed is None else self._put_placed(placed, run if staged else None)
            return [None if d is _DROPPED else d for d in kept], unit

    def _put_placed(self, placed: PlacedShards, staged_run: str | None = None):
        """``put_run`` of a unit's destinations: no pool, no block of their own, their tenures
        begun in one pass (``SharedShards.begin_placed``), the store's tables updated column by
        column. Their descriptors: as columns (``messages.PlacedDescriptors``), or a list, one
        each (None: peers cannot map it), where they were kept one by one. ``staged_run``: they
        are that run's staged results, kept as one entry (module docstring)."""
        if staged_run is not None:
            positions = (
                dict(zip(placed.tensors, range(len(placed.tensors)), strict=True))
                if placed.layout is None
                else placed.layout.positions
            )
            self._staged[staged_run] = _StagedUnit(
                positions, placed.views, tuple(placed.dtypes), placed.shapes, placed.block, placed.layout
            )
            return [None] * len(positions)
        names, views = placed.names, placed.views or []
        if self._tombstones and not self._tombstones.keys().isdisjoint(names):
            metas = placed.metas or [None] * len(names)
            return [  # aborted by name (a load's): one by one
                None if d is _DROPPED else d
                for d in (
                    self._put(name, t, name, dtype, meta, False)
                    for name, t, dtype, meta in zip(names, views, placed.dtypes, metas, strict=True)
                )
            ]
        self.shards.update(zip(names, views, strict=True))
        self.dtypes.update(zip(names, placed.dtypes, strict=True))
        self.holders.update(zip(names, zip(names), strict=True))  # each held by its own name
        self.placed.update(zip(names, placed.addresses, strict=True))
        if placed.metas is not None:  # readers take a None one as none
            self.meta.update(zip(names, placed.metas, strict=True))
        if self.shared is None:
            return [None] * len(names)
        return self.shared.begin_placed(placed)

    def staged_results(self, run: str, tensors) -> tuple[list, list, list]:
        """Run ``run``'s staged results of ``tensors`` (indices in its batch; None where one is
        gone), their dtypes and their shapes (None where gone)."""
        with self._lock:
            unit = self._staged.get(run, _NO_UNIT)
            at: list = list(map(unit.positions.get, tensors))
            views, dtypes, shapes = unit.views, unit.dtypes, unit.shapes
            if views is None:  # viewed now, if any is wanted
                views = []
                if unit.layout is not None and unit.block is not None and at.count(None) < len(at):
                    views = unit.layout.views(unit.block)
            if None not in at:  # all the unit's: column by column
                found, kinds, forms = (list(map(c.__getitem__, at)) for c in (views, dtypes, shapes))
                return found, kinds, forms
            names = [shard_name(run, t) for t in tensors]  # the others are named shards
            found = [self.shards.get(n) if i is None else views[i] for n, i in zip(names, at, strict=True)]
            kinds = [self.dtypes.get(n) if i is None else dtypes[i] for n, i in zip(names, at, strict=True)]
            forms = [
                (None if a is None else tuple(a.shape)) if i is None else shapes[i]
                for a, i in zip(found, at, strict=True)
            ]
            return found, kinds, forms

    def staged_unit(self, run: str) -> _StagedUnit | None:
        """Run ``run``'s unit's staged results (None: it staged none)."""
        return self._staged.get(run)

    def watch(self, names) -> int:
        """Count ``names`` (outputs about to be checked) in ``edits`` from now on; returns the count
        their check holds at."""
        with self._lock:
            self.watched.update(names)
            return self.edits

    def _left(self, name: str) -> None:
        if name in self.watched:
            self.edits += 1
            self.watched.discard(name)

    def block_at(self, address: int, nbytes: int, edits: int) -> np.ndarray | None:
        """The unit block (``allocate_block``) of at least ``nbytes`` that starts at ``address``,
        while no watched shard has left since ``edits`` (its views still alive: it is not another run's
        yet); else None. Held by the caller, it stays out of reuse."""
        with self._lock:
            if self.edits != edits:
                return None
            for block, _, size in self.blocks.values():
                if size >= nbytes and block.ctypes.data == address:
                    return block
            return None

    def free_staged(self, run: str, tensors) -> None:
        """Drop run ``run``'s staged results of ``tensors`` (its unit's entry, the others by name)."""
        with self._lock:
            positions = self._staged.pop(run, _NO_UNIT).positions
            if len(positions) < len(tensors):  # some are named shards (a unit's tensors are among them)
                self.free_many([shard_name(run, t) for t in tensors if t not in positions])

    def share(self, name: str, t, dtype: str, meta: dict, *, file: tuple[int, int] | None = None) -> None:
        """Make the user's tensor ``t`` (of dtype ``dtype``, by name) shard ``name`` (no copy; held
        by its user until ``unshare``). Sharing another tensor under a name in use ends the old one's
        tenure: descriptors of it stop reading (its memory may be freed now); sharing the same memory
        again keeps it (handles adopted before go on reading it). ``file``: ``(descriptor, offset)``
        of the shared-memory file ``t`` lies in (peers map it there)."""
        with self._lock:
            if name in self.shards and name not in self.users:
                raise ValueError(f"device {self.device} already holds a shard {name!r} of its own; pick another name")
            old = self.shards.get(name)
            again = old is not None and arrays.same_memory(old, t)
            if old is not None:
                self._left(name)
            if old is not None and not again and self.shared is not None:
                self.shared.end(old)
            self.shards[name] = t
            self.dtypes[name] = dtype
            self.holders[name] = (USER,)
            self.users.add(name)
            if self.shared is not None and not again:
                self.shared.begin(t, None if file is None else (file[0], os.fstat(file[0]).st_ino, file[1]))
            if not again:
                self._unversion(name)  # another tensor: nothing wrote it yet
            self.meta[name] = meta

    def unshare(self, name: str) -> None:
        """The user takes ``name`` back: handles on it can no longer read or reshard it."""
        with self._lock:
            if name in self.users:
                self._drop(name)

    def acquire(self, name: str, holder: str) -> bool:
        with self._lock:
            if (name, holder) in self._released:  # released before it arrived
                del self._released[(name, holder)]
                return False
            if name not in self.shards:
                return False
            held = self.holders[name]
            if holder not in held:
                self.holders[name] = (*held, holder)
            return True

    def release(self, name: str, holder: str) -> None:
        """``holder`` lets go; the shard is dropped when nobody holds it (a user's shard stays
        while its user holds it)."""
        with self._lock:
            held = self.holders.get(name)
            if held is None or holder not in held:
                if held is not None:  # the acquire has not arrived yet: ignore it when it does
                    self._released[(name, holder)] = None
                    while len(self._released) > RELEASED_TOKENS:
                        self._released.popitem(last=False)
                return
            held = self.holders[name] = tuple(h for h in held if h != holder)
            if not held:
                self._drop(name)

    def release_where(self, holds) -> list[str]:
        """Let go of every hold that ``holds(name, holder)`` accepts (the handles of a process that
        ended); returns the shards nobody holds any more, which are dropped (staged results too)."""
        dropped: list[str] = []
        with self._lock:
            for run, (positions, *_) in list(self._staged.items()):
                name = shard_name(run, next(iter(positions), 0))
                if holds(name, name):  # held by their own names, as the run's shards
                    del self._staged[run]
                    dropped.extend(shard_names(run, positions))
            for name, held in list(self.holders.items()):
                kept = tuple(h for h in held if not holds(name, h))
                if not kept:
                    self._drop(name)
                    dropped.append(name)
                elif len(kept) < len(held):
                    self.holders[name] = kept
        return dropped

    def free(self, name: str) -> bool:
        """Drop shard ``name`` whoever holds it (a user's own tensor only leaves the store)."""
        with self._lock:
            return self._drop(name)

    def free_many(self, names) -> int:
        """``free`` each of ``names``; those that are views of a unit's block (a tree's small
        outputs, thousands at once) column by column. Returns how many were dropped."""
        names = list(dict.fromkeys(names))  # once each
        with self._lock:
            placed = self.placed
            views = [n for n in names if n in placed]
            others = [n for n in names if n not in placed] if views else names
            if views:
                if not self.watched.isdisjoint(views):
                    self.edits += 1
                    self.watched.difference_update(views)
                shards = list(map(self.shards.pop, views))
                for table in (self.holders, self.meta, self.dtypes):
                    deque(map(table.pop, views, itertools.repeat(None)), maxlen=0)
                if list in set(map(type, map(self.versions.pop, views, itertools.repeat(None)))):
                    self._versioned += 1
                addresses = list(map(placed.pop, views))
                if self.shared is not None:
                    self.shared.end_placed(shards, addresses)
            return len(views) + sum(self._drop(n) for n in others)

    def tombstone(self, run: str, names=()) -> None:
        """The controller gave up on run ``run`` (a reshard, or a load named by its shard): a
        ``put`` of it that comes later keeps nothing; ``names``, shards it made already, are
        dropped now."""
        with self._lock:
            for name in names:
                self._drop(name)
            self._tombstones[run] = None
            while len(self._tombstones) > TOMBSTONES:
                self._tombstones.popitem(last=False)

    def _drop(self, name: str) -> bool:
        t = self.shards.pop(name, None)
        self.holders.pop(name, None)
        self.meta.pop(name, None)
        self.dtypes.pop(name, None)
        self._unversion(name)
        if t is None:
            return False
        self._left(name)
        at = self.placed.pop(name, None)
        if self.shared is not None:
            self.shared.end(t, at)  # peers' descriptors of it stop mapping, whatever the memory holds next
        if at is not None:  # a view of a unit's block: the block is reused once all its views are gone
            return True
        if name in self.users:  # the user's tensor: forget it, never recycle its memory
            self.users.discard(name)
            return True
        self._give_back(t, 1)
        return True

    def descriptor(self, t):
        """How peers on this machine map shard ``t`` (None: they cannot, it is not shared)."""
        return None if self.shared is None else self.shared.descriptor(t)

    def memory(self) -> dict:
        with self._lock:
            sizes = {k: int(v.nbytes) for k, v in self.shards.items()}
            return {
                "buffers": sizes,
                "buffer_bytes": sum(sizes.values()),
                "holders": {k: sorted(v) for k, v in self.holders.items()},
                "pool_bytes": self.pool.nbytes
                + sum(int(self.blocks[k][0].nbytes) for k in self._idle_blocks())
                + (
                    0 if self.device_type == "cpu" or self.shared is None else self.shared.idle_bytes
                ),  # idle freed shards kept for reuse
                "pool_limit_bytes": self.pool.limit_bytes,
                "pool_hits": self.pool.hits,
                "pool_misses": self.pool.misses,
                "assembly_bytes": self.assembly.nbytes,  # the private buffer destinations are assembled in
                "assembly_limit_bytes": self.assembly.keep_bytes,
            }

    def clear_pool(self) -> int:
        """Let go of the memory of freed shards kept for reuse: the pool and the units' blocks
        whose shards are all freed (``allocate_block``); the next shards take fresh memory.
        Returns the bytes let go of."""
        with self._lock:
            freed = self.pool.nbytes
            self.pool.clear()
            for k in self._idle_blocks():
                freed += int(self.blocks.pop(k)[0].nbytes)
            return freed

    def empty_cache(self) -> int:
        """Free the memory kept for reuse and idle now: freed shards (``clear_pool``) and the
        assembly buffer (unless a destination is being assembled in it). Returns the bytes freed."""
        with self._lock:
            freed = self.clear_pool()
            if self.device_type != "cpu" and self.shared is not None:
                freed += self.shared.empty_cache()
            if not self.assembly.busy:
                freed += self.assembly.nbytes
                self.assembly.clear()
            return freed

    def clear(self) -> None:
        with self._lock:
            self.edits += 1
            self.watched.clear()
            self._versioned += 1
            self.versions.clear()
            self.shards.clear()
            self.dtypes.clear()
            self.holders.clear()
            self.placed.clear()
            self.pool.clear()
            self.blocks.clear()
            self.assembly.clear()
            self._assembling = None

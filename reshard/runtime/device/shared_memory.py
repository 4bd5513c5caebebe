"""Shared memory between the CPU device actors of one machine.

An actor of a mesh created with ``shared_memory=True`` allocates its shards in ``memfd`` files
(anonymous shared memory that dies with the process: a killed actor leaks nothing).
``SharedShards.descriptor(t)`` names a shard to other processes as ``(pid, fd, inode, shape,
tenure)``; a peer on the same machine maps it READ-ONLY through ``/proc/<pid>/fd/<fd>``
(``PeerShards``; the inode guards against a reused descriptor number) and copies slices straight
out of it: the pulls of ``reshard.passes.pulls``.

Tenure. A block's memory outlives the shard in it (it is pooled, then holds the next shard of its
size; a peer's cached mapping keeps it too), so a descriptor alone cannot tell a puller that the
shard it names is gone. Each block starts with a header whose ``tenure`` the owner sets when a
shard takes the block (``begin``: a number never used before in this process) and clears when the
shard is dropped (``end``). A puller checks the descriptor's tenure before it copies and again
after (``PeerShards.check``): a shard freed before or during the reshard fails it, never yields
another tensor's bytes. A bug in one actor cannot write another's shard through its mapping; any
process of the same user may still open ``/proc/<pid>/fd`` itself, as it may attach a debugger
(the trust model of shared memory on one machine).

Relays. A device that relays slices it received (from another machine) to devices of its own
machine publishes them instead of sending them (``reshard.passes.pulls``). Its ``RelayBoard``, a small
memfd its peers map read-only, has a slot per run: the run's key, its destination shard's block
(fd, inode, tenure) and how many slices it has published so far (or ``FAILED``). A puller finds the
slot by key, waits until the count reaches the publication it needs (``PeerShards.relay``), maps
the destination shard like a source shard and checks its tenure after copying, as for source
shards. Slots are reused round robin, so a slot outlives its run by ``BOARD_SLOTS`` later runs
that relay on the same device.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import itertools
import mmap
import operator
import os
import platform
import resource
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from reshard.errors import ReshardError, ReshardTimeout
from reshard.runtime.backends.communicator import PeerFailed
from reshard.runtime.device import cross_memory
from reshard.runtime.device.cross_memory import RemoteShard, TenureBoard
from reshard.runtime.messages import CROSS_MEMORY, PlacedDescriptors

#: Bound on the peer mappings a device keeps: enough for every shard of a large model's state dict
#: from a few holders. A mapping of a shard its owner still holds costs no memory (the pages are the
#: owner's); one whose owner dropped the shard pins that memory, so those are dropped whenever the
#: device runs pulls (``PeerShards.purge``). Each keeps a descriptor (Python's ``mmap`` keeps a copy
#: of the one it mapped), so a low descriptor limit lowers it (``_peer_map_budget``).
PEER_MAPS = 4096
BATCHES = 16  # tuples of pulls whose views ``PeerShards.get_all`` keeps (a host unit's, one per binding)
#: Bound on a device's live shared-memory blocks (two descriptors and one mapping each): a tree of
#: tens of thousands of shards must not run the process out of descriptors. Shards past it stay in
#: private memory, which peers read by cross-memory attach (``reshard.runtime.device.cross_memory``).
MAX_BLOCKS = 1024
#: ``madvise`` advice that faults every page of a mapping in at once, writable (Linux >= 5.14; not
#: named by Python's mmap module yet): a fresh shard's pages are made in one call instead of one
#: trap per page while the first copy runs.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
HEADER = 64  # bytes before a block's data (alignment kept): its tenure, uint64, at offset 0
BOARD_SLOTS = 256  # runs whose publications a device's relay board holds at once
_KEY, _COUNT, _FD, _INODE, _TENURE = range(5)  # a board slot's words (uint64; 8 per slot)
FAILED = np.iinfo(np.uint64).max  # a slot's count once its run failed
#: How long a puller sleeps between looks at a publisher's board: doubling from the first to the
#: last (the slices it waits for cross a network, milliseconds at least); and how often it checks
#: that the publisher's process is still there.
POLL_S = (50e-6, 2e-3)
ALIVE_CHECK_S = 0.05


def base_address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _descriptor_limit() -> int | None:
    """The process's soft limit on open descriptors (None: none)."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else soft


def _block_budget() -> int:
    """Live blocks a device keeps at most: ``MAX_BLOCKS``, or where that is lower as many as take an
    eighth of the process's descriptor limit, two each (the file, and the copy Python's ``mmap``
    keeps)."""
    soft = _descriptor_limit()
    return MAX_BLOCKS if soft is None else max(1, min(MAX_BLOCKS, soft // 16))


def _peer_map_budget() -> int:
    """Peers' blocks a device keeps mapped at most: ``PEER_MAPS``, or where that is lower a quarter
    of the process's descriptor limit (each mapping keeps a descriptor). With ``_block_budget``
    the library takes at most 3/8 of the limit; the rest is the process's sockets, files and the
    user's own."""
    soft = _descriptor_limit()
    return PEER_MAPS if soft is None else max(16, min(PEER_MAPS, soft // 4))


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _populate(start: int, length: int) -> bool:
    """Make every page of the ``length`` mapped bytes at address ``start`` at once
    (``MADV_POPULATE_WRITE``), through ctypes so that the GIL is released meanwhile
    (``mmap.madvise`` holds it); False where the kernel cannot."""
    return _LIBC.madvise(start, length, MADV_POPULATE_WRITE) == 0


class SharedShards:
    """This actor's memfd-backed allocations, by start address while their mapping lives; and
    its shards in private memory, which peers read by cross-memory attach where the kernel lets
    them (``private``: ``reshard.runtime.device.cross_memory``)."""

    @staticmethod
    def available() -> bool:
        """memfd and /proc are there (Linux): elsewhere shards stay in private memory."""
        return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")

    def __init__(self, populate: bool = True, max_blocks: int | None = None):
        self.populate = populate
        self.blocks: dict[int, tuple[int, int, int, weakref.ref]] = {}  # data start -> (fd, inode, nbytes, mapping)
        self._tenures = itertools.count(1)
        self.private = TenureBoard() if cross_memory.available() else None
        self.pid = os.getpid()
        self.max_blocks = _block_budget() if max_blocks is None else max_blocks

    def holds_block(self, flat: np.ndarray) -> bool:
        """Whether ``flat`` is one of this process's blocks (its data, from its start)."""
        return base_address(flat) in self.blocks

    def has_room(self) -> bool:
        """Whether another block keeps the live ones within ``max_blocks``: each holds two
        descriptors (beyond it, shards stay in private memory, ``ShardStore``)."""
        return len(self.blocks) < self.max_blocks

    def allocate(self, nbytes: int) -> np.ndarray:
        """A flat uint8 array of ``nbytes`` (> 0) in a fresh memfd, its pages populated (when the
        kernel can); the fd closes when the mapping dies (every array over it gone)."""
        flat = self._new_block(nbytes)
        if self.populate and not _populate(base_address(flat) - HEADER, HEADER + nbytes):
            self.populate = False  # an older kernel: the pages fault in on first touch
        return flat

    def adopt(self, data: np.ndarray) -> np.ndarray:
        """A fresh block holding a copy of the flat uint8 array ``data``, written through the file
        (``pwrite``): the kernel makes each page as it copies into it, with no zeroing, no page
        fault and no page table entry (faster than making the pages and copying: ``ShardStore``
        assembles new destinations elsewhere for this)."""
        return self._new_block(data.nbytes, data)

    def _new_block(self, nbytes: int, data: np.ndarray | None = None) -> np.ndarray:
        """A fresh memfd block of ``nbytes`` past its header, holding ``data`` if given, mapped."""
        fd = os.memfd_create(f"meshreshard-{nbytes}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, HEADER + nbytes)
            if data is not None:
                view = data.data
                done = 0
                while done < nbytes:
                    done += os.pwrite(fd, view[done:], HEADER + done)
            mapping = mmap.mmap(fd, HEADER + nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            inode = os.fstat(fd).st_ino
        except BaseException:
            os.close(fd)
            raise
        flat = np.frombuffer(mapping, dtype=np.uint8, offset=HEADER)
        start = base_address(flat)
        self.blocks[start] = (fd, inode, nbytes, weakref.ref(mapping))
        weakref.finalize(mapping, self._closed, start, fd)
        return flat

    def _closed(self, start: int, fd: int) -> None:
        if self.blocks.get(start, (None,))[0] == fd:
            del self.blocks[start]
        os.close(fd)

    def _header(self, a) -> tuple[int | None, tuple[tuple, ctypes.c_uint64] | None]:
        """Where ``a`` starts (None: not a C-contiguous numpy array), and the block it fills with
        its tenure cell (None: not a whole live block). The cell is read through its address:
        ``a`` keeps the mapping alive meanwhile."""
        if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
            return None, None
        start = base_address(a)
        block = self.blocks.get(start)
        if block is None or block[2] != a.nbytes or block[3]() is None:
            return start, None
        return start, (block, ctypes.c_uint64.from_address(start - HEADER))

    def begin(self, a, file: tuple[int, int, int] | None = None) -> tuple | None:
        """A shard takes the block ``a`` fills (if it fills one): a fresh tenure. Else ``a`` is in
        private memory, or at ``file`` (``(descriptor, inode, offset)`` of a shared-memory file:
        torch's ``share_memory_()``): its cell on the tenure board. Returns its ``descriptor``. (A
        unit's destinations: ``begin_placed``.)"""
        start, found = self._header(a)
        if found is not None:
            block, cell = found
            cell.value = tenure = next(self._tenures)
            return (self.pid, block[0], block[1], tuple(a.shape), tenure)
        if self.private is not None:
            return self.private.begin(a, next(self._tenures), file, start)
        return None

    def begin_many(self, shards: list, begun: list[bool]) -> list:
        """``begin`` of each of ``shards``, or only its ``descriptor`` where ``begun``."""
        return [self.descriptor(a) if was else self.begin(a) for a, was in zip(shards, begun, strict=True)]

    def begin_placed(self, placed) -> PlacedDescriptors | list:
        """``begin`` of a unit's destinations (``shards.PlacedShards``: they fill no block of their
        own), in one pass: their descriptors, as columns (``TenureBoard.begin_placed``), or one each
        (None where the board is full, or there is none)."""
        if self.private is None:
            return [None] * len(placed.views)
        return self.private.begin_placed(placed, list(itertools.islice(self._tenures, len(placed.views))))

    def end_placed(self, shards: list, addresses: list) -> None:
        """``end`` of many shards that fill no block of their own, each at its address (a unit's)."""
        if self.private is not None:
            self.private.end_placed(shards, addresses)

    def end(self, a, at: int | None = None) -> None:
        """The shard in ``a``'s block is dropped: descriptors of it no longer map. ``at``: where
        ``a`` starts, when the caller knows it fills no block of its own (a unit's destination,
        ``begin_placed``)."""
        if at is not None:
            if self.private is not None:
                self.private.end(a, at)
            return
        start, found = self._header(a)
        if found is not None:
            found[1].value = 0
        elif self.private is not None:
            self.private.end(a, start)

    def descriptor(self, a) -> tuple | None:
        """``(pid, fd, inode, shape, tenure)`` of shard ``a`` if it fills a live memfd block held
        by a shard; else its ``TenureBoard`` descriptor if it is a held shard in private memory
        that peers may read; else None."""
        start, found = self._header(a)
        if found is None:
            return None if self.private is None else self.private.descriptor(a, start)
        block, cell = found
        tenure = cell.value
        if not tenure:
            return None
        return (self.pid, block[0], block[1], tuple(a.shape), tenure)


def run_key(name: str) -> int:
    """The board key of the run that makes destination shard ``name`` (nonzero)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") | 1


class RelayBoard:
    """This device's relay publications (module docstring), in a memfd its peers map."""

    @staticmethod
    def available() -> bool:
        """Boards need stores to become visible to other processes in program order (x86's TSO);
        elsewhere relays stay messages."""
        return SharedShards.available() and platform.machine().lower() in ("x86_64", "amd64")

    def __init__(self):
        fd = os.memfd_create("meshreshard-relays", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, BOARD_SLOTS * 64)
            self._mapping = mmap.mmap(fd, BOARD_SLOTS * 64, flags=mmap.MAP_SHARED)
            inode = os.fstat(fd).st_ino
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.descriptor = (os.getpid(), fd, inode)
        self.slots: np.ndarray | None = np.frombuffer(self._mapping, dtype=np.uint64).reshape(BOARD_SLOTS, 8)
        self._next = itertools.count()
        self._lock = threading.Lock()

    def open(self, name: str, block: tuple) -> int:
        """A slot for the run making ``name``, whose destination shard has descriptor ``block``
        (``SharedShards.descriptor``); nothing published yet. The key is written last and the count
        after the slices: x86 makes a process's stores visible to others in order (``available``)."""
        with self._lock:
            slot = next(self._next) % BOARD_SLOTS
        row = self._rows()[slot]
        row[_KEY] = 0
        row[_COUNT] = 0
        row[_FD], row[_INODE], row[_TENURE] = block[1], block[2], block[4]
        row[_KEY] = run_key(name)
        return slot

    def post(self, slot: int, count: int) -> None:
        self._rows()[slot, _COUNT] = count

    def fail(self, slot: int) -> None:
        self._rows()[slot, _COUNT] = FAILED

    def _rows(self) -> np.ndarray:
        if self.slots is None:
            raise RuntimeError("relay board used after close()")
        return self.slots

    def close(self) -> None:
        self.slots = None
        self._mapping.close()
        os.close(self._fd)


@dataclass(frozen=True, eq=False)
class _Batch:
    """What ``PeerShards.get_all`` gave a tuple of pulls out of shared blocks: each one's mapping
    (by key) then, its view, and its tenure then."""

    wanted: tuple
    keys: list
    mappings: list
    views: list
    tenures: np.ndarray


class _Mapped:
    """A peer's block mapped here: its descriptor number, its bytes, its tenure cell, and the typed
    views of its data handed out so far (a replay asks for the same ones)."""

    __slots__ = ("_words", "block", "fd", "tenure", "views")

    def __init__(self, fd: int, block: np.ndarray, header: bool = True):
        self.fd, self.block = fd, block
        self.tenure = block[:8].view(np.uint64) if header else None  # None: the tenure is on a board
        self.views: dict = {}
        self._words: np.ndarray | None = None

    @property
    def words(self) -> np.ndarray:
        """The block as uint64 words (a tenure board's cells)."""
        if self._words is None:
            self._words = self.block[: len(self.block) // 8 * 8].view(np.uint64)
        return self._words

    def word(self, index: int) -> int:
        """The block's ``index``-th uint64 (a tenure board's cell)."""
        return int(self.words[index])

    def view(self, dtype: np.dtype, shape: tuple[int, ...], offset: int = HEADER) -> np.ndarray:
        key = (dtype, shape, offset)
        v = self.views.get(key)
        if v is None:
            numel = 1
            for n in shape:
                numel *= n
            v = self.views[key] = self.block[offset : offset + numel * dtype.itemsize].view(dtype).reshape(shape)
        return v


def shard_gone(device: int, holder: int) -> ReshardError:
    """The error of a pull whose source shard's tenure changed: it was let go of."""
    return ReshardError(
        f"device {device}: device {holder}'s source shard is gone (the tensor was freed, through this "
        "handle or another); its memory no longer holds it"
    )


class PeerShards:
    """Peers' shards mapped into this process, kept while their owners keep them (``purge``, run
    by the actor after mapping a run's holders), at most ``limit`` (least recently used first)."""

    def __init__(self, device: int, limit: int | None = None):
        self.device = device
        self.limit = _peer_map_budget() if limit is None else limit
        self.maps: OrderedDict[tuple[int, int], _Mapped] = OrderedDict()  # (pid, inode) -> its mapping
        self._got: dict = {}  # (holder, descriptor, dtype) -> (key, mapping, what get gave): a replay asks again
        self._batches: OrderedDict[int, _Batch] = OrderedDict()  # id of a ``get_all`` tuple -> what it gave
        self._lock = threading.Lock()

    def get(self, holder: int, desc, dtype: np.dtype) -> np.ndarray | RemoteShard:
        """Device ``holder``'s shard named by ``desc``, viewed (read-only) as ``dtype`` of its shape;
        ``ReshardError`` if the shard was dropped (``check`` again after copying from it). A shard in
        its holder's private memory (``CROSS_MEMORY``) comes as a ``RemoteShard``, read, not mapped.
        What a descriptor gave is kept while its mapping is (its tenure checked again each time)."""
        try:
            hit = self._got.get((holder, desc, dtype))
        except TypeError:  # a descriptor that is not a tuple: not kept
            return self._get(holder, desc, dtype)
        if hit is not None:
            key, mapped, got = hit
            now = self.maps.get(key)
            if now is not None and now is mapped:
                self._check(holder, desc, now)
                return got
        got = self._get(holder, desc, dtype)
        key = (desc[1], desc[3]) if desc[0] == CROSS_MEMORY else (desc[0], desc[2])
        kept = self.maps.get(key)
        if kept is not None and (desc[0] != CROSS_MEMORY or desc[8] is None):  # not a view of another mapping
            if len(self._got) >= 4 * self.limit:
                self._got.clear()
            self._got[(holder, desc, dtype)] = (key, kept, got)
        return got

    def get_all(self, wanted: tuple) -> list:
        """``get`` of each ``(holder, desc, dtype)`` of ``wanted``, a tuple its caller asks with on
        every run (a host unit's pulls out of mapped shards): while the shared blocks they name stay
        mapped, the views given last time, every tenure checked again at once."""
        batch = self._batch(wanted)
        if batch is None:
            got = [self.get(holder, desc, dtype) for holder, desc, dtype in wanted]
            if all(len(desc) == 5 and desc[0] != CROSS_MEMORY for _, desc, _ in wanted):  # shared blocks
                keys = [(desc[0], desc[2]) for _, desc, _ in wanted]
                with self._lock:
                    mappings = list(map(self.maps.get, keys))
                    if None not in mappings:
                        tenures = np.array([desc[4] for _, desc, _ in wanted], np.uint64)
                        self._batches[id(wanted)] = _Batch(wanted, keys, mappings, got, tenures)
                        while len(self._batches) > BATCHES:
                            self._batches.popitem(last=False)
            return got
        self._check_batch(batch)
        return batch.views

    def check_all(self, wanted: tuple) -> None:
        """``check`` of each ``(holder, desc, dtype)`` of ``wanted`` (after copying from what
        ``get_all`` gave)."""
        batch = self._batch(wanted)
        if batch is None:
            for holder, desc, _ in wanted:
                self.check(holder, desc)
        else:
            self._check_batch(batch)

    def _batch(self, wanted: tuple) -> _Batch | None:
        """What ``get_all`` gave ``wanted`` last time, if every mapping it read is still the one mapped."""
        with self._lock:
            batch = self._batches.get(id(wanted))
            if batch is None or batch.wanted is not wanted:
                return None
            if not all(map(operator.is_, map(self.maps.get, batch.keys), batch.mappings)):
                del self._batches[id(wanted)]
                return None
            return batch

    def _check_batch(self, batch: _Batch) -> None:
        now = np.fromiter((m.tenure[0] for m in batch.mappings), np.uint64, len(batch.mappings))
        bad = np.flatnonzero(now != batch.tenures)
        if bad.size:
            raise shard_gone(self.device, batch.wanted[int(bad[0])][0])

    def _get(self, holder: int, desc, dtype: np.dtype) -> np.ndarray | RemoteShard:
        if desc[0] == CROSS_MEMORY:
            _, pid, fd, inode, _, _, address, shape, file = desc
            self._check(holder, desc, self._mapped(holder, pid, fd, inode))
            if file is None:
                return RemoteShard(self.device, holder, pid, address, tuple(shape), dtype)
            data_fd, data_inode, offset = file  # a shared-memory file the holder's storage lies in: mapped
            return self._mapped(holder, pid, data_fd, data_inode, header=False).view(dtype, tuple(shape), offset)
        return self.view(holder, desc, dtype)

    def view(self, holder: int, desc, dtype: np.dtype) -> np.ndarray:
        """``get`` of a shared-memory block's descriptor: the block mapped here, viewed."""
        pid, fd, inode, shape, _ = desc
        mapped = self._mapped(holder, pid, fd, inode)
        self._check(holder, desc, mapped)
        return mapped.view(dtype, tuple(shape))

    def board(self, holder: int, pid: int, fd: int, inode: int) -> np.ndarray:
        """Process ``pid``'s tenure board (memfd ``fd``, ``inode``) as its uint64 cells, mapped once
        and kept (``cross_memory.TenureBoard``)."""
        return self._mapped(holder, pid, fd, inode).words

    def mapped_block(self, holder: int, pid: int, fd: int, inode: int) -> np.ndarray:
        """Process ``pid``'s memfd ``fd`` (``inode``) as a read-only uint8 array, mapped once and kept."""
        return self._mapped(holder, pid, fd, inode).block

    def _mapped(self, holder: int, pid: int, fd: int, inode: int, header: bool = True) -> _Mapped:
        """Process ``pid``'s memfd ``fd`` (``inode``), mapped once and kept (least recently used out);
        ``header``: it starts with a tenure cell (not a file torch made, whose tenure is on a board)."""
        key = (pid, inode)
        with self._lock:
            hit = self.maps.get(key)
            if hit is None:
                hit = self.maps[key] = _Mapped(fd, self._map(holder, pid, fd, inode), header)
                while len(self.maps) > self.limit:
                    self.maps.popitem(last=False)
            else:
                self.maps.move_to_end(key)
        return hit

    def relay(
        self, holder: int, board: tuple, name: str, after: int, shape, dtype: np.dtype, deadline: float, cancelled=None
    ) -> tuple[np.ndarray, tuple]:
        """Device ``holder``'s destination shard (of ``shape``) in the run making ``name``, once
        the holder's board (descriptor ``board``) shows publication ``after``; with the shard's
        descriptor, to ``check`` after copying. Raises ``PeerFailed`` when the holder's run failed
        or ``cancelled()`` (the controller gave up), ``ReshardError`` when its process is gone,
        ``ReshardTimeout`` at ``deadline`` (monotonic)."""
        pid, fd, inode = board
        slots = self._mapped(holder, pid, fd, inode).block.view(np.uint64).reshape(BOARD_SLOTS, 8)
        want = run_key(name)
        pause = POLL_S[0]
        alive_at = time.monotonic() + ALIVE_CHECK_S
        while True:
            found = np.flatnonzero(slots[:, _KEY] == want)
            if found.size:
                row = slots[found[0]]
                count, block = int(row[_COUNT]), (pid, int(row[_FD]), int(row[_INODE]), tuple(shape), int(row[_TENURE]))
                if count == FAILED:
                    raise PeerFailed(f"device {self.device}: device {holder}, which relays slices to it, failed")
                if count >= after and int(row[_KEY]) == want:
                    return self.view(holder, block, dtype), block
            now = time.monotonic()
            if now >= deadline:
                raise ReshardTimeout(
                    f"device {self.device}: device {holder} had not published the slice it relays "
                    f"(publication {after}) by the deadline"
                )
            if cancelled is not None and cancelled():
                raise PeerFailed(
                    f"device {self.device}: the controller aborted the reshard while it waited for "
                    f"device {holder}'s relay"
                )
            if now >= alive_at:
                if not os.path.exists(f"/proc/{pid}"):
                    raise ReshardError(f"device {self.device}: device {holder}'s process ({pid}) is gone")
                alive_at = now + ALIVE_CHECK_S
            time.sleep(min(pause, deadline - now))
            pause = min(2 * pause, POLL_S[1])

    def check(self, holder: int, desc) -> None:
        """``ReshardError`` unless the shard ``desc`` names is still its holder's (after a copy
        from it: it was not dropped, nor its memory reused, meanwhile)."""
        key = (desc[1], desc[3]) if desc[0] == CROSS_MEMORY else (desc[0], desc[2])
        with self._lock:
            hit = self.maps.get(key)
        if hit is not None:
            self._check(holder, desc, hit)

    def _check(self, holder: int, desc, mapped: _Mapped) -> None:
        if desc[0] == CROSS_MEMORY:  # its cell on the holder's tenure board
            cell, tenure = desc[4], desc[5]
            now = mapped.word(cell)
        else:
            assert mapped.tenure is not None, "a shared block's descriptor names a block with a header"
            now, tenure = int(mapped.tenure[0]), desc[4]
        if now != tenure:
            raise shard_gone(self.device, holder)

    def purge(self, full: bool = True) -> None:
        """Drop the mappings of blocks whose owner has let go of the shard in them: its tenure is
        cleared (the block went back to the owner's pool, or was freed and is pinned by this
        mapping alone), read without a system call. With ``full``, also those whose descriptor is
        closed (the memory died with its last array; a lookup each) or whose owner's process is
        gone (a lookup per owner). Every run that pulls purges without system calls; the device's
        look at its callers (``DeviceContext.check_callers``, every ``caller_check_s``) fully."""
        with self._lock:
            gone = {pid for pid in {pid for pid, _ in self.maps} if not os.path.exists(f"/proc/{pid}")} if full else ()
            headed = [(key, m.tenure) for key, m in self.maps.items() if m.tenure is not None]
            tenures = np.fromiter((t[0] for _, t in headed), np.uint64, len(headed))
            cleared = [headed[i][0] for i in np.flatnonzero(tenures == 0).tolist()]  # all tenures read at once
            for key in cleared:
                del self.maps[key]
            dropped = bool(cleared)
            for key, mapped in list(self.maps.items()) if full else ():
                live = key[0] not in gone
                if live:
                    try:
                        live = os.stat(f"/proc/{key[0]}/fd/{mapped.fd}").st_ino == key[1]
                    except OSError:
                        live = False
                if not live:
                    del self.maps[key]
                    dropped = True
            if dropped:
                self._got = {k: v for k, v in self._got.items() if self.maps.get(v[0]) is v[1]}
                self._batches.clear()  # their views must not keep dropped mappings alive

    def _map(self, holder: int, pid: int, fd: int, inode: int) -> np.ndarray:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            peer = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                st = os.fstat(peer)
                if st.st_ino != inode:
                    raise FileNotFoundError(f"{path} is another file now")
                view = mmap.mmap(peer, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            finally:
                os.close(peer)
        except PermissionError as e:
            raise ReshardError(
                f"device {self.device} may not map device {holder}'s source shard (process {pid}): {e}. The actors "
                "of this machine cannot open each other's /proc/<pid>/fd; create the meshes with shared_memory=False"
            ) from e
        except OSError as e:
            if e.errno == errno.ENOMEM:
                raise ReshardError(
                    f"device {self.device}: no memory left to map device {holder}'s source shard: {e}"
                ) from e
            raise ReshardError(
                f"device {self.device}: device {holder}'s source shard is gone (the tensor was freed, or the actor "
                f"of device {holder} died): {type(e).__name__}: {e}"
            ) from e
        return np.frombuffer(view, dtype=np.uint8)  # read-only, as the mapping

    def clear(self) -> None:
        with self._lock:
            self.maps.clear()
            self._got.clear()
            self._batches.clear()

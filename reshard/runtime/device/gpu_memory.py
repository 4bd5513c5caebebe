"""GPU device memory that peers sharing the GPU read straight out of: CUDA IPC pulls, the GPU twin
of the CPU devices' shared memory (``reshard.runtime.device.shared_memory``).

Holder. ``GpuBlocks`` allocates device memory in blocks (``cudaMalloc`` through
``cupy.cuda.Memory``, outside cupy's pool: CUDA IPC exports whole allocations, "the base of an
existing device memory allocation"): one block holds the shards one call makes (a run's
destinations, a load's shards), each a piece of it; freed blocks are kept for reuse by byte size.
Each shard has a tenure in a board of host shared memory (a memfd of uint64 slots) that its peers
map read-only. A shard's descriptor names the block (its IPC handle), the piece, the board, the
slot and the tenure. A block a peer may have opened is never given back to CUDA except by ``empty_cache`` or
when the device closes (CUDA: freeing exported memory before importers close it is undefined).

Puller. ``GpuPeers`` opens each holder block once (``cudaIpcOpenMemHandle``; CUDA allows one open
per handle and process, reference counted), keeps it while the holder keeps a shard in it, and
checks the shard's tenure before copying and again after the run (``check``): a shard freed
meanwhile fails the reshard, never yields another tensor's bytes. Past ``PEER_BLOCKS`` open blocks
the least recently used is retired, and closed only once nothing here references its memory any
more (``purge``, as each run that pulls starts): a run reading it holds its views, and
``cudaIpcCloseMemHandle`` under a kernel reading the mapping would make its reads invalid (a tree
of more single-shard holder blocks than that reads them all in one run). A run's pulled shards are
viewed at once and kept for the next runs that pull the same (``pulled``: a replay, or a fresh call
of the same tree), their tenures checked as one comparison per holder's board; kept views are
dropped whenever a block is retired or closed, so they never hold one open. The copy itself is a
kernel on the puller's run stream; the holder's bytes are complete because the run that wrote
them returned only once its stream had finished.

Which devices pull from which: those of one Ray node on one GPU (by its UUID), where IPC needs no
peer-to-peer access; the driver groups them into one memory domain (``memory_domain``). Between
GPUs every byte goes through NCCL.
"""

from __future__ import annotations

import bisect
import itertools
import os
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from reshard.errors import ReshardError
from reshard.runtime.device.shared_memory import PeerShards

#: Tenure slots of a device's board: shards it holds at once (8 bytes each; the memfd is sparse).
BOARD_SLOTS = 1 << 20
#: Holder blocks a puller keeps open (least recently used retired first, closed once unused).
PEER_BLOCKS = 4096
#: Sets of shards a run pulled that a puller keeps viewed, for the next runs that pull the same.
PULLED_KEPT = 8
#: ``cudaErrorMemoryAllocation`` (driver_types.h): the device has no memory left for an allocation.
CUDA_ERROR_MEMORY_ALLOCATION = 2


class TenureBoard:
    """A device's tenure slots, in a memfd its peers map read-only."""

    def __init__(self, slots: int = BOARD_SLOTS):
        import mmap

        fd = os.memfd_create("meshreshard-gpu-tenures", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, slots * 8)
            self._mapping = mmap.mmap(fd, slots * 8, flags=mmap.MAP_SHARED)
            inode = os.fstat(fd).st_ino
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.descriptor = (os.getpid(), fd, inode)
        self.words = np.frombuffer(self._mapping, dtype=np.uint64)
        self._free = list(range(slots - 1, -1, -1))
        self._tenures = itertools.count(1)
        self._lock = threading.Lock()

    def begin(self) -> tuple[int, int]:
        """A slot with a fresh tenure: ``(slot, tenure)``."""
        with self._lock:
            if not self._free:
                raise ReshardError(f"this device holds {len(self.words)} GPU shards already; free some first")
            slot = self._free.pop()
            tenure = next(self._tenures)
        self.words[slot] = tenure
        return slot, tenure

    def end(self, slot: int) -> None:
        self.words[slot] = 0
        with self._lock:
            self._free.append(slot)

    def close(self) -> None:
        self.words = np.zeros(0, np.uint64)
        self._mapping.close()
        os.close(self._fd)


#: Pieces of one block start on this boundary (cudaMalloc's alignment keeps every dtype aligned).
ALIGN = 256


@dataclass
class _Piece:
    """One shard's bytes in a block: where, how many, and its tenure (slot -1: none)."""

    offset: int
    nbytes: int
    slot: int = -1
    tenure: int = 0
    released: bool = False


@dataclass
class _Block:
    mem: Any  # cupy.cuda.Memory: the allocation
    nbytes: int
    pieces: dict[int, _Piece]  # offset -> piece
    handle: bytes | None = None  # its IPC handle, once asked for
    held: int = 0  # pieces not released yet: the block is idle once none is (a count, not a scan per release)


class GpuBlocks:
    """A GPU device's shard memory (module docstring): blocks pooled by size, each holding the
    shards of one call (a run's destinations, a load's shards: a state dict is one block, one IPC
    handle, whatever its number of tensors) or one shard."""

    @staticmethod
    def available() -> bool:
        """CUDA IPC and memfd are there (Linux, a CUDA build of cupy with its runtime's IPC calls)."""
        try:
            import cupy
        except ImportError:
            return False
        return hasattr(os, "memfd_create") and hasattr(cupy.cuda.runtime, "ipcGetMemHandle")

    def __init__(self, cuda_device: int, keep_bytes: int):
        self.cuda_device = cuda_device
        self.keep_bytes = keep_bytes
        self.board = TenureBoard()
        self.blocks: dict[int, _Block] = {}  # base pointer -> block
        self._bases: list[int] = []  # sorted, to find the block an address is in
        self.idle: OrderedDict[tuple[int, int], _Block] = OrderedDict()  # (nbytes, base) -> a freed block
        self.idle_bytes = 0
        self._unlooked = 0  # new blocks since the last look for blocks nobody uses (``_reclaim``)
        self._lock = threading.Lock()

    def allocate(self, nbytes: int):
        """A flat uint8 cupy array over a block of ``nbytes`` (> 0): a freed one of that size, else new."""
        return self.allocate_many([nbytes])[0]

    def allocate_many(self, sizes: list[int], forms: list | None = None) -> list:
        """Cupy arrays of ``sizes`` bytes (each > 0), pieces of one block: flat uint8, or of each
        ``(shape, dtype)`` of ``forms`` (one array each, made as it is: a call's thousands of
        shards)."""
        import cupy

        offsets, end = [], 0
        for n in sizes:
            offsets.append(end)
            end += -(-n // ALIGN) * ALIGN
        block = self._take(end) or self._new(end)
        block.pieces = {o: _Piece(o, n) for o, n in zip(offsets, sizes, strict=True)}
        block.held = len(block.pieces)
        pointer, mem = cupy.cuda.MemoryPointer, block.mem
        if forms is None:
            return [cupy.ndarray((n,), np.uint8, memptr=pointer(mem, o)) for o, n in zip(offsets, sizes, strict=True)]
        return [
            cupy.ndarray(shape, dtype, memptr=pointer(mem, o)) for o, (shape, dtype) in zip(offsets, forms, strict=True)
        ]

    def _new(self, nbytes: int) -> _Block:
        """A block of fresh device memory; where CUDA has none left, one nobody uses any more
        (``_take`` with a look at every block) before the error."""
        import cupy

        try:
            with cupy.cuda.Device(self.cuda_device):
                mem = cupy.cuda.Memory(nbytes)
        except cupy.cuda.runtime.CUDARuntimeError as e:
            block = self._take(nbytes, look=True) if e.status == CUDA_ERROR_MEMORY_ALLOCATION else None
            if block is None:
                raise
            return block
        block = _Block(mem, nbytes, {})
        with self._lock:
            self.blocks[mem.ptr] = block
            bisect.insort(self._bases, mem.ptr)
            self._unlooked += 1
        return block

    def _take(self, nbytes: int, look: bool = False) -> _Block | None:
        """An idle block of ``nbytes``. Where there is none, a look for blocks nobody uses any more
        (``_reclaim``, a pass over every block) when ``look``, or once as many new blocks as half
        the device's were made since the last: each new block pays for a bounded share of a look,
        so making thousands one by one (a model's tensors shared one at a time) is not quadratic."""
        with self._lock:
            key = next((k for k in self.idle if k[0] == nbytes), None)
            if key is None and (look or 2 * self._unlooked >= len(self.blocks)) and self._reclaim():
                key = next((k for k in self.idle if k[0] == nbytes), None)
            if key is None:
                return None
            self.idle_bytes -= nbytes
            return self.idle.pop(key)

    def _reclaim(self) -> bool:
        """Blocks whose pieces no shard holds and no array uses any more (``DeviceContext.empty``'s,
        once its user let go) go to the pool; True if one did. An array over a block holds a
        reference to its memory."""
        self._unlooked = 0
        found = False
        idle = {id(b) for b in self.idle.values()}
        for block in self.blocks.values():
            if id(block) in idle or any(p.slot >= 0 for p in block.pieces.values()):
                continue
            if sys.getrefcount(block.mem) <= 2:
                self._idle(block)
                found = True
        return found

    def _find(self, a, near: _Block | None = None) -> tuple[_Block, _Piece] | None:
        """The block and piece ``a`` fills exactly, or None (not a piece of ours); looked for in
        ``near`` first (a run's shards are pieces of one block), then among all blocks."""
        if a is None or not hasattr(a, "data") or not a.nbytes or not a.flags.c_contiguous:
            return None
        ptr = a.data.ptr
        block = near if near is not None and ptr - near.mem.ptr in near.pieces else None
        if block is None:
            with self._lock:
                i = bisect.bisect_right(self._bases, ptr) - 1
                block = self.blocks.get(self._bases[i]) if i >= 0 else None
        if block is None:
            return None
        piece = block.pieces.get(ptr - block.mem.ptr)
        if piece is None or piece.nbytes != a.nbytes:
            return None
        return block, piece

    def begin(self, a, file: tuple[int, int, int] | None = None) -> tuple | None:
        """A shard takes the piece ``a`` fills (if it fills one): a fresh tenure. Returns its
        ``descriptor``. ``file``: as ``SharedShards.begin``'s, where host memory lies in a
        shared-memory file; device memory never does (None)."""
        if file is not None:
            raise ValueError(f"GPU memory lies in no shared-memory file nor private host memory, got {file!r}")
        found = self._find(a)
        if found is None:
            return None
        self._begin(*found)
        return self._descriptor(*found, a)

    def _begin(self, block: _Block, piece: _Piece) -> None:
        if piece.slot < 0:
            piece.slot, piece.tenure = self.board.begin()
            if piece.released:
                with self._lock:
                    piece.released = False
                    block.held += 1

    def begin_many(self, shards: list, begun: list[bool]) -> list:
        """``begin`` of each of ``shards``, or only its ``descriptor`` where ``begun`` (it has its
        tenure already): a run's new shards, pieces of one block found once (``allocate_many``)."""
        out: list[tuple | None] = []
        block = None
        for a, was in zip(shards, begun, strict=True):
            found = self._find(a, block)
            if found is None:
                out.append(None)
                continue
            block = found[0]
            if not was:
                self._begin(*found)
            out.append(self._descriptor(*found, a))
        return out

    def end(self, a, at: int | None = None) -> None:
        """The shard in ``a``'s piece is dropped: descriptors of it no longer map. ``at``: as
        ``SharedShards.end``'s (never given here: a GPU device has no unit)."""
        found = self._find(a)
        if found is not None:
            self._end(found[1])

    def _end(self, piece: _Piece) -> None:
        if piece.slot >= 0:
            self.board.end(piece.slot)
            piece.slot, piece.tenure = -1, 0

    def descriptor(self, a) -> tuple | None:
        """``("cuda", pid, IPC handle, block bytes, offset, shape, board, slot, tenure)`` of shard
        ``a`` if it fills a piece held by a shard, else None."""
        found = self._find(a)
        return None if found is None else self._descriptor(*found, a)

    def _descriptor(self, block: _Block, piece: _Piece, a) -> tuple | None:
        if piece.slot < 0:
            return None
        if block.handle is None:
            import cupy

            with cupy.cuda.Device(self.cuda_device):
                block.handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(block.mem.ptr))
        return (
            "cuda",
            os.getpid(),
            block.handle,
            block.nbytes,
            piece.offset,
            tuple(a.shape),
            self.board.descriptor,
            piece.slot,
            piece.tenure,
        )

    def release(self, a) -> bool:
        """The last use of ``a``'s piece is over (its tenure ends); the block goes back to the pool
        once every piece of it is released."""
        found = self._find(a)
        if found is None:
            return False
        block, piece = found
        self._end(piece)
        with self._lock:
            if piece.released:
                return True
            piece.released = True
            block.held -= 1
            if not block.held:
                self._idle(block)
                while self.idle_bytes > self.keep_bytes and self._evictable():
                    pass
        return True

    def _idle(self, block: _Block) -> None:
        block.pieces = {}
        self.idle[(block.nbytes, block.mem.ptr)] = block
        self.idle_bytes += block.nbytes

    def _forget(self, base: int) -> None:
        del self.blocks[base]
        del self._bases[bisect.bisect_left(self._bases, base)]

    def _evictable(self) -> bool:
        """Give back to CUDA the oldest idle block no peer was given a handle of; False when none is."""
        for key, block in self.idle.items():
            if block.handle is None:
                del self.idle[key]
                self._forget(key[1])
                self.idle_bytes -= block.nbytes
                return True
        return False

    def empty_cache(self) -> int:
        """Give every idle block back to CUDA (exported ones too: peers must have closed them).
        Returns the bytes freed."""
        with self._lock:
            freed = self.idle_bytes
            for key in list(self.idle):
                self._forget(key[1])
            self.idle.clear()
            self.idle_bytes = 0
        return freed

    def close(self) -> None:
        with self._lock:
            self.idle.clear()
            self.blocks.clear()
            self._bases.clear()
            self.idle_bytes = 0
        self.board.close()


class _Opened:
    """A holder's block opened here: its pointer, memory object and typed views handed out."""

    __slots__ = ("ptr", "mem", "views")

    def __init__(self, ptr: int, mem):
        self.ptr, self.mem = ptr, mem
        self.views: dict = {}


@dataclass(frozen=True, eq=False)
class Pulled:
    """The peers' shards a run's parts pull (``Bound.pulls``: tensor -> {holder: descriptor}),
    viewed as each tensor's storage dtype (``storages``), and the tenures to check as columns per
    holder's board (``GpuPeers.check_pulled``: a comparison per holder, not a call per shard)."""

    pulls: dict
    storages: dict
    views: dict[int, dict[int, Any]]  # tensor -> {holder: cupy view of its shard}
    boards: tuple[tuple[int, tuple, np.ndarray, np.ndarray], ...]  # (holder, board, slots, tenures)


class GpuPeers:
    """Blocks of peers sharing this device's GPU, opened here through CUDA IPC (module docstring)."""

    def __init__(self, device: int, cuda_device: int, limit: int = PEER_BLOCKS):
        self.device = device
        self.cuda_device = cuda_device
        self.limit = limit
        self.boards = PeerShards(device)  # the holders' tenure boards, mapped read-only
        self.maps: OrderedDict[tuple[int, bytes], _Opened] = OrderedDict()
        self.retired: dict[tuple[int, bytes], _Opened] = {}  # past the limit, closed once unused (``_close_unused``)
        #: the latest ``Pulled`` (a replay, or a fresh call, pulls the same again); dropped whenever a
        #: block is retired or closed, so that it views only blocks counted in ``maps``
        self.recent: OrderedDict[int, Pulled] = OrderedDict()
        self._changes = 0  # blocks retired or closed so far
        self._lock = threading.Lock()

    def get(self, holder: int, desc, dtype: np.dtype):
        """Device ``holder``'s shard named by ``desc``, as a cupy array of ``dtype`` and its shape;
        ``ReshardError`` if the shard was dropped (``check`` again after copying from it). The
        block is opened and the view made under the lock: a ``purge`` in another thread never
        closes the block between the two (the view then holds it open)."""
        _, pid, handle, nbytes, offset, shape, _, _, _ = desc
        self._check(holder, desc)
        key = (offset, dtype, tuple(shape))
        with self._lock:
            opened = self._opened(holder, pid, bytes(handle), nbytes)
            view = opened.views.get(key)
            if view is None:
                import cupy

                ptr = cupy.cuda.MemoryPointer(opened.mem, offset)
                view = opened.views[key] = cupy.ndarray(tuple(shape), dtype, memptr=ptr)
        return view

    def pulled(self, pulls: dict[int, dict], storages: dict[int, np.dtype]) -> Pulled:
        """Every shard of ``pulls`` (tensor -> {holder: descriptor}) viewed as its tensor's
        storage dtype (``storages``), checked still its holder's; one of the ``PULLED_KEPT``
        latest where it pulled the same, else opened as ``get`` opens each. One that opening had
        to retire blocks for is not kept: it would hold them open past the limit."""
        with self._lock:
            for key, p in self.recent.items():
                if (p.pulls is pulls or p.pulls == pulls) and p.storages == storages:
                    self.recent.move_to_end(key)
                    break
            else:
                p = None
            changes = self._changes
        if p is not None:
            self.check_pulled(p)
            return p
        p = self._view_all(pulls, storages)
        with self._lock:
            if self._changes == changes:
                self.recent[id(p)] = p
                while len(self.recent) > PULLED_KEPT:
                    self.recent.popitem(last=False)
        return p

    def _view_all(self, pulls: dict[int, dict], storages: dict[int, np.dtype]) -> Pulled:
        views: dict[int, dict[int, Any]] = {}
        columns: dict[tuple, tuple[list, list]] = {}
        for tensor, seen in pulls.items():
            storage, mine = storages[tensor], {}
            for holder, desc in seen.items():
                mine[holder] = self.get(holder, desc, storage)
                slots, tenures = columns.setdefault((holder, desc[6]), ([], []))
                slots.append(desc[7])
                tenures.append(desc[8])
            views[tensor] = mine
        boards = tuple(
            (h, board, np.array(slots, np.int64), np.array(tenures, np.uint64))
            for (h, board), (slots, tenures) in columns.items()
        )
        return Pulled(pulls, storages, views, boards)

    def check_pulled(self, pulled: Pulled) -> None:
        """``ReshardError`` unless every shard ``pulled`` views is still its holder's (``check``,
        one comparison per holder's board)."""
        for holder, board, slots, tenures in pulled.boards:
            words = self.boards.mapped_block(holder, *board).view(np.uint64)
            if not np.array_equal(words[slots], tenures):
                self._gone(holder)

    def _opened(self, holder: int, pid: int, handle: bytes, nbytes: int) -> _Opened:
        """The holder's block, opened once (the caller holds the lock)."""
        key = (pid, handle)
        hit = self.maps.get(key)
        if hit is None and key in self.retired:  # still open: taken back, never opened twice
            hit = self.maps[key] = self.retired.pop(key)
        if hit is not None:
            self.maps.move_to_end(key)
            return hit
        import cupy

        try:
            with cupy.cuda.Device(self.cuda_device):
                ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle)
                mem = cupy.cuda.UnownedMemory(ptr, nbytes, self, self.cuda_device)
        except Exception as e:
            raise ReshardError(
                f"device {self.device} could not open device {holder}'s GPU shard through CUDA IPC (process {pid}): "
                f"{type(e).__name__}: {e}; create the meshes with shared_memory=False to send it through NCCL"
            ) from e
        opened = self.maps[key] = _Opened(ptr, mem)
        while len(self.maps) > self.limit:
            self._changed()
            old_key, old = self.maps.popitem(last=False)
            old.views.clear()  # ours; whoever still reads it holds its own
            self.retired[old_key] = old  # closed by a later ``purge``, once no run reads it
        return opened

    def _changed(self) -> None:
        """A block is retired or closed (the caller holds the lock): no ``Pulled`` kept views it."""
        self._changes += 1
        self.recent.clear()

    def _close_unused(self) -> None:
        """Close the retired blocks whose memory nothing here references any more (no view, no
        pointer into it: ``_Opened.mem`` and ``getrefcount``'s own argument are the only two)."""
        for key in [k for k, o in self.retired.items() if sys.getrefcount(o.mem) <= 2]:
            self._close(self.retired.pop(key))

    def _tenure(self, holder: int, desc) -> int:
        board, slot = desc[6], desc[7]
        words = self.boards.mapped_block(holder, *board).view(np.uint64)
        return int(words[slot])

    def _check(self, holder: int, desc) -> None:
        if self._tenure(holder, desc) != desc[8]:
            self._gone(holder)

    def _gone(self, holder: int) -> None:
        raise ReshardError(
            f"device {self.device}: device {holder}'s source shard is gone (the tensor was freed, through this "
            "handle or another); its memory no longer holds it"
        )

    def check(self, holder: int, desc) -> None:
        """``ReshardError`` unless the shard ``desc`` names is still its holder's (after the run that
        copied from it: it was not dropped, nor its memory reused, meanwhile)."""
        self._check(holder, desc)

    def purge(self, full: bool = True) -> None:
        """Close the retired blocks no run reads any more, ``full`` or not; the others stay open
        while their holder may reuse them for the next shard of their size (the same handle);
        ``clear`` closes them all."""
        with self._lock:
            self._close_unused()

    def _close(self, opened: _Opened) -> None:
        import cupy

        opened.views.clear()
        opened.mem = None
        try:
            with cupy.cuda.Device(self.cuda_device):
                cupy.cuda.runtime.ipcCloseMemHandle(opened.ptr)
        except Exception:  # the holder's process is gone: nothing left to close
            pass

    def clear(self) -> None:
        with self._lock:
            self._changed()
            items = [*self.maps.values(), *self.retired.values()]
            self.maps.clear()
            self.retired.clear()
        for opened in items:
            self._close(opened)
        self.boards.clear()

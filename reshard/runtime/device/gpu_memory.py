"""GPU device memory that peers sharing the GPU read straight out of: CUDA IPC pulls, the GPU twin
of the CPU devices' shared memory (``reshard.runtime.device.shared_memory``).

Holder. ``GpuBlocks`` allocates each shard its own block of device memory (``cudaMalloc`` through
``cupy.cuda.Memory``, outside cupy's pool: CUDA IPC exports whole allocations, "the base of an
existing device memory allocation"), keeps freed blocks for reuse by byte size, and gives each
shard a tenure in a board of host shared memory (a memfd of uint64 slots) that its peers map
read-only. A shard's descriptor names the block (its IPC handle), the board, the slot and the
tenure. A block a peer may have opened is never given back to CUDA except by ``empty_cache`` or
when the device closes (CUDA: freeing exported memory before importers close it is undefined).

Puller. ``GpuPeers`` opens each holder block once (``cudaIpcOpenMemHandle``; CUDA allows one open
per handle and process, reference counted), keeps it while the holder keeps a shard in it, and
checks the shard's tenure before copying and again after the run (``check``): a shard freed
meanwhile fails the reshard, never yields another tensor's bytes. The copy itself is a kernel on
the puller's run stream; the holder's bytes are complete because the run that wrote them
returned only once its stream had finished.

Which devices pull from which: those of one Ray node on one GPU (by its UUID), where IPC needs no
peer-to-peer access; the driver groups them into one memory domain (``memory_domain``). Between
GPUs every byte goes through NCCL.
"""

from __future__ import annotations

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
#: Holder blocks a puller keeps open (least recently used closed first).
PEER_BLOCKS = 4096


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


@dataclass
class _Block:
    mem: Any  # cupy.cuda.Memory: the allocation
    nbytes: int
    handle: bytes | None = None  # its IPC handle, once asked for
    slot: int = -1  # the tenure slot of the shard in it (-1: none)
    tenure: int = 0


class GpuBlocks:
    """A GPU device's shard memory (module docstring): one block per shard, pooled by size."""

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
        self.idle: OrderedDict[tuple[int, int], _Block] = OrderedDict()  # (nbytes, base) -> a freed block
        self.idle_bytes = 0
        self._lock = threading.Lock()

    def allocate(self, nbytes: int):
        """A flat uint8 cupy array over a block of ``nbytes`` (> 0): a freed one of that size, else new."""
        import cupy

        with self._lock:
            key = next((k for k in self.idle if k[0] == nbytes), None)
            if key is None and self._reclaim():
                key = next((k for k in self.idle if k[0] == nbytes), None)
            block = self.idle.pop(key) if key is not None else None
            if block is not None:
                self.idle_bytes -= nbytes
        if block is None:
            with cupy.cuda.Device(self.cuda_device):
                mem = cupy.cuda.Memory(nbytes)
            block = _Block(mem, nbytes)
            with self._lock:
                self.blocks[mem.ptr] = block
        ptr = cupy.cuda.MemoryPointer(block.mem, 0)
        return cupy.ndarray((nbytes,), np.uint8, memptr=ptr)

    def _reclaim(self) -> bool:
        """Blocks handed out (``DeviceContext.empty``), held by no shard and no array any more,
        go to the pool; True if one did. An array over a block holds a reference to its memory."""
        found = False
        idle = {id(b) for b in self.idle.values()}
        for base, block in self.blocks.items():
            if block.slot < 0 and id(block) not in idle and sys.getrefcount(block.mem) <= 2:
                self.idle[(block.nbytes, base)] = block
                self.idle_bytes += block.nbytes
                found = True
        return found

    def _block(self, a) -> _Block | None:
        """The block ``a`` fills, or None (not a whole block of ours)."""
        if a is None or not hasattr(a, "data") or not a.flags.c_contiguous:
            return None
        block = self.blocks.get(a.data.ptr)
        if block is None or block.nbytes != a.nbytes or not a.nbytes:
            return None
        return block

    def begin(self, a) -> None:
        """A shard takes the block ``a`` fills (if it fills one): a fresh tenure."""
        block = self._block(a)
        if block is not None and block.slot < 0:
            block.slot, block.tenure = self.board.begin()

    def end(self, a) -> None:
        """The shard in ``a``'s block is dropped: descriptors of it no longer map."""
        block = self._block(a)
        if block is not None and block.slot >= 0:
            self.board.end(block.slot)
            block.slot, block.tenure = -1, 0

    def descriptor(self, a) -> tuple | None:
        """``("cuda", pid, IPC handle, nbytes, shape, board, slot, tenure)`` of shard ``a`` if it fills
        a live block held by a shard, else None."""
        block = self._block(a)
        if block is None or block.slot < 0:
            return None
        if block.handle is None:
            import cupy

            with cupy.cuda.Device(self.cuda_device):
                block.handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(block.mem.ptr))
        return ("cuda", os.getpid(), block.handle, block.nbytes, tuple(a.shape), self.board.descriptor, block.slot,
                block.tenure)  # fmt: skip

    def release(self, a) -> bool:
        """The last use of ``a``'s block is over: it goes back to the pool (its tenure ended first)."""
        block = self._block(a)
        if block is None:
            return False
        self.end(a)
        with self._lock:
            self.idle[(block.nbytes, block.mem.ptr)] = block
            self.idle_bytes += block.nbytes
            while self.idle_bytes > self.keep_bytes and self._evictable():
                pass
        return True

    def _evictable(self) -> bool:
        """Give back to CUDA the oldest idle block no peer was given a handle of; False when none is."""
        for key, block in self.idle.items():
            if block.handle is None:
                del self.idle[key]
                del self.blocks[key[1]]
                self.idle_bytes -= block.nbytes
                return True
        return False

    def empty_cache(self) -> int:
        """Give every idle block back to CUDA (exported ones too: peers must have closed them).
        Returns the bytes freed."""
        with self._lock:
            freed = self.idle_bytes
            for key in list(self.idle):
                del self.blocks[key[1]]
            self.idle.clear()
            self.idle_bytes = 0
        return freed

    def close(self) -> None:
        with self._lock:
            self.idle.clear()
            self.blocks.clear()
            self.idle_bytes = 0
        self.board.close()


class _Opened:
    """A holder's block opened here: its pointer, memory object and typed views handed out."""

    __slots__ = ("ptr", "mem", "views")

    def __init__(self, ptr: int, mem):
        self.ptr, self.mem = ptr, mem
        self.views: dict = {}


class GpuPeers:
    """Blocks of peers sharing this device's GPU, opened here through CUDA IPC (module docstring)."""

    def __init__(self, device: int, cuda_device: int, limit: int = PEER_BLOCKS):
        self.device = device
        self.cuda_device = cuda_device
        self.limit = limit
        self.boards = PeerShards(device)  # the holders' tenure boards, mapped read-only
        self.maps: OrderedDict[tuple[int, bytes], _Opened] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, holder: int, desc, dtype: np.dtype):
        """Device ``holder``'s shard named by ``desc``, as a cupy array of ``dtype`` and its shape;
        ``ReshardError`` if the shard was dropped (``check`` again after copying from it)."""
        _, pid, handle, nbytes, shape, _, _, _ = desc
        self._check(holder, desc)
        opened = self._opened(holder, pid, bytes(handle), nbytes)
        key = (dtype, tuple(shape))
        view = opened.views.get(key)
        if view is None:
            import cupy

            ptr = cupy.cuda.MemoryPointer(opened.mem, 0)
            view = opened.views[key] = cupy.ndarray(tuple(shape), dtype, memptr=ptr)
        return view

    def _opened(self, holder: int, pid: int, handle: bytes, nbytes: int) -> _Opened:
        key = (pid, handle)
        with self._lock:
            hit = self.maps.get(key)
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
        opened = _Opened(ptr, mem)
        with self._lock:
            self.maps[key] = opened
            while len(self.maps) > self.limit:
                _, old = self.maps.popitem(last=False)
                self._close(old)
        return opened

    def _tenure(self, holder: int, desc) -> int:
        board, slot = desc[5], desc[6]
        words = self.boards.mapped_block(holder, *board).view(np.uint64)
        return int(words[slot])

    def _check(self, holder: int, desc) -> None:
        if self._tenure(holder, desc) != desc[7]:
            raise ReshardError(
                f"device {self.device}: device {holder}'s source shard is gone (the tensor was freed, through this "
                "handle or another); its memory no longer holds it"
            )

    def check(self, holder: int, desc) -> None:
        """``ReshardError`` unless the shard ``desc`` names is still its holder's (after the run that
        copied from it: it was not dropped, nor its memory reused, meanwhile)."""
        self._check(holder, desc)

    def purge(self) -> None:
        """Nothing to do per run: an opened block stays open while its holder may reuse it for the
        next shard of its size (the same handle); ``clear`` closes them."""

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
            items = list(self.maps.values())
            self.maps.clear()
        for opened in items:
            self._close(opened)
        self.boards.clear()

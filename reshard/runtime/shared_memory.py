"""Shared memory between the CPU device actors of one machine.

An actor of a mesh created with ``shared_memory=True`` allocates its shards in ``memfd`` files
(anonymous shared memory that dies with the process: a killed actor leaks nothing).
``SharedShards.descriptor(t)`` names a shard to other processes as ``(pid, fd, inode, shape)``;
a peer on the same machine maps it READ-ONLY through ``/proc/<pid>/fd/<fd>`` (``PeerShards``; the
inode guards against a reused descriptor number) and copies slices straight out of it: the pulls
of ``reshard.pulls``. A bug in one actor cannot write another's shard through its mapping; any
process of the same user may still open ``/proc/<pid>/fd`` itself, as it may attach a debugger
(the trust model of shared memory on one machine).
"""

from __future__ import annotations

import mmap
import os
import threading
import warnings
import weakref
from collections import OrderedDict

import torch

from reshard.errors import ReshardError

#: Bound on the peer mappings a device keeps. A mapping of a shard its owner still holds costs no
#: memory (the pages are the owner's); one whose owner dropped the shard pins that memory, so
#: those are dropped whenever the device runs pulls (``PeerShards.purge``).
PEER_MAPS = 256


class SharedShards:
    """This actor's memfd-backed allocations, keyed by storage address while the storage lives."""

    @staticmethod
    def available() -> bool:
        """memfd and /proc are there (Linux): elsewhere shards stay in private memory."""
        return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")

    def __init__(self):
        self.blocks: dict[int, tuple[int, int, weakref.ref]] = {}  # data_ptr -> (fd, inode, storage)

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor of ``nbytes`` (> 0) in a fresh memfd; the fd closes when the storage
        dies (torch keeps one Python object per storage, so a weak reference tracks it)."""
        fd = os.memfd_create(f"meshreshard-{nbytes}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)
            inode = os.fstat(fd).st_ino
        except BaseException:
            os.close(fd)
            raise
        flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))
        ptr = storage.data_ptr()
        self.blocks[ptr] = (fd, inode, weakref.ref(storage))
        weakref.finalize(storage, self._closed, ptr, fd)
        return flat

    def _closed(self, ptr: int, fd: int) -> None:
        if self.blocks.get(ptr, (None,))[0] == fd:
            del self.blocks[ptr]
        os.close(fd)

    def descriptor(self, t: torch.Tensor | None) -> tuple | None:
        """``(pid, fd, inode, shape)`` of shard ``t`` if it fills a live memfd block, else None."""
        if t is None or t.device.type != "cpu" or t.storage_offset() != 0 or not t.is_contiguous():
            return None
        block = self.blocks.get(t.untyped_storage().data_ptr())
        if block is None or block[2]() is None:
            return None
        return (os.getpid(), block[0], block[1], tuple(t.shape))


class PeerShards:
    """Peers' shards mapped into this process, kept while their owners keep them (``purge``, run
    by the actor after mapping a run's holders), at most ``limit`` (least recently used first)."""

    def __init__(self, device: int, limit: int = PEER_MAPS):
        self.device = device
        self.limit = limit
        self.maps: OrderedDict[tuple[int, int], tuple[int, torch.Tensor]] = OrderedDict()  # (pid, inode) -> fd, flat
        self._lock = threading.Lock()

    def get(self, holder: int, desc, dtype: torch.dtype) -> torch.Tensor:
        """Device ``holder``'s shard named by ``desc``, viewed (read-only) as ``dtype`` of its shape."""
        pid, fd, inode, shape = desc
        key = (pid, inode)
        with self._lock:
            hit = self.maps.get(key)
            if hit is None:
                hit = self.maps[key] = (fd, self._map(holder, pid, fd, inode))
                while len(self.maps) > self.limit:
                    self.maps.popitem(last=False)
            else:
                self.maps.move_to_end(key)
        numel = 1
        for n in shape:
            numel *= n
        return hit[1][: numel * dtype.itemsize].view(dtype).view(tuple(shape))

    def purge(self) -> None:
        """Drop the mappings whose owner has let go of the shard (its descriptor is closed)."""
        with self._lock:
            for (pid, inode), (fd, _) in list(self.maps.items()):
                try:
                    live = os.stat(f"/proc/{pid}/fd/{fd}").st_ino == inode
                except OSError:
                    live = False
                if not live:
                    del self.maps[(pid, inode)]

    def _map(self, holder: int, pid: int, fd: int, inode: int) -> torch.Tensor:
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
            raise ReshardError(
                f"device {self.device}: device {holder}'s source shard is gone (the tensor was freed, or the actor "
                f"of device {holder} died): {type(e).__name__}: {e}"
            ) from e
        with warnings.catch_warnings():  # torch warns that the buffer is not writable: it must not be
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(view, dtype=torch.uint8)

    def clear(self) -> None:
        with self._lock:
            self.maps.clear()

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
import weakref
from collections import OrderedDict

import numpy as np

from reshard.errors import ReshardError

#: Bound on the peer mappings a device keeps. A mapping of a shard its owner still holds costs no
#: memory (the pages are the owner's); one whose owner dropped the shard pins that memory, so
#: those are dropped whenever the device runs pulls (``PeerShards.purge``).
PEER_MAPS = 256
#: ``madvise`` advice that faults every page of a mapping in at once, writable (Linux >= 5.14; not
#: named by Python's mmap module yet): a fresh shard's pages are made in one call instead of one
#: trap per page while the first copy runs.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def base_address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class SharedShards:
    """This actor's memfd-backed allocations, by start address while their mapping lives."""

    @staticmethod
    def available() -> bool:
        """memfd and /proc are there (Linux): elsewhere shards stay in private memory."""
        return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")

    def __init__(self, populate: bool = True):
        self.populate = populate
        self.blocks: dict[int, tuple[int, int, int, weakref.ref]] = {}  # start -> (fd, inode, nbytes, mapping)

    def allocate(self, nbytes: int) -> np.ndarray:
        """A flat uint8 array of ``nbytes`` (> 0) in a fresh memfd, its pages populated (when the
        kernel can); the fd closes when the mapping dies (every array over it gone)."""
        fd = os.memfd_create(f"meshreshard-{nbytes}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            inode = os.fstat(fd).st_ino
        except BaseException:
            os.close(fd)
            raise
        if self.populate:
            try:
                mapping.madvise(MADV_POPULATE_WRITE)
            except OSError:  # an older kernel: the pages fault in on first touch
                self.populate = False
        flat = np.frombuffer(mapping, dtype=np.uint8)
        start = base_address(flat)
        self.blocks[start] = (fd, inode, nbytes, weakref.ref(mapping))
        weakref.finalize(mapping, self._closed, start, fd)
        return flat

    def _closed(self, start: int, fd: int) -> None:
        if self.blocks.get(start, (None,))[0] == fd:
            del self.blocks[start]
        os.close(fd)

    def descriptor(self, a) -> tuple | None:
        """``(pid, fd, inode, shape)`` of shard ``a`` if it fills a live memfd block, else None."""
        if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
            return None
        block = self.blocks.get(base_address(a))
        if block is None or block[3]() is None or block[2] != a.nbytes:
            return None
        return (os.getpid(), block[0], block[1], tuple(a.shape))


class PeerShards:
    """Peers' shards mapped into this process, kept while their owners keep them (``purge``, run
    by the actor after mapping a run's holders), at most ``limit`` (least recently used first)."""

    def __init__(self, device: int, limit: int = PEER_MAPS):
        self.device = device
        self.limit = limit
        self.maps: OrderedDict[tuple[int, int], tuple[int, np.ndarray]] = OrderedDict()  # (pid, inode) -> fd, flat
        self._lock = threading.Lock()

    def get(self, holder: int, desc, dtype: np.dtype) -> np.ndarray:
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
        return hit[1][: numel * dtype.itemsize].view(dtype).reshape(tuple(shape))

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
            raise ReshardError(
                f"device {self.device}: device {holder}'s source shard is gone (the tensor was freed, or the actor "
                f"of device {holder} died): {type(e).__name__}: {e}"
            ) from e
        return np.frombuffer(view, dtype=np.uint8)  # read-only, as the mapping

    def clear(self) -> None:
        with self._lock:
            self.maps.clear()

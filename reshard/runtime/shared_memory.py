"""Shared memory between the CPU device actors of one machine.

An actor of a mesh created with ``shared_memory=True`` allocates its shards in ``memfd`` files
(anonymous shared memory that dies with the process: a killed actor leaks nothing).
``SharedShards.descriptor(t)`` names a shard to other processes as ``(pid, fd, inode, shape,
tenure)``; a peer on the same machine maps it READ-ONLY through ``/proc/<pid>/fd/<fd>``
(``PeerShards``; the inode guards against a reused descriptor number) and copies slices straight
out of it: the pulls of ``reshard.pulls``.

Tenure. A block's memory outlives the shard in it (it is pooled, then holds the next shard of its
size; a peer's cached mapping keeps it too), so a descriptor alone cannot tell a puller that the
shard it names is gone. Each block starts with a header whose ``tenure`` the owner sets when a
shard takes the block (``begin``: a number never used before in this process) and clears when the
shard is dropped (``end``). A puller checks the descriptor's tenure before it copies and again
after (``PeerShards.check``): a shard freed before or during the reshard fails it, never yields
another tensor's bytes. A bug in one actor cannot write another's shard through its mapping; any
process of the same user may still open ``/proc/<pid>/fd`` itself, as it may attach a debugger
(the trust model of shared memory on one machine).
"""

from __future__ import annotations

import ctypes
import errno
import itertools
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
HEADER = 64  # bytes before a block's data (alignment kept): its tenure, uint64, at offset 0


def base_address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _populate(mapping: mmap.mmap, length: int) -> bool:
    """Make every page of ``mapping`` at once (``MADV_POPULATE_WRITE``), through ctypes so that
    the GIL is released meanwhile (``mmap.madvise`` holds it); False where the kernel cannot."""
    start = base_address(np.frombuffer(mapping, dtype=np.uint8, count=1))
    return _LIBC.madvise(start, length, MADV_POPULATE_WRITE) == 0


class SharedShards:
    """This actor's memfd-backed allocations, by start address while their mapping lives."""

    @staticmethod
    def available() -> bool:
        """memfd and /proc are there (Linux): elsewhere shards stay in private memory."""
        return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")

    def __init__(self, populate: bool = True):
        self.populate = populate
        self.blocks: dict[int, tuple[int, int, int, weakref.ref]] = {}  # data start -> (fd, inode, nbytes, mapping)
        self._tenures = itertools.count(1)

    def allocate(self, nbytes: int) -> np.ndarray:
        """A flat uint8 array of ``nbytes`` (> 0) in a fresh memfd, its pages populated (when the
        kernel can); the fd closes when the mapping dies (every array over it gone)."""
        fd = os.memfd_create(f"meshreshard-{nbytes}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, HEADER + nbytes)
            mapping = mmap.mmap(fd, HEADER + nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            inode = os.fstat(fd).st_ino
        except BaseException:
            os.close(fd)
            raise
        if self.populate and not _populate(mapping, HEADER + nbytes):
            self.populate = False  # an older kernel: the pages fault in on first touch
        flat = np.frombuffer(mapping, dtype=np.uint8, offset=HEADER)
        start = base_address(flat)
        self.blocks[start] = (fd, inode, nbytes, weakref.ref(mapping))
        weakref.finalize(mapping, self._closed, start, fd)
        return flat

    def _closed(self, start: int, fd: int) -> None:
        if self.blocks.get(start, (None,))[0] == fd:
            del self.blocks[start]
        os.close(fd)

    def _header(self, a) -> tuple[tuple, np.ndarray] | None:
        """The block ``a`` fills and its tenure cell, or None (not a whole live block)."""
        if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
            return None
        block = self.blocks.get(base_address(a))
        mapping = None if block is None else block[3]()
        if mapping is None or block[2] != a.nbytes:
            return None
        return block, np.frombuffer(mapping, dtype=np.uint64, count=1)

    def begin(self, a) -> None:
        """A shard takes the block ``a`` fills (if it fills one): a fresh tenure."""
        found = self._header(a)
        if found is not None:
            found[1][0] = next(self._tenures)

    def end(self, a) -> None:
        """The shard in ``a``'s block is dropped: descriptors of it no longer map."""
        found = self._header(a)
        if found is not None:
            found[1][0] = 0

    def descriptor(self, a) -> tuple | None:
        """``(pid, fd, inode, shape, tenure)`` of shard ``a`` if it fills a live memfd block held
        by a shard, else None."""
        found = self._header(a)
        if found is None or not found[1][0]:
            return None
        block, tenure = found
        return (os.getpid(), block[0], block[1], tuple(a.shape), int(tenure[0]))


class PeerShards:
    """Peers' shards mapped into this process, kept while their owners keep them (``purge``, run
    by the actor after mapping a run's holders), at most ``limit`` (least recently used first)."""

    def __init__(self, device: int, limit: int = PEER_MAPS):
        self.device = device
        self.limit = limit
        self.maps: OrderedDict[tuple[int, int], tuple[int, np.ndarray]] = OrderedDict()  # (pid, inode) -> fd, block
        self._lock = threading.Lock()

    def get(self, holder: int, desc, dtype: np.dtype) -> np.ndarray:
        """Device ``holder``'s shard named by ``desc``, viewed (read-only) as ``dtype`` of its shape;
        ``ReshardError`` if the shard was dropped (``check`` again after copying from it)."""
        pid, fd, inode, shape, _ = desc
        key = (pid, inode)
        with self._lock:
            hit = self.maps.get(key)
            if hit is None:
                hit = self.maps[key] = (fd, self._map(holder, pid, fd, inode))
                while len(self.maps) > self.limit:
                    self.maps.popitem(last=False)
            else:
                self.maps.move_to_end(key)
        self._check(holder, desc, hit[1])
        numel = 1
        for n in shape:
            numel *= n
        return hit[1][HEADER : HEADER + numel * dtype.itemsize].view(dtype).reshape(tuple(shape))

    def check(self, holder: int, desc) -> None:
        """``ReshardError`` unless the shard ``desc`` names is still its holder's (after a copy
        from it: it was not dropped, nor its memory reused, meanwhile)."""
        with self._lock:
            hit = self.maps.get((desc[0], desc[2]))
        if hit is not None:
            self._check(holder, desc, hit[1])

    def _check(self, holder: int, desc, block: np.ndarray) -> None:
        if int(block[:8].view(np.uint64)[0]) != desc[4]:
            raise ReshardError(
                f"device {self.device}: device {holder}'s source shard is gone (the tensor was freed, through this "
                "handle or another); its memory no longer holds it"
            )

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

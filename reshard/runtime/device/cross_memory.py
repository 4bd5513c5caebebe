"""Pulls out of a peer's private memory: Linux cross-memory attach (``process_vm_readv``).

A tensor a framework allocated (FSDP2's parameters, an inference engine's weights) lives in its
process's private heap, which no peer can map as it maps the library's shared blocks
(``reshard.runtime.device.shared_memory``). Such a shard still gets a descriptor: its device
enters it in its ``TenureBoard`` and names it as ``(CROSS_MEMORY, pid, board fd, board inode,
cell, tenure, address, shape, file)``. A puller on the same machine reads the slices it needs
straight out of the holder's memory into its destination (``RemoteShard``): one kernel copy per
run of contiguous bytes, up to ``IOV_MAX`` runs per system call, as a pull from shared memory
copies once, and no message through the backend. Where the tensor's storage lies in a
shared-memory file (torch's ``share_memory_()``, e.g. ``share(..., reback=True)``), ``file`` is
``(fd, inode, offset)`` of it and peers map it instead, as they map the library's own blocks (a
mapped copy is faster than the kernel's); its tenure stays on the board.

Tenure. The board is a small memfd that peers map read-only, with a cell per shard in private
memory. The holder writes a fresh tenure into the shard's cell when it starts holding it and
clears the cell when it lets go, before the memory can be freed or reused. A puller checks the
cell before it reads and again after (``PeerShards.check``): a shard let go of meanwhile fails the
pull, never yields another tensor's bytes. Cell 0 holds ``LIVE`` for as long as the board exists.

Trust. The kernel lets a process read another's memory only where it may ptrace it: the same user
where Yama's ``ptrace_scope`` is 0 (or Yama is absent), or with ``CAP_SYS_PTRACE``; so no process
gains a read it did not have. The library never loosens that (no ``PR_SET_PTRACER``). Where this
process cannot read itself that way (a seccomp profile, Yama's scope 1 or more without the
capability), its private shards get no descriptor and move through the backend, as before.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import itertools
import mmap
import operator
import os
from collections import deque
from dataclasses import dataclass

import numpy as np

from reshard.errors import ReshardError
from reshard.runtime.messages import CROSS_MEMORY, PlacedDescriptors

BOARD_CELLS = 1 << 16  # shards in private memory a device names at once (8 bytes each, pages made on use)
LIVE = 1  # cell 0 of every board
IOV_MAX = 1024  # iovec entries per call (Linux's UIO_MAXIOV)
CALL_BYTES = 1 << 30  # bytes per call, under the kernel's 2 GiB bound on one transfer

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.process_vm_readv.argtypes = (
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_ulong,
)
_LIBC.process_vm_readv.restype = ctypes.c_ssize_t


def read_rows(pid: int, local: np.ndarray, remote: np.ndarray) -> int:
    """One ``process_vm_readv`` of the ``(address, length)`` rows of ``remote`` in process ``pid``
    into those of ``local`` (uint64 arrays); bytes read, or ``-errno``. ctypes lets the GIL go."""
    got = _LIBC.process_vm_readv(pid, local.ctypes.data, len(local), remote.ctypes.data, len(remote), 0)
    return got if got >= 0 else -ctypes.get_errno()


def _yama_scope() -> int:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0  # no Yama: the classic rule, the same user may read


@functools.cache
def available() -> bool:
    """Whether peers of this process's user may read its private memory (module docstring): the
    call works here (no seccomp filter refuses it) and Yama lets the same user read, or this process
    holds the capability that overrides it (root, in CI's containers)."""
    if not hasattr(os, "memfd_create"):
        return False
    probe = np.arange(4, dtype=np.uint64)
    into = np.zeros(4, dtype=np.uint64)
    local = np.array([[into.ctypes.data, into.nbytes]], dtype=np.uint64)
    remote = np.array([[probe.ctypes.data, probe.nbytes]], dtype=np.uint64)
    if read_rows(os.getpid(), local, remote) != probe.nbytes or not np.array_equal(probe, into):
        return False
    return _yama_scope() == 0 or os.geteuid() == 0


def base_address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class TenureBoard:
    """This device's cells of tenure for its shards in private memory (module docstring)."""

    def __init__(self):
        self.fd = os.memfd_create("meshreshard-tenures", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, BOARD_CELLS * 8)
            self._mapping = mmap.mmap(self.fd, BOARD_CELLS * 8, flags=mmap.MAP_SHARED)
            self.inode = os.fstat(self.fd).st_ino
        except BaseException:
            os.close(self.fd)
            raise
        self.cells = np.frombuffer(self._mapping, dtype=np.uint64)
        self.cells[0] = LIVE
        self.pid = os.getpid()
        self._free = list(range(BOARD_CELLS - 1, 0, -1))
        self._cell: dict[tuple[int, int], int] = {}  # (address, bytes) -> its cell
        self._file: dict[int, tuple[int, int, int] | None] = {}  # cell -> (fd, inode, offset) of its file
        self._held: dict[int, np.ndarray] = {}  # cell -> the shard (its memory freed only once the cell is clear)

    def begin(
        self, a, tenure: int, file: tuple[int, int, int] | None = None, address: int | None = None
    ) -> tuple | None:
        """Shard ``a`` (a C-contiguous numpy array in private memory, or at ``(descriptor, inode,
        offset)`` of a shared-memory ``file``: peers map that instead of reading) takes ``tenure``;
        returns its descriptor. Nothing (None) when every cell is taken (the shard then moves
        through the backend). ``address``: where ``a`` starts, when the caller knows."""
        if not isinstance(a, np.ndarray) or not a.flags.c_contiguous or not a.nbytes:
            return None
        if address is None:
            address = base_address(a)
        key = (address, a.nbytes)
        cell = self._cell.get(key)
        if cell is None:
            if not self._free:
                return None
            cell = self._cell[key] = self._free.pop()
        self._file[cell] = file
        self._held[cell] = a  # its memory lives while the cell names it, whoever else lets go of it
        self.cells[cell] = tenure
        return (CROSS_MEMORY, self.pid, self.fd, self.inode, cell, tenure, address, tuple(a.shape), file)

    def begin_placed(self, placed, tenures: list) -> PlacedDescriptors | list:
        """``begin`` of a unit's destinations (``shards.PlacedShards``: C-contiguous views at known
        addresses), each with its tenure: their descriptors, as columns. Cells are taken and filled
        column by column; where some already has a cell, or too few are free, shard by shard (a
        list of descriptors, None once every cell is taken)."""
        keys = list(zip(placed.addresses, placed.sizes, strict=True))
        n, free = len(keys), self._free
        if not n:
            return []
        if len(free) < n or not self._cell.keys().isdisjoint(keys):
            return [
                self.begin(a, tenure, file, address)
                for a, tenure, file, address in zip(placed.views, tenures, placed.files, placed.addresses, strict=True)
            ]
        taken = free[-n:]
        del free[-n:]
        self._cell.update(zip(keys, taken, strict=True))
        files = tuple(placed.files) if any(placed.files) else None
        if files is not None:  # a cell without a file has no entry (``descriptor`` reads None)
            self._file.update(zip(taken, files, strict=True))
        self._held.update(zip(taken, placed.views, strict=True))  # its memory lives while the cell names it
        cells, tenures_ = np.array(taken, np.int64), np.array(tenures, np.uint64)
        self.cells[cells] = tenures_
        return PlacedDescriptors(
            self.pid,
            self.fd,
            self.inode,
            np.array(placed.tensors, np.int64),
            cells,
            tenures_,
            np.array(placed.addresses, np.uint64),
            placed.shape_ids,
            placed.distinct,
            files,
        )

    def end(self, a, address: int | None = None) -> None:
        """The shard in ``a``'s memory is let go of: its descriptors stop reading."""
        if not isinstance(a, np.ndarray):
            return
        cell = self._cell.pop((base_address(a) if address is None else address, a.nbytes), None)
        if cell is not None:
            self.cells[cell] = 0
            self._file.pop(cell, None)
            self._held.pop(cell, None)
            self._free.append(cell)

    def end_placed(self, shards: list, addresses: list) -> None:
        """``end`` of many C-contiguous shards at known addresses, cell by cell in one pass."""
        keys = zip(addresses, map(operator.attrgetter("nbytes"), shards), strict=True)
        cells = [c for c in map(self._cell.pop, keys, itertools.repeat(None)) if c is not None]
        if not cells:
            return
        self.cells[np.array(cells, np.int64)] = 0
        for table in (self._file, self._held):
            deque(map(table.pop, cells, itertools.repeat(None)), maxlen=0)
        self._free.extend(cells)

    def descriptor(self, a, address: int | None = None) -> tuple | None:
        if not isinstance(a, np.ndarray):
            return None
        if address is None:
            address = base_address(a)
        cell = self._cell.get((address, a.nbytes))
        if cell is None:
            return None
        return (
            CROSS_MEMORY,
            self.pid,
            self.fd,
            self.inode,
            cell,
            int(self.cells[cell]),
            address,
            tuple(a.shape),
            self._file.get(cell),
        )


class RemoteShard:
    """A peer's shard in its private memory, read slice by slice (never mapped here)."""

    __slots__ = ("address", "device", "dtype", "holder", "pid", "shape")

    def __init__(self, device: int, holder: int, pid: int, address: int, shape: tuple[int, ...], dtype: np.dtype):
        self.device, self.holder, self.pid, self.address = device, holder, pid, address
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    def __getitem__(self, index) -> np.ndarray:
        box = self._box(index)
        out = np.empty(tuple(hi - lo for lo, hi in box), dtype=self.dtype)
        self._read_box(box, out)
        return out

    def read_into(self, index, out) -> None:
        """``out[...] = self[index]``, read straight into ``out`` where it is C-contiguous."""
        if isinstance(out, np.ndarray) and out.flags.c_contiguous and out.dtype == self.dtype:
            self._read_box(self._box(index), out)
        else:
            from reshard.runtime import arrays

            arrays.copy(out, self[index])

    def _box(self, index) -> tuple[tuple[int, int], ...]:
        """``((lo, hi), ...)`` per dimension of ``index`` (slices with unit steps, then ``Ellipsis``)."""
        index = () if index is None else index if isinstance(index, tuple) else (index,)
        box = []
        for dim, n in enumerate(self.shape):
            s = index[dim] if dim < len(index) and index[dim] is not Ellipsis else slice(None)
            lo, hi, step = s.indices(n)
            if step != 1:
                raise ReshardError(f"device {self.device}: a pull read step {step} of device {self.holder}'s shard")
            box.append((lo, max(lo, hi)))
        return tuple(box)

    def _read_box(self, box: tuple[tuple[int, int], ...], out: np.ndarray) -> None:
        if out.nbytes == 0:
            return
        plan = read_plan(self.shape, self.dtype.itemsize, box)
        if plan.span is not None and plan.span_plan is not None:  # short runs close together: their span, copied
            lo, hi = plan.span
            flat = np.empty(hi - lo, dtype=np.uint8)
            self._read(lo, flat, plan.span_plan)
            inner = flat.view(self.dtype).reshape(plan.span_shape)
            np.copyto(out, inner[plan.span_index])
        else:
            self._read(0, out, plan)

    def _read(self, base: int, out: np.ndarray, plan: ReadPlan) -> None:
        """The runs of ``plan`` (offsets from ``base`` bytes into the shard) into ``out``, in order."""
        into, address = base_address(out), self.address + base
        if len(plan.iov) == 1:  # one run: no arrays to build
            got = _read_one(self.pid, into, address + plan.first, plan.nbytes)
            if got != plan.nbytes:
                self._failed(got, plan.nbytes)
            return
        remote = plan.iov.copy()
        remote[:, 0] += np.uint64(address)
        for start, stop, at, want in plan.calls:
            got = read_rows(self.pid, np.array([[into + at, want]], dtype=np.uint64), remote[start:stop])
            if got != want:
                self._failed(got, want)

    def _failed(self, got: int, want: int):
        raise read_failed(self.device, self.holder, self.pid, got, want)


def read_failed(device: int, holder: int, pid: int, got: int, want: int) -> ReshardError:
    """The error of a read out of ``holder``'s process ``pid`` that got ``got`` of ``want`` bytes
    (negative: ``-errno``)."""
    code = -got if got < 0 else 0
    if code == errno.EPERM:
        return ReshardError(
            f"device {device} may not read device {holder}'s shard out of its process ({pid}): "
            f"{os.strerror(code)}. The kernel allows it only where the process may be traced (same user, Yama "
            "ptrace_scope 0, or CAP_SYS_PTRACE); allocate shared tensors with reshard_device.empty(...) or "
            "create the meshes with shared_memory=False"
        )
    what = os.strerror(code) if code else f"read {got} of {want} bytes"
    return ReshardError(
        f"device {device}: device {holder}'s source shard is gone (the tensor was freed, or the actor "
        f"of device {holder} died): {what}"
    )


class Gather:
    """Reads out of peers' private memory gathered over many pulls and issued together: one
    ``process_vm_readv`` per holder for as many boxes as ``IOV_MAX`` and ``CALL_BYTES`` allow (a
    state dict's small shards: one system call where there were hundreds). A box read as a span
    (short runs), or one that needs calls of its own, is not gathered (``add`` says so)."""

    __slots__ = ("pending",)

    def __init__(self):
        self.pending: dict[int, list] = {}  # pid -> [(shard, box, out, plan)]

    def add(self, shard: RemoteShard, box: tuple[tuple[int, int], ...], out) -> bool:
        """Queue ``out[...] = shard[box]`` (``out`` a C-contiguous numpy array of the shard's
        dtype); False, nothing queued, when it cannot be gathered: the caller reads it itself."""
        if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or out.dtype != shard.dtype or not out.nbytes:
            return False
        plan = read_plan(shard.shape, shard.dtype.itemsize, box)
        if plan.span is not None or len(plan.calls) != 1 or len(plan.iov) > IOV_MAX:
            return False
        self.pending.setdefault(shard.pid, []).append((shard, box, out, plan))
        return True

    def flush(self) -> None:
        """Read everything queued (``ReshardError`` naming the first box that failed)."""
        pending, self.pending = self.pending, {}
        for pid, items in pending.items():
            start = 0
            while start < len(items):
                stop, rows, nbytes = start, 0, 0
                while stop < len(items) and stop - start < IOV_MAX:
                    plan = items[stop][3]
                    if stop > start and (rows + len(plan.iov) > IOV_MAX or nbytes + plan.nbytes > CALL_BYTES):
                        break
                    rows += len(plan.iov)
                    nbytes += plan.nbytes
                    stop += 1
                self._call(pid, items[start:stop], nbytes)
                start = stop

    @staticmethod
    def _call(pid: int, items: list, nbytes: int) -> None:
        local, remote = [], []
        for shard, _, out, plan in items:
            local.append((base_address(out), plan.nbytes))
            if len(plan.iov) == 1:
                remote.append((shard.address + plan.first, plan.nbytes))
            else:
                rows = plan.iov.astype(np.uint64)  # a copy: the plan is cached
                rows[:, 0] += np.uint64(shard.address)
                remote.extend(map(tuple, rows.tolist()))
        got = read_rows(pid, np.array(local, dtype=np.uint64), np.array(remote, dtype=np.uint64))
        if got != nbytes:  # one by one: the box that fails raises, naming its holder
            for shard, box, out, _ in items:
                shard._read_box(box, out)


class _Iovec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_uint64), ("len", ctypes.c_uint64))


def _read_one(pid: int, into: int, address: int, nbytes: int) -> int:
    local, remote = _Iovec(into, nbytes), _Iovec(address, nbytes)
    got = _LIBC.process_vm_readv(pid, ctypes.addressof(local), 1, ctypes.addressof(remote), 1, 0)
    return got if got >= 0 else -ctypes.get_errno()


@dataclass(frozen=True, eq=False)
class ReadPlan:
    """How one box of a shard is read (``read_plan``): ``iov``, the runs' ``(offset, length)``
    rows; ``calls``, ``(first row, end row, offset in the output, bytes)`` per system call; or
    ``span``: the bytes ``[lo, hi)`` the runs lie in, read whole by ``span_plan`` and viewed as
    ``span_shape``, of which ``span_index`` is the box."""

    iov: np.ndarray
    calls: tuple[tuple[int, int, int, int], ...]
    nbytes: int
    span: tuple[int, int] | None = None
    span_plan: ReadPlan | None = None
    span_shape: tuple[int, ...] = ()
    span_index: tuple = ()

    @property
    def first(self) -> int:
        return int(self.iov[0, 0])


#: Runs shorter than this, whose span is at most ``SPAN_WASTE`` times the box, are read as one span
#: and copied here: the kernel's cost per run (it pins each run's pages) outweighs the bytes.
SHORT_RUN = 4096
SPAN_WASTE = 4


@functools.lru_cache(maxsize=4096)
def read_plan(shape: tuple[int, ...], itemsize: int, box: tuple[tuple[int, int], ...]) -> ReadPlan:
    """How to read ``box`` of a C-contiguous shard of ``shape`` (cached: a program reads the same
    boxes every time it runs)."""
    offsets, length = runs(shape, itemsize, list(box))
    nbytes = len(offsets) * length
    if len(offsets) > 1 and length < SHORT_RUN:
        lead = next(d for d, (a, b) in enumerate(box) if b - a != 1)  # dimensions before it: one index each
        strides = c_strides(shape, itemsize)
        lo = sum(a * st for (a, _), st in zip(box[: lead + 1], strides, strict=False))
        hi = lo + (box[lead][1] - box[lead][0]) * strides[lead]
        if hi - lo <= SPAN_WASTE * nbytes:
            span_shape = (box[lead][1] - box[lead][0], *shape[lead + 1 :])
            index = (slice(None), *(slice(a, b) for a, b in box[lead + 1 :]))
            whole = _iov_plan(np.zeros(1, dtype=np.uint64), hi - lo)
            return ReadPlan(np.zeros((0, 2), np.uint64), (), nbytes, (lo, hi), whole, span_shape, index)
    return _iov_plan(offsets, length)


def c_strides(shape, itemsize: int) -> tuple[int, ...]:
    """The byte strides of a C-contiguous array of ``shape``."""
    strides = [itemsize] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return tuple(strides)


def _iov_plan(offsets: np.ndarray, length: int) -> ReadPlan:
    pieces = -(-length // CALL_BYTES)
    if pieces > 1:  # a run the kernel would cut: in pieces of at most CALL_BYTES
        offsets = (offsets[:, None] + np.arange(pieces, dtype=np.uint64) * np.uint64(CALL_BYTES)).ravel()
    lengths = np.full(len(offsets), min(length, CALL_BYTES), dtype=np.uint64)
    if pieces > 1:
        lengths.reshape(-1, pieces)[:, -1] = length - (pieces - 1) * CALL_BYTES
    iov = np.empty((len(offsets), 2), dtype=np.uint64)
    iov[:, 0], iov[:, 1] = offsets, lengths
    ends = np.cumsum(lengths)
    calls, done, start = [], 0, 0
    while start < len(iov):
        stop = min(start + IOV_MAX, len(iov))
        stop = start + max(1, int(np.searchsorted(ends[start:stop], done + CALL_BYTES, side="right")))
        want = int(ends[stop - 1]) - done
        calls.append((start, stop, done, want))
        done += want
        start = stop
    iov.setflags(write=False)
    return ReadPlan(iov, tuple(calls), int(ends[-1]))


def runs(shape: tuple[int, ...], itemsize: int, box: list[tuple[int, int]]) -> tuple[np.ndarray, int]:
    """``(offsets, length)``: the byte offsets in C order of the runs of contiguous bytes that
    ``box`` covers in a C-contiguous array of ``shape``, each ``length`` bytes long. Inner
    dimensions the box covers whole merge into one run."""
    if not shape:
        return np.zeros(1, dtype=np.uint64), itemsize
    strides = c_strides(shape, itemsize)
    k = len(shape) - 1
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    lo, hi = box[k]
    offsets = np.array([lo * strides[k]], dtype=np.uint64)
    for d in range(k - 1, -1, -1):
        outer = np.arange(box[d][0], box[d][1], dtype=np.uint64) * np.uint64(strides[d])
        offsets = (outer[:, None] + offsets[None, :]).ravel()
    return offsets, (hi - lo) * strides[k]


__all__ = [
    "BOARD_CELLS",
    "Gather",
    "RemoteShard",
    "TenureBoard",
    "available",
    "c_strides",
    "read_failed",
    "read_plan",
    "read_rows",
    "runs",
]

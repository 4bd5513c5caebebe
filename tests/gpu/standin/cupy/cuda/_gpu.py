"""The stand-in's device: memory behind fake pointers, streams as FIFO worker threads, events.

Memory: one registry per process maps a fake device pointer range to a host ``numpy.uint8``
buffer. Allocations are rounded to 512 bytes, as cupy's memory pool does (cupy/cuda/memory.pyx,
``ALLOCATION_UNIT_SIZE``), and start on a page. Fresh memory is filled with 0xA5, not zeros: like
a reused pool block, it holds garbage until written. Work that touches a pointer no live
allocation covers (use after free, out of bounds) is a kernel fault: the error becomes sticky
for the whole process (``cudaErrorIllegalAddress``), as a CUDA context is after such a fault.

Each device's memory is one sparse shared-memory file (memfd) that the fake pointers index, so
that another process can map an allocation: CUDA IPC (CUDA runtime API, "Interprocess
Communication"). ``ipc_handle`` names an allocation by its base pointer only (cudaIpcGetMemHandle
takes "the base of an existing device memory allocation"); ``ipc_open`` maps it in another
process, reference counted per handle ("may only be opened by one context per device per other
process"; cuIpcCloseMemHandle "decrements the reference count"), never in the process that made
it; ``ipc_close`` unmaps at the last close. Freed memory goes back to the system (a hole punched in
the file).

Streams (CUDA programming guide, "Streams"): every stream is a worker thread running its tasks
in FIFO order. ``Stream.null`` is the legacy default stream: work on it waits for all earlier
work on the device's blocking streams and blocking streams wait for it; streams made with
``non_blocking=True`` do not synchronise with it. An event records a (stream, position) pair:
it is done once that stream completed everything submitted before the record (an event never
recorded is done); ``wait_event`` makes a stream's later tasks wait for it.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import mmap
import os
import struct
import sys
import threading
import weakref
from collections import deque

import numpy as np

from cupy.cuda import runtime

ALLOCATION_UNIT = 512
PAGE = 4096
ARENA_BYTES = 1 << 38  # each device's sparse memory file: pages exist only where allocations are
LAUNCHER = "standin-nccl-group"  # the thread that finishes a non-blocking NCCL group
POISON = 0xA5
_BASE = 0x7F00_0000_0000  # first fake pointer of device 0; each device gets its own range
_DEVICE_SPAN = 1 << 40

# ------------------------------------------------------------------------------------------------
# Diagnostics (what the stand-in saw that a GPU would turn into a hang, corruption or fault)

_notes: list[str] = []
_notes_lock = threading.Lock()


def note(text: str) -> None:
    with _notes_lock:
        _notes.append(text)
    print(f"[cupy stand-in] {text}", file=sys.stderr, flush=True)


def notes() -> list[str]:
    with _notes_lock:
        return list(_notes)


# ------------------------------------------------------------------------------------------------
# Sticky error


class IllegalAddress(Exception):
    """A task touched device memory that no live allocation covers."""


_sticky: int | None = None


def set_sticky(status: int, why: str) -> None:
    global _sticky
    if _sticky is None:
        _sticky = status
        note(f"device fault, the CUDA context is now unusable ({runtime.CUDARuntimeError(status)}): {why}")


def sticky() -> int | None:
    return _sticky


def check_sticky() -> None:
    if _sticky is not None:
        raise runtime.CUDARuntimeError(_sticky)


def reset_device() -> None:
    """Clear a sticky fault (tests of the stand-in only; a real context has to be recreated)."""
    global _sticky
    _sticky = None


# ------------------------------------------------------------------------------------------------
# Memory


class Arena:
    """One device's memory: a sparse memfd the size of its fake pointer range, mapped whole."""

    def __init__(self, device: int):
        self.fd = os.memfd_create(f"cupy-standin-gpu{device}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, ARENA_BYTES)
        self.inode = os.fstat(self.fd).st_ino
        self.mapping = mmap.mmap(self.fd, ARENA_BYTES, flags=mmap.MAP_SHARED)
        self.base = _BASE + device * _DEVICE_SPAN

    def view(self, ptr: int, size: int) -> np.ndarray:
        return np.frombuffer(self.mapping, dtype=np.uint8, count=size, offset=ptr - self.base)

    def release(self, ptr: int, size: int) -> None:
        """The pages wholly inside ``[ptr, ptr + size)`` go back to the system (read as zeros)."""
        lo = -(-(ptr - self.base) // PAGE) * PAGE
        hi = (ptr - self.base + size) // PAGE * PAGE
        if hi > lo:
            _LIBC.fallocate(self.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, lo, hi - lo)


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
FALLOC_FL_KEEP_SIZE = 1
FALLOC_FL_PUNCH_HOLE = 2
_arenas: dict[int, Arena] = {}


def arena(device: int) -> Arena:
    with _mem_lock:
        a = _arenas.get(device)
        if a is None:
            a = _arenas[device] = Arena(device)
        return a


class Allocation:
    __slots__ = ("ptr", "size", "device", "buf", "owned", "__weakref__")

    def __init__(self, ptr: int, size: int, device: int):
        self.ptr = ptr
        self.size = size
        self.device = device
        self.buf = _arenas[device].view(ptr, size)
        self.buf[...] = POISON
        self.owned = True  # memory of this process's pool (not lent through DLPack or opened by IPC)


_mem_lock = threading.Lock()
_bases: list[int] = []
_allocs: dict[int, Allocation] = {}
_next_ptr: dict[int, int] = {}
#: device -> the bytes its allocations of this process may take (``_control.device_memory``; none: unbounded)
capacity: dict[int, int] = {}


def malloc(nbytes: int, device: int) -> Allocation | None:
    """A fresh allocation (None for 0 bytes: cupy's pointer of an empty allocation is 0)."""
    check_sticky()
    if nbytes == 0:
        return None
    size = -(-nbytes // ALLOCATION_UNIT) * ALLOCATION_UNIT
    arena(device)
    with _mem_lock:
        ptr = _next_ptr.get(device, _BASE + device * _DEVICE_SPAN)
        _next_ptr[device] = -(-(ptr + size + ALLOCATION_UNIT) // PAGE) * PAGE  # a gap: running off the end faults
        if _next_ptr[device] - _BASE - device * _DEVICE_SPAN > ARENA_BYTES:
            raise runtime.CUDARuntimeError(runtime.cudaErrorMemoryAllocation)
        cap = capacity.get(device)
        if cap is not None and _owned_bytes(device) + size > cap:
            # cudaMalloc: "cudaErrorMemoryAllocation" when the device has no memory left for it
            raise runtime.CUDARuntimeError(runtime.cudaErrorMemoryAllocation)
        alloc = Allocation(ptr, size, device)
        bisect.insort(_bases, ptr)
        _allocs[ptr] = alloc
    return alloc


def owned_bytes(device: int) -> int:
    """The bytes of this process's own allocations on ``device`` (not lent through DLPack nor opened by IPC)."""
    with _mem_lock:
        return _owned_bytes(device)


def _owned_bytes(device: int) -> int:
    return sum(a.size for a in _allocs.values() if a.device == device and a.owned)


def register_host(buf: np.ndarray, device: int) -> Allocation:
    """Host bytes ``buf`` (uint8, contiguous) as an allocation of ``device`` (``cupy.from_dlpack``
    of a CPU tensor): a fake pointer range over them, no copy."""
    check_sticky()
    size = max(1, buf.size)
    with _mem_lock:
        ptr = _next_ptr.get(device, _BASE + device * _DEVICE_SPAN)
        _next_ptr[device] = ptr + -(-size // ALLOCATION_UNIT) * ALLOCATION_UNIT + ALLOCATION_UNIT
        alloc = Allocation.__new__(Allocation)
        alloc.ptr, alloc.size, alloc.device, alloc.buf, alloc.owned = ptr, buf.size, device, buf, False
        bisect.insort(_bases, ptr)
        _allocs[ptr] = alloc
    return alloc


_cached = [0]  # bytes of freed allocations cupy's memory pool would keep (``pool_cached_bytes``)


def device_address(host_address: int, nbytes: int) -> int | None:
    """The device pointer of host bytes that are stand-in device memory already (an array that
    went out through DLPack and comes back: a GPU pointer survives the round trip), else None."""
    with _mem_lock:
        for alloc in _allocs.values():
            if alloc.buf is None or not alloc.buf.size:
                continue
            start = alloc.buf.ctypes.data
            if start <= host_address and host_address + nbytes <= start + alloc.buf.size:
                return alloc.ptr + (host_address - start)
    return None


def free(ptr: int) -> None:
    """The last reference to an allocation went: its range becomes invalid (a later use faults),
    and its bytes count as cached until ``release_cached`` (cupy's pool keeps freed blocks for
    reuse until ``free_all_blocks``)."""
    with _mem_lock:
        alloc = _allocs.pop(ptr, None)
        if alloc is not None:
            del _bases[bisect.bisect_left(_bases, ptr)]
            if alloc.owned:
                _cached[0] += alloc.size
                alloc.buf = None
                _arenas[alloc.device].release(alloc.ptr, alloc.size)


# ------------------------------------------------------------------------------------------------
# CUDA IPC

_IPC = struct.Struct("<4sQiQQQi")  # magic, pid, arena fd, arena inode, offset, size, device
IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
_opened: dict[tuple[int, int, int], list] = {}  # (pid, inode, offset) -> [allocation, mapping, count]


def ipc_handle(ptr: int) -> bytes:
    """``cudaIpcGetMemHandle``: 64 bytes naming the allocation that starts at ``ptr``."""
    check_sticky()
    with _mem_lock:
        alloc = _allocs.get(ptr)
    if alloc is None or not alloc.owned:
        raise runtime.CUDARuntimeError(runtime.cudaErrorInvalidValue)
    a = _arenas[alloc.device]
    raw = _IPC.pack(b"SIPC", os.getpid(), a.fd, a.inode, ptr - a.base, alloc.size, alloc.device)
    return raw.ljust(IPC_HANDLE_BYTES, b"\0")


def ipc_open(handle: bytes, device: int) -> int:
    """``cudaIpcOpenMemHandle``: the allocation ``handle`` names, mapped into this process (once per
    handle, reference counted); refused for a handle of this process."""
    check_sticky()
    magic, pid, fd, inode, offset, size, _ = _IPC.unpack(bytes(handle)[: _IPC.size])
    if magic != b"SIPC":
        raise runtime.CUDARuntimeError(runtime.cudaErrorInvalidResourceHandle)
    if pid == os.getpid():
        raise runtime.CUDARuntimeError(runtime.cudaErrorInvalidDevice)  # not within the exporting process
    key = (pid, inode, offset)
    with _mem_lock:
        hit = _opened.get(key)
        if hit is not None:
            hit[2] += 1
            return hit[0].ptr
    try:
        peer = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise runtime.CUDARuntimeError(runtime.cudaErrorInvalidResourceHandle) from e
    try:
        if os.fstat(peer).st_ino != inode:
            raise runtime.CUDARuntimeError(runtime.cudaErrorInvalidResourceHandle)
        start = offset // PAGE * PAGE
        mapping = mmap.mmap(peer, offset - start + size, flags=mmap.MAP_SHARED, offset=start)
    finally:
        os.close(peer)
    buf = np.frombuffer(mapping, dtype=np.uint8, count=size, offset=offset - start)
    alloc = register_host(buf, device)
    with _mem_lock:
        _opened[key] = [alloc, mapping, 1]
    return alloc.ptr


def ipc_close(ptr: int) -> None:
    """``cudaIpcCloseMemHandle``: one reference less; unmapped at the last."""
    with _mem_lock:
        key = next((k for k, v in _opened.items() if v[0].ptr == ptr), None)
        if key is None:
            raise runtime.CUDARuntimeError(runtime.cudaErrorInvalidValue)
        entry = _opened[key]
        entry[2] -= 1
        if entry[2]:
            return
        del _opened[key]
    free(ptr)


def pool_cached_bytes() -> int:
    return _cached[0]


def release_cached() -> None:
    with _mem_lock:
        _cached[0] = 0


def allocated_bytes() -> int:
    with _mem_lock:
        return sum(a.size for a in _allocs.values())


def resolve(ptr: int, nbytes: int) -> np.ndarray:
    """The bytes ``[ptr, ptr + nbytes)`` of a live allocation, as a writable uint8 view."""
    with _mem_lock:
        i = bisect.bisect_right(_bases, ptr) - 1
        alloc = _allocs[_bases[i]] if i >= 0 else None
    if alloc is None or not alloc.ptr <= ptr or ptr + nbytes > alloc.ptr + alloc.size:
        raise IllegalAddress(f"{nbytes} bytes at {ptr:#x} are not inside a live allocation")
    start = ptr - alloc.ptr
    return alloc.buf[start : start + nbytes]


def allocation_of(ptr: int) -> Allocation | None:
    with _mem_lock:
        i = bisect.bisect_right(_bases, ptr) - 1
        alloc = _allocs[_bases[i]] if i >= 0 else None
    if alloc is None or ptr >= alloc.ptr + alloc.size:
        return None
    return alloc


# ------------------------------------------------------------------------------------------------
# Streams


class Queue:
    """One stream: tasks run in submission order on one worker thread."""

    def __init__(self, ptr: int, device: int, kind: str):
        self.ptr = ptr
        self.device = device
        self.kind = kind  # "legacy" (the null stream), "blocking" or "non_blocking"
        self.cv = threading.Condition()
        self.tasks: deque = deque()
        self.submitted = 0
        self.completed = 0
        self.closed = False
        self.thread: threading.Thread | None = None
        self.nccl_launches = 0  # non-blocking NCCL launches for this stream not yet enqueued

    def __repr__(self) -> str:
        return f"<stand-in stream {self.ptr:#x} ({self.kind}, device {self.device})>"

    def submit(self, fn, what: str, deps=()) -> int:
        """Queue ``fn`` after everything already queued here and after ``deps`` ((queue, ticket) pairs)."""
        check_sticky()
        if self.nccl_launches and threading.current_thread().name != LAUNCHER:
            note(
                f"{what} issued on {self} while an NCCL launch for it is ncclInProgress: it may run before NCCL's "
                "kernel (NCCL: do not issue CUDA work on NCCL's streams before the state is ncclSuccess)"
            )
        deps = list(deps) + _implicit_deps(self)
        with self.cv:
            if self.closed:
                raise runtime.CUDARuntimeError(runtime.cudaErrorInvalidResourceHandle)
            self.submitted += 1
            ticket = self.submitted
            self.tasks.append((ticket, fn, what, deps))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name=f"standin-stream-{self.ptr:#x}", daemon=True)
                self.thread.start()
            self.cv.notify_all()
        return ticket

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.tasks:
                    if self.closed:
                        return
                    self.cv.wait()
                ticket, fn, what, deps = self.tasks[0]
            for q, t in deps:
                q.wait(t)
            if _sticky is None:
                try:
                    fn()
                except IllegalAddress as e:
                    set_sticky(runtime.cudaErrorIllegalAddress, f"{what} on {self}: {e}")
                except BaseException as e:  # a failing kernel faults the context
                    set_sticky(runtime.cudaErrorLaunchFailure, f"{what} on {self}: {type(e).__name__}: {e}")
            fn = deps = None  # a finished kernel holds no buffer alive
            with self.cv:
                self.tasks.popleft()
                self.completed = ticket
                self.cv.notify_all()

    def last(self) -> int:
        with self.cv:
            return self.submitted

    def reached(self, ticket: int) -> bool:
        return self.completed >= ticket

    def wait(self, ticket: int, timeout: float | None = None) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: self.completed >= ticket, timeout)

    def close(self) -> None:
        """``cudaStreamDestroy``: returns at once; queued work still completes."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        with _streams_lock:
            if _streams.get(self.ptr) is self:
                del _streams[self.ptr]


_streams_lock = threading.Lock()
_streams: dict[int, Queue] = {}
_legacy: dict[int, Queue] = {}
_blocking: dict[int, weakref.WeakSet] = {}
_stream_ptrs = itertools.count(0x5500_0000_0000, 0x100)


def create_stream(device: int, non_blocking: bool) -> Queue:
    q = Queue(next(_stream_ptrs), device, "non_blocking" if non_blocking else "blocking")
    with _streams_lock:
        _streams[q.ptr] = q
        if not non_blocking:
            _blocking.setdefault(device, weakref.WeakSet()).add(q)
    return q


def queue_of(ptr: int) -> Queue:
    """The stream behind a ``cudaStream_t`` (0: the current device's legacy default stream)."""
    if ptr == 0:
        device = runtime.getDevice()
        with _streams_lock:
            q = _legacy.get(device)
            if q is None:
                q = _legacy[device] = Queue(0, device, "legacy")
        return q
    with _streams_lock:
        q = _streams.get(ptr)
    if q is None:
        raise runtime.CUDARuntimeError(runtime.cudaErrorInvalidResourceHandle)
    return q


def _implicit_deps(q: Queue) -> list:
    """Legacy default stream semantics (CUDA runtime API, "stream synchronization behavior")."""
    if q.kind == "non_blocking":
        return []
    if q.kind == "blocking":
        legacy = _legacy.get(q.device)
        return [(legacy, legacy.last())] if legacy is not None else []
    with _streams_lock:
        others = list(_blocking.get(q.device, ()))
    return [(s, s.last()) for s in others]


def synchronize_device(device: int) -> None:
    with _streams_lock:
        queues = [q for q in list(_streams.values()) + list(_legacy.values()) if q.device == device]
    for q in queues:
        q.wait(q.last())
    check_sticky()


# ------------------------------------------------------------------------------------------------
# Events


class EventState:
    """Where an event was last recorded: (stream, its task count at that moment)."""

    __slots__ = ("queue", "ticket", "__weakref__")

    def __init__(self):
        self.queue: Queue | None = None
        self.ticket = 0

    def record(self, q: Queue) -> None:
        check_sticky()
        self.queue, self.ticket = q, q.last()

    def query(self) -> int:
        """``cudaEventQuery``: 0, ``cudaErrorNotReady``, or the sticky error (not raised: cupy 14's
        ``runtime.eventQuery`` returns the status and ``Event.done`` compares it with 0)."""
        if _sticky is not None:
            return _sticky
        if self.queue is None or self.queue.reached(self.ticket):
            return 0
        return runtime.cudaErrorNotReady

    def synchronize(self) -> None:
        if self.queue is not None:
            self.queue.wait(self.ticket)
        check_sticky()

    def dep(self) -> list:
        return [] if self.queue is None else [(self.queue, self.ticket)]


# ------------------------------------------------------------------------------------------------
# Current stream per thread and device (cupy's _ThreadLocal stream stack)

_tls = threading.local()


def stream_stack(device: int) -> list:
    stacks = getattr(_tls, "streams", None)
    if stacks is None:
        stacks = _tls.streams = {}
    return stacks.setdefault(device, [])


def launch(fn, what: str, stream=None) -> int:
    """Run ``fn`` as a kernel on ``stream`` (default: this thread's current stream)."""
    if stream is None:
        from cupy.cuda.stream import get_current_stream

        stream = get_current_stream()
    return queue_of(stream.ptr).submit(fn, what)

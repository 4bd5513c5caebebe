"""The stand-in's device: memory behind fake pointers, streams as FIFO worker threads, events.

Memory: one registry per process maps a fake device pointer range to a host ``numpy.uint8``
buffer. Allocations are rounded to 512 bytes and 512-aligned, as cupy's memory pool does
(cupy/cuda/memory.pyx, ``ALLOCATION_UNIT_SIZE``). Fresh memory is filled with 0xA5, not zeros:
like a reused pool block, it holds garbage until written. Work that touches a pointer no live
allocation covers (use after free, out of bounds) is a kernel fault: the error becomes sticky
for the whole process (``cudaErrorIllegalAddress``), as a CUDA context is after such a fault.

Streams (CUDA programming guide, "Streams"): every stream is a worker thread running its tasks
in FIFO order. ``Stream.null`` is the legacy default stream: work on it waits for all earlier
work on the device's blocking streams and blocking streams wait for it; streams made with
``non_blocking=True`` do not synchronise with it. An event records a (stream, position) pair:
it is done once that stream completed everything submitted before the record (an event never
recorded is done); ``wait_event`` makes a stream's later tasks wait for it.
"""

from __future__ import annotations

import bisect
import itertools
import sys
import threading
import weakref
from collections import deque

import numpy as np

from cupy.cuda import runtime

ALLOCATION_UNIT = 512
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


class Allocation:
    __slots__ = ("ptr", "size", "device", "buf", "owned", "__weakref__")

    def __init__(self, ptr: int, size: int, device: int):
        self.ptr = ptr
        self.size = size
        self.device = device
        self.buf = np.full(size, POISON, dtype=np.uint8)
        self.owned = True  # memory of this process's pool (not host memory lent through DLPack)


_mem_lock = threading.Lock()
_bases: list[int] = []
_allocs: dict[int, Allocation] = {}
_next_ptr: dict[int, int] = {}


def malloc(nbytes: int, device: int) -> Allocation | None:
    """A fresh allocation (None for 0 bytes: cupy's pointer of an empty allocation is 0)."""
    check_sticky()
    if nbytes == 0:
        return None
    size = -(-nbytes // ALLOCATION_UNIT) * ALLOCATION_UNIT
    with _mem_lock:
        ptr = _next_ptr.get(device, _BASE + device * _DEVICE_SPAN)
        _next_ptr[device] = ptr + size + ALLOCATION_UNIT  # a gap: running off the end is a fault
        alloc = Allocation(ptr, size, device)
        bisect.insort(_bases, ptr)
        _allocs[ptr] = alloc
    return alloc


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

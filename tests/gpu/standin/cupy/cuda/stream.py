"""``cupy.cuda.stream`` of the stand-in: ``Stream``, ``ExternalStream``, ``Event``, ``get_current_stream``.

API as in cupy 14's cupy/cuda/stream.pyx: ``Stream(null=False, non_blocking=False)``,
``Stream.null`` (ptr 0, the legacy default stream), ``Stream.from_external(obj)`` through the CUDA
stream protocol (``obj.__cuda_stream__() -> (0, ptr)``), ``with stream:`` making it the thread's
current stream, ``Event(block, disable_timing, interprocess)`` with ``record``, ``done`` and
``synchronize``. Behaviour: see ``_gpu``.
"""

from __future__ import annotations

import itertools
import weakref

from cupy.cuda import _gpu, runtime


class _BaseStream:
    def __init__(self, ptr: int, device_id: int):
        self.ptr = ptr
        self.device_id = device_id

    def __eq__(self, other):
        return isinstance(other, _BaseStream) and self.ptr == other.ptr

    def __hash__(self):
        return self.ptr

    def __repr__(self):
        return f"<{type(self).__name__} {self.ptr} (device {self.device_id})>"

    def __cuda_stream__(self):
        return (0, self.ptr)

    def _device(self) -> int:
        device = runtime.getDevice()
        if self.device_id not in (-1, device):
            raise RuntimeError(
                f"The device that the stream is created on ({self.device_id}) does not match with the current "
                f"device ({device})"
            )
        return device

    def __enter__(self):
        _gpu.stream_stack(self._device()).append(self)
        return self

    def __exit__(self, *args):
        _gpu.stream_stack(runtime.getDevice()).pop()

    def use(self):
        stack = _gpu.stream_stack(self._device())
        stack[:] = [self]
        return self

    @property
    def done(self) -> bool:
        q = _gpu.queue_of(self.ptr)
        return _gpu.sticky() is None and q.reached(q.last())

    def synchronize(self) -> None:
        q = _gpu.queue_of(self.ptr)
        q.wait(q.last())
        _gpu.check_sticky()

    def record(self, event=None):
        if event is None:
            event = Event()
        event.record(self)
        return event

    def launch_host_func(self, callback, arg) -> None:
        """``cudaLaunchHostFunc``: ``callback(arg)`` runs on a host thread once everything queued on
        this stream before it completed; later work on the stream waits for it to return. Work
        after a fault never runs, so neither does a callback queued behind it (CUDA runtime API,
        "cudaLaunchHostFunc": it is not called when the stream is in an error state)."""
        _gpu.queue_of(self.ptr).submit(lambda: callback(arg), "cudaLaunchHostFunc")

    def wait_event(self, event) -> None:
        """``cudaStreamWaitEvent``: later work on this stream waits for ``event``'s recorded work."""
        deps = event._state.dep()
        if deps:
            _gpu.queue_of(self.ptr).submit(lambda: None, "cudaStreamWaitEvent", deps)


class Stream(_BaseStream):
    null: Stream = None  # set below

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False, priority=None):
        if ptds:
            raise NotImplementedError("the cupy stand-in does not model the per-thread default stream")
        self._queue = None
        self._foreign_stream_ref = None
        if null:
            super().__init__(0, -1)
            return
        device = runtime.getDevice()
        self._queue = _gpu.create_stream(device, non_blocking)
        super().__init__(self._queue.ptr, device)

    def __del__(self):
        q = getattr(self, "_queue", None)
        if q is not None:
            q.close()

    @classmethod
    def from_external(cls, obj):
        try:
            version, ptr = obj.__cuda_stream__()
        except AttributeError as e:
            raise TypeError(
                f"Object of type {type(obj).__name__} does not implement the CUDA stream protocol (__cuda_stream__ "
                "method)"
            ) from e
        if not isinstance(version, int) or not isinstance(ptr, int):
            raise TypeError("__cuda_stream__() must return (int, int)")
        if version != 0:
            raise TypeError(f"__cuda_stream__() returned unsupported version {version}, only version 0 is supported")
        stream = cls.__new__(cls)
        _BaseStream.__init__(stream, ptr, -1)
        stream._queue = None
        stream._foreign_stream_ref = obj
        return stream


Stream.null = Stream(null=True)


class ExternalStream(_BaseStream):
    """A stream owned by someone else, named by its pointer."""

    def __init__(self, ptr: int, device_id: int = -1):
        super().__init__(int(ptr), device_id)


def get_current_stream(device_id: int = -1):
    device = runtime.getDevice() if device_id == -1 else device_id
    stack = _gpu.stream_stack(device)
    return stack[-1] if stack else Stream.null


def get_current_stream_ptr() -> int:
    return get_current_stream().ptr


_event_ptrs = itertools.count(0x4400_0000_0000, 0x40)
_EVENTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # ptr -> state, for runtime.eventQuery


def event_query(ptr: int) -> int:
    """``cudaEventQuery`` by handle: 0, ``cudaErrorNotReady`` or the sticky error, returned, not raised."""
    state = _EVENTS.get(ptr)
    return runtime.cudaErrorInvalidResourceHandle if state is None else state.query()


class Event:
    """A CUDA event (``cudaEventCreateWithFlags``)."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False):
        if interprocess and not disable_timing:
            raise ValueError("Timing must be disabled for interprocess events")
        if interprocess:
            raise NotImplementedError("the cupy stand-in does not model interprocess (IPC) events")
        self.ptr = next(_event_ptrs)
        self._state = _gpu.EventState()
        _EVENTS[self.ptr] = self._state

    @property
    def done(self) -> bool:
        return self._state.query() == 0

    def record(self, stream=None) -> None:
        ptr = get_current_stream_ptr() if stream is None else stream.ptr
        self._state.record(_gpu.queue_of(ptr))

    def synchronize(self) -> None:
        self._state.synchronize()

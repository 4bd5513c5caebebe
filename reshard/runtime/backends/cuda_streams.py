"""CUDA streams as the runtime uses them: work queued on a stream of its own, ordered after the
work that produced its inputs by events (never by the legacy default stream, which would make it
wait for the user's unrelated compute), and waited for through a host function that the stream
runs once it got there, instead of polling an event with sleeps.

CUDA runtime API, "Stream synchronization behavior": a stream created with
``cudaStreamNonBlocking`` does not synchronise with the legacy default stream; ``cudaStreamWaitEvent``
makes later work on a stream wait for an event's recorded work; ``cudaLaunchHostFunc`` runs a
host function once all work queued before it on the stream completed (cupy:
``Stream.launch_host_func``). cupy, torch and every library over them queue on the calling
thread's current stream.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable

from reshard.errors import ReshardTimeout
from reshard.runtime.backends import cuda_buffers as cb

#: How often a wait for a stream runs its health check (a peer's abort, NCCL's asynchronous
#: error) while the stream has not got there: the first slice, doubling up to the last.
CHECK_S = (0.002, 0.05)
#: How long a wait first asks the stream again at once (``cudaStreamQuery``), before it hands
#: over to a host function: short work ends sooner than a host function wakes a thread.
SPIN_S = 150e-6


def new_stream(cuda_device: int):
    """A non-blocking cupy stream on GPU ``cuda_device``."""
    cupy = cb.import_cupy()
    with cupy.cuda.Device(cuda_device):
        return cupy.cuda.Stream(non_blocking=True)


def current_stream():
    """The calling thread's current cupy stream (``Stream.null`` when none was made current)."""
    return cb.import_cupy().cuda.get_current_stream()


def producer_streams(cuda_device: int) -> list:
    """The streams the calling thread's work on GPU ``cuda_device`` may have been queued on: cupy's
    current stream and, where torch has started CUDA, torch's, as cupy streams."""
    cupy = cb.import_cupy()
    with cupy.cuda.Device(cuda_device):
        out = [cupy.cuda.get_current_stream()]
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        ptr = torch.cuda.current_stream(cuda_device).cuda_stream
        if all(s.ptr != ptr for s in out):
            out.append(cb._external_stream(cupy, ptr))
    return out


def order_after(stream, producers: Iterable) -> None:
    """Later work on ``stream`` waits for everything queued so far on ``producers`` (events)."""
    for p in producers:
        if p.ptr == stream.ptr:
            continue
        ready = _event(p.ptr)
        ready.record(p)
        stream.wait_event(ready)  # captures the record: the event may be recorded again next time


def recorded(stream):
    """A new event recorded on ``stream`` now: what a wait for it waits for is what was queued so far."""
    event = cb.import_cupy().cuda.Event(block=False, disable_timing=True)
    event.record(stream)
    return event


_tls = threading.local()


def _event(ptr: int):
    """This thread's event for producer stream ``ptr`` (made once: ``cudaStreamWaitEvent`` waits for
    the record that precedes it, so recording the same event again later is safe)."""
    events = getattr(_tls, "events", None)
    if events is None:
        events = _tls.events = {}
    event = events.get(ptr)
    if event is None:
        if len(events) > 256:
            events.clear()
        event = events[ptr] = cb.import_cupy().cuda.Event(block=False, disable_timing=True)
    return event


def wait(stream, deadline: float, what: str, check: Callable[[], object] | None = None) -> None:
    """Return once ``stream`` completed everything queued on it so far; ``check()`` runs between
    slices of the wait (it raises what makes the wait pointless: a peer's abort, an NCCL error);
    ``ReshardTimeout`` at ``deadline`` (monotonic). A CUDA error of the work raises at once."""
    cupy = cb.import_cupy()
    spin_until = time.monotonic() + SPIN_S
    while time.monotonic() < spin_until:  # short work: done before a host function would wake us
        status = cupy.cuda.runtime.streamQuery(stream.ptr)
        if status == 0:
            return
        if status != CUDA_NOT_READY:
            raise cupy.cuda.runtime.CUDARuntimeError(status)
    done = threading.Event()
    stream.launch_host_func(_set, done)
    pause = CHECK_S[0]
    while not done.wait(max(0.0, min(pause, deadline - time.monotonic()))):
        _raise_error(stream)
        if check is not None:
            check()
        if time.monotonic() >= deadline:
            raise ReshardTimeout(f"{what}: the GPU did not finish the work queued on its stream before the deadline")
        pause = min(2 * pause, CHECK_S[1])
    _raise_error(stream)


def _set(event: threading.Event) -> None:
    event.set()


def _raise_error(stream) -> None:
    """The CUDA error of the work queued on ``stream`` (a failed kernel, an illegal address: the
    context is then unusable), raised; ``cudaStreamQuery`` reports it, and "not ready" is no error.
    cupy 14's ``runtime.streamQuery`` returns the status instead of raising it."""
    cupy = cb.import_cupy()
    status = cupy.cuda.runtime.streamQuery(stream.ptr)
    if status not in (0, CUDA_NOT_READY):
        raise cupy.cuda.runtime.CUDARuntimeError(status)


CUDA_NOT_READY = 600  # cudaErrorNotReady

"""Where a GPU device's runs queue their work: one stream per controller (and per pipeline lane), so
that two callers' transfers never wait on each other, and a transfer never waits behind the
user's compute queued on the default stream.

A run starts after the work its caller's thread queued so far (events on that thread's current
streams: the producers of what it reads and writes), queues its copies and messages on its own
stream, and returns only once the GPU did all of it: a caller that reads the results on any
stream, or in another process, sees the new bytes. A CPU device has no stream: every call here
does nothing there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from reshard.runtime.backends import cuda_buffers, cuda_streams
from reshard.runtime.backends.communicator import Backend


class RunStream:
    """One caller's stream on a device's GPU (``cuda_device``; None on a CPU device)."""

    def __init__(self, backend: Backend, cuda_device: int | None):
        self.backend = backend
        self.cuda_device = cuda_device
        self.stream = None if cuda_device is None else cuda_streams.new_stream(cuda_device)
        self._side = None

    @property
    def side(self):
        """A second stream of the caller's, for work that overlaps the run's own stream (a window's
        buckets packed while the window before moves, or unpacked while the next moves); None on a
        CPU device."""
        if self._side is None and self.cuda_device is not None:
            self._side = cuda_streams.new_stream(self.cuda_device)
        return self._side

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Inside: this GPU is the current device and the stream the current stream, behind what
        the calling thread queued before."""
        gpu = self.cuda_device
        if self.stream is None or gpu is None:
            yield
            return
        cupy = cuda_buffers.import_cupy()
        with cupy.cuda.Device(gpu):
            cuda_streams.order_after(self.stream, cuda_streams.producer_streams(gpu))
            with self.stream:
                yield

    def finish(self, deadline: float, what: str) -> None:
        """Return once the GPU did what was queued on the stream (``deadline``: monotonic); the
        backend checks its communicators meanwhile and raises a peer's failure at once."""
        if self.stream is None:
            return
        cupy = cuda_buffers.import_cupy()
        with cupy.cuda.Device(self.cuda_device), self.stream:
            if self.backend.stream_ordered:
                self.backend.synchronize(deadline, what)
            else:
                cuda_streams.wait(self.stream, deadline, what)

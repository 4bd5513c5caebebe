"""Batches of NCCL operations: issuing, polling and failing them (the backend's half that runs on the
actor's NCCL thread)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from reshard.errors import ReshardError, ReshardTimeout
from reshard.runtime.backends import cuda_buffers as cb
from reshard.runtime.backends.communicator import PeerFailed
from reshard.runtime.backends.nccl.aborts import PeerAborts, peer_aborts
from reshard.runtime.backends.nccl.communicator import NcclCommunicator
from reshard.runtime.backends.nccl.status import NCCL_TIMEOUT, event_fired, nccl_status
from reshard.runtime.backends.nccl.wedge import WEDGE_GRACE_S

log = logging.getLogger(__name__)


#: How long a failed batch waits for the copies it queued on the stream before staging is reused.
STREAM_DRAIN_S = 5.0


@dataclass
class _Batch:
    grouped: bool
    deadline: float | None
    comms: dict[int, NcclCommunicator] = field(default_factory=dict)  # id -> communicator
    unpack: list[tuple[Any, Any, str]] = field(default_factory=list)  # (dst, staged, framework)
    consumers: dict[int, Any] = field(default_factory=dict)  # stream ptr -> cupy stream
    keep: list[Any] = field(default_factory=list)  # buffers referenced until completion
    ops: list[str] = field(default_factory=list)  # descriptions for error messages
    staged: bool = False
    open: bool = False  # inside nccl.groupStart() and not yet ended


class Operations:
    """Issuing, polling and failing batches of NCCL operations; ``NcclBackend`` inherits these (they
    use its lock, staging, stream and communicators)."""

    timeout_s: float
    cuda_device: int | None
    stats: dict[str, float]
    _device: int | None
    _stream: Any  # a cupy stream (cupy has no type information)
    _staging: cb.StagingBuffer | None
    _abandoned_staging: list[cb.StagingBuffer]
    _tls: threading.local
    _lock: threading.RLock

    if TYPE_CHECKING:

        def _call(self, fn: Callable[[], object], deadline: float, what: str) -> bool: ...
        def _async_state(self, raw: Any, deadline: float) -> bool: ...
        def _serve_abort_requests(self, batch: _Batch | None) -> None: ...
        def _after_release(self) -> None: ...

    @contextlib.contextmanager
    def grouped(self, timeout_s: float | None = None) -> Iterator[None]:
        """Issue every operation inside the block as one NCCL group call; wait once at the end.

        This is the batching interface for executors: wrap a run of consecutive communication ops
        of one program (in the program's order) in one block. Ops in one block must not depend on
        each other (NCCL may run them in any order: no "receive, then forward what was received"),
        each staged op needs its own staging region, and every actor must issue its ops in the
        program's global order. Nested blocks join the outer one. On any error every communicator
        the block used is aborted (and its peers told) before the error propagates."""
        if getattr(self._tls, "batch", None) is not None:
            yield
            return
        _, nccl = cb.import_nccl()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        batch = _Batch(grouped=True, deadline=deadline)
        try:
            with self._lock:
                self._tls.batch = batch
                self._call(nccl.groupStart, time.monotonic() + self.timeout_s, "ncclGroupStart")
                batch.open = True
                try:
                    yield
                    self._finish(batch, nccl)
                except BaseException:
                    if batch.open or any(not c.aborted for c in batch.comms.values()):
                        # The block failed: end the group (groupStart/groupEnd must pair), then abort what it used.
                        self._end_group(batch, nccl, time.monotonic() + WEDGE_GRACE_S)
                        for c in list(batch.comms.values()):
                            c.abort()
                        self._reset_staging_after_failure()
                    raise
                finally:
                    self._tls.batch = None
        finally:
            self._after_release()

    def _end_group(self, batch: _Batch, nccl, deadline: float) -> BaseException | None:
        """``nccl.groupEnd()`` of an open batch: the error it raised, if any (in progress is fine)."""
        if not batch.open:
            return None
        batch.open = False
        try:
            self._call(nccl.groupEnd, deadline, "ncclGroupEnd")
        except Exception as e:
            return e
        return None

    def _issue(self, comm: NcclCommunicator, kind: str, x, arg) -> None:
        try:
            with self._lock:
                self._issue_locked(comm, kind, x, arg)
        finally:
            if getattr(self._tls, "batch", None) is None:
                self._after_release()

    def _issue_locked(self, comm: NcclCommunicator, kind: str, x, arg) -> None:
        cupy, nccl = cb.import_nccl()
        view = cb.describe(x)
        if view.cuda_device != self.cuda_device:
            raise ValueError(
                f"{kind} on group {comm.group}: buffer is on CUDA device {view.cuda_device}, "
                f"this actor's communicators use device {self.cuda_device}"
            )
        if kind == "all_reduce":
            cb.nccl_reduce_args(view.dtype_name, view.numel, view.itemsize, arg)  # refuse before queuing
        batch: _Batch | None = getattr(self._tls, "batch", None)
        single = batch is None
        if batch is None:
            batch = _Batch(grouped=False, deadline=None)
        if batch.deadline is None:
            batch.deadline = time.monotonic() + comm.timeout_s
        self.stats["ops"] += 1
        batch.ops.append(f"{kind}(group={comm.group}, rank={comm.rank}, arg={arg}, shape={view.shape})")
        batch.comms[id(comm)] = comm
        self._serve_abort_requests(batch)
        if comm.peer_aborted():
            self.stats["peer_aborts"] += 1
            self._fail(batch, None, timeout=False, peer=True)
        stream = self._stream
        if view.numel == 0:
            return  # every member sees the same shape, so every member skips
        # 1. the comm stream waits for the computation that produced / last used the buffer
        producer = cb.producer_stream(x, view)
        ready = cupy.cuda.Event(block=False, disable_timing=True)
        ready.record(producer)
        stream.wait_event(ready)
        batch.consumers[producer.ptr] = producer
        # 2. non-contiguous: pass through a segment of the staging buffer
        reads = kind in ("send", "all_reduce") or (kind == "broadcast" and arg == comm.rank)
        writes = kind in ("recv", "broadcast", "all_reduce")
        buf, bview = x, view
        if not view.contiguous:
            buf = self._staging_buffer().segment_like(view, x)
            bview = cb.describe(buf)
            batch.staged = True
            if reads:
                cb.copy_on_stream(buf, x, view.framework, stream)
            if writes:
                batch.unpack.append((x, buf, view.framework))
        batch.keep.append(x)
        batch.keep.append(buf)
        # 3. enqueue: returns at once (queued in a group, or ncclInProgress on a non-blocking comm)
        if kind == "all_reduce":
            count, dtype, op = cb.nccl_reduce_args(bview.dtype_name, bview.numel, bview.itemsize, arg)
            call = lambda: comm.raw.allReduce(bview.ptr, bview.ptr, count, dtype, op, stream.ptr)  # noqa: E731
        else:
            count, dtype = bview.nccl_args()
            method = {"broadcast": comm.raw.bcast, "send": comm.raw.send, "recv": comm.raw.recv}[kind]
            call = lambda: method(bview.ptr, count, dtype, arg, stream.ptr)  # noqa: E731
        try:
            self._call(call, batch.deadline, batch.ops[-1])
        except Exception as e:
            self._fail(batch, e, timeout=False)
        if single:
            self._finish(batch, nccl)

    def _finish(self, batch: _Batch, nccl) -> None:
        cupy = cb.import_cupy()
        stream = self._stream
        if batch.deadline is None:
            batch.deadline = time.monotonic() + self.timeout_s
        if batch.grouped:
            error = self._end_group(batch, nccl, batch.deadline)
            if error is not None:
                self._fail(batch, error, timeout=False)
        if not batch.keep:  # only empty transfers
            return
        self.stats["batches"] += 1
        # 4. wait until NCCL has launched the group (connection setup included) on the comm stream
        self._poll(batch, None)
        # 5. received data leaves the staging buffer after the NCCL kernels, on the same stream
        for dst, staged, fw in batch.unpack:
            cb.copy_on_stream(dst, staged, fw, stream)
        done = cupy.cuda.Event(block=False, disable_timing=True)
        done.record(stream)
        # 6. later work on the producers' streams sees the arrived data
        for s in batch.consumers.values():
            s.wait_event(done)
        self._poll(batch, done)
        if batch.staged:
            self._staging_buffer().reset()

    def _poll(self, batch: _Batch, done) -> None:
        """Until the batch's calls left ``ncclInProgress`` (``done`` None) or ``done`` fired. Each
        round checks, in order: abort requests of other threads, peers' abort notices (before
        NCCL's own error: a peer's abort surfaces there as a remote error), asynchronous errors,
        the event, the deadline."""
        deadline = batch.deadline
        if deadline is None:
            raise RuntimeError("an NCCL batch polled before its deadline was set")
        comms = list(batch.comms.values())
        aborts = peer_aborts()
        pause = 0.0
        while True:
            self._serve_abort_requests(batch)
            self._check_notices(batch, comms, aborts)
            busy = False
            for c in comms:
                try:
                    busy |= self._async_state(c.raw, deadline)
                except Exception as e:
                    self._check_notices(batch, comms, aborts)
                    self._fail(batch, e, timeout=False)
            finished = not busy
            if done is not None and finished:
                try:
                    finished = event_fired(done)
                except Exception as e:  # a CUDA error: the batch's kernels or copies failed
                    self._fail(batch, e, timeout=False)
            if finished:
                return
            if time.monotonic() >= deadline:
                self._fail(batch, None, timeout=True)
            time.sleep(pause)
            pause = min(max(2 * pause, 2e-5), 1e-3)

    def _check_notices(self, batch: _Batch, comms: list[NcclCommunicator], aborts: PeerAborts) -> None:
        if any(aborts.aborted(c.digest) for c in comms):
            self.stats["peer_aborts"] += 1
            self._fail(batch, None, timeout=False, peer=True)

    def _staging_buffer(self) -> cb.StagingBuffer:
        if self._staging is None:
            raise RuntimeError(f"device {self._device}: the NCCL backend has no staging buffer before it connects")
        return self._staging

    def _reset_staging_after_failure(self) -> None:
        """Staging is free again once the copies a failed batch queued on the stream have run; if
        they do not finish within ``STREAM_DRAIN_S`` its buffers are set aside, never reused."""
        if self._staging is None:
            return
        drained = self._stream is None
        if not drained:
            with contextlib.suppress(Exception):
                cupy = cb.import_cupy()
                event = cupy.cuda.Event(block=False, disable_timing=True)
                event.record(self._stream)
                until = time.monotonic() + STREAM_DRAIN_S
                while not (drained := event_fired(event)) and time.monotonic() < until:
                    time.sleep(1e-3)
        if drained:
            self._staging.reset()
        else:
            log.error("device %s: copies queued on the NCCL stream did not finish within %.0fs after a failure; "
                      "its staging buffer is set aside", self._device, STREAM_DRAIN_S)  # fmt: skip
            self._abandoned_staging.append(self._staging)
            self._staging = cb.StagingBuffer(self._staging.cuda_device)

    def _fail(self, batch: _Batch, error: BaseException | None, *, timeout: bool, peer: bool = False,
              aborted: bool = False) -> NoReturn:  # fmt: skip
        if batch.open:
            # never abort a communicator that an unfinished NCCL group still refers to: end it first
            _, nccl = cb.import_nccl()
            self._end_group(batch, nccl, time.monotonic() + WEDGE_GRACE_S)
        for c in list(batch.comms.values()):
            c.abort()
        self._reset_staging_after_failure()
        ops = "; ".join(batch.ops[:8]) + (" ..." if len(batch.ops) > 8 else "")
        if aborted:
            raise PeerFailed(
                f"NCCL operations on device {self._device}: the controller aborted them: {ops}; communicators "
                "aborted and the other members told"
            )
        if peer:
            raise PeerFailed(
                f"NCCL operations on device {self._device}: a member of the group aborted its communicator: {ops}; "
                "aborted here too (a failure elsewhere; the driver reports it)"
            )
        if timeout or (error is not None and nccl_status(error) == NCCL_TIMEOUT):
            raise ReshardTimeout(
                f"NCCL operations did not complete before their deadline on device {self._device}: {ops}; "
                "communicators aborted (a peer is missing, dead or issued a different operation order)"
            ) from error
        raise ReshardError(f"NCCL operations failed on device {self._device}: {ops}: {error}") from error

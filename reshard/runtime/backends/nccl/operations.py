"""Batches of NCCL operations: issuing, completing and failing them (the backend's half that runs on
the threads that move data).

Streams. A batch belongs to the calling thread's current cupy stream (a run's stream, a pipeline
lane's; a caller on the null stream gets a non-blocking stream of the backend per thread). The
operations of the batch's first communicator go on that stream itself (a single message, or a
window over one link, needs no event). Every other communicator has a stream of its own: an
operation is queued there behind an event recorded on the caller's stream when it is issued (so it
reads what the caller queued before, packing included), and at the batch's end the caller's
stream waits for every such stream (so what comes after reads what arrived). Kernels of different
communicators of one group thus never queue behind each other, whatever NCCL does inside a group;
a buffer produced on another stream (a torch tensor on torch's) is ordered by events too.

Locks. Each communicator has its own lock, held by the thread that queues operations on it, from
its first operation of a batch until NCCL launched the batch; two threads that use different
communicators (two pipeline lanes, two controllers) never wait on each other. NCCL allows one
thread at a time inside one communicator and any number of threads in different ones.

Completion. ``grouped(wait=True)`` (and every single operation outside a block) returns once the
GPU finished the operations: the stream runs a host function that wakes the waiting thread,
whose wait checks between slices for a peer's abort notice and NCCL's asynchronous errors.
``grouped(wait=False)`` returns once NCCL launched them: the caller's later work on the same stream
runs after them, and the caller waits once, for everything it queued, with ``synchronize``.
"""

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
from reshard.runtime.backends import cuda_streams
from reshard.runtime.backends.communicator import PeerFailed
from reshard.runtime.backends.nccl.aborts import PeerAborts, peer_aborts
from reshard.runtime.backends.nccl.communicator import NcclCommunicator
from reshard.runtime.backends.nccl.status import NCCL_TIMEOUT, event_fired, nccl_status
from reshard.runtime.backends.nccl.wedge import WEDGE_GRACE_S

log = logging.getLogger(__name__)


#: How long a failed batch waits for the copies it queued on the stream before staging is reused.
STREAM_DRAIN_S = 5.0
#: How long a thread looks again at once (no sleep) for NCCL to have launched a batch.
SPIN_S = 200e-6


@dataclass
class _Batch:
    grouped: bool
    wait: bool
    deadline: float | None
    stream: Any = None  # the cupy stream the batch's operations are queued on
    comms: dict[int, NcclCommunicator] = field(default_factory=dict)  # id -> communicator
    joins: dict[int, Any] = field(default_factory=dict)  # stream ptr -> a communicator stream used
    first: int | None = None  # id of the communicator whose operations go on the caller's stream
    locked: list[NcclCommunicator] = field(default_factory=list)  # whose lock the batch holds
    unpack: list[tuple[Any, Any, str]] = field(default_factory=list)  # (dst, staged, framework)
    consumers: dict[int, Any] = field(default_factory=dict)  # stream ptr -> cupy stream
    keep: list[Any] = field(default_factory=list)  # buffers referenced until completion
    ops: list = field(default_factory=list)  # what was issued, formatted only for an error message
    staged: bool = False
    open: bool = False  # inside nccl.groupStart() and not yet ended


class Operations:
    """Issuing, completing and failing batches of NCCL operations; ``NcclBackend`` inherits these
    (they use its communicators, streams and staging)."""

    timeout_s: float
    cuda_device: int | None
    stats: dict[str, float]
    _device: int | None
    _tls: threading.local
    _lock: threading.RLock
    _stagings: list[cb.StagingBuffer]

    if TYPE_CHECKING:

        def _call(self, fn: Callable[[], object], deadline: float, what: str) -> bool: ...
        def _async_state(self, raw: Any, deadline: float) -> bool: ...
        def _abort_now(self, comm: NcclCommunicator) -> None: ...

    @contextlib.contextmanager
    def grouped(self, timeout_s: float | None = None, *, wait: bool = True) -> Iterator[None]:
        """Issue every operation inside the block as one NCCL group call.

        This is the batching interface for executors: wrap a run of consecutive communication ops
        of one program (in the program's order) in one block. Ops in one block must not depend on
        each other (NCCL may run them in any order: no "receive, then forward what was received"),
        each staged op needs its own staging region, and every actor must issue its ops in the
        program's global order. Nested blocks join the outer one. ``wait``: return once the data
        arrived (else once NCCL launched the group: see the module docstring). On any error every
        communicator the block used is aborted (and its peers told) before the error propagates."""
        if getattr(self._tls, "batch", None) is not None:
            yield
            return
        guard = contextlib.ExitStack()  # this actor's GPU is the current device inside the block
        cupy, nccl = cb.import_nccl()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        batch = _Batch(grouped=True, wait=wait, deadline=deadline)
        try:
            guard.enter_context(cupy.cuda.Device(self.cuda_device or 0))
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
                        self._abort_now(c)
                    self._reset_staging_after_failure(batch.stream)
                raise
            finally:
                self._tls.batch = None
        finally:
            self._unlock(batch)
            guard.close()

    def synchronize(self, deadline: float, what: str = "NCCL operations") -> None:
        """Return once the GPU finished what this thread queued on its current stream (the
        operations of ``grouped(wait=False)`` blocks and the work around them); a peer's abort, an
        NCCL error or the deadline (monotonic) fails the communicators involved and raises."""
        pending: dict[int, NcclCommunicator] = getattr(self._tls, "pending", None) or {}
        self._tls.pending = {}
        cupy = cb.import_cupy()
        with cupy.cuda.Device(self.cuda_device or 0):
            self._synchronize(pending, deadline, what)

    def _synchronize(self, pending: dict[int, NcclCommunicator], deadline: float, what: str) -> None:
        stream = self._thread_stream()
        comms = list(pending.values())
        batch = _Batch(grouped=False, wait=True, deadline=deadline, stream=stream, comms=dict(pending))
        batch.ops.append(f"{what} of {len(comms)} communicator(s) on device {self._device}")
        try:
            cuda_streams.wait(stream, deadline, what, lambda: self._check(batch))
        except ReshardTimeout as e:
            self._fail(batch, e, timeout=True)
        except PeerFailed:
            raise
        except ReshardError as e:
            self._fail(batch, e, timeout=False)
        except Exception as e:  # a CUDA error of the queued work
            self._fail(batch, e, timeout=False)
        self._check(batch, after=True)

    def _thread_stream(self):
        """The stream this thread's operations go to: its current cupy stream, or (null stream)
        the backend's stream of this thread."""
        stream = cuda_streams.current_stream()
        if stream.ptr != 0:
            return stream
        own = getattr(self._tls, "stream", None)
        if own is None:
            own = self._tls.stream = cuda_streams.new_stream(self.cuda_device or 0)
        return own

    def _comm_stream(self, comm: NcclCommunicator):
        """``comm``'s own stream (made on first use, on this actor's GPU)."""
        if comm.stream is None:
            comm.stream = cuda_streams.new_stream(self.cuda_device or 0)
        return comm.stream

    def _staging_buffer(self) -> cb.StagingBuffer:
        staging = getattr(self._tls, "staging", None)
        if staging is None:
            if self._device is None:
                raise RuntimeError("the NCCL backend has no staging buffer before it connects")
            staging = self._tls.staging = cb.StagingBuffer(self.cuda_device or 0)
            with self._lock:
                self._stagings.append(staging)
        return staging

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
        batch: _Batch | None = getattr(self._tls, "batch", None)
        single = batch is None
        if batch is None:
            batch = _Batch(grouped=False, wait=True, deadline=time.monotonic() + comm.timeout_s)
        cupy, nccl = cb.import_nccl()
        try:
            with cupy.cuda.Device(self.cuda_device or 0):
                self._issue_in(batch, comm, kind, x, arg)
                if single:
                    self._finish(batch, nccl)
        finally:
            if single:
                self._unlock(batch)

    def _lock_for(self, batch: _Batch, comm: NcclCommunicator) -> None:
        """Hold ``comm``'s lock for the batch (until NCCL launched it), waiting for another thread
        that uses it at most until the batch's deadline."""
        if any(c is comm for c in batch.locked):
            return
        left = (batch.deadline or time.monotonic() + self.timeout_s) - time.monotonic()
        if not comm.lock.acquire(timeout=max(0.0, left)):
            raise ReshardTimeout(
                f"device {self._device}: communicator of group {comm.group} stayed busy with another thread's "
                "operations until the deadline (one thread at a time per communicator: give each lane a channel)"
            )
        batch.locked.append(comm)

    def _unlock(self, batch: _Batch) -> None:
        """Let go of the batch's communicators; an abort another thread asked for meanwhile is done now."""
        for c in batch.locked:
            c.lock.release()
            # after letting go: a request made while it was held is seen here, or its asker got the lock
            if c.abort_requested and not c.aborted and c.lock.acquire(blocking=False):
                try:
                    self._abort_now(c)
                finally:
                    c.lock.release()
        batch.locked.clear()

    def _issue_in(self, batch: _Batch, comm: NcclCommunicator, kind: str, x, arg) -> None:
        cupy, nccl = cb.import_nccl()
        view = cb.describe(x)
        if view.cuda_device != self.cuda_device:
            raise ValueError(
                f"{kind} on group {comm.group}: buffer is on CUDA device {view.cuda_device}, "
                f"this actor's communicators use device {self.cuda_device}"
            )
        if kind == "all_reduce":
            cb.nccl_reduce_args(view.dtype_name, view.numel, view.itemsize, arg)  # refuse before queuing
        if batch.deadline is None:
            batch.deadline = time.monotonic() + comm.timeout_s
        self._lock_for(batch, comm)
        self.stats["ops"] += 1
        batch.ops.append((kind, comm.group, comm.rank, arg, view.shape))
        batch.comms[id(comm)] = comm
        self._check_requests(batch)
        if comm.peer_aborted():
            self.stats["peer_aborts"] += 1
            self._fail(batch, None, timeout=False, peer=True)
        if view.numel == 0:
            return  # every member sees the same shape, so every member skips
        if batch.stream is None:
            batch.stream = self._thread_stream()
        stream = batch.stream
        # 1. the stream waits for the computation that produced / last used the buffer (nothing to
        #    do when that computation is queued on the same stream)
        producer = cb.producer_stream(x, view)
        if producer.ptr != stream.ptr:
            cuda_streams.order_after(stream, [producer])
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
        # 3. the batch's first communicator works on the caller's stream itself; any other on a
        #    stream of its own, after what the caller's stream holds now
        first = batch.first if batch.first is not None else id(comm)
        batch.first = first
        if first != id(comm):
            stream = self._comm_stream(comm)
            cuda_streams.order_after(stream, [batch.stream])
            batch.joins[stream.ptr] = stream
        # 4. enqueue: returns at once (queued in a group, or ncclInProgress on a non-blocking comm)
        if kind == "all_reduce":
            count, dtype, op = cb.nccl_reduce_args(bview.dtype_name, bview.numel, bview.itemsize, arg)
            call = lambda: comm.raw.allReduce(bview.ptr, bview.ptr, count, dtype, op, stream.ptr)  # noqa: E731
        else:
            count, dtype = bview.nccl_args()
            method = {"broadcast": comm.raw.bcast, "send": comm.raw.send, "recv": comm.raw.recv}[kind]
            call = lambda: method(bview.ptr, count, dtype, arg, stream.ptr)  # noqa: E731
        try:
            self._call(call, batch.deadline, kind)
        except Exception as e:
            self._fail(batch, e, timeout=False)

    def _finish(self, batch: _Batch, nccl) -> None:
        cupy = cb.import_cupy()
        if batch.deadline is None:
            batch.deadline = time.monotonic() + self.timeout_s
        if batch.grouped:
            error = self._end_group(batch, nccl, batch.deadline)
            if error is not None:
                self._fail(batch, error, timeout=False)
        if not batch.keep:  # only empty transfers
            return
        self.stats["batches"] += 1
        stream = batch.stream
        # 5. wait until NCCL has launched the group (connection setup included) on its streams
        self._launched(batch)
        # 6. the caller's stream waits for them; received data leaves the staging buffer after
        cuda_streams.order_after(stream, batch.joins.values())
        for dst, staged, fw in batch.unpack:
            cb.copy_on_stream(dst, staged, fw, stream)
        # 7. later work on the producers' streams sees the arrived data
        if batch.consumers:
            done = cupy.cuda.Event(block=False, disable_timing=True)
            done.record(stream)
            for s in batch.consumers.values():
                s.wait_event(done)
        if batch.wait or batch.staged:
            try:
                cuda_streams.wait(stream, batch.deadline, "NCCL operations", lambda: self._check(batch))
            except ReshardTimeout as e:
                self._fail(batch, e, timeout=True)
            except PeerFailed:
                raise
            except Exception as e:
                self._fail(batch, e, timeout=False)
            self._check(batch, after=True)
            if batch.staged:
                self._staging_buffer().reset()
        else:
            pending = getattr(self._tls, "pending", None)
            if pending is None:
                pending = self._tls.pending = {}
            pending.update(batch.comms)

    def _launched(self, batch: _Batch) -> None:
        """Until the batch's calls left ``ncclInProgress`` (a non-blocking communicator connecting
        or launching), checking between looks: abort requests, peers' notices (before NCCL's own
        error: a peer's abort surfaces there as a remote error), asynchronous errors, the deadline."""
        deadline = batch.deadline
        if deadline is None:
            raise RuntimeError("an NCCL batch polled before its deadline was set")
        pause = 0.0
        spin_until = time.monotonic() + SPIN_S
        while True:
            busy = self._check(batch)
            if not busy:
                return
            now = time.monotonic()
            if now >= deadline:
                self._fail(batch, None, timeout=True)
            if now < spin_until:
                continue  # a launch takes microseconds: a sleep would cost a scheduler tick
            time.sleep(pause)
            pause = min(max(2 * pause, 2e-5), 1e-3)

    def _check(self, batch: _Batch, after: bool = False) -> bool:
        """Raise what fails the batch now: an abort another thread asked for, a peer's notice, an
        aborted communicator, an asynchronous error. True while a call is still in progress.
        ``after``: the batch's work is done; a communicator aborted meanwhile still fails it (an
        abort ends NCCL's kernels early: what they left is not the data)."""
        self._check_requests(batch)
        aborts = peer_aborts()
        self._check_notices(batch, aborts)
        busy = False
        held = {id(c) for c in batch.locked}
        for c in list(batch.comms.values()):
            if c.aborted:
                self.stats["peer_aborts"] += 1
                self._fail(batch, None, timeout=False, aborted=True)
            if after:
                continue
            if id(c) in held:
                state = self._comm_state(batch, c, aborts)
            else:
                with c.lock:
                    if c.aborted:
                        self._fail(batch, None, timeout=False, aborted=True)
                    state = self._comm_state(batch, c, aborts)
            busy |= state
        return busy

    def _comm_state(self, batch: _Batch, c: NcclCommunicator, aborts: PeerAborts) -> bool:
        try:
            return self._async_state(c.raw, batch.deadline or time.monotonic() + self.timeout_s)
        except Exception as e:
            self._check_notices(batch, aborts)
            self._fail(batch, e, timeout=False)

    def _check_requests(self, batch: _Batch) -> None:
        """An abort of one of the batch's communicators that another thread asked for while this
        one held it fails the batch (at once; inside an open group once the group is ended)."""
        if any(c.abort_requested for c in batch.comms.values()):
            self._fail(batch, None, timeout=False, aborted=True)

    def _check_notices(self, batch: _Batch, aborts: PeerAborts) -> None:
        if any(aborts.aborted(c.uid) for c in batch.comms.values()):
            self.stats["peer_aborts"] += 1
            self._fail(batch, None, timeout=False, peer=True)

    def _reset_staging_after_failure(self, stream) -> None:
        """Staging is free again once the copies a failed batch queued on the stream have run; if
        they do not finish within ``STREAM_DRAIN_S`` its buffers are set aside, never reused."""
        staging = getattr(self._tls, "staging", None)
        if staging is None:
            return
        drained = stream is None
        if not drained:
            with contextlib.suppress(Exception):
                cupy = cb.import_cupy()
                event = cupy.cuda.Event(block=False, disable_timing=True)
                event.record(stream)
                until = time.monotonic() + STREAM_DRAIN_S
                while not (drained := event_fired(event)) and time.monotonic() < until:
                    time.sleep(1e-3)
        if drained:
            staging.reset()
        else:
            log.error(
                "device %s: copies queued on an NCCL stream did not finish within %.0fs after a failure; "
                "its staging buffer is set aside",
                self._device,
                STREAM_DRAIN_S,
            )
            self._tls.staging = None  # never reused; the next batch of this thread makes another

    def _fail(
        self, batch: _Batch, error: BaseException | None, *, timeout: bool, peer: bool = False, aborted: bool = False
    ) -> NoReturn:
        if batch.open:
            # never abort a communicator that an unfinished NCCL group still refers to: end it first
            _, nccl = cb.import_nccl()
            self._end_group(batch, nccl, time.monotonic() + WEDGE_GRACE_S)
        for c in list(batch.comms.values()):
            c.abort()
        self._reset_staging_after_failure(batch.stream)
        ops = "; ".join(map(_describe, batch.ops[:8])) + (" ..." if len(batch.ops) > 8 else "")
        if aborted:
            raise PeerFailed(
                f"NCCL operations on device {self._device}: the controller aborted their communicator (or a failure "
                f"elsewhere did): {ops}; communicators aborted and the other members told"
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


def _describe(op) -> str:
    """An issued operation, as an error message names it."""
    if isinstance(op, str):
        return op
    kind, group, rank, arg, shape = op
    return f"{kind}(group={group}, rank={rank}, arg={arg}, shape={shape})"

"""Executor: runs one ``DeviceProgram`` exactly as written (``reshard.ir.program``), over numpy arrays
(CPU devices), cupy arrays (GPU devices: every copy and message queued on the run's stream) or
torch tensors (wherever the caller hands torch), ``arrays``.

It connects the program's groups in the listed order (those not connected yet), starts the
background ops on the process's helper thread, then runs the ops window by window: local ops at
once, messages issued through their group's communicator, and at the end of each window it waits
for the window's messages in order, copies staged receives into place and runs its publications
(each once the ops before it have landed). One handler per op type
(``HANDLERS``). Every wait is bounded by the run's deadline; the helper thread is joined before the
run returns or raises, so nothing writes the destination afterwards.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from reshard.errors import ReshardError, ReshardTimeout
from reshard.ir.program import (
    Broadcast,
    Buffer,
    Copy,
    DeviceProgram,
    Op,
    Publish,
    Pull,
    Recv,
    Scale,
    Send,
    group_of,
    op_shape,
)
from reshard.runtime import arrays
from reshard.runtime.device.cross_memory import RemoteShard

VIEWS_KEPT = 1 << 18  # views of the staging buffer kept at most (about 30 MiB of them)


class StagingBuffer:
    """One byte buffer per device, reused by every staged op (ops name their offset in it): numpy
    on a CPU device, cupy on a GPU.

    ``reserve(nbytes)`` makes it exactly ``nbytes`` for a run (kept as is when the size repeats), so
    a run never holds more staging than its program says; ``trim()`` after a run frees it when it
    is bigger than ``keep_bytes``, so an idle device keeps at most ``keep_bytes``."""

    def __init__(self, device: str, keep_bytes: int):
        self.device = str(device)  # "cpu" or a torch device string
        self.keep_bytes = keep_bytes
        self.buf: Any = None  # a numpy or cupy uint8 array
        self._views: dict = {}  # id(owner) -> (owner, views of the current buffer) (``views``)
        self._kept = 0  # views in ``_views``

    @property
    def nbytes(self) -> int:
        return 0 if self.buf is None else int(self.buf.shape[0])

    def reserve(self, nbytes: int) -> None:
        if nbytes == self.nbytes:
            return
        self.drop()  # free first: never hold two
        if nbytes:
            if self.device == "cpu":
                self.buf = np.empty(nbytes, dtype=np.uint8)
            else:
                import cupy

                with cupy.cuda.Device(int(self.device.partition(":")[2] or 0)):
                    self.buf = cupy.empty(nbytes, dtype=np.uint8)

    def view(self, offset: int, dtype: str, shape: tuple[int, ...]):
        numel = 1
        for n in shape:
            numel *= n
        item = arrays.storage(dtype).itemsize
        end = offset + numel * item
        if self.buf is None or end > self.nbytes:
            raise ReshardError(f"staging buffer of {self.nbytes} B is too small for [{offset}, {end}) (program bug)")
        raw = self.buf[offset:end]
        if arrays.is_torch(raw):
            return raw.view(arrays.torch_dtype(dtype)).view(shape)
        return raw.view(arrays.storage(dtype)).reshape(shape)

    def views(self, owner, make: Callable):
        """``make(self)``: a list of views of the buffer for ``owner`` (a bucket), made once per
        buffer (dropped with it, and all of them past ``VIEWS_KEPT`` views)."""
        hit = self._views.get(id(owner))
        if hit is None or hit[0] is not owner:
            views = make(self)
            if self._kept + len(views) > VIEWS_KEPT:
                self._views.clear()
                self._kept = 0
            hit = self._views[id(owner)] = (owner, views)
            self._kept += len(views)
        return hit[1]

    def drop(self) -> None:
        self.buf = None
        self._views.clear()
        self._kept = 0

    def trim(self) -> None:
        if self.nbytes > self.keep_bytes:
            self.drop()


OpT = TypeVar("OpT", bound=Op, covariant=True)


@dataclass(frozen=True, slots=True)
class Step(Generic[OpT]):
    """One op with everything precomputed: its handler, slices, communicator key and ranks."""

    handler: Callable
    op: OpT
    read: tuple | None
    write: tuple | None
    key: tuple[int, ...] | None
    root: int  # rank of group[0] in key
    peer: int  # the other rank of a send/recv
    shape: tuple[int, ...]


class PreparedProgram:
    """A ``DeviceProgram`` ready to run: steps per window, background steps, dtype, and what its
    run needs: the holders it pulls from, whether it publishes, whether a window holds messages
    (else it runs its ops at once). The steps are worked out when a run first asks for them, then
    kept: the parts a CPU device's host unit runs never do (``batches``); making them for every
    part took about a third of each device's part of a 20,000-tensor tree's first call."""

    __slots__ = ("_holders", "_steps", "dtype", "program", "publishes")

    def __init__(self, program: DeviceProgram, dtype: str, publishes: bool = False):
        self.program, self.dtype, self.publishes = program, dtype, publishes
        self._steps: tuple | None = None
        self._holders: tuple[int, ...] | None = None

    @property
    def holders(self) -> tuple[int, ...]:
        """The devices it pulls source shards from (worked out once: every run checks them)."""
        if self._holders is None:
            self._holders = self.program.holders
        return self._holders

    @property
    def windows(self) -> tuple[tuple[Step[Op], ...], ...]:
        return self._prepared()[0]

    @property
    def background(self) -> tuple[Step[Op], ...]:
        return self._prepared()[1]

    @property
    def messages(self) -> tuple[bool, ...]:
        return self._prepared()[2]

    def _prepared(self) -> tuple:
        if self._steps is None:  # two threads may both make them: the same steps
            d = self.program.device
            windows = tuple(tuple(_step(op, d) for op in w) for w in self.program.issue_windows)
            messages = tuple(any(isinstance(s.op, Send | Recv | Broadcast | Publish) for s in w) for w in windows)
            self._steps = (windows, tuple(_step(op, d) for op in self.program.background), messages)
        return self._steps

    @property
    def device(self) -> int:
        return self.program.device

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        return self.program.connect


class Run:
    """The state of one program run: buffers, peers' shards, communicators, staging, deadline;
    ``relayed(holder, after)``: the holder's destination shard once it published ``after`` slices,
    ``publish(count)``: tell pullers this device published ``count`` (relays, ``reshard.passes.pulls``)."""

    def __init__(
        self,
        prepared,
        *,
        src,
        dst,
        groups,
        staging,
        deadline,
        peers=None,
        tmp=None,
        before_op=None,
        batch=None,
        relayed=None,
        publish=None,
    ):
        self.prepared = prepared
        self.device = prepared.device
        self.src = src
        self.dst = dst
        self.tmp = tmp  # scratch of the source shard's shape, where contributions combine (Partial)
        self.peers = peers or {}
        self.groups = groups
        self.staging = staging
        self.dtype = prepared.dtype  # the dtype name
        self.deadline = deadline
        self.before_op = before_op
        self.batch = batch  # the backend's ``grouped(timeout_s=)`` (NCCL: one group call per window), or None
        self.relayed = relayed
        self.publish = publish
        self.comm_s = 0.0

    def left(self, step: Step[Op]) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ReshardTimeout(f"device {self.device}: its deadline passed before step {step.op.step} ({step.op})")
        return left

    def buffer(self, which: Buffer):
        return self.src if which is Buffer.SRC else self.dst if which is Buffer.DST else self.tmp

    def comm(self, step: Step[Op]):
        comm = self.groups.get(step.key)
        comm.timeout_s = self.left(step)
        return comm

    def read_buffer(self, op: Send | Broadcast):
        """The buffer a send, or a broadcast's root, reads."""
        if op.buffer is None:
            raise ReshardError(f"device {self.device}: step {op.step} ({op}) reads no buffer (program bug)")
        return self.buffer(op.buffer)

    def outgoing(self, step: Step[Send | Broadcast]):
        view = self.read_buffer(step.op)[step.read]
        if step.op.staging is None:
            return arrays.wire(_contiguous(view, step, self.device))
        t = self.staging.view(step.op.staging, self.dtype, step.shape)
        arrays.copy(t, view)
        return arrays.wire(t)

    def incoming(self, step: Step[Recv | Broadcast]):
        """Where a message lands: the target box itself, or its staging slot (strided, combined)."""
        if step.op.staging is None:
            return _contiguous(self.target(step)[step.write], step, self.device)
        return self.staging.view(step.op.staging, self.dtype, step.shape)

    def target(self, step: Step[Op]):
        return self.buffer(getattr(step.op, "target", Buffer.DST))

    def land(self, step: Step[Op], data) -> None:
        """Write (or combine, by the op's ``reduce``) ``data`` into the op's target box."""
        view = self.target(step)[step.write]
        reduce = getattr(step.op, "reduce", None)
        if reduce is None:
            arrays.copy(view, data)
        else:
            arrays.combine(reduce, view, data, self.dtype)

    def landed(self, step: Step[Op], t) -> None:
        if getattr(step.op, "staging", None) is not None:
            self.land(step, t)


# ------------------------------------------------------------------------------------- handlers
# A handler runs a local op, or issues a message and returns what to wait for: (work, landing)


def _copy(run: Run, step: Step[Copy]):
    run.land(step, run.buffer(step.op.buffer)[step.read])


def _pull(run: Run, step: Step[Pull]):
    op = step.op
    shard = run.peers[op.holder] if op.buffer is Buffer.SRC else run.relayed(op.holder, op.after)
    if isinstance(shard, RemoteShard) and op.reduce is None:
        shard.read_into(step.read, run.target(step)[step.write])  # out of the holder's memory, once
    else:
        run.land(step, shard[step.read])


def _publish(run: Run, step: Step[Publish]):
    run.publish(step.op.count)


def _scale(run: Run, step: Step[Scale]):
    arrays.scale(run.dst[step.write], step.op.divisor, run.dtype)


def _send(run: Run, step: Step[Send]):
    return run.comm(step).isend(run.outgoing(step), step.peer), None


def _recv(run: Run, step: Step[Recv]):
    t = run.incoming(step)
    return run.comm(step).irecv(arrays.wire(t), step.peer), t


def _broadcast(run: Run, step: Step[Broadcast]):
    if step.op.read is not None:
        return run.comm(step).ibroadcast(run.outgoing(step), step.root), None
    t = run.incoming(step)
    return run.comm(step).ibroadcast(arrays.wire(t), step.root), t


HANDLERS: dict[type, Callable] = {
    Copy: _copy,
    Pull: _pull,
    Scale: _scale,
    Publish: _publish,
    Send: _send,
    Recv: _recv,
    Broadcast: _broadcast,
}


def box_index(box):
    """The index of ``box``: always a view, a 0-d one too (numpy gives a scalar for ``a[()]``)."""
    return None if box is None else (*(slice(lo, hi) for lo, hi in box), Ellipsis)


def _step(op: Op, device: int) -> Step[Op]:
    key = root = peer = None
    group = getattr(op, "group", None)
    if group is not None:
        key = group_of(group)
        root = key.index(group[0])
        other = group[1] if group[0] == device else group[0]
        peer = key.index(other) if isinstance(op, Send | Recv) else -1
    return Step(
        HANDLERS[type(op)],
        op,
        box_index(getattr(op, "read", None)),
        box_index(getattr(op, "write", None)),
        key,
        -1 if root is None else root,
        -1 if peer is None else peer,
        op_shape(op),
    )


def prepare(program: DeviceProgram, dtype: str) -> PreparedProgram:
    """``program`` ready to run (its steps worked out on first use: ``PreparedProgram``)."""
    return PreparedProgram(program, dtype, program.publishes)


_helper: ThreadPoolExecutor | None = None


def _helper_thread() -> ThreadPoolExecutor:
    """This process's one helper thread for background copies (torch releases the GIL in ``copy_``)."""
    global _helper
    if _helper is None:
        _helper = ThreadPoolExecutor(1, thread_name_prefix="reshard-background")
    return _helper


def execute(run: Run) -> dict:
    """Run ``run.prepared`` (module docstring). Returns ``{"elapsed_s", "comm_s"}``; raises
    ``ReshardError`` / ``ReshardTimeout``; the caller aborts the program's groups on failure."""
    t0 = time.monotonic()
    begin_run(run)
    run_windows(run)
    return {"elapsed_s": time.monotonic() - t0, "comm_s": run.comm_s}


def begin_run(run: Run) -> None:
    """Check the run's buffers against its program and zero a destination that starts as zeros."""
    prog = run.prepared.program
    check_buffer("source", run.src, prog.src_shape, run.dtype, run.device)
    check_buffer("destination", run.dst, prog.dst_shape, run.dtype, run.device)
    if prog.tmp:
        check_buffer("scratch", run.tmp, prog.src_shape, run.dtype, run.device)
    if prog.zero_dst:
        run.dst[...] = 0
    _check_peers(prog, run)


def run_windows(run: Run) -> None:
    prepared = run.prepared
    background = None
    if prepared.background:
        background = _helper_thread().submit(_run_local, run, prepared.background)
    try:
        for window, messages in zip(prepared.windows, prepared.messages, strict=True):
            if messages:
                _run_window(run, window)
            else:
                _run_local(run, window)
    finally:
        if background is not None:
            background.result()  # re-raises a copy error; never leaves a thread writing dst


def _run_local(run: Run, steps) -> None:
    for s in steps:
        if run.before_op is not None:
            run.before_op(run, s.op)
        s.handler(run, s)


def _run_window(run: Run, window: tuple[Step[Op], ...]) -> None:
    """Issue the window's ops in order (inside one backend batch when the backend batches), then
    wait for each and land what was staged. A publication runs in
    that second pass, once the ops before it have landed, while the window's later ops are in
    flight."""
    pending = []
    c0 = time.monotonic()
    with run.batch(timeout_s=run.deadline - c0) if run.batch is not None else contextlib.nullcontext():
        for s in window:
            if isinstance(s.op, Publish):
                pending.append((s, None, None))
                continue
            if run.before_op is not None:
                run.before_op(run, s.op)
            issued = s.handler(run, s)
            if issued is not None:
                pending.append((s, *issued))
    messages = False
    for s, work, landing in pending:
        if work is None:
            _run_local(run, (s,))
            continue
        messages = True
        work.wait(run.left(s))
        if landing is not None:
            run.landed(s, landing)
    if messages:
        run.comm_s += time.monotonic() - c0


def _contiguous(view, step: Step[Op], device: int):
    if not arrays.contiguous(view):
        raise ReshardError(f"device {device}: step {step.op.step} slice is strided but not staged (program bug)")
    return view


def _check_peers(prog: DeviceProgram, run: Run) -> None:
    """Every holder the program pulls from is mapped, with the program's dtype; relays have a
    source and publications a board."""
    if prog.relays and run.relayed is None:
        raise ReshardError(f"device {prog.device}: the program pulls relays but the run has no way to find them")
    if run.prepared.publishes and run.publish is None:
        raise ReshardError(f"device {prog.device}: the program publishes relays but the run has nowhere to")
    dtype = run.dtype
    for holder in run.prepared.holders:
        t = run.peers.get(holder)
        if t is None or not _is(t, dtype):
            got = "nothing" if t is None else f"a {t.dtype} shard"
            raise ReshardError(
                f"device {prog.device}: the program pulls from device {holder}'s source shard "
                f"but {got} was mapped for it"
            )


def check_buffer(what: str, t, shape, dtype, device: int) -> None:
    if shape is None:
        return
    if t is None:
        raise ReshardError(f"device {device}: the program needs a {what} shard of shape {shape} but none is present")
    if tuple(t.shape) != tuple(shape) or not _is(t, dtype):
        raise ReshardError(
            f"device {device}: {what} shard is {t.dtype}{list(t.shape)}, the program expects {dtype}{list(shape)}"
        )


def _is(a, dtype: str) -> bool:
    """Whether array ``a`` holds ``dtype`` (a numpy or cupy array: its storage dtype)."""
    if type(a) is np.ndarray:
        return a.dtype == arrays.storage(dtype)
    return a.dtype == arrays.torch_dtype(dtype) if arrays.is_torch(a) else a.dtype == arrays.storage(dtype)

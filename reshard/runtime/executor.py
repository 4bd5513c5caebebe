"""Actor-side interpreter of ``DeviceProgram``s: runs the ops in program order, nothing else.

COPY copies a slice of SRC (or DST, for a relay) into a DST slice; PULL copies a slice of a peer's
source shard (mapped shared memory, ``peers``) into a DST slice. SEND/RECV/BROADCAST look up the
communicator of ``group_key(op.group)``; the root's rank is the index of ``op.group[0]`` in it.
A slice that is not contiguous in its buffer (``op.stage``) passes through ONE reusable staging
buffer (raw bytes, viewed as the op's dtype and shape): the executor never allocates a full-size
temporary. Every communication op gets the time left before the run's deadline as its timeout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from reshard.dtypes import ITEMSIZE
from reshard.errors import ReshardError, ReshardTimeout
from reshard.lowering import Buffer, DeviceProgram, OpKind
from reshard.runtime.groups import group_key

#: Default bound on the staging buffer an idle actor keeps for the next run (reused when the next
#: run needs the same size: no page faults for repeated reshards).
STAGING_KEEP_BYTES = 64 << 20

TORCH_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


class StagingBuffer:
    """One byte buffer per actor, reused by every staged op of a program.

    ``reserve(nbytes)`` at the start of a run makes it exactly ``nbytes`` (reused as is when a
    repeated program needs the same size), so a run never holds more staging than its largest
    staged slice; ``trim()`` after a run frees it if it is bigger than ``keep_bytes``, so an idle
    actor keeps at most ``keep_bytes`` of staging.
    """

    def __init__(self, device: torch.device, keep_bytes: int = 1 << 20):
        self.device = device
        self.keep_bytes = keep_bytes
        self.buf: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel()

    def reserve(self, nbytes: int) -> None:
        if nbytes == self.nbytes:
            return
        self.buf = None  # free first: never hold two
        if nbytes:
            self.buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def view(self, dtype: torch.dtype, shape: tuple[int, ...], numel: int) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if nbytes > self.nbytes:
            raise ReshardError(
                f"staging buffer of {self.nbytes} B is too small for {nbytes} B (program staging_numel too low)"
            )
        return self.buf[:nbytes].view(dtype).view(shape)

    def trim(self) -> None:
        if self.nbytes > self.keep_bytes:
            self.buf = None


@dataclass(frozen=True, slots=True)
class _Step:
    """One op, precomputed for fast interpretation."""

    kind: OpKind
    step: int
    key: tuple[int, ...]
    root: int  # rank of op.group[0] in key (sender / broadcast root)
    me: int  # this device's rank in key
    peer: int  # the other rank of a SEND/RECV
    shape: tuple[int, ...]
    numel: int
    read_dst: bool
    read: tuple | None
    write: tuple | None
    stage: bool
    op: object


def _slices(box) -> tuple | None:
    if box is None:
        return None
    return tuple(slice(lo, hi) for lo, hi in box)


_LOCAL = (OpKind.COPY, OpKind.PULL)  # ops that involve no communicator

#: Local COPY bytes from which a program's copies run on a helper thread while its communication
#: proceeds (below, the thread hand-off costs more than it saves).
OVERLAP_COPY_BYTES = 1 << 20

_copy_pool = None


def _copier():
    """This process's one helper thread for local copies (torch releases the GIL in ``copy_``)."""
    global _copy_pool
    if _copy_pool is None:
        from concurrent.futures import ThreadPoolExecutor

        _copy_pool = ThreadPoolExecutor(1, thread_name_prefix="reshard-copy")
    return _copy_pool


def _run_copies(steps, src, dst, peers) -> None:
    for s in steps:
        dst[s.write].copy_((peers[s.op.group[0]] if s.kind is OpKind.PULL else src)[s.read])


@dataclass(frozen=True, slots=True)
class CompiledProgram:
    """A ``DeviceProgram`` with slices and ranks precomputed, plus its dtype.

    ``copies`` (when set) are the local COPY and PULL ops that may run concurrently with the communication
    ops in ``steps`` (no op reads the destination, and they write boxes no other op writes)."""

    program: DeviceProgram
    dtype: str
    steps: tuple[_Step, ...]
    groups: tuple[tuple[int, ...], ...]  # communicator keys, in order of first use
    copies: tuple[_Step, ...] = ()
    copy_numel: int = 0
    holders: tuple[int, ...] = ()  # devices whose source shards the PULL ops read

    @property
    def device(self) -> int:
        return self.program.device

    @property
    def staging_bytes(self) -> int:
        return self.program.staging_numel * ITEMSIZE[self.dtype]


def compile_program(program: DeviceProgram, dtype: str) -> CompiledProgram:
    """Precompute slices and ranks. Local COPY and PULL ops wait for no peer, so when no op of the
    program reads the destination shard (no relay), they run after the communication ops: peers
    waiting for this device's sends are served first. Communication ops keep their global order."""
    steps = []
    groups: dict = {}
    me_dev = program.device
    for op in program.ops:
        key = group_key(op.group)
        if op.kind not in _LOCAL:
            groups.setdefault(key, None)
        root = key.index(op.group[0])
        me = key.index(me_dev)
        peer = -1
        if op.kind is OpKind.SEND:
            peer = key.index(op.group[1])
        elif op.kind is OpKind.RECV:
            peer = root
        numel = 1
        for n in op.shape:
            numel *= n
        steps.append(
            _Step(
                op.kind,
                op.step,
                key,
                root,
                me,
                peer,
                tuple(op.shape),
                numel,
                op.read_buffer is Buffer.DST,
                _slices(op.read),
                _slices(op.write),
                bool(op.stage),
                op,
            )  # fmt: skip
        )
    holders = tuple(sorted({s.op.group[0] for s in steps if s.kind is OpKind.PULL}))
    if not any(s.read_dst for s in steps):
        comm = [s for s in steps if s.kind not in _LOCAL]
        copies = [s for s in steps if s.kind in _LOCAL]
        copy_numel = sum(s.numel for s in copies)
        if comm and copies and copy_numel * ITEMSIZE[dtype] >= OVERLAP_COPY_BYTES:
            # big local copies: on the helper thread while this device communicates
            return CompiledProgram(
                program, dtype, tuple(comm + copies), tuple(groups), tuple(copies), copy_numel, holders
            )
        steps = comm + copies
    return CompiledProgram(program, dtype, tuple(steps), tuple(groups), holders=holders)


def run_program(
    ctx,
    compiled: CompiledProgram,
    src: torch.Tensor | None,
    dst: torch.Tensor | None,
    timeout_s: float,
    groups=None,
    peers: dict | None = None,
) -> dict:
    """Run one device's program: read ``src`` (this device's source shard), write ``dst`` (its
    destination shard, already allocated). ``groups`` (default ``ctx.groups``) maps a group key to
    a communicator through ``.get(key)``; ``peers`` maps a device to its source shard as mapped
    here, for PULL ops. Raises ``ReshardError``/``ReshardTimeout``; the caller aborts the
    program's communicators on failure."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    dtype = torch_dtype(compiled.dtype)
    prog = compiled.program
    _check_buffer("source", src, prog.src_shape, dtype, prog.device)
    _check_buffer("destination", dst, prog.dst_shape, dtype, prog.device)
    staging = ctx.staging
    staging.reserve(compiled.staging_bytes)
    peak = (0 if dst is None else dst.numel() * dst.element_size()) + staging.nbytes
    ctx.note_peak(peak)
    groups = ctx.groups if groups is None else groups
    peers = _check_peers(compiled, peers or {}, dtype)
    before = ctx.before_op
    comm_s = 0.0
    steps = compiled.steps
    if compiled.copies and before is None and dst.device.type == "cpu":
        # local copies on the helper thread, communication here; joined before returning or raising
        steps = steps[: len(steps) - len(compiled.copies)]
        copying = _copier().submit(_run_copies, compiled.copies, src, dst, peers)
        try:
            comm_s = _communicate(
                ctx, compiled, steps, src, dst, peers, deadline, timeout_s, groups, staging, dtype, None
            )
        finally:
            copying.result()  # re-raises a copy error; never leaves a thread writing dst
    else:
        comm_s = _communicate(
            ctx, compiled, steps, src, dst, peers, deadline, timeout_s, groups, staging, dtype, before
        )
    return {"elapsed_s": time.monotonic() - t0, "comm_s": comm_s, "ops": len(compiled.steps), "peak_bytes": peak}


def _communicate(ctx, compiled, steps, src, dst, peers, deadline, timeout_s, groups, staging, dtype, before) -> float:
    prog = compiled.program
    comm_s = 0.0
    for s in steps:
        if before is not None:
            before(ctx, s.op)
        kind = s.kind
        if kind is OpKind.COPY:
            buf = dst if s.read_dst else src
            dst[s.write].copy_(buf[s.read])
            continue
        if kind is OpKind.PULL:
            dst[s.write].copy_(peers[s.op.group[0]][s.read])
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            raise ReshardTimeout(
                f"device {prog.device}: deadline of {timeout_s:.2f}s passed before step {s.step} "
                f"({kind.name} {s.op.group})"
            )
        comm = groups.get(s.key)
        comm.timeout_s = left
        c0 = time.monotonic()
        if kind is OpKind.RECV or (kind is OpKind.BROADCAST and s.me != s.root):
            if s.stage:
                t = staging.view(dtype, s.shape, s.numel)
            else:
                t = _contiguous(dst[s.write], s, prog.device)
            if kind is OpKind.RECV:
                comm.recv(t, s.peer)
            else:
                comm.broadcast(t, s.root)
            if s.stage:
                dst[s.write].copy_(t)
        else:  # SEND, or the broadcast root
            view = (dst if s.read_dst else src)[s.read]
            if s.stage:
                t = staging.view(dtype, s.shape, s.numel)
                t.copy_(view)
            else:
                t = _contiguous(view, s, prog.device)
            if kind is OpKind.SEND:
                comm.send(t, s.peer)
            else:
                comm.broadcast(t, s.root)
        comm_s += time.monotonic() - c0
    return comm_s


def _check_peers(compiled: CompiledProgram, peers: dict, dtype: torch.dtype) -> dict:
    """Every holder the program pulls from is mapped, with the dtype of the program."""
    for holder in compiled.holders:
        t = peers.get(holder)
        if t is None or t.dtype != dtype:
            got = "nothing" if t is None else f"a {t.dtype} shard"
            raise ReshardError(
                f"device {compiled.device}: the program pulls from device {holder}'s source shard but {got} "
                "was mapped for it"
            )
    return peers


def _contiguous(view: torch.Tensor, s: _Step, device: int) -> torch.Tensor:
    if not view.is_contiguous():
        raise ReshardError(
            f"device {device}: step {s.step} slice {s.op.read or s.op.write} is not contiguous but the program "
            "does not stage it (lowering bug)"
        )
    return view


def _check_buffer(what: str, t, shape, dtype, device: int) -> None:
    if shape is None:
        return
    if t is None:
        raise ReshardError(f"device {device}: the program needs a {what} shard of shape {shape} but none is present")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ReshardError(
            f"device {device}: {what} shard is {t.dtype}{list(t.shape)}, the program expects {dtype}{list(shape)}"
        )

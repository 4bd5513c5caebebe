"""Sequencing: the order and overlap in which each device runs its ops.

Message ops keep the plan's global order (deadlock freedom). Local ops (``Copy``, ``Pull``) wait
for nobody but a relay's publication, so when no op of a device reads what its ops write (it
relays, combines or scales nothing) they go after its messages, those that are ready first (pulls
of relays by publication): the peers waiting on this device are served first. When those
local ops move at least ``overlap_copy_bytes`` and the device also communicates, they run on the
device's helper thread instead (``background``), overlapping its messages (CPU devices only: a GPU
copies on its streams). With ``window_ops`` > 1 consecutive message ops are issued together, up to
that many, as long as they move at most ``window_bytes`` together (a window overlaps latencies;
bigger messages go one at a time, in the order the planner chose for the links), their staged
slices fit ``window_staging_bytes`` side by side and no op reads a box the window writes; a pull
of a relay (it waits) gets a window of its own, and a device that relays (publishes, or sends on
what it received) issues its messages one at a time (its peers wait for each slice).
``reshard.validate.validate_program`` replays the result.
"""

from __future__ import annotations

from dataclasses import replace

from reshard.dtypes import itemsize
from reshard.program import (
    LOCAL_OPS,
    MESSAGE_OPS,
    Broadcast,
    Buffer,
    DeviceProgram,
    Op,
    Program,
    Publish,
    Pull,
    Send,
    op_numel,
    reads_output,
)

OVERLAP_COPY_BYTES = 1 << 20  # below it the hand-off to the helper thread costs more than it saves
WINDOW_STAGING_BYTES = 64 << 20
# Messages a device issues together, per backend: gloo runs a window's sends and receives at once
# (their latencies overlap). NCCL keeps one at a time: a window is one group call over several
# communicators, whose kernels could queue behind each other on one stream (untested without GPUs).
WINDOW_OPS = {"gloo": 4}
# ... while they move at most this much together. Measured on 4 emulated hosts (1 Gbit/s, ~1 ms
# per gloo message): 64 KiB reshards gained from windows, while 4-16 MiB slices in flight together
# ran at half the rate one at a time reached (shard -> replicate at 256 MiB: 4.5 s against 2.5 s).
WINDOW_BYTES = 1 << 20


def window_ops_for(backend: str) -> int:
    """The ``window_ops`` the runtime sequences with for ``backend``'s devices (1: one at a time)."""
    return WINDOW_OPS.get(backend, 1)


def sequence_program(
    program: Program,
    *,
    overlap_copy_bytes: int | None = OVERLAP_COPY_BYTES,
    window_ops: int = 1,
    window_staging_bytes: int = WINDOW_STAGING_BYTES,
    window_bytes: int = WINDOW_BYTES,
) -> Program:
    """``program`` with every device's ops ordered, overlapped and windowed (module docstring);
    ``overlap_copy_bytes=None`` keeps local ops in the foreground (GPU devices)."""
    if window_ops < 1:
        raise ValueError(f"window_ops must be >= 1, got {window_ops}")
    item = itemsize(program.dtype)
    devices = tuple(
        _sequence_device(p, item, overlap_copy_bytes, window_ops, window_staging_bytes, window_bytes)
        for p in program.devices
    )
    return replace(program, devices=devices)


def _sequence_device(
    p: DeviceProgram, item: int, overlap_bytes, window_ops: int, window_staging: int, window_bytes: int
) -> DeviceProgram:
    ops: list[Op] = [*p.ops, *p.background]
    messages: list[Op] = [op for op in ops if isinstance(op, MESSAGE_OPS)]
    local: list[Op] = [op for op in ops if isinstance(op, LOCAL_OPS)]
    background: list[Op] = []
    if local and not any(reads_output(op) for op in ops):  # plain writes of disjoint boxes: any order
        local.sort(key=_publication)
        if messages and overlap_bytes is not None and sum(op_numel(op) for op in local) * item >= overlap_bytes:
            ops, background = messages, local
        else:
            ops = messages + local
    # a device that relays takes its messages one at a time: each slice lands, and is forwarded or
    # published, as early as it can, instead of all of a window's slices at the window's end
    most = 1 if _relays(ops) else window_ops
    ops, windows, staging = _windows(list(ops), item, most, window_staging, window_bytes, p.staging_bytes)
    return replace(p, ops=tuple(ops), background=tuple(background), windows=windows, staging_bytes=staging)


def _relays(ops) -> bool:
    """Whether a device forwards what it receives: publishes it, or sends it from its destination
    shard or scratch buffer."""
    return any(isinstance(op, Publish) or (isinstance(op, Send | Broadcast) and reads_output(op)) for op in ops)


def _publication(op: Op) -> int:
    """The publication a local op waits for (0: none)."""
    return op.after if isinstance(op, Pull) else 0


def _windows(ops: list[Op], item: int, most: int, bound: int, moved_bound: int, staging: int):
    """Cut ``ops`` into issue windows; staged ops of one window get side-by-side staging offsets.
    Returns (ops, window lengths or () for one op at a time, staging bytes)."""
    if most == 1:
        return ops, (), staging
    out: list[Op] = []
    lengths: list[int] = []
    count = used = peak = moved = 0
    written: list = []  # boxes written in the current window
    alone = False  # the current window holds a pull of a relay
    for op in ops:
        message = isinstance(op, MESSAGE_OPS)
        size = op_numel(op) * item if message else 0  # only messages move bytes or are staged
        nbytes = size if getattr(op, "staging", None) is not None else 0
        depends = reads_output(op) is not None and written
        waits = isinstance(op, Pull) and op.buffer is Buffer.DST
        full = message and (
            count >= most or used + nbytes > max(bound, nbytes) or (count and moved + size > moved_bound)
        )
        if lengths and (depends or waits or alone or full):
            lengths.append(0)
            count = used = moved = 0
            written = []
        if not lengths:
            lengths.append(0)
        if nbytes and isinstance(op, MESSAGE_OPS):
            op = replace(op, staging=used)
            used += nbytes
            peak = max(peak, used)
        if message:
            count += 1
            moved += size
        write = getattr(op, "write", None)
        if write is not None:
            written.append(write)
        out.append(op)
        lengths[-1] += 1
        alone = waits
    return out, tuple(lengths), peak

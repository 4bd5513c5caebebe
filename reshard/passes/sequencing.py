"""Sequencing: the order and overlap in which each device runs its ops.

Message ops keep the plan's global order (deadlock freedom). Local ops (``Copy``, ``Pull``) wait
for nobody but a relay's publication, so when no op of a device reads what its ops write (it
relays, combines or scales nothing) they go after its messages, those that are ready first (pulls
of relays by publication): the peers waiting on this device are served first. When those
local ops move at least ``overlap_copy_bytes`` and the device also communicates, they run on the
device's helper thread instead (``background``), overlapping its messages (CPU devices only: a GPU
copies on its streams). With ``window_ops`` > 1 consecutive message ops are issued together, up to
that many, as long as their staged slices fit ``window_staging_bytes`` side by side and no op
reads a box the window writes. A window holds small messages of at most ``window_bytes`` together
(their latencies overlap) or one bigger message (bigger messages go one at a time, in the order the
planner chose for the links), except that a device forwards what it received while the next slice
comes in: the bound is per direction of its link, and only a forward (out) and a receive (in) take
one direction each (duplex; a send of its own source, which on emulated hosts ran slower beside a
big receive than modelled, takes both). A device that relays (publishes, or forwards) takes at
most one message per direction per window: each slice lands, and is forwarded or published, as
early as it can. A publication stays in its window: the executor runs it once the window's ops
before it have landed. A pull of a relay (it waits) gets a window of its own.
``reshard.passes.validate.validate_program`` replays the result.
"""

from __future__ import annotations

from dataclasses import replace

from reshard.dtypes import itemsize
from reshard.ir.program import (
    LOCAL_OPS,
    MESSAGE_OPS,
    Broadcast,
    Buffer,
    DeviceProgram,
    Op,
    Program,
    Publish,
    Pull,
    Recv,
    Send,
    op_numel,
    reads_output,
)
from reshard.ir.target import WINDOW_BYTES, WINDOW_STAGING_BYTES

OVERLAP_COPY_BYTES = 1 << 20  # below it the hand-off to the helper thread costs more than it saves
OUT, IN = 0, 1  # the directions of a device's link


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
    ops, windows, staging = _windows(
        list(ops), item, window_ops, window_staging, window_bytes, p.staging_bytes, single=_relays(ops)
    )
    return replace(p, ops=tuple(ops), background=tuple(background), windows=windows, staging_bytes=staging)


def _relays(ops) -> bool:
    """Whether a device forwards what it receives: publishes it, or sends it from its destination
    shard or scratch buffer."""
    return any(isinstance(op, Publish) or (isinstance(op, Send | Broadcast) and reads_output(op)) for op in ops)


def _directions(op: Op) -> tuple[int, ...]:
    """The directions of the device's link a message takes up (``OUT``, ``IN``) in a window: a
    receive comes in; a forward (a send of what the device received) goes out; a send of its own
    source and a broadcast member (it may forward: gloo's binomial tree) take both, so only a
    forward and a receive go together."""
    if isinstance(op, Recv):
        return (IN,)
    if reads_output(op) is not None:  # a send or broadcast root reading its destination or scratch
        return (OUT,)
    return (OUT, IN)


def _publication(op: Op) -> int:
    """The publication a local op waits for (0: none)."""
    return op.after if isinstance(op, Pull) else 0


def _windows(ops: list[Op], item: int, most: int, bound: int, moved_bound: int, staging: int, *, single: bool):
    """Cut ``ops`` into issue windows (``single``: at most one message per direction); staged ops
    of one window get side-by-side staging offsets. Returns (ops, window lengths or () for one op
    at a time, staging bytes)."""
    if most == 1:
        return ops, (), staging
    out: list[Op] = []
    lengths: list[int] = []
    count = used = peak = 0
    moved = [0, 0]  # bytes per direction in the current window
    carried = [0, 0]  # messages per direction
    written: list = []  # boxes written in the current window
    alone = False  # the current window holds a pull of a relay
    for op in ops:
        message = isinstance(op, MESSAGE_OPS)
        size = op_numel(op) * item if message else 0  # only messages move bytes or are staged
        nbytes = size if getattr(op, "staging", None) is not None else 0
        directions = _directions(op) if message else ()
        depends = reads_output(op) is not None and written and not isinstance(op, Publish)  # it runs after them
        waits = isinstance(op, Pull) and op.buffer is Buffer.DST
        full = message and (
            count >= most
            or used + nbytes > max(bound, nbytes)
            or any(carried[d] and (single or moved[d] + size > moved_bound) for d in directions)
        )
        if lengths and (depends or waits or alone or full):
            lengths.append(0)
            count = used = 0
            moved, carried, written = [0, 0], [0, 0], []
        if not lengths:
            lengths.append(0)
        if nbytes and isinstance(op, MESSAGE_OPS):
            op = replace(op, staging=used)
            used += nbytes
            peak = max(peak, used)
        count += message
        for d in directions:
            moved[d] += size
            carried[d] += 1
        write = getattr(op, "write", None)
        if write is not None:
            written.append(write)
        out.append(op)
        lengths[-1] += 1
        alone = waits
    return out, tuple(lengths), peak

"""Pulls: transfers among devices that share memory become copies out of the sender's memory.

Where a transfer's sender and all its receivers share one memory domain (device actors on one
machine), each receiver copies the slice straight out of the sender's shard into its own: one
memory copy, no message, and nothing for the sender to do but, for a relay, say when the slice is
there.

- A slice of the sender's SOURCE shard: a source shard is complete before a reshard starts and
  nothing writes it during one, so the pull waits for nobody.
- A relay, a slice of the sender's DESTINATION shard that it received earlier in the same program
  (from another machine, typically): the sender's relay message becomes a ``Publish``, placed right
  after the last of its ops that writes the slice, and each receiver pulls once that publication
  ran (``Pull.after``). The receivers wait for no more than the relay message made them wait for,
  and the sender no longer waits for them, so the program stays deadlock free; the pull overlaps
  the sender's next receives instead of following them. Only senders in ``publishers`` (whose
  destination shard is in shared memory) qualify.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping
from dataclasses import replace

from reshard.dtypes import itemsize
from reshard.ir.program import (
    MESSAGE_OPS,
    Broadcast,
    Buffer,
    DeviceProgram,
    Op,
    Program,
    Publish,
    Pull,
    Send,
    first_use_groups,
    op_box,
    op_numel,
    writes,
)
from reshard.ir.regions import intersect


def pulled_steps(
    program: Program, domain_of: Mapping[int, Hashable | None], publishers: Collection[int] | None = None
) -> dict[int, Send | Broadcast]:
    """``{step: the sender's op}`` for every step whose group shares one memory domain and whose
    sender reads its source shard, or its destination shard when it is one of ``publishers``
    (None: every device). ``domain_of[d]`` (None or absent: shares memory with nobody)."""
    out: dict[int, Send | Broadcast] = {}
    for p in program.devices:
        for op in p.ops:
            if not isinstance(op, Send | Broadcast) or op.group[0] != p.device:
                continue
            relay = op.buffer is Buffer.DST and (publishers is None or p.device in publishers)
            if op.buffer is not Buffer.SRC and not relay:
                continue
            domain = domain_of.get(op.group[0])
            if domain is not None and all(domain_of.get(d) == domain for d in op.group):
                out[op.step] = op
    return out


def to_pulls(
    program: Program, domain_of: Mapping[int, Hashable | None], publishers: Collection[int] | None = None
) -> Program:
    """``program`` with every step of ``pulled_steps`` rewritten (module docstring): the sender's
    op is dropped (a relay's becomes a ``Publish``), each receiver's op becomes a ``Pull`` of the
    sender's box; staging and groups shrink to what is left."""
    pulled = pulled_steps(program, domain_of, publishers)
    if not pulled:
        return program
    item = itemsize(program.dtype)
    dst_shapes = {p.device: p.dst_shape for p in program.devices}
    after: dict[int, int] = {}
    publishing = {p.device: _with_publications(p, pulled, after) for p in program.devices}
    devices = []
    for p in program.devices:
        ops: list[Op] = []
        relays: dict[int, tuple[int, ...]] = {}
        for op in publishing[p.device]:
            root = pulled.get(op.step)
            if root is None or isinstance(op, Publish):
                ops.append(op)
            elif p.device != (holder := root.group[0]):
                target = getattr(op, "target", Buffer.DST)
                box = op_box(root)
                if root.buffer is Buffer.DST:
                    relays[holder] = _shape(dst_shapes[holder], holder)
                    ops.append(
                        Pull(
                            op.step,
                            holder,
                            box,
                            op_box(op),
                            target,
                            getattr(op, "reduce", None),
                            Buffer.DST,
                            after[op.step],
                        )
                    )
                else:
                    ops.append(Pull(op.step, holder, box, op_box(op), target, getattr(op, "reduce", None)))
        staging = max(
            (op_numel(op) * item for op in ops if isinstance(op, MESSAGE_OPS) and op.staging is not None), default=0
        )
        connect = first_use_groups(ops)
        relayed = tuple(sorted(relays.items()))
        devices.append(replace(p, ops=tuple(ops), staging_bytes=staging, connect=connect, relays=relayed))
    return Program(program.dtype, program.shape, tuple(devices))


def last_write(ops, end: int, box) -> int | None:
    """The index of the last of ``ops[:end]`` that writes into ``box`` of the destination shard
    (where a relay of ``box`` is published), or None."""
    return max(
        (j for j in range(end) if (w := writes(ops[j])) and w[0] is Buffer.DST and intersect(w[1], box) is not None),
        default=None,
    )


def _shape(shape: tuple[int, ...] | None, device: int) -> tuple[int, ...]:
    if shape is None:
        raise ValueError(f"device {device} relays out of a destination shard it does not have (program bug)")
    return shape


def _with_publications(p: DeviceProgram, pulled: Mapping[int, Send | Broadcast], after: dict[int, int]) -> list[Op]:
    """``p``'s ops with each of its pulled relays replaced by a ``Publish`` right after the last
    earlier op that writes into the relayed box; records each relay's publication in ``after``."""
    ops = list(p.ops)
    relays: list[tuple[int, Send | Broadcast]] = [
        (i, op)
        for i, op in enumerate(ops)
        if isinstance(op, Send | Broadcast) and pulled.get(op.step) is op and op.buffer is Buffer.DST
    ]
    if not relays:
        return ops
    at: list[tuple[int, int, Send | Broadcast]] = []  # (insert before this index, relay step, relay op)
    for i, op in relays:
        last = last_write(ops, i, op_box(op))
        at.append((0 if last is None else last + 1, op.step, op))
    at.sort(key=lambda x: (x[0], x[1]))
    inserts: dict[int, list[Publish]] = {}
    for count, (pos, step, op) in enumerate(at, 1):
        after[step] = count
        inserts.setdefault(pos, []).append(Publish(step, op_box(op), count))
    dropped = {id(op) for _, op in relays}
    out: list[Op] = []
    for j in range(len(ops) + 1):
        out += inserts.get(j, [])
        if j < len(ops) and id(ops[j]) not in dropped:
            out.append(ops[j])
    return out

"""Pulls: transfers among devices that share memory become copies out of the holder's source shard.

Where a transfer's sender and all its receivers share one memory domain (device actors on one
machine), each receiver copies the slice straight out of the sender's source shard into its own
destination shard: one memory copy, no message, no staging buffer, and nothing for the sender to
do. Only transfers that read the sender's SOURCE shard qualify: a source shard is complete before
a reshard starts and nothing writes it during one, so a pull waits for nobody. A relay (a device
forwarding what it received earlier in the same program) keeps its messages.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import replace

from reshard.dtypes import itemsize
from reshard.program import (
    MESSAGE_OPS,
    Broadcast,
    Buffer,
    Op,
    Program,
    Pull,
    Send,
    first_use_groups,
    op_box,
    op_numel,
)


def pulled_steps(program: Program, domain_of: Mapping[int, Hashable | None]) -> dict[int, Send | Broadcast]:
    """``{step: the sender's op}`` for every step whose group shares one memory domain and whose
    sender reads its source shard. ``domain_of[d]`` (None or absent: shares memory with nobody)."""
    out: dict[int, Send | Broadcast] = {}
    for p in program.devices:
        for op in p.ops:
            if not isinstance(op, Send | Broadcast) or op.group[0] != p.device or op.buffer is not Buffer.SRC:
                continue
            domain = domain_of.get(op.group[0])
            if domain is not None and all(domain_of.get(d) == domain for d in op.group):
                out[op.step] = op
    return out


def to_pulls(program: Program, domain_of: Mapping[int, Hashable | None]) -> Program:
    """``program`` with every step of ``pulled_steps`` rewritten: the sender's op is dropped, each
    receiver's op becomes a ``Pull`` of the sender's box; staging and groups shrink to what is left."""
    pulled = pulled_steps(program, domain_of)
    if not pulled:
        return program
    item = itemsize(program.dtype)
    devices = []
    for p in program.devices:
        ops: list[Op] = []
        for op in p.ops:
            root = pulled.get(op.step)
            if root is None:
                ops.append(op)
            elif p.device != (holder := root.group[0]):
                target = getattr(op, "target", Buffer.DST)
                ops.append(Pull(op.step, holder, op_box(root), op_box(op), target, getattr(op, "reduce", None)))
        staging = max(
            (op_numel(op) * item for op in ops if isinstance(op, MESSAGE_OPS) and op.staging is not None), default=0
        )
        devices.append(replace(p, ops=tuple(ops), staging_bytes=staging, connect=first_use_groups(ops)))
    return Program(program.dtype, program.shape, tuple(devices))

"""Pulls: transfers among devices that share memory become copies out of the holder's source shard.

Where a transfer's sender and all its receivers share one memory domain (device actors on one
machine), each receiver copies the slice straight out of the sender's source shard into its own
destination shard: one memory copy, no message, no staging buffer, and nothing for the sender to
do. Only transfers that read the sender's SOURCE shard qualify: a source shard is complete before
a reshard starts and nothing writes it during one, so a pull waits for nobody. A relay (a device
forwarding what it received earlier in the same program) keeps its messages.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Mapping

from reshard.lowering import Buffer, DeviceProgram, Op, OpKind, Program


def pulled_steps(program: Program, domain_of: Mapping[int, Hashable | None]) -> dict[int, Op]:
    """``{step: the sender's op}`` for every step whose group shares one memory domain and whose
    sender reads its source shard. ``domain_of[d]`` (None or absent: shares memory with nobody)."""
    roots: dict[int, Op] = {}
    for p in program.devices:
        for op in p.ops:
            if op.kind in (OpKind.SEND, OpKind.BROADCAST) and op.group[0] == p.device:
                roots[op.step] = op
    out = {}
    for step, op in roots.items():
        if op.read_buffer is not Buffer.SRC:
            continue
        domain = domain_of.get(op.group[0])
        if domain is not None and all(domain_of.get(d) == domain for d in op.group):
            out[step] = op
    return out


def to_pulls(program: Program, domain_of: Mapping[int, Hashable | None]) -> Program:
    """``program`` with every step of ``pulled_steps`` rewritten: the sender's op is dropped, each
    receiver's op becomes a PULL of the sender's ``read`` box; staging shrinks to what is left."""
    pulled = pulled_steps(program, domain_of)
    if not pulled:
        return program
    devices = []
    for p in program.devices:
        ops = []
        for op in p.ops:
            root = pulled.get(op.step)
            if root is None:
                ops.append(op)
            elif p.device != (holder := root.group[0]):
                ops.append(Op(OpKind.PULL, op.step, (holder, p.device), op.shape, Buffer.SRC, root.read, op.write))
        staging = max((op.numel for op in ops if op.stage), default=0)
        devices.append(DeviceProgram(p.device, p.src_shape, p.dst_shape, tuple(ops), staging))
    return Program(program.dtype, program.shape, tuple(devices))


def pull_sources(program: Program) -> dict[int, tuple[int, ...]]:
    """``{device: the devices whose source shards it pulls from}`` (sorted), for devices that pull."""
    out: dict[int, set[int]] = defaultdict(set)
    for p in program.devices:
        for op in p.ops:
            if op.kind is OpKind.PULL:
                out[p.device].add(op.group[0])
    return {d: tuple(sorted(s)) for d, s in out.items()}

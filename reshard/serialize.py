"""msgpack encoding of plans and programs, with a schema version, so the driver ships them cheaply."""

from __future__ import annotations

import msgpack

from reshard.layout import Layout
from reshard.lowering import DeviceProgram, Program
from reshard.placement import Replicate, Shard
from reshard.plan import ReshardPlan, Transfer, TransferKind
from reshard.tasks import UnitTask
from topology.mesh import Mesh

SCHEMA_VERSION = 2  # 2: OpKind.PULL


def _box(obj) -> tuple:
    return tuple(tuple(iv) for iv in obj)


def _layout_obj(layout: Layout) -> list:
    return [layout.mesh.to_msgpack_obj(), [-1 if isinstance(p, Replicate) else p.dim for p in layout.placements]]


def _layout(obj) -> Layout:
    mesh, placements = obj
    return Layout(Mesh.from_msgpack_obj(mesh), tuple(Replicate() if d < 0 else Shard(d) for d in placements))


def _check_version(kind: str, obj) -> list:
    if not isinstance(obj, list) or len(obj) != 3 or obj[0] != kind:
        raise ValueError(f"not an encoded {kind}")
    if obj[1] != SCHEMA_VERSION:
        raise ValueError(f"encoded {kind} has schema version {obj[1]}, this library reads version {SCHEMA_VERSION}")
    return obj[2]


def encode_plan(plan: ReshardPlan) -> bytes:
    body = [
        list(plan.shape), plan.dtype, _layout_obj(plan.src), _layout_obj(plan.dst), plan.strategy,
        [[[list(iv) for iv in t.box], list(t.senders), list(t.receivers), t.size_bytes] for t in plan.tasks],
        [[int(t.kind), [list(iv) for iv in t.box], t.src, list(t.dsts), t.task] for t in plan.transfers],
    ]  # fmt: skip
    return msgpack.packb(["plan", SCHEMA_VERSION, body])


def decode_plan(data: bytes) -> ReshardPlan:
    shape, dtype, src, dst, strategy, tasks, transfers = _check_version("plan", msgpack.unpackb(data))
    return ReshardPlan(
        tuple(shape), dtype, _layout(src), _layout(dst), strategy,
        tuple(UnitTask(_box(b), tuple(s), tuple(r), n) for b, s, r, n in tasks),
        tuple(Transfer(TransferKind(k), _box(b), s, tuple(d), i) for k, b, s, d, i in transfers),
    )  # fmt: skip


def encode_device_program(program: DeviceProgram, dtype: str) -> bytes:
    return msgpack.packb(["device_program", SCHEMA_VERSION, [dtype, program.to_obj()]])


def decode_device_program(data: bytes) -> tuple[str, DeviceProgram]:
    dtype, obj = _check_version("device_program", msgpack.unpackb(data))
    return dtype, DeviceProgram.from_obj(obj)


def encode_program(program: Program) -> bytes:
    body = [program.dtype, list(program.shape), [p.to_obj() for p in program.devices]]
    return msgpack.packb(["program", SCHEMA_VERSION, body])


def decode_program(data: bytes) -> Program:
    dtype, shape, devices = _check_version("program", msgpack.unpackb(data))
    return Program(dtype, tuple(shape), tuple(DeviceProgram.from_obj(p) for p in devices))

"""msgpack encoding of plans and programs, with a schema version, so the driver ships them cheaply.

Ops travel as ``[tag, field, ...]`` in their dataclass field order (``OP_TAGS``); boxes as lists of
``[lo, hi]``, enums as ints.
"""

from __future__ import annotations

from dataclasses import fields

import msgpack

from reshard.ir.batch import BatchDeviceProgram, Bucket, Part, Piece
from reshard.ir.layout import Layout
from reshard.ir.placement import Partial, ReduceOp, Replicate, Shard, StridedShard
from reshard.ir.plan import ReshardPlan, Transfer, TransferKind
from reshard.ir.program import Broadcast, Buffer, Copy, DeviceProgram, Op, Program, Publish, Pull, Recv, Scale, Send
from reshard.ir.tasks import UnitTask
from topology.mesh import Mesh

SCHEMA_VERSION = 7  # 2: pulls; 3: ops as a tagged union, connect order, windows, background ops, plan hosts;
# 4: Partial sources (combining ops, scratch buffer, Scale, transfers' read/write/reduce), zero-filled destinations;
# 5: relays pulled out of destination shards (Publish, Pull.buffer/after, DeviceProgram.relays); 6: batches;
# 7: a batch's distinct part programs and shard metas as tables its parts index

OP_TAGS: dict[type, int] = {Copy: 0, Pull: 1, Send: 2, Recv: 3, Broadcast: 4, Scale: 5, Publish: 6}
_OP_TYPES = {tag: cls for cls, tag in OP_TAGS.items()}
_BOXES = {"read", "write", "box"}


def _box(obj) -> tuple:
    return tuple(tuple(iv) for iv in obj)


def _placement_obj(p) -> list:
    if isinstance(p, StridedShard):
        return ["SS", p.dim, p.split_factor]
    if isinstance(p, Shard):
        return ["S", p.dim]
    if isinstance(p, Partial):
        return ["P", p.reduce_op.value]
    return ["R"]


def _placement(obj):
    kind = obj[0]
    if kind == "SS":
        return StridedShard(obj[1], obj[2])
    return Shard(obj[1]) if kind == "S" else Partial(obj[1]) if kind == "P" else Replicate()


def _layout_obj(layout: Layout) -> list:
    return [layout.mesh.to_msgpack_obj(), [_placement_obj(p) for p in layout.placements]]


def _layout(obj) -> Layout:
    mesh, placements = obj
    return Layout(Mesh.from_msgpack_obj(mesh), tuple(_placement(p) for p in placements))


def _check_version(kind: str, obj) -> list:
    if not isinstance(obj, list) or len(obj) != 3 or obj[0] != kind:
        raise ValueError(f"not an encoded {kind}")
    if obj[1] != SCHEMA_VERSION:
        raise ValueError(f"encoded {kind} has schema version {obj[1]}, this library reads version {SCHEMA_VERSION}")
    return obj[2]


def encode_plan(plan: ReshardPlan) -> bytes:
    body = [
        list(plan.shape),
        plan.dtype,
        _layout_obj(plan.src),
        _layout_obj(plan.dst),
        plan.strategy,
        [
            [
                [list(iv) for iv in t.box],
                list(t.senders),
                list(t.receivers),
                t.size_bytes,
                [list(c) for c in t.contributions],
            ]
            for t in plan.tasks
        ],
        [
            [
                int(t.kind),
                [list(iv) for iv in t.box],
                t.src,
                list(t.dsts),
                t.task,
                t.reduce,
                None if t.read is None else int(t.read),
                int(t.write),
            ]
            for t in plan.transfers
        ],
        [list(pair) for pair in plan.hosts],
    ]
    return msgpack.packb(["plan", SCHEMA_VERSION, body])


def decode_plan(data: bytes) -> ReshardPlan:
    shape, dtype, src, dst, strategy, tasks, transfers, hosts = _check_version("plan", msgpack.unpackb(data))
    return ReshardPlan(
        tuple(shape),
        dtype,
        _layout(src),
        _layout(dst),
        strategy,
        tuple(UnitTask(_box(b), tuple(s), tuple(r), n, tuple(tuple(c) for c in cs)) for b, s, r, n, cs in tasks),
        tuple(
            Transfer(TransferKind(k), _box(b), s, tuple(d), i, red, None if rd is None else Buffer(rd), Buffer(wr))
            for k, b, s, d, i, red, rd, wr in transfers
        ),
        tuple((d, h) for d, h in hosts),
    )


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    """An op type's field names in order, kept (``dataclasses.fields`` costs more than the op)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


def _box_obj(v) -> list:
    return [list(iv) for iv in v]


_BUFFERS = {b.value: b for b in Buffer}
#: Per op field, how its value is written and read (None: as it is); a None value stays None.
_FIELD_CODECS: dict[str, tuple] = {
    **{name: (_box_obj, _box) for name in _BOXES},
    "group": (list, tuple),
    "buffer": (int, _BUFFERS.__getitem__),
    "target": (int, _BUFFERS.__getitem__),
    "reduce": (lambda r: r.value, ReduceOp),
}
_CODECS: dict[type, tuple] = {}


def _codecs(cls: type) -> tuple:
    """``(name, encode, decode)`` of each field of op class ``cls`` (made once per class: a tree's
    programs hold hundreds of thousands of ops)."""
    out = _CODECS.get(cls)
    if out is None:
        out = _CODECS[cls] = tuple((n, *_FIELD_CODECS.get(n, (None, None))) for n in _field_names(cls))
    return out


def op_to_obj(op: Op) -> list:
    out: list = [OP_TAGS[type(op)]]
    for name, encode, _ in _codecs(type(op)):
        v = getattr(op, name)
        out.append(v if v is None or encode is None else encode(v))
    return out


def op_from_obj(obj) -> Op:
    cls = _OP_TYPES[obj[0]]
    return cls(
        *(
            v if v is None or decode is None else decode(v)
            for (_, _, decode), v in zip(_codecs(cls), obj[1:], strict=True)
        )
    )


def _shape(s):
    return None if s is None else tuple(s)


def _list(s):
    return None if s is None else list(s)


def device_program_to_obj(p: DeviceProgram) -> list:
    return [
        p.device,
        _list(p.src_shape),
        _list(p.dst_shape),
        [op_to_obj(op) for op in p.ops],
        p.staging_bytes,
        [list(g) for g in p.connect],
        list(p.windows),
        [op_to_obj(op) for op in p.background],
        p.tmp,
        p.zero_dst,
        [[h, list(s)] for h, s in p.relays],
    ]


def device_program_from_obj(obj) -> DeviceProgram:
    device, src, dst, ops, staging, connect, windows, background, tmp, zero_dst, relays = obj
    return DeviceProgram(
        device,
        _shape(src),
        _shape(dst),
        tuple(op_from_obj(o) for o in ops),
        staging,
        tuple(tuple(g) for g in connect),
        tuple(windows),
        tuple(op_from_obj(o) for o in background),
        tmp,
        zero_dst,
        tuple((h, tuple(s)) for h, s in relays),
    )


def encode_device_program(program: DeviceProgram, dtype: str) -> bytes:
    return msgpack.packb(["device_program", SCHEMA_VERSION, [dtype, device_program_to_obj(program)]])


def decode_device_program(data: bytes) -> tuple[str, DeviceProgram]:
    dtype, obj = _check_version("device_program", msgpack.unpackb(data))
    return dtype, device_program_from_obj(obj)


def encode_program(program: Program) -> bytes:
    body = [program.dtype, list(program.shape), [device_program_to_obj(p) for p in program.devices]]
    return msgpack.packb(["program", SCHEMA_VERSION, body])


def decode_program(data: bytes) -> Program:
    dtype, shape, devices = _check_version("program", msgpack.unpackb(data))
    return Program(dtype, tuple(shape), tuple(device_program_from_obj(p) for p in devices))


def _bucket_obj(b: Bucket) -> list:
    pieces = [[q.tensor, q.step, [list(iv) for iv in q.box], q.offset, q.nbytes] for q in b.pieces]
    return [b.step, list(b.group), pieces, b.nbytes, b.staging]


def _bucket(obj) -> Bucket:
    step, group, pieces, nbytes, staging = obj
    return Bucket(
        step, tuple(group), tuple(Piece(t, s, _box(box), o, n) for t, s, box, o, n in pieces), nbytes, staging
    )


def _meta_obj(meta: dict | None) -> list | None:
    if meta is None:
        return None
    return [
        list(meta["shape"]),
        [_placement_obj(p) for p in meta["placements"]],
        list(meta["mesh_shape"]),
        list(meta["coordinate"]),
    ]


def _meta(obj) -> dict | None:
    if obj is None:
        return None
    shape, placements, mesh_shape, coordinate = obj
    return {
        "shape": tuple(shape),
        "placements": tuple(_placement(p) for p in placements),
        "mesh_shape": tuple(mesh_shape),
        "coordinate": tuple(coordinate),
    }


def encode_batch_device_program(program: BatchDeviceProgram, metas: dict[int, dict] | None = None) -> bytes:
    """One device's part of a batch, with ``metas[tensor]``: what its destination shard of that
    tensor is a shard of (global ``shape``, ``placements``, ``mesh_shape``, ``coordinate``).

    Tensors of one shape and layouts share their program and meta objects (the compiler's caches),
    so each distinct object is encoded once, in a table its parts index: a 20,000-tensor tree has a
    handful of distinct programs per device."""
    metas = metas or {}
    programs: dict[int, int] = {}  # id -> its index in the table
    program_objs: list = []
    meta_ids: dict[int, int] = {}
    meta_objs: list = []
    parts = []
    for p in program.parts:
        k = programs.get(id(p.program))
        if k is None:
            k = programs[id(p.program)] = len(program_objs)
            program_objs.append(device_program_to_obj(p.program))
        meta = metas.get(p.tensor)
        m = meta_ids.get(id(meta))
        if m is None:
            m = meta_ids[id(meta)] = len(meta_objs)
            meta_objs.append(_meta_obj(meta))
        parts.append([p.tensor, p.dtype, k, m])
    body = [
        program.device,
        parts,
        program_objs,
        meta_objs,
        [_bucket_obj(b) for b in program.buckets],
        list(program.windows),
        program.staging_bytes,
        [list(g) for g in program.connect],
    ]
    return msgpack.packb(["batch_device_program", SCHEMA_VERSION, body])


def decode_batch_device_program(data: bytes) -> tuple[BatchDeviceProgram, dict[int, dict]]:
    """``(program, metas)`` as ``encode_batch_device_program`` took them; parts that shared a
    program (or a meta) share one decoded object."""
    device, parts, program_objs, meta_objs, buckets, windows, staging, connect = _check_version(
        "batch_device_program", msgpack.unpackb(data)
    )
    programs = [device_program_from_obj(obj) for obj in program_objs]
    decoded = [_meta(obj) for obj in meta_objs]
    metas = {t: m for t, _, _, k in parts if (m := decoded[k]) is not None}
    program = BatchDeviceProgram(
        device,
        tuple(Part(t, dtype, programs[k]) for t, dtype, k, _ in parts),
        tuple(_bucket(b) for b in buckets),
        tuple(windows),
        staging,
        tuple(tuple(g) for g in connect),
    )
    return program, metas

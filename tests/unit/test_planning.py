"""Property tests of the pure planning layer (no Ray, no torch).

For random meshes (1-D to 3-D, disjoint / overlapping / identical), layouts, uneven shapes,
dtypes and every registered strategy, checked with numpy masks independently of
``reshard.validate``: every destination element arrives exactly once, from a device that holds it
at that point; unit tasks tile every destination region once and name only holders; lowering pairs
every op and runs to completion under blocking in-order execution; plans and programs survive a
msgpack round trip. Plus known tables of torch.chunk semantics.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard import STRATEGIES, Layout, Replicate, Shard, lower_plan, plan_reshard, validate_plan, validate_program
from reshard.dtypes import ITEMSIZE
from reshard.lowering import Buffer, OpKind
from reshard.regions import chunk, layout_regions
from reshard.serialize import (
    decode_device_program,
    decode_plan,
    decode_program,
    encode_device_program,
    encode_plan,
    encode_program,
)
from reshard.tasks import plan_unit_tasks
from topology import Mesh

pytestmark = pytest.mark.unit

HOST_SPAN = 3  # global device d lives on host d // HOST_SPAN in every mesh


# ------------------------------------------------------------------------------------ generators


@st.composite
def mesh_shapes(draw, max_size=8):
    ndim = draw(st.integers(1, 3))
    shape = []
    for _ in range(ndim):
        room = max_size // math.prod(shape) if shape else max_size
        shape.append(draw(st.integers(1, max(1, min(4, room)))))
    return tuple(shape)


def make_mesh(shape, ids) -> Mesh:
    return Mesh(shape, ids, [d // HOST_SPAN for d in ids])


@st.composite
def mesh_pairs(draw):
    src_shape = draw(mesh_shapes())
    dst_shape = draw(mesh_shapes())
    n_src, n_dst = math.prod(src_shape), math.prod(dst_shape)
    src_ids = draw(st.permutations(range(n_src)))
    mode = draw(st.sampled_from(["disjoint", "overlap", "same"]))
    if mode == "same" and dst_shape == src_shape:
        return make_mesh(src_shape, src_ids), make_mesh(src_shape, src_ids)
    if mode == "disjoint":
        dst_ids = [n_src + i for i in draw(st.permutations(range(n_dst)))]
    else:
        universe = list(range(n_src + n_dst))
        dst_ids = draw(st.permutations(universe))[:n_dst]
    return make_mesh(src_shape, src_ids), make_mesh(dst_shape, dst_ids)


def placements(draw, mesh_ndim, tensor_ndim):
    choices = [Replicate()] + [Shard(d) for d in range(tensor_ndim)]
    return tuple(draw(st.sampled_from(choices)) for _ in range(mesh_ndim))


@st.composite
def problems(draw):
    src_mesh, dst_mesh = draw(mesh_pairs())
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    src = Layout(src_mesh, placements(draw, src_mesh.ndim, ndim))
    dst = Layout(dst_mesh, placements(draw, dst_mesh.ndim, ndim))
    dtype = draw(st.sampled_from(sorted(ITEMSIZE)))
    strategy = draw(st.sampled_from(sorted(STRATEGIES)))
    return shape, dtype, src, dst, strategy


# ------------------------------------------------------------------------------------ independent oracles


def torch_chunk_pieces(n: int, k: int) -> list[tuple[int, int]]:
    """torch.chunk semantics, padded to ``k`` pieces: size ceil(n/k) each, trailing ones short or empty."""
    size = -(-n // k) if n else 0
    out = []
    for i in range(k):
        lo = min(i * size, n)
        out.append((lo, min(lo + size, n)))
    return out


def expected_region(layout: Layout, shape, flat: int):
    mesh = layout.mesh
    coords = np.unravel_index(flat, mesh.shape)
    box = []
    for dim, n in enumerate(shape):
        lo, hi = 0, n
        for axis, p in enumerate(layout.placements):
            if isinstance(p, Shard) and p.dim == dim:
                a, b = torch_chunk_pieces(hi - lo, mesh.shape[axis])[coords[axis]]
                lo, hi = lo + a, lo + b
        box.append((lo, hi))
    return tuple(box)


def mask(shape, box) -> np.ndarray:
    m = np.zeros(shape, dtype=bool)
    m[tuple(slice(lo, hi) for lo, hi in box)] = True
    return m


def regions_by_device(layout: Layout, shape) -> dict[int, tuple]:
    return dict(zip(layout.mesh.device_ids, layout_regions(layout, shape), strict=True))


# ------------------------------------------------------------------------------------ properties

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(problems())
def test_regions_follow_torch_chunk(problem):
    shape, _, src, dst, _ = problem
    for layout in (src, dst):
        regions = layout_regions(layout, shape)
        for flat in range(layout.mesh.size):
            assert regions[flat] == expected_region(layout, shape, flat)
        # every element is held by exactly (number of devices / number of distinct regions) devices
        count = np.zeros(shape, dtype=int)
        for box in regions:
            count += mask(shape, box)
        distinct = {b for b in regions if all(hi > lo for lo, hi in b)}
        if math.prod(shape):
            sharded = math.prod(layout.mesh.shape[a] for a, p in enumerate(layout.placements) if isinstance(p, Shard))
            assert (count == layout.mesh.size // sharded).all()
            assert len(distinct) <= sharded


@SETTINGS
@given(problems())
def test_plan_delivers_every_element_once_from_a_holder(problem):
    shape, dtype, src, dst, strategy = problem
    plan = plan_reshard(shape, dtype, src, dst, strategy=strategy)
    src_regions = regions_by_device(src, shape)
    dst_regions = regions_by_device(dst, shape)
    devices = set(src_regions) | set(dst_regions)
    held = {d: mask(shape, src_regions[d]) if d in src_regions else np.zeros(shape, bool) for d in devices}
    got = {d: np.zeros(shape, dtype=int) for d in dst_regions}
    for t in plan.transfers:
        box = mask(shape, t.box)
        assert held[t.src][box].all(), f"{t}: the sender does not hold the box"
        for r in t.dsts:
            assert r in dst_regions, f"{t}: {r} is not a destination device"
            got[r] += box
            held[r] |= box
    for d, region in dst_regions.items():
        assert (got[d] == mask(shape, region)).all(), f"device {d}: elements missing or delivered twice"
    validate_plan(plan)


@SETTINGS
@given(problems())
def test_unit_tasks_tile_destinations_from_holders(problem):
    shape, dtype, src, dst, _ = problem
    tasks = plan_unit_tasks(shape, ITEMSIZE[dtype], src, dst)
    src_regions = regions_by_device(src, shape)
    dst_regions = regions_by_device(dst, shape)
    got = {d: np.zeros(shape, dtype=int) for d in dst_regions}
    for task in tasks:
        box = mask(shape, task.box)
        assert task.size_bytes == int(box.sum()) * ITEMSIZE[dtype]
        assert task.senders and task.receivers
        for s in task.senders:
            assert mask(shape, src_regions[s])[box].all()
        for s, region in src_regions.items():  # every holder is a candidate sender
            if box.any() and mask(shape, region)[box].all():
                assert s in task.senders
        for r in task.receivers:
            got[r] += box
    for d, region in dst_regions.items():
        assert (got[d] == mask(shape, region)).all()


def _blocking_run_completes(program) -> bool:
    """Independent simulation: a step runs once every member's next op is that step."""
    heads = {p.device: 0 for p in program.devices}
    ops = {p.device: p.ops for p in program.devices}
    members = defaultdict(set)
    for p in program.devices:
        for op in p.ops:
            members[op.step].add(p.device)
    progress = True
    while progress:
        progress = False
        waiting = defaultdict(set)
        for d, h in heads.items():
            if h < len(ops[d]):
                waiting[ops[d][h].step].add(d)
        for step, ds in waiting.items():
            if ds == members[step]:
                for d in ds:
                    heads[d] += 1
                progress = True
    return all(h == len(ops[d]) for d, h in heads.items())


@SETTINGS
@given(problems())
def test_lowering_is_paired_cycle_free_and_staged_correctly(problem):
    shape, dtype, src, dst, strategy = problem
    plan = plan_reshard(shape, dtype, src, dst, strategy=strategy)
    program = lower_plan(plan)
    validate_program(program)
    assert _blocking_run_completes(program)
    by_step = defaultdict(dict)
    for p in program.devices:
        steps = [op.step for op in p.ops]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)
        for op in p.ops:
            by_step[op.step][p.device] = op
            buffer_shape = p.dst_shape
            box = op.write
            if op.kind in (OpKind.SEND,) or (op.kind is OpKind.BROADCAST and op.group[0] == p.device):
                box = op.read
                buffer_shape = p.src_shape if op.read_buffer is Buffer.SRC else p.dst_shape
            if op.kind is not OpKind.COPY and box is not None:
                view = np.zeros(buffer_shape, dtype=np.uint8)[tuple(slice(lo, hi) for lo, hi in box)]
                if not op.stage:
                    assert view.flags.c_contiguous, f"{op} reads/writes a strided slice without staging"
                else:
                    assert p.staging_numel >= op.numel
    for step, ops in by_step.items():
        t = plan.transfers[step]
        assert set(ops) == set(t.group)
        kinds = sorted(op.kind.name for op in ops.values())
        expected = {"COPY": ["COPY"], "SEND": ["RECV", "SEND"], "BROADCAST": ["BROADCAST"] * len(t.group)}
        assert kinds == expected[t.kind.name]


@SETTINGS
@given(problems())
def test_msgpack_round_trip(problem):
    shape, dtype, src, dst, strategy = problem
    plan = plan_reshard(shape, dtype, src, dst, strategy=strategy)
    assert decode_plan(encode_plan(plan)) == plan
    program = lower_plan(plan)
    assert decode_program(encode_program(program)) == program
    for p in program.devices:
        assert decode_device_program(encode_device_program(p, program.dtype)) == (program.dtype, p)


# ------------------------------------------------------------------------------------ tables

# (n, k) -> torch.chunk(torch.arange(n), k) piece sizes, padded with empty pieces to k
CHUNK_TABLE = {
    (5, 4): [2, 2, 1, 0],
    (6, 4): [2, 2, 2, 0],
    (10, 4): [3, 3, 3, 1],
    (7, 3): [3, 3, 1],
    (3, 5): [1, 1, 1, 0, 0],
    (1, 2): [1, 0],
    (0, 3): [0, 0, 0],
    (8, 8): [1] * 8,
    (9, 2): [5, 4],
    (13, 6): [3, 3, 3, 3, 1, 0],
}


@pytest.mark.parametrize(("n", "k"), sorted(CHUNK_TABLE))
def test_chunk_matches_torch_chunk_table(n, k):
    pieces = [chunk(0, n, k, i) for i in range(k)]
    assert [hi - lo for lo, hi in pieces] == CHUNK_TABLE[(n, k)]
    assert pieces == torch_chunk_pieces(n, k)
    offset = [chunk(10, 10 + n, k, i) for i in range(k)]
    assert offset == [(lo + 10, hi + 10) for lo, hi in pieces]


REGION_TABLE = [
    # mesh shape, placements, tensor shape, regions by flat index
    ((2, 2), (Shard(0), Shard(0)), (10,), [((0, 3),), ((3, 5),), ((5, 8),), ((8, 10),)]),
    ((2, 2), (Shard(0), Shard(1)), (3, 5), [((0, 2), (0, 3)), ((0, 2), (3, 5)), ((2, 3), (0, 3)), ((2, 3), (3, 5))]),
    ((2, 2), (Replicate(), Shard(1)), (2, 3), [((0, 2), (0, 2)), ((0, 2), (2, 3))] * 2),
    ((4,), (Shard(0),), (5, 2), [((0, 2), (0, 2)), ((2, 4), (0, 2)), ((4, 5), (0, 2)), ((5, 5), (0, 2))]),
    ((2, 2), (Shard(0), Shard(0)), (3,), [((0, 1),), ((1, 2),), ((2, 3),), ((3, 3),)]),
    ((1, 3), (Replicate(), Replicate()), (), [(), (), ()]),
]


@pytest.mark.parametrize(("mesh_shape", "placement", "shape", "regions"), REGION_TABLE)
def test_layout_regions_table(mesh_shape, placement, shape, regions):
    layout = Layout(Mesh(mesh_shape), placement)
    assert list(layout_regions(layout, shape)) == regions


# ------------------------------------------------------------------------------------ pulls


def interpret(program, src_layout, dst_layout, full: np.ndarray) -> dict[int, np.ndarray]:
    """Run every device's program in numpy, step by step in the global order: the destination
    shards it produces. Staged and unstaged slices behave alike here (numpy copies either)."""
    src = {d: full[tuple(slice(lo, hi) for lo, hi in box)].copy()
           for d, box in regions_by_device(src_layout, full.shape).items()}  # fmt: skip
    dst = {p.device: np.zeros(p.dst_shape, full.dtype) for p in program.devices if p.dst_shape is not None}
    by_step = defaultdict(dict)
    for p in program.devices:
        for op in p.ops:
            by_step[op.step][p.device] = op

    def sl(box):
        return tuple(slice(lo, hi) for lo, hi in box)

    for step in sorted(by_step):
        ops = by_step[step]
        root = next(iter(ops.values())).group[0]
        if root in ops:  # a message (or a local copy): the root reads, everybody else writes
            rop = ops[root]
            data = (src[root] if rop.read_buffer is Buffer.SRC else dst[root])[sl(rop.read)].copy()
            for d, op in ops.items():
                if op.write is not None:
                    dst[d][sl(op.write)] = data
        else:  # pulls: every op reads the holder's source shard itself
            for d, op in ops.items():
                assert op.kind is OpKind.PULL
                dst[d][sl(op.write)] = src[root][sl(op.read)]
    return dst


@st.composite
def problems_with_domains(draw):
    problem = draw(problems())
    _, _, src, dst, _ = problem
    devices = sorted(set(src.mesh.device_ids) | set(dst.mesh.device_ids))
    domain_of = {d: draw(st.sampled_from([None, 0, 1])) for d in devices}
    return problem, domain_of


@SETTINGS
@given(problems_with_domains())
def test_pulls_keep_the_program_valid_and_its_result_exact(case):
    from reshard.pulls import pull_sources, pulled_steps, to_pulls

    (shape, dtype, src, dst, strategy), domain_of = case
    plan = plan_reshard(shape, dtype, src, dst, strategy=strategy)
    program = lower_plan(plan)
    pulled = to_pulls(program, domain_of)
    validate_program(pulled)
    assert _blocking_run_completes(pulled)
    full = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    want = {d: full[tuple(slice(lo, hi) for lo, hi in box)] for d, box in regions_by_device(dst, shape).items()}
    for got in (interpret(program, src, dst, full), interpret(pulled, src, dst, full)):
        for d, w in want.items():
            np.testing.assert_array_equal(got[d], w)
    steps = pulled_steps(program, domain_of)
    for p in pulled.devices:
        for op in p.ops:
            if op.kind is OpKind.PULL:
                holder = op.group[0]
                assert op.step in steps and domain_of[holder] is not None
                assert domain_of[holder] == domain_of[p.device]
            elif op.kind is not OpKind.COPY:
                assert op.step not in steps
        assert p.staging_numel == max((op.numel for op in p.ops if op.stage), default=0)
    if all(v is None for v in domain_of.values()):
        assert pulled == program and not pull_sources(pulled)
    assert decode_program(encode_program(pulled)) == pulled


def test_pulls_need_the_holders_source_shard():
    """A relay (the sender forwards from its destination shard) keeps its message; a group that
    leaves the domain keeps its broadcast; the holder of a pulled step runs nothing."""
    from reshard.lowering import DeviceProgram, Op, Program
    from reshard.pulls import to_pulls

    box = ((0, 2),)
    progs = (
        DeviceProgram(0, (2,), None, (Op(OpKind.SEND, 0, (0, 1), (2,), Buffer.SRC, box),), 0),
        DeviceProgram(1, None, (2,), (Op(OpKind.RECV, 0, (0, 1), (2,), None, None, box),
                                      Op(OpKind.BROADCAST, 1, (1, 2, 3), (2,), Buffer.DST, box)), 0),
        DeviceProgram(2, None, (2,), (Op(OpKind.BROADCAST, 1, (1, 2, 3), (2,), None, None, box),), 0),
        DeviceProgram(3, None, (2,), (Op(OpKind.BROADCAST, 1, (1, 2, 3), (2,), None, None, box),), 0),
    )  # fmt: skip
    program = Program("float32", (2,), progs)
    validate_program(program)
    out = to_pulls(program, {0: "a", 1: "a", 2: "a", 3: "b"})
    validate_program(out)
    assert out.devices[0].ops == ()
    assert out.devices[1].ops[0] == Op(OpKind.PULL, 0, (0, 1), (2,), Buffer.SRC, box, box)
    assert [op.kind for op in out.devices[1].ops[1:]] == [OpKind.BROADCAST]  # relay: kept
    assert to_pulls(program, {0: "a", 1: "b"}) == program


def test_validate_rejects_bad_pulls():
    from reshard.errors import PlanError
    from reshard.lowering import DeviceProgram, Op, Program

    def program(read, src_shape=(2,)):
        return Program("float32", (2,), (
            DeviceProgram(0, src_shape, None, (), 0),
            DeviceProgram(1, None, (2,), (Op(OpKind.PULL, 0, (0, 1), (2,), Buffer.SRC, read, ((0, 2),)),), 0),
        ))  # fmt: skip

    validate_program(program(((0, 2),)))
    with pytest.raises(PlanError, match="outside device 0's source shard"):
        validate_program(program(((1, 3),)))
    with pytest.raises(PlanError, match="outside device 0's source shard"):
        validate_program(program(((0, 2),), src_shape=None))

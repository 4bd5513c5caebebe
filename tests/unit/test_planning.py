"""Property tests of the pure planning layer (no Ray, no torch).

For random meshes (1-D to 3-D, disjoint / overlapping / identical), layouts, uneven shapes,
dtypes and every registered strategy, checked with numpy masks independently of
``reshard.passes.validate``: every destination element arrives exactly once, from a device that holds it
at that point; unit tasks tile every destination region once and name only holders; plans survive
a msgpack round trip. Plus known tables of torch.chunk semantics. (Lowered programs:
``test_program.py``.)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from problems import SETTINGS, expected_region, mask, problems, regions_by_device, torch_chunk_pieces

from reshard import Layout, Replicate, Shard, plan_reshard, validate_plan
from reshard.dtypes import ITEMSIZE
from reshard.ir.regions import chunk, layout_regions
from reshard.ir.serialize import decode_plan, encode_plan
from reshard.ir.tasks import plan_unit_tasks
from topology import Mesh

pytestmark = pytest.mark.unit


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


@SETTINGS
@given(problems())
def test_plan_msgpack_round_trip(problem):
    shape, dtype, src, dst, strategy = problem
    plan = plan_reshard(shape, dtype, src, dst, strategy=strategy)
    assert decode_plan(encode_plan(plan)) == plan
    merged = {d: 0 for d in (*src.mesh.device_ids, *dst.mesh.device_ids)}  # one shared-memory machine
    plan = plan_reshard(shape, dtype, src, dst, strategy=strategy, hosts=merged)
    assert decode_plan(encode_plan(plan)) == plan and plan.host_map == merged


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

"""Batches (no Ray, no torch): for random trees of problems over one pair of meshes, packing keeps
every slice, lays pieces out alike on every member of a bucket, stays within the bucket bound and
the staging buffer, survives a msgpack round trip, and an independent interpreter that packs and
unpacks bucket bytes as the executor does, then runs each tensor's program, produces exactly every
destination shard. Pytrees flatten and rebuild as state dicts expect."""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict, namedtuple

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from problems import SETTINGS, mesh_pairs, placements, regions_by_device
from test_program import expected, interpret, sl

from reshard import STRATEGIES, Layout, compile_reshard
from reshard.dtypes import ITEMSIZE, storage_name
from reshard.errors import PlanError
from reshard.ir.batch import PIECE_ALIGN
from reshard.ir.program import Program
from reshard.ir.serialize import decode_batch_device_program
from reshard.passes.compile import BatchItem, compile_batch
from reshard.passes.packing import pack_batch, packable
from reshard.passes.validate import validate_batch
from reshard.pytree import flatten, leaves_in_order_of, same_structure, unflatten

pytestmark = pytest.mark.unit


@st.composite
def batches(draw):
    """Tensors over one pair of meshes; at times devices share memory domains (pulls, relays)."""
    src_mesh, dst_mesh = draw(mesh_pairs())
    devices = sorted(set(src_mesh.device_ids) | set(dst_mesh.device_ids))
    domains = tuple(sorted((d, dom) for d in devices if (dom := draw(st.sampled_from([None, 0, 1]))) is not None))
    items = []
    for _ in range(draw(st.integers(1, 6))):
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
        src = Layout(src_mesh, placements(draw, src_mesh.ndim, ndim)).for_shape(shape)
        dst = Layout(dst_mesh, placements(draw, dst_mesh.ndim, ndim)).for_shape(shape)
        items.append(BatchItem(shape, draw(st.sampled_from(sorted(ITEMSIZE))), src, dst, domains))
    return items, draw(st.sampled_from(sorted(STRATEGIES))), draw(st.sampled_from([1, 64, 400, 1 << 20]))


def full_of(item: BatchItem, seed: int) -> np.ndarray:
    storage = np.dtype(storage_name(item.dtype))
    return (np.arange(math.prod(item.shape)) * 7 + seed).astype(storage).reshape(item.shape)


def interpret_batch(compiled, items, fulls) -> dict[tuple[int, int], np.ndarray]:
    """Every device's buckets in order (the sender packs its pieces into a byte buffer at their
    offsets, each receiver unpacks its own out of it), then each tensor's remaining program
    (``interpret``). Returns ``{(tensor, device): destination shard}``."""
    batch = compiled.program
    landed: dict = {}
    by_step = defaultdict(dict)
    for p in batch.devices:
        for b in p.buckets:
            by_step[b.step][p.device] = b
    src = {
        (t, d): fulls[t][sl(box)]
        for t, item in enumerate(items)
        for d, box in regions_by_device(item.src, item.shape).items()
    }
    for step in sorted(by_step):
        buckets = by_step[step]
        sender = buckets[next(iter(buckets.values())).group[0]]
        wire = np.zeros(sender.nbytes, np.uint8)
        for q in sender.pieces:
            a = src[(q.tensor, sender.group[0])][sl(q.box)]
            wire[q.offset : q.offset + q.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        for d, b in buckets.items():
            if d == sender.group[0]:
                continue
            for q in b.pieces:
                dtype = fulls[q.tensor].dtype
                landed[(q.tensor, d, q.box)] = wire[q.offset : q.offset + q.nbytes].view(dtype)
    out = {}
    for t, item in enumerate(items):
        after_buckets = {}  # what the buckets landed in each destination shard: the parts start from it
        for d, box in regions_by_device(item.dst, item.shape).items():
            shard = np.zeros([hi - lo for lo, hi in box], fulls[t].dtype)
            for (tt, dd, pbox), data in landed.items():
                if (tt, dd) == (t, d):
                    shard[sl(pbox)] = data.reshape([hi - lo for lo, hi in pbox])
            after_buckets[d] = shard
        parts = [p.part(t) for p in batch.devices if p.part(t) is not None]
        program = Program(item.dtype, item.shape, tuple(part.program for part in parts))
        got = interpret(program, item.src, fulls[t], dst_init=after_buckets) if parts else {}
        for d in after_buckets:
            out[(t, d)] = got.get(d, after_buckets[d])
    return out


def spans_of(window) -> list[tuple[int, int]]:
    return [(b.staging, b.staging + b.nbytes) for b in window]


@SETTINGS
@given(batches(), st.sampled_from([1, 4]), st.booleans())
def test_packed_batches_are_valid_and_exact(case, window_ops, double_buffer):
    items, strategy, bucket_bytes = case
    from reshard.passes.compile import CompileOptions

    options = CompileOptions(window_ops=window_ops, double_buffer=double_buffer)
    compiled = compile_batch(items, strategy=strategy, options=options, bucket_bytes=bucket_bytes)
    batch = compiled.program
    validate_batch(batch)
    fulls = [full_of(item, t) for t, item in enumerate(items)]
    got = interpret_batch(compiled, items, fulls)
    holders = defaultdict(list)  # device -> the tensors it holds a shard of afterwards, in order
    for t, item in enumerate(items):
        for d, want in expected(item.dst, fulls[t]).items():
            np.testing.assert_array_equal(got[(t, d)], want, err_msg=f"tensor {t} device {d}")
            holders[d].append(t)
    assert {d: list(ts) for d, ts in compiled.results.items() if ts} == dict(holders)
    packed = [t for t, c in enumerate(compiled.tensors) if packable(c.program, bucket_bytes)]
    for p in batch.devices:
        for b in p.buckets:
            assert all(q.offset % PIECE_ALIGN == 0 for q in b.pieces)
            assert b.nbytes <= bucket_bytes or len(b.pieces) == 1
            assert {q.tensor for q in b.pieces} <= set(packed)
        for part in p.parts:
            if part.tensor in packed:
                assert not part.program.connect and not part.program.staging_bytes
        program, _ = decode_batch_device_program(compiled.blobs[p.device])
        assert program == p
        if double_buffer:  # no window shares a byte of staging with the one before
            windows = p.issue_windows
            for w, nxt in zip(windows, windows[1:], strict=False):
                assert not any(a < f and e < g for a, g in spans_of(w) for e, f in spans_of(nxt))


@pytest.mark.parametrize("double_buffer", [False, True])
def test_double_buffered_windows_alternate_within_the_staging_bound(double_buffer):
    """Forty tensors' slices in 4 KiB buckets from one device to another, windows of 4 buckets
    in 32 KiB of staging: double-buffered, the windows alternate between two regions of at most
    half the bound each (the run packs one while the one before moves, and unpacks one while the
    next moves), else each starts at 0."""
    from reshard import Shard
    from reshard.passes.compile import CompileOptions
    from reshard.runtime.device.batches import prepare_batch
    from topology import Mesh

    src_mesh, dst_mesh = Mesh((1,), (0,), (0,)), Mesh((1,), (1,), (1,))
    item = BatchItem((1024,), "float32", Layout(src_mesh, (Shard(0),)), Layout(dst_mesh, (Shard(0),)))
    options = CompileOptions(window_ops=4, window_staging_bytes=32 << 10, double_buffer=double_buffer)
    compiled = compile_batch([item] * 40, strategy="send_recv", options=options, bucket_bytes=4096)
    validate_batch(compiled.program)
    for d in (0, 1):
        p = compiled.program.for_device(d)
        windows = p.issue_windows
        assert len(windows) == 10 and p.staging_bytes <= 32 << 10
        starts = [w[0].staging for w in windows]
        if double_buffer:
            assert starts == [0, 16 << 10] * 5
            assert all(e <= 16 << 10 for w in windows[::2] for _, e in spans_of(w))
        else:
            assert starts == [0] * 10
        # the sender packs each next window ahead, only where it lies apart; the receiver packs
        # nothing, and unpacks each window but the last while the next one moves
        prepared = prepare_batch(p)
        assert prepared.pack_ahead == (d == 0 and double_buffer,) * 9
        assert prepared.unpack_behind == (d == 1 and double_buffer,) * 9 + (False,)


def test_small_tensors_share_buckets_and_big_ones_stream():
    """Twenty small tensors from 2 to 2 devices without shared memory: a bucket per pair carries all
    their slices, while a tensor over the bound keeps its own messages."""
    from topology import Mesh

    src_mesh, dst_mesh = Mesh((2,), (0, 1), (0, 1)), Mesh((2,), (2, 3), (2, 3))
    from reshard import Replicate, Shard

    small = [BatchItem((64,), "float32", Layout(src_mesh, (Shard(0),)), Layout(dst_mesh, (Shard(0),)))] * 20
    big = BatchItem((1 << 16,), "float32", Layout(src_mesh, (Replicate(),)), Layout(dst_mesh, (Shard(0),)))
    compiled = compile_batch([*small, big], strategy="send_recv", bucket_bytes=64 << 10)
    batch = compiled.program
    assert batch.buckets == 2  # 0 -> 2 and 1 -> 3, every small tensor's slice in them
    assert sum(len(b.pieces) for b in batch.for_device(2).buckets) == 20
    big_part = batch.for_device(2).part(20)
    assert big_part is not None and any(op.step >= 0 for op in big_part.program.ops)
    assert not packable(compiled.tensors[20].program, 64 << 10)


@pytest.mark.parametrize("domains", [(), ((0, 0), (1, 0), (2, 0), (3, 0))], ids=["messages", "pulls"])
def test_tensors_alike_travel_as_one_program_and_one_meta(domains):
    """A tree of many tensors of one shape and layouts, and one other: each device's blob holds
    their program (stripped, where packed) and their shard meta once, and the decoded parts of the
    tensors alike share one program object, equal to what was compiled, with each tensor's meta."""
    import msgpack

    from reshard import Replicate, Shard
    from reshard.passes.compile import shard_meta
    from topology import Mesh

    src_mesh, dst_mesh = Mesh((2,), (0, 1), (0, 1)), Mesh((2,), (2, 3), (2, 3))
    alike = BatchItem((8, 4), "float32", Layout(src_mesh, (Shard(0),)), Layout(dst_mesh, (Shard(1),)), domains)
    other = BatchItem((6,), "int16", Layout(src_mesh, (Replicate(),)), Layout(dst_mesh, (Shard(0),)), domains)
    items = [alike] * 300 + [other]
    compiled = compile_batch(items, strategy="send_recv")
    for p in compiled.program.devices:
        program, metas = decode_batch_device_program(compiled.blobs[p.device])
        assert program == p
        assert len({id(part.program) for part in program.parts if part.tensor < 300}) == 1
        _, _, (_, _, programs, meta_objs, *_) = msgpack.unpackb(compiled.blobs[p.device])
        assert len(programs) == len({id(part.program) for part in p.parts}) <= 2
        assert len(meta_objs) <= 2
        for t, item in enumerate(items):
            if p.device in dst_mesh.device_ids:
                assert metas[t] == shard_meta(item.dst, item.shape)[p.device]


def test_validate_batch_rejects_mismatched_buckets():
    from dataclasses import replace

    from topology import Mesh

    src_mesh, dst_mesh = Mesh((1,), (0,), (0,)), Mesh((1,), (1,), (1,))
    from reshard import Replicate

    item = BatchItem((8,), "int32", Layout(src_mesh, (Replicate(),)), Layout(dst_mesh, (Replicate(),)))
    batch = pack_batch([compile_reshard(item.shape, item.dtype, item.src, item.dst).program] * 2)
    receiver = batch.for_device(1)
    bucket = receiver.buckets[0]
    moved = replace(
        bucket, pieces=(replace(bucket.pieces[0], offset=bucket.pieces[0].offset + PIECE_ALIGN), *bucket.pieces[1:])
    )
    broken = replace(batch, devices=(batch.for_device(0), replace(receiver, buckets=(moved,))))
    with pytest.raises(PlanError, match="pieces reach|lay out different"):
        validate_batch(broken)


def test_pytrees_flatten_and_rebuild_state_dicts():
    Pair = namedtuple("Pair", "a b")
    tree = {"h": [{"w": 1, "b": 2}, {"w": 3, "b": None}], "o": OrderedDict(x=4), "t": (5, Pair(6, 7))}
    leaves, paths, treedef = flatten(tree, lambda x: isinstance(x, int))
    assert leaves == [1, 2, 3, 4, 5, 6, 7]
    assert paths == ["h.0.w", "h.0.b", "h.1.w", "o.x", "t.0", "t.1.a", "t.1.b"]
    rebuilt = unflatten(treedef, [v * 10 for v in leaves])
    assert rebuilt == {"h": [{"w": 10, "b": 20}, {"w": 30, "b": None}], "o": OrderedDict(x=40), "t": (50, Pair(60, 70))}
    assert type(rebuilt["o"]) is OrderedDict and type(rebuilt["t"][1]) is Pair
    assert flatten(5, lambda x: isinstance(x, int))[1] == [""]
    other = {"t": (0, [0, 0]), "o": {"x": 0}, "h": [{"b": 0, "w": 0}, {"w": 0, "b": None}]}
    _, _, other_def = flatten(other, lambda x: isinstance(x, int))
    assert same_structure(treedef, other_def) is None
    assert leaves_in_order_of(treedef, other_def, list(range(7))) == [5, 4, 6, 3, 0, 1, 2]
    assert "keys" in same_structure(treedef, flatten({"h": 1}, lambda x: isinstance(x, int))[2])
    with pytest.raises(TypeError, match="at h.0"):
        flatten({"h": [object()]}, lambda x: isinstance(x, int))
    flat = {"b": 1, 2: 2, "a": 3}  # a flat state dict (taken without walking it): the same as a walk gives
    leaves, paths, flat_def = flatten(flat, lambda x: isinstance(x, int))
    walked = flatten(OrderedDict(flat), lambda x: isinstance(x, int))
    assert (leaves, paths) == walked[:2] == ([1, 2, 3], ["b", "2", "a"])
    assert flat_def.children == walked[2].children and flat_def.keys == walked[2].keys and flat_def.type is dict
    assert unflatten(flat_def, [4, 5, 6]) == {"b": 4, 2: 5, "a": 6} and same_structure(flat_def, walked[2]) is None


def test_relays_of_packed_tensors_are_published_after_the_buckets_and_pulled():
    """A small tensor replicated onto two devices of one machine, from another machine: the plan
    sends it across once and relays it inside (the receiver publishes, its peer pulls). Packed, the
    message rides a bucket; the publication and the pull stay in the tensor's parts; exact."""
    import dataclasses

    from reshard import Replicate
    from reshard.ir.program import Publish, Pull
    from topology import Cluster, Mesh

    src_mesh, dst_mesh = Mesh((1,), (0,), (0,)), Mesh((2,), (1, 2), (1, 1))
    cluster = dataclasses.replace(
        Cluster.for_hosts({0: 0, 1: 1, 2: 1}, nic_GBps=0.12, intra_host_GBps=2.8), latency_us=900, backend="gloo"
    )
    domains = ((1, "b"), (2, "b"))
    items = [
        BatchItem((256, 32), "float32", Layout(src_mesh, (Replicate(),)), Layout(dst_mesh, (Replicate(),)), domains)
    ] * 3
    compiled = compile_batch(items, cluster=cluster, bucket_bytes=1 << 20)
    batch = compiled.program
    assert batch.buckets == 1  # the three tensors' slices cross in one message
    ops = [(d.device, type(op)) for d in batch.devices for part in d.parts for op in part.program.ops]
    assert sum(kind is Publish for _, kind in ops) == 3 and sum(kind is Pull for _, kind in ops) == 3
    fulls = [full_of(item, t) for t, item in enumerate(items)]
    got = interpret_batch(compiled, items, fulls)
    for t in range(3):
        for d in (1, 2):
            np.testing.assert_array_equal(got[(t, d)], fulls[t])


def test_buckets_go_in_host_disjoint_rounds():
    """Eight links between two source hosts and two destination hosts, three buckets each: every
    run of consecutive buckets that one round holds uses each sending host and each receiving host
    once, so the buckets a device issues together cross different links."""
    from collections import deque

    from reshard.passes.packing import _rounds

    hosts = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2, 6: 3, 7: 3}
    groups = [(s, r) for s in (0, 2) for r in (4, 6)] + [(s, r) for s in (1, 3) for r in (5, 7)]
    chunked = [(g, deque([([], 1), ([], 1), ([], 1)])) for g in groups]
    order = [g for g, _, _ in _rounds(chunked, hosts)]
    assert len(order) == 3 * len(groups)
    for k in range(0, len(order), 2):  # two source hosts, two destination hosts: rounds of two
        pair = order[k : k + 2]
        assert len({hosts[s] for s, _ in pair}) == 2 and len({hosts[r] for _, r in pair}) == 2, order

"""A batch's pulls run as one unit on a CPU device (``reshard.runtime.device.host_unit``): trees of
small tensors between two meshes of this machine in many layouts, bit-exact into fresh outputs and
with ``out=``, staged or ``direct``, the unit's parts counted on the devices; larger shards, copied out of peers'
shared blocks into one shared block whose file every new shard names, pulled onward from there; a
source shard let go of behind the caller's back fails the run, naming its holder; and the unit's
read rows against numpy slicing."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from dist_helpers import BIT_PATTERN, assert_bit_exact, pl, random_array
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard import Layout, ReshardError, distribute, free, reshard
from reshard.runtime import runtime_stats
from reshard.runtime.device import cross_memory, host_unit
from reshard.runtime.device.shards import SMALL_SHARD_BYTES
from reshard.runtime.messages import CROSS_MEMORY

pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(not cross_memory.available(), reason="this kernel does not let the user read its processes"),
]

# (shape, source placements, destination placements, dtype): splits that cut rows into short runs,
# uneven splits, 3-D, replicated sources and destinations
TENSORS = {
    "down": ((16, 32), "S0", "S1", "float32"),
    "gate": ((32, 16), "S0", "S0", "float32"),
    "uneven": ((7, 5), "S1", "S0", "float64"),
    "cube": ((4, 6, 10), "S2", "S1", "int16"),
    "bias": ((9,), "R", "S0", "bfloat16"),
    "gathered": ((6, 4), "S0", "R", "int8"),
    "scalar": ((), "R", "R", "float32"),
}


def _unit_parts(ctx) -> int:
    return ctx.counters.get("unit_parts", 0)


def _tree(seed: int) -> dict:
    return {k: random_array(shape, dtype, seed + i) for i, (k, (shape, _, _, dtype)) in enumerate(TENSORS.items())}


def _layouts(mesh, which: int) -> dict:
    return {k: Layout(mesh, pl(spec[1 + which])) for k, spec in TENSORS.items()}


def _zeros(v):
    return np.zeros_like(v) if isinstance(v, np.ndarray) else torch.zeros_like(v)


def _numpy(t):
    return t.to_torch() if t.dtype_name in BIT_PATTERN else t.to_numpy()


def test_a_tree_of_small_tensors_moves_as_one_unit_bit_exact(view):
    a, b = view([0, 1], (2,)), view([2, 3, 4], (3,))
    sd = _tree(10)
    src = distribute(sd, _layouts(a, 0))
    before = b.call(_unit_parts)
    for _ in range(2):  # a first call and a replay (its unit cached)
        out = reshard(src, a, _layouts(b, 1))
        for k, v in sd.items():
            assert_bit_exact(_numpy(out[k]), v)
            assert all(d[0] == CROSS_MEMORY and d[8] is None for d in out[k]._shared.values()), "read, not mapped"
        free(out)
    after = b.call(_unit_parts)
    assert all(n > m for n, m in zip(after, before, strict=True)), (before, after)


def test_tensors_of_one_kind_interleaved_in_a_tree_each_land_as_their_own(view):
    """Three tensors of each kind, interleaved in the tree: a unit lays each kind's destinations
    out together and views them at once, and every tensor still lands bit-exact as its own shard,
    also after one of each kind is freed and the call replayed into the freed block."""
    a, b = view([0, 1], (2,)), view([2, 3, 4], (3,))
    names = [(f"{k}.{j}", k) for j in range(3) for k in TENSORS]
    sd = {n: random_array(TENSORS[k][0], TENSORS[k][3], 40 + i) for i, (n, k) in enumerate(names)}
    src = distribute(sd, {n: Layout(a, pl(TENSORS[k][1])) for n, k in names})
    dst = {n: Layout(b, pl(TENSORS[k][2])) for n, k in names}
    before = b.call(_unit_parts)
    first = reshard(src, a, dst)
    free([first[f"{k}.1"] for k in TENSORS])
    second = reshard(src, a, dst)
    for out in (second, {n: t for n, t in first.items() if not t.freed}):
        for n, t in out.items():
            assert_bit_exact(_numpy(t), sd[n])
    after = b.call(_unit_parts)
    assert all(n - m >= 2 * len(TENSORS) for n, m in zip(after, before, strict=True)), (before, after)


def test_a_unit_commits_into_outputs_and_its_results_move_on(view):
    a, b, c = view([0, 1], (2,)), view([2, 3, 4], (3,)), view([5, 6], (2,))
    sd, new = _tree(20), _tree(30)
    out = distribute({k: _zeros(v) for k, v in sd.items()}, _layouts(b, 1))
    for tree in (sd, new):
        src = distribute(tree, _layouts(a, 0))
        assert reshard(src, a, _layouts(b, 1), out=out) is out
        for k, v in tree.items():
            assert_bit_exact(_numpy(out[k]), v)
        free(src)
    onward = reshard(out, b, _layouts(c, 0))  # the committed outputs are pulled in turn
    for k, v in new.items():
        assert_bit_exact(_numpy(onward[k]), v)


def _units_built(ctx) -> int:
    return ctx.counters.get("units_built", 0)


def test_a_replay_of_the_same_sources_into_other_outputs_shares_their_unit(view):
    """A weight sync's first ``out=`` call reads what the fresh call before it read: its binding is
    shipped as that one's sources with outputs of its own (``Bound.like``), and the unit built for
    that binding is the new binding's too, on every device; another source builds its own."""
    a, b = view([0, 1], (2,)), view([2, 3, 4], (3,))
    sd = _tree(120)
    src = distribute(sd, _layouts(a, 0))
    before = b.call(_units_built)
    out = reshard(src, a, _layouts(b, 1))
    into = distribute({k: _zeros(v) for k, v in sd.items()}, _layouts(b, 1))
    shipped = runtime_stats()
    for outputs in (out, into):
        assert reshard(src, a, _layouts(b, 1), out=outputs) is outputs
        for k, v in sd.items():
            assert_bit_exact(_numpy(outputs[k]), v)
    after = runtime_stats()
    alike = after["bindings_alike"] - shipped.get("bindings_alike", 0)
    assert alike >= 2 * len(b.device_ids) and alike == after["bindings_shipped"] - shipped["bindings_shipped"]
    shared = b.call(_units_built)
    assert all(n == m + 1 for n, m in zip(shared, before, strict=True)), (before, shared)
    new = _tree(130)
    other = distribute(new, _layouts(a, 0))
    assert reshard(other, a, _layouts(b, 1), out=into) is into
    for k, v in new.items():
        assert_bit_exact(_numpy(into[k]), v)
    assert all(n == m + 1 for n, m in zip(b.call(_units_built), shared, strict=True))


def _forget_bindings(ctx) -> int:
    """This device loses the calling controller's bindings, as a device whose cache went would."""
    bindings = ctx.controllers[ctx.caller].bindings
    lost = len(bindings)
    bindings.clear()
    return lost


def test_a_binding_shipped_as_outputs_of_one_the_device_lost_fails_cleanly_then_ships_whole(view):
    """A device without the binding a new one reads as (``Bound.like``) fails the call by name and
    every output keeps its values; the next call ships that device its binding whole, bit-exact."""
    a, b = view([0, 1], (2,)), view([2, 3, 4], (3,))
    sd = _tree(170)
    src = distribute(sd, _layouts(a, 0))
    reshard(src, a, _layouts(b, 1))
    into = distribute({k: _zeros(v) for k, v in sd.items()}, _layouts(b, 1))
    assert b.call(_forget_bindings, devices=[0])[0] >= 1
    with pytest.raises(ReshardError, match="whose sources a new binding reads, is not cached here"):
        reshard(src, a, _layouts(b, 1), out=into)
    for k, v in sd.items():
        assert_bit_exact(_numpy(into[k]), _zeros(v))
    before = runtime_stats()
    assert reshard(src, a, _layouts(b, 1), out=into) is into
    for k, v in sd.items():
        assert_bit_exact(_numpy(into[k]), v)
    after = runtime_stats()
    assert after["bindings_shipped"] > before["bindings_shipped"]
    assert after["bindings_alike"] == before["bindings_alike"]


def _block_commits(ctx) -> int:
    return ctx.counters.get("block_commits", 0)


def test_a_replay_into_the_first_calls_outputs_commits_block_to_block(view):
    """A weight sync's loop: the first call makes the outputs, every replay commits into them.
    Its unit's results are copied block to block on every device, bit-exact; into outputs of
    two calls (not one block's views laid out alike) they are copied one by one, bit-exact too."""
    a, b = view([0, 1], (2,)), view([2, 3, 4], (3,))
    src = distribute(_tree(80), _layouts(a, 0))
    out = reshard(src, a, _layouts(b, 1))
    before = b.call(_block_commits)
    for seed in (90, 100):
        tree = _tree(seed)
        free(src)
        src = distribute(tree, _layouts(a, 0))
        assert reshard(src, a, _layouts(b, 1), out=out) is out
        for k, v in tree.items():
            assert_bit_exact(_numpy(out[k]), v)
    after = b.call(_block_commits)
    assert all(n == m + 2 for n, m in zip(after, before, strict=True)), (before, after)
    other = reshard(src, a, _layouts(b, 1))
    mixed = {k: (out if i % 2 else other)[k] for i, k in enumerate(TENSORS)}
    tree = _tree(110)
    free(src)
    src = distribute(tree, _layouts(a, 0))
    assert reshard(src, a, _layouts(b, 1), out=mixed) is mixed
    for k, v in tree.items():
        assert_bit_exact(_numpy(mixed[k]), v)
    assert b.call(_block_commits) == after


def _block_delivers(ctx) -> int:
    return ctx.counters.get("block_delivers", 0)


def test_a_direct_replay_into_the_first_calls_outputs_delivers_block_to_block(view):
    """``direct=True`` into the outputs of the tree's first call: the unit's results are copied
    into them block to block on every device, bit-exact; into outputs of two calls one by one."""
    a, b = view([0, 1], (2,)), view([2, 3, 4], (3,))
    src = distribute(_tree(140), _layouts(a, 0))
    out = reshard(src, a, _layouts(b, 1))
    other = reshard(src, a, _layouts(b, 1))
    mixed = {k: (out if i % 2 else other)[k] for i, k in enumerate(TENSORS)}
    before = b.call(_block_delivers)
    for seed, outputs, blocks in ((150, out, 1), (160, mixed, 0)):
        tree = _tree(seed)
        free(src)
        src = distribute(tree, _layouts(a, 0))
        assert reshard(src, a, _layouts(b, 1), out=outputs, direct=True) is outputs
        for k, v in tree.items():
            assert_bit_exact(_numpy(outputs[k]), v)
        after = b.call(_block_delivers)
        assert all(n == m + blocks for n, m in zip(after, before, strict=True)), (seed, before, after)
        before = after


@pytest.mark.parametrize("shared_memory", [True, False], ids=["pulls", "buckets"])
def test_a_direct_write_runs_as_a_unit_and_delivers_every_output(view, shared_memory):
    """``direct=True`` into existing outputs: the small tensors run as one unit (pulled, or landed
    out of gloo buckets) and are copied into the user's tensors, bit-exact, first call and replay."""
    a, b = view([0, 1], (2,)), view([2, 3, 4], (3,))
    out = distribute({k: _zeros(v) for k, v in _tree(50).items()}, _layouts(b, 1))
    before = b.call(_unit_parts)
    for seed in (60, 70):
        tree = _tree(seed)
        src = distribute(tree, _layouts(a, 0))
        assert reshard(src, a, _layouts(b, 1), out=out, direct=True, shared_memory=shared_memory) is out
        for k, v in tree.items():
            assert_bit_exact(_numpy(out[k]), v)
        free(src)
    assert all(n > m for n, m in zip(b.call(_unit_parts), before, strict=True))


def _sender_parts(ctx) -> int:
    return ctx.counters.get("sender_parts", 0)


def test_buckets_land_in_the_unit_and_senders_pack_without_a_run_each(view):
    """Over gloo (no pulls), a tree's pieces travel in buckets: each receiver lands them in its
    unit's block (rows copied out of the staging buffer), each sender packs them straight out of
    its source shards, bit-exact into fresh outputs (first call and replay), with ``out=``, and
    between overlapping meshes, where a device sends and receives pieces of one tensor."""
    a, b = view([0, 1], (2,)), view([2, 3, 4], (3,))
    sd = _tree(40)
    src = distribute(sd, _layouts(a, 0))
    units, senders = b.call(_unit_parts), a.call(_sender_parts)
    for _ in range(2):
        out = reshard(src, a, _layouts(b, 1), shared_memory=False)
        for k, v in sd.items():
            assert_bit_exact(_numpy(out[k]), v)
        free(out)
    assert all(n > m for n, m in zip(b.call(_unit_parts), units, strict=True))
    assert all(n > m for n, m in zip(a.call(_sender_parts), senders, strict=True))
    out = distribute({k: _zeros(v) for k, v in sd.items()}, _layouts(b, 1))
    assert reshard(src, a, _layouts(b, 1), out=out, shared_memory=False) is out
    for k, v in sd.items():
        assert_bit_exact(_numpy(out[k]), v)
    c = view([1, 2, 3], (3,))  # device 1 sends to and receives from the others
    moved = reshard(src, a, _layouts(c, 1), shared_memory=False)
    for k, v in sd.items():
        assert_bit_exact(_numpy(moved[k]), v)


# shards of 21-128 KiB: above SMALL_SHARD_BYTES (sources in shared blocks), below UNIT_MAX_BYTES
MIDDLE = {
    "wide": ((64, 256), "S0", "S1", "float32"),
    "tall": ((512, 64), "S1", "S0", "float32"),
    "halves": ((96, 128), "S0", "R", "float64"),
}


def test_larger_shards_are_copied_into_one_shared_block_that_peers_map(view):
    a, b, c = view([0, 1], (2,)), view([2, 3, 4], (3,)), view([5, 6], (2,))
    sd = {k: random_array(shape, dtype, 50 + i) for i, (k, (shape, _, _, dtype)) in enumerate(MIDDLE.items())}
    src = distribute(sd, {k: Layout(a, pl(spec[1])) for k, spec in MIDDLE.items()})
    assert all(sd[k].nbytes // (1 if spec[2] == "R" else 3) > SMALL_SHARD_BYTES for k, spec in MIDDLE.items())
    for t in src.values():
        assert all(len(d) == 5 for d in t._shared.values()), "sources of this size fill shared blocks of their own"
    before = b.call(_unit_parts)
    out = reshard(src, a, {k: Layout(b, pl(spec[2])) for k, spec in MIDDLE.items()})
    assert [n - m for n, m in zip(b.call(_unit_parts), before, strict=True)] == [3, 3, 3]
    for d in b.device_ids:
        files = {out[k]._shared[d][8][:2] for k in MIDDLE}
        assert all(out[k]._shared[d][0] == CROSS_MEMORY for k in MIDDLE) and len(files) == 1, files
    for k, v in sd.items():
        assert_bit_exact(out[k].to_numpy(), v)
    onward = reshard(out, b, {k: Layout(c, pl(spec[1])) for k, spec in MIDDLE.items()})  # mapped by the next pullers
    for k, v in sd.items():
        assert_bit_exact(onward[k].to_numpy(), v)


def _drop(ctx, name: str) -> None:
    ctx.store.free(name)


def test_a_source_let_go_of_behind_the_callers_back_fails_the_unit_naming_its_holder(view):
    a, b = view([0, 1], (2,)), view([2, 3, 4], (3,))
    src = distribute(_tree(40), _layouts(a, 0))
    free(reshard(src, a, _layouts(b, 1)))
    a.call(_drop, src["down"].name, devices=[1])  # as another process's handle would
    with pytest.raises(ReshardError, match=f"device {a.device_ids[1]}'s source shard is gone"):
        reshard(src, a, _layouts(b, 1))


def test_a_senders_source_let_go_of_fails_the_gloo_run_naming_it_and_the_rest_still_moves(view):
    """Over gloo, a sender whose source shard is gone (as another process's handle would free it)
    fails the run, naming its device and the shard, even with its shards lent without a ``Run``
    and the receivers' unit cached; the other tensors then move bit-exact."""
    a, b = view([0, 1], (2,)), view([2, 3, 4], (3,))
    sd = _tree(50)
    src = distribute(sd, _layouts(a, 0))
    free(reshard(src, a, _layouts(b, 1), shared_memory=False))  # the unit and the lent senders cached
    a.call(_drop, src["down"].name, devices=[1])
    with pytest.raises(
        ReshardError, match=rf"device {a.device_ids[1]}: source shard .*{src['down'].name}.* is missing"
    ):
        reshard(src, a, _layouts(b, 1), shared_memory=False)
    rest = {k: v for k, v in src.items() if k != "down"}
    out = reshard(rest, a, {k: v for k, v in _layouts(b, 1).items() if k != "down"}, shared_memory=False)
    for k, t in out.items():
        assert_bit_exact(_numpy(t), sd[k])


@st.composite
def _pairs(draw):
    """A box of one shape, placed in two arrays that hold it."""
    box = draw(st.lists(st.integers(0, 5), min_size=0, max_size=4))
    src, dst, read, write = [], [], [], []
    for n in box:
        for shape, where in ((src, read), (dst, write)):
            lo = draw(st.integers(0, 3))
            shape.append(lo + n + draw(st.integers(0, 3)))
            where.append((lo, lo + n))
    return tuple(src), tuple(dst), tuple(read), tuple(write)


@settings(max_examples=300, deadline=None)
@given(_pairs(), st.sampled_from([1, 2, 8]))
def test_the_read_rows_copy_what_numpy_slicing_does(pair, itemsize):
    """The kernel reads the remote rows as one stream of bytes and writes it over the local rows in
    order; the rows of a pull, so read, write what numpy's slicing does (gaps into scratch)."""
    src_shape, dst_shape, read, write = pair
    dtype = {1: np.uint8, 2: np.uint16, 8: np.uint64}[itemsize]
    a = np.arange(int(np.prod(src_shape)), dtype=dtype).reshape(src_shape)
    got, want = np.zeros(dst_shape, dtype), np.zeros(dst_shape, dtype)
    rows = host_unit.rows_of(src_shape, dst_shape, itemsize, read, write)
    raw_a, raw_got = a.reshape(-1).view(np.uint8), got.reshape(-1).view(np.uint8)
    stream = np.concatenate([raw_a[o : o + n] for o, n in rows.remote.tolist()] or [np.zeros(0, np.uint8)])
    at = 0
    for (o, n), trash in zip(rows.local.tolist(), rows.trash.tolist(), strict=True):
        if trash:
            assert n <= host_unit.GAP_BYTES
        else:
            raw_got[o : o + n] = stream[at : at + n]
        at += n
    assert at == len(stream) and int(rows.per_span.sum()) == len(rows.local) == len(rows.trash)
    assert len(rows.per_span) == len(rows.remote) and rows.per_span.max(initial=0) < 2 * host_unit.SPAN_RUNS
    want[tuple(slice(lo, hi) for lo, hi in write)] = a[tuple(slice(lo, hi) for lo, hi in read)]
    np.testing.assert_array_equal(got, want)


def test_short_runs_close_together_are_read_as_spans():
    """A column block of a row-major shard (a row-parallel weight's slice): one span row, the gaps
    between its runs into scratch, instead of one row out of the holder per run."""
    rows = host_unit.rows_of((8, 32), (16, 8), 4, ((0, 8), (8, 16)), ((0, 8), (0, 8)))
    assert rows.remote.tolist() == [[32, 7 * 128 + 32]]
    assert len(rows.local) == 15 and rows.trash.sum() == 7
    wide = host_unit.rows_of((8, 4096), (8, 8), 4, ((0, 8), (0, 8)), ((0, 8), (0, 8)))
    assert len(wide.remote) == 8 and not wide.trash.any()  # runs 16 KiB apart: a row each


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2 * host_unit.SHARD_GAP_BYTES), _pairs()), min_size=1, max_size=10), st.randoms()
)
def test_shards_lying_close_together_are_read_as_one_span_and_land_as_listed(shards, rnd):
    """Pulls out of shards a holder allocated one after another (gaps up to twice ``SHARD_GAP_BYTES``),
    listed in any order: the merged spans read (by the kernel, out of this process) what the
    listed ones read, and what numpy's slicing copies; fewer remote rows where any merged."""
    itemsize, at, arrays, reads = 4, 0, [], []
    for gap, (src_shape, dst_shape, read, write) in shards:
        at += gap
        a = (np.arange(int(np.prod(src_shape)), dtype=np.uint32) + 1000 * len(arrays)).reshape(src_shape)
        arrays.append((at, a, dst_shape, read, write))
        at += a.nbytes
    rnd.shuffle(arrays)  # the parts' order is not the holder's
    mem = np.zeros(at + 64, np.uint8)
    block = np.zeros(sum(-(-int(np.prod(d)) * itemsize // 64) * 64 + 64 for _, _, d, _, _ in arrays), np.uint8)
    want, places = np.zeros_like(block), []
    for at, a, dst_shape, read, write in arrays:
        mem[at : at + a.nbytes] = a.reshape(-1).view(np.uint8)
        place = sum(-(-int(np.prod(d)) * itemsize // 64) * 64 + 64 for _, _, d, _, _ in arrays[: len(places)])
        places.append(place)
        out = want[place : place + int(np.prod(dst_shape)) * itemsize].view(np.uint32).reshape(dst_shape)
        out[tuple(slice(*b) for b in write)] = a[tuple(slice(*b) for b in read)]
        reads.append((mem.ctypes.data + at, host_unit.rows_of(a.shape, dst_shape, itemsize, read, write)))
    source = host_unit.source_of((1, os.getpid(), 0, 0), [1] * len(reads), [1] * len(reads), reads, places)
    scratch = np.zeros(max(host_unit.GAP_BYTES, host_unit.SHARD_GAP_BYTES), np.uint8)
    where = (scratch.ctypes.data, block.ctypes.data)
    assert host_unit._read(source, where) is None
    np.testing.assert_array_equal(block, want)
    other = np.zeros_like(block)  # another block: its rows worked out again
    assert host_unit._read(source, (scratch.ctypes.data, other.ctypes.data)) is None
    np.testing.assert_array_equal(other, want)
    if source.unmerged is not None:
        assert len(source.remote) < len(source.unmerged.remote)
        block[:] = 0
        assert host_unit._read(source.unmerged, where) is None
        np.testing.assert_array_equal(block, want)
    for first, end, local_first, local_end, nbytes in source.calls:
        assert 0 < end - first <= cross_memory.IOV_MAX and 0 < local_end - local_first <= cross_memory.IOV_MAX
        assert nbytes == int(source.remote[first:end, 1].sum()) == int(source.local[local_first:local_end, 1].sum())


def test_a_run_of_thousands_of_adjacent_shards_merges_into_spans_that_fit_a_call():
    rows = host_unit.rows_of((8, 32), (16, 8), 4, ((0, 8), (8, 16)), ((0, 8), (0, 8)))  # a span, 15 local rows
    n = 3000
    s = host_unit.source_of(
        (1, 2, 3, 4), [1] * n, [5] * n, [(1024 * i, rows) for i in range(n)], [512 * i for i in range(n)]
    )
    assert s.unmerged is not None and len(s.unmerged.remote) == n
    assert len(s.remote) <= -(-n * 16 // host_unit.MERGED_ROWS) + 1, "about MERGED_ROWS local rows a span"
    assert all(0 < local_end - local_first <= cross_memory.IOV_MAX for _, _, local_first, local_end, _ in s.calls)
    assert int(s.remote[:, 1].sum()) == int(s.local[:, 1].sum())


def test_a_sources_calls_cover_its_rows_at_most_iov_max_a_side():
    rows = host_unit.rows_of((8, 32), (16, 8), 4, ((0, 8), (8, 16)), ((0, 8), (0, 8)))  # a span, 15 local rows
    n = 300
    s = host_unit.source_of(
        (1, 2, 3, 4), [1] * n, [5] * n, [((1 << 20) * i, rows) for i in range(n)], [512 * i for i in range(n)]
    )
    assert [c[0] for c in s.calls] == [0, *(c[1] for c in s.calls[:-1])] and s.calls[-1][1] == n
    assert [c[2] for c in s.calls] == [0, *(c[3] for c in s.calls[:-1])] and s.calls[-1][3] == n * 15
    for first, end, local_first, local_end, nbytes in s.calls:
        assert 0 < end - first <= cross_memory.IOV_MAX and 0 < local_end - local_first <= cross_memory.IOV_MAX
        assert nbytes == int(s.remote[first:end, 1].sum()) == int(s.local[local_first:local_end, 1].sum())
    assert s.remote[:, 0].tolist() == [(1 << 20) * i + 32 for i in range(n)]
    assert s.local[~s.trash, 0].tolist()[:16] == [32 * k for k in range(8)] + [512 + 32 * k for k in range(8)]


def test_spans_of_shards_a_little_more_than_a_runs_gap_apart_merge():
    """The row-parallel slices of every third of a MoE expert's shards lie a little over
    ``GAP_BYTES`` apart: spans of different shards merge up to ``SHARD_GAP_BYTES`` apart."""
    rows = host_unit.rows_of((8, 32), (16, 8), 4, ((0, 8), (8, 16)), ((0, 8), (0, 8)))  # a span of 928 bytes
    near = host_unit.source_of((1, 2, 3, 4), [1, 1], [5, 5], [(0, rows), (3072, rows)], [0, 512])
    assert host_unit.GAP_BYTES < 3072 - 928 <= host_unit.SHARD_GAP_BYTES
    assert near.remote.tolist() == [[32, 3072 + 928]]
    far = host_unit.source_of((1, 2, 3, 4), [1, 1], [5, 5], [(0, rows), (8192, rows)], [0, 512])
    assert far.remote.tolist() == [[32, 928], [8192 + 32, 928]]

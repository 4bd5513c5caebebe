"""A device's shard memory without Ray: the tenure that retires a dropped shard's shared-memory
descriptors before its memory is reused (``reshard.runtime.device.shared_memory``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from reshard.errors import ReshardError
from reshard.runtime import arrays
from reshard.runtime.device import cross_memory
from reshard.runtime.device.shards import PlacedShards, ShardStore
from reshard.runtime.device.shared_memory import PeerShards, SharedShards
from reshard.runtime.messages import maps_shared

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not SharedShards.available(), reason="needs memfd and /proc (Linux)"),
]

BIG = 2 << 20


def store(pool_bytes: int = 64 << 20) -> ShardStore:
    return ShardStore(0, "cpu", pool_bytes, shared=SharedShards())


def test_a_dropped_shards_descriptor_stops_mapping_before_its_memory_is_reused():
    s = store()
    t = s.allocate((BIG,), "uint8")
    t[:] = 1
    s.put("t", t, "h", arrays.dtype_of(t))
    desc = s.descriptor(t)
    peers = PeerShards(1)
    assert peers.get(0, desc, np.dtype(np.uint8)).all()
    del t
    s.free("t")
    with pytest.raises(ReshardError, match="gone"):
        peers.check(0, desc)
    reused = s.allocate((BIG,), "uint8")  # the pooled block comes back: another shard's bytes
    assert s.memory()["pool_hits"] == 1
    reused[:] = 2
    s.put("u", reused, "h", arrays.dtype_of(reused))
    with pytest.raises(ReshardError, match="gone"):
        peers.get(0, desc, np.dtype(np.uint8))


def test_pulls_asked_for_on_every_run_keep_their_views_and_check_every_tenure_each_time():
    s, peers = store(), PeerShards(1)
    made = []
    for i in range(3):
        t = s.allocate((BIG // 4,), "float32")
        t[:] = i
        s.put(f"t{i}", t, "h", "float32")
        made.append(t)
    wanted = tuple((0, s.descriptor(t), np.dtype(np.float32)) for t in made)
    first = peers.get_all(wanted)
    assert [float(v[7]) for v in first] == [0.0, 1.0, 2.0]
    assert peers.get_all(wanted) is first, "kept while their mappings are"
    peers.check_all(wanted)
    s.free("t1")
    for ask in (peers.check_all, peers.get_all):
        with pytest.raises(ReshardError, match="gone"):
            ask(wanted)
    peers.purge(full=False)  # the dropped shard's mapping goes, and what was kept with it
    with pytest.raises(ReshardError, match="gone"):
        peers.get_all(wanted)
    assert [float(v[7]) for v in peers.get_all(wanted[::2])] == [0.0, 2.0], "the others still read"


def test_an_assembled_destination_becomes_a_shared_shard_of_its_own():
    s = ShardStore(0, "cpu", 64 << 20, shared=SharedShards(), assembly_bytes=8 << 20)
    t = s.allocate_destination((BIG // 4,), "float32")
    assert s.assembled(t) and s.descriptor(t) is None  # private scratch: peers cannot map it yet
    t[:] = np.arange(t.size, dtype=np.float32)
    assert s.allocate_destination((BIG // 4,), "float32") is not None  # busy: the next is made in place
    assert not s.assembled(s.allocate_destination((BIG // 4,), "float32"))
    shard = s.settle(t)
    assert not s.assembled(shard) and shard.shape == t.shape and shard.dtype == t.dtype
    s.put("t", shard, "h", arrays.dtype_of(shard))
    desc = s.descriptor(shard)
    assert desc is not None  # now in shared memory: peers pull from it
    np.testing.assert_array_equal(PeerShards(1).get(0, desc, np.dtype(np.float32)), np.arange(t.size, dtype=np.float32))
    assert s.memory()["assembly_bytes"] == BIG  # kept warm for the next destination
    again = s.allocate_destination((BIG // 8,), "float32")
    assert s.assembled(again) and np.shares_memory(again, t)  # the same buffer, not grown


def test_assembly_bounds_and_the_pool_come_first():
    s = ShardStore(0, "cpu", 64 << 20, shared=SharedShards(), assembly_bytes=BIG)
    assert not s.assembled(s.allocate_destination((BIG + 1,), "uint8"))  # over the bound: in place
    assert not s.assembled(s.allocate_destination((1024,), "uint8"))  # small: in place
    t = s.allocate_destination((BIG,), "uint8")
    assert s.assembled(t)
    s.abandon(t)  # the run failed: the buffer is free again, no shard was made
    assert s.memory()["buffers"] == {}
    freed = s.allocate((BIG,), "uint8")
    s.put("f", freed, "h", arrays.dtype_of(freed))
    del freed
    s.free("f")
    assert not s.assembled(s.allocate_destination((BIG,), "uint8"))  # the pool's freed block instead
    assert s.memory()["pool_hits"] == 1
    private = ShardStore(0, "cpu", 0, shared=None, assembly_bytes=BIG)
    assert not private.assembled(private.allocate_destination((BIG,), "uint8"))  # nothing to assemble for


def test_empty_cache_frees_the_pool_and_the_idle_assembly_buffer_only():
    s = ShardStore(0, "cpu", 64 << 20, shared=SharedShards(), assembly_bytes=BIG)
    live = s.allocate((BIG,), "uint8")
    s.put("live", live, "h", arrays.dtype_of(live))
    freed = s.allocate((BIG,), "uint8")
    s.put("f", freed, "h", arrays.dtype_of(freed))
    del freed
    s.free("f")
    t = s.allocate_destination((BIG // 2,), "uint8")
    assert s.assembled(t)
    assert s.empty_cache() == BIG  # the pool's block; the assembly buffer is in use
    assert s.memory()["pool_bytes"] == 0 and s.memory()["assembly_bytes"] == BIG // 2
    shard = s.settle(t)
    assert s.empty_cache() == BIG // 2  # now idle: freed
    assert s.memory()["assembly_bytes"] == 0
    assert s.memory()["buffers"] == {"live": BIG}  # live shards untouched
    assert s.empty_cache() == 0
    assert s.assembled(s.allocate_destination(shard.shape, "uint8"))  # made again when needed


def test_a_runs_scratch_goes_back_to_the_pool_once_nothing_else_holds_it():
    s = store()
    scratch = s.allocate((BIG // 4,), "float32")
    view = scratch[1:]
    assert not s.recycle(scratch)  # a view of it is alive: kept out of the pool
    del view
    assert s.recycle(scratch) and s.memory()["pool_bytes"] == BIG
    again = s.allocate((BIG // 4,), "float32")
    assert s.memory()["pool_hits"] == 1 and np.shares_memory(again, scratch)  # warm memory, reused
    assert not s.recycle(None)


@pytest.mark.skipif(not cross_memory.available(), reason="peers may not read this process's memory")
def test_shards_past_the_block_budget_stay_private_and_peers_still_read_them():
    s = ShardStore(0, "cpu", 0, shared=SharedShards(max_blocks=2))
    peers, before = PeerShards(1), len(os.listdir("/proc/self/fd"))
    made = []
    for i in range(5):
        t = s.allocate_destination((64, 256), "float32")  # 64 KiB: a block of its own while there is room
        t[:] = i
        s.put(f"t{i}", t, "h", "float32")
        made.append(t)
    descs = [s.descriptor(t) for t in made]
    assert [maps_shared(d) for d in descs] == [True, True, False, False, False]
    assert len(os.listdir("/proc/self/fd")) == before + 4  # two blocks, two descriptors each (file, mapping)
    for i, d in enumerate(descs):
        got = peers.get(0, d, np.dtype(np.float32))
        np.testing.assert_array_equal(got[2:4, 5:9], np.full((2, 4), i, np.float32))


@pytest.mark.skipif(not cross_memory.available(), reason="peers may not read this process's memory")
def test_idle_pooled_blocks_give_way_to_new_shards_at_the_block_budget():
    s = ShardStore(0, "cpu", 64 << 20, shared=SharedShards(max_blocks=2))
    for i in range(2):
        s.put(f"old{i}", s.allocate_destination((64, 256), "float32"), "h", "float32")
    s.free("old0")
    s.free("old1")  # both blocks idle in the pool: the budget is full of them
    t = s.allocate_destination((32, 256), "float32")  # another size: the pool has none of it
    s.put("new", t, "h", "float32")
    assert maps_shared(s.descriptor(t))  # a block of its own: an idle one was freed for it
    assert len(s.shared.blocks) == 2 and s.memory()["pool_bytes"] == 64 << 10


def _placed(s: ShardStore, run: str, n: int, meta=None) -> PlacedShards:
    block, _ = s.allocate_block(64 * n, False)
    views = _unit_views(block, n)
    for i, v in enumerate(views):
        v[:] = i
    shape = (16,)
    return PlacedShards(
        run,
        views,
        ("float32",) * n,
        None if meta is None else [meta] * n,
        [block.ctypes.data + 64 * i for i in range(n)],
        (64,) * n,
        [None] * n,
        tuple(range(n)),
        np.zeros(n, np.int32),
        (shape,),
        [shape] * n,
    )


def _kept(s: ShardStore, run: str, placed: PlacedShards) -> list:
    """``put_run`` of a unit's shards: their descriptors, one each."""
    kept = s.put_run(run, [], placed)
    assert kept is not None and kept[0] == []
    columns = kept[1]
    if isinstance(columns, list):
        return columns
    assert list(columns.tensors) == list(placed.tensors)
    return [columns.descriptor(k) for k in range(len(columns.tensors))]


@pytest.mark.skipif(not cross_memory.available(), reason="peers may not read this process's memory")
def test_a_units_shards_are_kept_at_once_and_each_reads_until_it_is_dropped():
    s, peers = store(), PeerShards(1)
    placed = _placed(s, "r", 6, meta={"shape": [96]})
    descs = _kept(s, "r", placed)
    assert descs == [s.descriptor(v) for v in placed.views], "what a shard's own descriptor says"
    assert len({d[4] for d in descs}) == 6 and len({d[5] for d in descs}) == 6, "a cell and a tenure each"
    assert s.holders["r/3"] == ("r/3",) and s.dtype("r/3") == "float32" and s.meta["r/3"] == {"shape": [96]}
    for i, d in enumerate(descs):
        np.testing.assert_array_equal(peers.get(0, d, np.dtype(np.float32))[:], np.full(16, i, np.float32))
    s.release("r/2", "r/2")
    with pytest.raises(ReshardError, match="gone"):
        peers.check(0, descs[2])
    for d in descs[:2] + descs[3:]:
        peers.check(0, d)


@pytest.mark.skipif(not cross_memory.available(), reason="peers may not read this process's memory")
def test_freeing_a_units_shards_at_once_ends_each_tenure_and_leaves_the_others():
    s, peers = store(), PeerShards(1)
    placed = _placed(s, "r", 4)
    descs = _kept(s, "r", placed)
    own = s.allocate((BIG,), "uint8")
    s.put("own", own, "own", "uint8")
    own_desc = s.descriptor(own)
    for d in (*descs, own_desc):  # read once: a check looks at what was read
        peers.get(0, d, np.dtype(np.uint8))
    free_cells = len(s.shared.private._free)
    assert s.free_many(["r/0", "r/2", "own", "r/0", "missing"]) == 3
    assert "r/0" not in s and "r/2" not in s and "own" not in s and "r/1" in s and "r/0" not in s.placed
    for gone in (descs[0], descs[2], own_desc):
        with pytest.raises(ReshardError, match="gone"):
            peers.check(0, gone)
    for kept in (descs[1], descs[3]):
        peers.check(0, kept)
    assert len(s.shared.private._free) == free_cells + 2, "the cells are free for the next shards"


@pytest.mark.skipif(not cross_memory.available(), reason="peers may not read this process's memory")
def test_a_unit_larger_than_the_free_cells_gets_descriptors_for_those_it_fits():
    s = store()
    board = s.shared.private
    del board._free[2:]  # two cells left
    descs = _kept(s, "r", _placed(s, "r", 4))
    assert [d is not None for d in descs] == [True, True, False, False]
    assert "r/3" in s, "kept: only peers cannot read it (it moves through the backend)"
    s.tombstone("late/1")  # given up on by its name (a load's)
    assert _kept(s, "late", _placed(s, "late", 2)) == [None, None]
    assert "late/0" in s and "late/1" not in s
    s.tombstone("aborted")
    assert s.put_run("aborted", [], _placed(s, "aborted", 2)) is None and "aborted/0" not in s


def test_a_units_staged_results_are_one_entry_read_by_name_and_dropped_with_the_run_or_its_process():
    """Results staged for a commit (``put_run(staged=True)``): no named shard, no tenure, no
    descriptor; the commit reads them by name beside the run's other staged results, and
    ``free_staged`` drops them all; a process that ended lets go of its runs' staged results."""
    s = store()
    cells = len(s.shared.private._free)
    placed = _placed(s, "c:1", 3)
    big = s.allocate((BIG,), "uint8")
    kept = s.put_run("c:1", [("c:1/3", big, "uint8", None, False)], placed, staged=True)
    assert kept is not None and kept[1] == [None, None, None]
    assert "c:1/0" not in s and "c:1/3" in s and len(s.shared.private._free) == cells
    found, dtypes, shapes = s.staged_results("c:1", [2, 3, 9])
    assert found[0] is placed.views[2] and found[1] is big and found[2] is None
    assert dtypes == ["float32", "uint8", None]
    assert shapes == [placed.views[2].shape, (BIG,), None]
    found, dtypes, shapes = s.staged_results("c:1", [1, 0])  # all the unit's
    assert found[0] is placed.views[1] and found[1] is placed.views[0] and dtypes == ["float32"] * 2
    assert shapes == [placed.views[1].shape, placed.views[0].shape]
    s.free_staged("c:1", [0, 1, 2, 3])
    assert s.staged_results("c:1", [0, 3])[0] == [None, None]
    s.put_run("c:2", [], _placed(s, "c:2", 2), staged=True)
    s.put_run("d:1", [], _placed(s, "d:1", 2), staged=True)
    dropped = s.release_where(lambda name, holder: holder == name and name.startswith("c:"))
    assert sorted(dropped) == ["c:2/0", "c:2/1"]
    assert s.staged_results("c:2", [0])[0] == [None]
    assert s.staged_results("d:1", [1])[0][0] is not None


def _unit_views(block: np.ndarray, n: int) -> list[np.ndarray]:
    return [np.ndarray((16,), np.float32, block, 64 * i) for i in range(n)]


def test_a_units_block_is_reused_once_its_shards_are_gone_and_waits_while_other_units_run():
    s = ShardStore(0, "cpu", 1 << 20, shared=SharedShards())
    big, file = s.allocate_block(64 * 8, True)
    assert file is not None and file[2] > 0, "destinations of a unit that peers map lie in a shared file"
    views = _unit_views(big, 8)
    assert s.allocate_block(64 * 8, True)[0] is not big, "its shards are alive: a fresh block"
    del views
    small, _ = s.allocate_block(64 * 2, True)  # another call's unit, of another size
    del small
    hits = s.pool.hits
    again, _ = s.allocate_block(64 * 8, True)
    assert s.pool.hits == hits + 1 and again is not None
    assert s.allocate_block(64 * 8, False)[1] is None, "a private block is asked for: not a shared one"


def test_idle_unit_blocks_beyond_the_pools_limit_go_least_recently_used_first():
    s = ShardStore(0, "cpu", 1000, shared=SharedShards())
    for n in (400, 500, 600):  # each idle once the next is asked for: 1,500 bytes
        s.allocate_block(n, False)
    assert sorted(size for _, _, size in s.blocks.values()) == [400, 500, 600]
    s.allocate_block(700, False)  # the oldest go until the idle ones fit 1,000 bytes
    assert sorted(size for _, _, size in s.blocks.values()) == [600, 700]
    assert s.clear_pool() == 1300 and not s.blocks

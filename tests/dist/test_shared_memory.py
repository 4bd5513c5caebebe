"""Shards in memfd shared memory and peer mappings (``reshard.runtime.device.shared_memory``), in one
process: a process maps its own shards through /proc/<pid>/fd exactly as a peer actor does."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

from reshard.errors import ReshardError
from reshard.runtime import arrays
from reshard.runtime.device.shards import BufferPool, ShardStore
from reshard.runtime.device.shared_memory import PeerShards, SharedShards

pytestmark = pytest.mark.dist


def test_a_mapped_shard_is_the_owners_memory():
    owner, peers = SharedShards(), PeerShards(device=1)
    a = owner.allocate(6 * 4).view(np.float32).reshape(2, 3)
    a[...] = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert owner.descriptor(a) is None  # no shard holds the block yet
    owner.begin(a)
    desc = owner.descriptor(a)
    assert desc[0] == os.getpid() and desc[3] == (2, 3)
    seen = peers.get(0, desc, np.dtype(np.float32))
    assert np.array_equal(seen, a) and not seen.flags.writeable  # peers map it read-only
    a[1, 2] = 42.0  # one memory, not a copy
    assert float(seen[1, 2]) == 42.0
    assert owner.descriptor(a[1:]) is None  # not a whole block
    assert owner.descriptor(np.zeros(3)) is None  # private memory


def test_the_descriptor_closes_with_the_memory_and_peers_let_go():
    owner, peers = SharedShards(), PeerShards(device=1)
    flat = owner.allocate(64)
    a = flat.view(np.int64).reshape(8)
    owner.begin(a)
    desc = owner.descriptor(a)
    peers.get(0, desc, np.dtype(np.int64))
    del flat  # views keep the mapping, and so the descriptor, alive
    gc.collect()
    assert owner.descriptor(a) == desc and os.path.exists(f"/proc/self/fd/{desc[1]}")
    t = torch.from_numpy(a)  # a torch tensor over it keeps it alive too
    del a
    gc.collect()
    peers.purge()
    assert len(peers.maps) == 1 and os.path.exists(f"/proc/self/fd/{desc[1]}")
    del t
    gc.collect()
    assert not owner.blocks and not os.path.exists(f"/proc/self/fd/{desc[1]}")
    peers.purge()  # the owner dropped it: the mapping (which pinned the memory) goes too
    assert not peers.maps
    with pytest.raises(ReshardError, match="device 0's source shard is gone"):
        peers.get(0, desc, np.dtype(np.int64))


def test_a_runs_purge_reads_tenures_and_the_full_one_looks_descriptors_up():
    """After a run, mappings of shards their owner dropped go (the tenure cleared, no system
    call); one whose memory died without its shard being dropped goes at the full purge."""
    owner, peers = SharedShards(), PeerShards(device=1)
    store = ShardStore(0, "cpu", 0, owner)  # no pool: a freed shard's memory dies
    kept, dropped = store.allocate((4096,), "float32"), store.allocate((4096,), "float32")
    store.put("kept", kept, "h", "float32")
    store.put("dropped", dropped, "h", "float32")
    for t in (kept, dropped):
        peers.get(0, store.descriptor(t), np.dtype(np.float32))
    died = owner.allocate(64)
    owner.begin(died)
    peers.get(0, owner.descriptor(died), np.dtype(np.uint8))
    fd = owner.descriptor(died)[1]
    del dropped, died
    store.free("dropped")
    gc.collect()
    assert not os.path.exists(f"/proc/self/fd/{fd}") and len(peers.maps) == 3
    peers.purge(full=False)
    assert len(peers.maps) == 2  # the dropped shard's mapping went, the dead memory's did not
    peers.purge()
    assert [m.fd for m in peers.maps.values()] == [store.descriptor(kept)[1]]


def test_a_dropped_shard_never_maps_again_whatever_its_memory_holds_next():
    """The tenure in the block's header: a descriptor of a shard that was dropped fails before
    the copy (its memory idle in the pool) and after it (the memory reused meanwhile)."""
    owner, peers = SharedShards(), PeerShards(device=1)
    store = ShardStore(0, "cpu", 1 << 20, owner)
    first = store.allocate((4096,), "float32")  # 16 KiB: a shared block (smaller ones stay private)
    first[...] = 1.0
    store.put("first", first, "h", arrays.dtype_of(first))
    old = store.descriptor(first)
    view = peers.get(0, old, np.dtype(np.float32))
    np.testing.assert_array_equal(view, 1.0)
    del first
    store.free("first")
    with pytest.raises(ReshardError, match="device 0's source shard is gone"):
        peers.get(0, old, np.dtype(np.float32))  # the memory idles in the pool, still mapped here
    second = store.allocate((4096,), "float32")
    assert store.pool.hits == 1  # the same memory
    second[...] = 2.0
    store.put("second", second, "h", arrays.dtype_of(second))
    assert view[0] == 2.0  # what a puller that copied during the reuse would have read ...
    with pytest.raises(ReshardError, match="source shard is gone"):
        peers.check(0, old)  # ... and why it checks after copying
    peers.check(0, store.descriptor(second))


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_a_freed_shard_is_reused_only_when_nothing_references_it(shared):
    store = ShardStore(0, "cpu", 1 << 20, SharedShards() if shared else None)
    a = store.allocate((4, 8), "float32")
    store.put("a", a, "h", arrays.dtype_of(a))
    del a
    store.free("a")
    assert store.pool.nbytes == 128  # nothing else referenced it: idle, for the next shard of its size
    b = store.allocate((32,), "int32")
    assert store.pool.hits == 1 and store.pool.nbytes == 0
    store.put("b", b, "h", arrays.dtype_of(b))
    assert shared == (store.descriptor(b) is not None)  # reused shared memory is still shared
    view = b[3:5]  # a view of it is still alive: its memory must not be handed out again
    del b
    store.free("b")
    assert store.pool.nbytes == 0
    c = store.allocate((32,), "int32")
    store.put("c", c, "h", arrays.dtype_of(c))
    t = torch.from_numpy(c)  # nor while a torch tensor over it lives
    del c
    store.free("c")
    assert store.pool.nbytes == 0
    del view, t


def test_the_pool_keeps_within_its_bound_oldest_out():
    pool = BufferPool(limit_bytes=100)
    kept = []
    for n in (40, 40, 40):
        a = np.empty(n, np.uint8)
        kept.append(pool.put(a, refs=1))  # refs: our name ``a``
    assert kept == [True] * 3
    del a
    assert pool.nbytes == 80  # the oldest went
    assert [pool.take(40) is not None for _ in range(3)] == [True, True, False]
    big, part = np.empty(200, np.uint8), np.empty((4, 4))[:, :2]
    assert not pool.put(big, refs=1)  # bigger than the bound: never kept
    assert not pool.put(part, refs=1)  # part of an array: never kept


def test_peer_mappings_are_bounded():
    owner, peers = SharedShards(), PeerShards(device=1, limit=2)
    shards = [owner.allocate(16) for _ in range(3)]
    for s in shards:
        owner.begin(s)
        peers.get(0, owner.descriptor(s), np.dtype(np.uint8))
    assert len(peers.maps) == 2


def _own_shards(conn, n: int) -> None:
    """Another process's shards: their descriptors go to the parent, then it waits to be killed."""
    owner = SharedShards()
    shards = [owner.allocate(64) for _ in range(n)]
    for s in shards:
        owner.begin(s)
    conn.send([owner.descriptor(s) for s in shards])
    conn.recv()  # never comes: the parent kills this process


def test_a_dead_owners_mappings_all_go_at_the_next_purge():
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    owner = ctx.Process(target=_own_shards, args=(there, 100))
    owner.start()
    try:
        descs = here.recv()
        peers = PeerShards(device=1)
        for d in descs:
            peers.get(0, d, np.dtype(np.uint8))
        peers.purge()
        assert len(peers.maps) == 100  # a live owner's shards stay mapped
    finally:
        owner.kill()
        owner.join(30)
    peers.purge()
    assert not peers.maps  # all at once

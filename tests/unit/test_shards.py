"""A device's shard memory without Ray: shared blocks made ahead for shards the pool cannot serve
(``ShardStore.allocate``, ``reshard.runtime.shards``), within the pool's bound, fresh memory that
no dropped shard ever held, and the tenure that retires a dropped shard's descriptors."""

from __future__ import annotations

import numpy as np
import pytest

from reshard.errors import ReshardError
from reshard.runtime.shards import REFILL_MIN_BYTES, ShardStore
from reshard.runtime.shared_memory import PeerShards, SharedShards

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not SharedShards.available(), reason="needs memfd and /proc (Linux)"),
]

BIG = 2 * REFILL_MIN_BYTES  # a shard size that gets a block made ahead


def store(pool_bytes: int = 64 << 20) -> ShardStore:
    return ShardStore(0, "cpu", pool_bytes, shared=SharedShards())


def test_a_block_is_made_ahead_for_the_next_shard_of_that_size():
    s = store()
    first = s.allocate((BIG // 4,), "float32")
    s.blocks_made(timeout_s=30)
    assert s.memory()["ready_bytes"] == BIG
    first[:] = 7  # the live shard's bytes must not show up in the block made ahead
    second = s.allocate((BIG // 4,), "float32")
    m = s.memory()
    assert m["ready_hits"] == 1 and m["pool_hits"] == 0
    assert not np.shares_memory(first, second)
    assert not second.view(np.uint8).any(), "a block made ahead is fresh (zero) memory"
    assert s.shared.descriptor(second) is None  # not a shard until put
    s.put("b", second, "h")
    assert s.shared.descriptor(second) is not None
    s.blocks_made(timeout_s=30)
    assert s.memory()["ready_bytes"] == BIG, "taking a block asks for the next one"


def test_blocks_made_ahead_stay_within_the_pool_bound():
    s = store(pool_bytes=BIG)
    s.allocate((BIG,), "uint8")
    s.blocks_made(timeout_s=30)
    assert s.memory()["ready_bytes"] == BIG
    s.allocate((BIG // 2,), "uint8")  # no room left beside the block already made
    s.blocks_made(timeout_s=30)
    assert s.memory()["ready_bytes"] == BIG
    none = store(pool_bytes=0)  # the pool disabled: nothing is kept idle, nothing made ahead
    none.allocate((BIG,), "uint8")
    none.blocks_made(timeout_s=30)
    assert none.memory()["ready_bytes"] == 0


def test_small_shards_pool_hits_and_private_memory_get_no_block_ahead():
    s = store()
    s.allocate((REFILL_MIN_BYTES - 8,), "uint8")
    s.blocks_made(timeout_s=30)
    assert s.memory()["ready_bytes"] == 0
    t = s.allocate((BIG,), "uint8")
    s.blocks_made(timeout_s=30)
    s.put("t", t, "h")
    del t
    s.free("t")  # into the pool
    s.allocate((BIG,), "uint8")  # served by the pool: nothing more made
    s.blocks_made(timeout_s=30)
    assert s.memory()["pool_hits"] == 1 and s.memory()["ready_bytes"] == BIG
    private = ShardStore(0, "cpu", 64 << 20, shared=None)
    private.allocate((BIG,), "uint8")
    private.blocks_made(timeout_s=30)
    assert private.memory()["ready_bytes"] == 0
    s.clear()
    assert s.memory()["ready_bytes"] == 0


def test_a_dropped_shards_descriptor_stops_mapping_before_its_memory_is_reused():
    s = store()
    t = s.allocate((BIG,), "uint8")
    t[:] = 1
    s.put("t", t, "h")
    desc = s.descriptor(t)
    peers = PeerShards(1)
    assert peers.get(0, desc, np.dtype(np.uint8)).all()
    s.free("t")
    with pytest.raises(ReshardError, match="gone"):
        peers.check(0, desc)

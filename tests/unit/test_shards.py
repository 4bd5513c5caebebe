"""A device's shard memory without Ray: the tenure that retires a dropped shard's shared-memory
descriptors before its memory is reused (``reshard.runtime.shared_memory``)."""

from __future__ import annotations

import numpy as np
import pytest

from reshard.errors import ReshardError
from reshard.runtime.shards import ShardStore
from reshard.runtime.shared_memory import PeerShards, SharedShards

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
    s.put("t", t, "h")
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
    s.put("u", reused, "h")
    with pytest.raises(ReshardError, match="gone"):
        peers.get(0, desc, np.dtype(np.uint8))

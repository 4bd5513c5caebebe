"""Shards in memfd shared memory and peer mappings (``reshard.runtime.shared_memory``), in one
process: a process maps its own shards through /proc/<pid>/fd exactly as a peer actor does."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from reshard.errors import ReshardError
from reshard.runtime.shared_memory import PeerShards, SharedShards

pytestmark = pytest.mark.dist


def test_a_mapped_shard_is_the_owners_memory():
    owner, peers = SharedShards(), PeerShards(device=1)
    t = owner.allocate(6 * 4).view(torch.float32).view(2, 3)
    t.copy_(torch.arange(6, dtype=torch.float32).view(2, 3))
    desc = owner.descriptor(t)
    assert desc[0] == os.getpid() and desc[3] == (2, 3)
    seen = peers.get(0, desc, torch.float32)
    assert torch.equal(seen, t)
    t[1, 2] = 42.0  # one memory, not a copy
    assert float(seen[1, 2]) == 42.0
    assert owner.descriptor(t[1:]) is None  # not a whole block
    assert owner.descriptor(torch.zeros(3)) is None  # private memory


def test_the_descriptor_closes_with_the_storage_and_peers_let_go():
    owner, peers = SharedShards(), PeerShards(device=1)
    flat = owner.allocate(64)
    t = flat.view(torch.int64).view(8)
    desc = owner.descriptor(t)
    peers.get(0, desc, torch.int64)
    del flat  # views keep the storage, and so the descriptor, alive
    gc.collect()
    assert owner.descriptor(t) == desc and os.path.exists(f"/proc/self/fd/{desc[1]}")
    peers.purge()
    assert len(peers.maps) == 1
    del t
    gc.collect()
    assert not owner.blocks and not os.path.exists(f"/proc/self/fd/{desc[1]}")
    peers.purge()  # the owner dropped it: the mapping (which pinned the memory) goes too
    assert not peers.maps
    with pytest.raises(ReshardError, match="device 0's source shard is gone"):
        peers.get(0, desc, torch.int64)


def test_peer_mappings_are_bounded():
    owner, peers = SharedShards(), PeerShards(device=1, limit=2)
    shards = [owner.allocate(16) for _ in range(3)]
    for s in shards:
        peers.get(0, owner.descriptor(s), torch.uint8)
    assert len(peers.maps) == 2

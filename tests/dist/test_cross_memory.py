"""Shards in a process's private memory (a framework's tensors), read by peers with cross-memory
attach (``reshard.runtime.device.cross_memory``), in one process: ``process_vm_readv`` reads this
process exactly as it reads a peer actor."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import ReshardError
from reshard.runtime import arrays
from reshard.runtime.device import cross_memory
from reshard.runtime.device.cross_memory import RemoteShard
from reshard.runtime.device.shards import ShardStore
from reshard.runtime.device.shared_memory import PeerShards, SharedShards
from reshard.runtime.messages import CROSS_MEMORY, maps_shared

pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(not cross_memory.available(), reason="this kernel does not let the user read its processes"),
]


@st.composite
def boxes(draw):
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=4)))
    box = []
    for n in shape:
        lo = draw(st.integers(0, n))
        box.append((lo, draw(st.integers(lo, n))))
    return shape, box


@settings(max_examples=200, deadline=None)
@given(boxes(), st.sampled_from(["int8", "float32", "float64"]))
def test_a_read_box_is_what_numpy_slices(case, dtype):
    shape, box = case
    a = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    remote = RemoteShard(0, 1, os.getpid(), a.__array_interface__["data"][0], shape, a.dtype)
    index = (*(slice(lo, hi) for lo, hi in box), Ellipsis)
    np.testing.assert_array_equal(remote[index], a[index])
    into = np.full((8,) * len(shape), -1, dtype=dtype)  # a strided view: read apart, then copied
    view = into[(*(slice(0, hi - lo) for lo, hi in box), Ellipsis)]
    remote.read_into(index, view)
    np.testing.assert_array_equal(view, a[index])


@settings(max_examples=30, deadline=None)
@given(st.lists(boxes(), min_size=1, max_size=40), st.integers(1, 60))
def test_gathered_reads_are_what_numpy_slices(cases, copies):
    """Boxes of many shards, read by as few calls as fit (more than IOV_MAX boxes: several)."""
    sources, outs, gather, alone = [], [], cross_memory.Gather(), 0
    for _ in range(copies):
        for shape, box in cases:
            a = np.random.default_rng(len(sources)).standard_normal(shape).astype(np.float32)
            remote = RemoteShard(0, 1, os.getpid(), a.__array_interface__["data"][0], shape, a.dtype)
            out = np.full([hi - lo for lo, hi in box], np.nan, dtype=np.float32)
            if not gather.add(remote, tuple(box), out):
                alone += 1
                remote.read_into((*(slice(lo, hi) for lo, hi in box), Ellipsis), out)
            sources.append((a, box))
            outs.append(out)
    gather.flush()
    assert not gather.pending
    for (a, box), out in zip(sources, outs, strict=True):
        np.testing.assert_array_equal(out, a[(*(slice(lo, hi) for lo, hi in box), Ellipsis)])


def test_a_gathered_read_of_a_process_gone_names_its_holder():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    gather = cross_memory.Gather()
    assert gather.add(RemoteShard(0, 3, pid, 4096, (4,), np.dtype(np.float32)), ((0, 4),), np.zeros(4, np.float32))
    with pytest.raises(ReshardError, match="device 3's source shard is gone"):
        gather.flush()


def test_a_box_read_as_a_span_is_not_gathered():
    a = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    remote = RemoteShard(0, 1, os.getpid(), a.__array_interface__["data"][0], a.shape, a.dtype)
    out = np.zeros((64, 32), dtype=np.float32)  # 64 short runs close together: read as their span
    assert not cross_memory.Gather().add(remote, ((0, 64), (0, 32)), out)
    assert not cross_memory.Gather().add(remote, ((0, 64), (0, 64)), np.zeros((64, 64)))  # another dtype


def test_runs_merge_whole_inner_dimensions():
    offsets, length = cross_memory.runs((4, 3, 5), 8, [(1, 3), (0, 3), (0, 5)])
    assert offsets.tolist() == [1 * 15 * 8] and length == 2 * 15 * 8  # one run: rows 1-2 whole
    offsets, length = cross_memory.runs((4, 6), 4, [(0, 2), (2, 5)])
    assert offsets.tolist() == [8, 32] and length == 12  # one run per row


def test_a_framework_tensor_is_read_in_its_owners_memory_and_only_while_held():
    store, peers = ShardStore(0, "cpu", 1 << 20, SharedShards()), PeerShards(device=1)
    weights = torch.arange(24, dtype=torch.float32).reshape(4, 6)  # torch's own memory
    store.share("w", arrays.as_numpy(weights), "float32", {})
    desc = store.descriptor(store.get("w"))
    assert desc[0] == CROSS_MEMORY and desc[1] == os.getpid() and not maps_shared(desc)
    shard = peers.get(0, desc, np.dtype(np.float32))
    assert isinstance(shard, RemoteShard)
    weights[2, 3] = 42.0  # one memory, read when pulled
    np.testing.assert_array_equal(shard[1:3, 2:5], weights.numpy()[1:3, 2:5])
    peers.check(0, desc)
    store.unshare("w")
    with pytest.raises(ReshardError, match="device 0's source shard is gone"):
        peers.check(0, desc)  # a puller that read meanwhile fails after its copy
    with pytest.raises(ReshardError, match="device 0's source shard is gone"):
        peers.get(0, desc, np.dtype(np.float32))
    other = torch.zeros(4, 6)
    store.share("other", arrays.as_numpy(other), "float32", {})  # the freed cell, a new tenure
    assert store.descriptor(store.get("other"))[4] == desc[4]
    with pytest.raises(ReshardError, match="source shard is gone"):
        peers.check(0, desc)


def test_shards_in_shared_memory_keep_their_mapped_descriptors():
    store = ShardStore(0, "cpu", 1 << 20, SharedShards())
    a = store.allocate((4096,), "float32")
    store.put("a", a, "h", "float32")
    assert maps_shared(store.descriptor(a))
    small = store.allocate((4,), "float32")  # under SMALL_SHARD_BYTES: private memory, read by peers
    store.put("small", small, "h", "float32")
    assert store.descriptor(small)[0] == CROSS_MEMORY
    relay = store.allocate((4,), "float32", mapped=True)  # a relay is published in it: a shared block
    store.put("relay", relay, "h", "float32")
    assert maps_shared(store.descriptor(relay))
    assert ShardStore(0, "cpu", 1 << 20, None).descriptor(np.zeros(3)) is None  # no shared memory: no reads


def test_a_process_gone_fails_the_read():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    remote = RemoteShard(0, 3, pid, 4096, (4,), np.dtype(np.float32))
    with pytest.raises(ReshardError, match="device 3's source shard is gone"):
        remote[...]


def test_sharing_the_same_tensor_again_keeps_its_descriptors_reading():
    store, peers = ShardStore(0, "cpu", 1 << 20, SharedShards()), PeerShards(device=1)
    weights = torch.arange(6, dtype=torch.float32)
    store.share("w", arrays.as_numpy(weights), "float32", {})
    desc = store.descriptor(store.get("w"))
    store.share("w", arrays.as_numpy(weights), "float32", {})  # a second weight_sync over the same model
    assert store.descriptor(store.get("w")) == desc
    peers.check(0, desc)
    np.testing.assert_array_equal(peers.get(0, desc, np.dtype(np.float32))[2:4], weights.numpy()[2:4])


def test_a_tensor_rebacked_in_shared_memory_is_mapped_and_its_views_follow():
    from reshard.runtime.device.context import shared_file

    store, peers = ShardStore(0, "cpu", 1 << 20, SharedShards()), PeerShards(device=1)
    weights = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    row = weights[2]  # a view a framework keeps (FSDP2's padded buffer and its DTensor share a storage)
    weights[1:].untyped_storage().share_memory_()  # what share(..., reback=True) does: in place, one copy
    file = shared_file(weights[1:])
    assert weights.untyped_storage().is_shared() and file[1] == 6 * 4
    row[0] = 99.0
    assert float(weights[2, 0]) == 99.0  # the view follows the storage
    store.share("w", arrays.as_numpy(weights[1:]), "float32", {}, file=file)
    desc = store.descriptor(store.get("w"))
    assert desc[0] == CROSS_MEMORY and desc[8] is not None
    mapped = peers.get(0, desc, np.dtype(np.float32))
    assert isinstance(mapped, np.ndarray) and not mapped.flags.writeable  # mapped read-only, no kernel copy
    np.testing.assert_array_equal(mapped, weights[1:].numpy())
    weights[3, 5] = -1.0  # one memory
    assert float(mapped[2, 5]) == -1.0
    peers.purge()
    assert any(m.tenure is None for m in peers.maps.values())  # the file's mapping stays (its tenure is on the board)
    store.unshare("w")
    with pytest.raises(ReshardError, match="device 0's source shard is gone"):
        peers.check(0, desc)

"""CUDA IPC pulls between device actors that share a GPU: a destination copies its slices straight
out of the holder's device memory, tenure-checked, in stream order (one GPU; the CPU stand-in
models IPC between processes with a shared memory file per device)."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_bodies import (
    ipc_allocate,
    ipc_counts,
    ipc_free,
    ipc_limit,
    ipc_opened,
    ipc_pull,
    ipc_recent,
    kernel_commits,
    share_device_array,
)

from reshard import Layout, Replicate, Shard, distribute, reshard
from reshard.errors import ReshardError

pytestmark = pytest.mark.gpu(1)


@pytest.fixture
def pair(view):
    return view([0, 1], (2,)), view([2, 3], (2,))


def test_a_pulled_shard_is_the_holders_memory_and_a_freed_one_never_maps(pair):
    """The tenure in the holder's board: a descriptor of a shard that was dropped fails before the
    copy (its block idle in the pool) and after the block was reused for another shard."""
    a, b = pair
    holder = a.device_ids[0]
    (desc,) = a.call(ipc_allocate, "first", 1024, 1.5, devices=[0])
    assert desc[0] == "cuda" and desc[3] == 4096 and desc[4] == 0  # a block of its own
    (got,) = b.call(ipc_pull, holder, desc, devices=[0])
    np.testing.assert_array_equal(got, np.full(1024, 1.5, np.float32))
    a.call(ipc_free, "first", devices=[0])
    with pytest.raises(Exception, match="source shard is gone"):
        b.call(ipc_pull, holder, desc, devices=[0])
    (again,) = a.call(ipc_allocate, "second", 1024, 2.5, devices=[0])
    assert again[2] == desc[2]  # the same block, reused: the same IPC handle
    with pytest.raises(Exception, match="source shard is gone"):
        b.call(ipc_pull, holder, desc, devices=[0])
    (got,) = b.call(ipc_pull, holder, again, devices=[0])
    np.testing.assert_array_equal(got, np.full(1024, 2.5, np.float32))
    assert b.call(ipc_opened, devices=[0]) == [1]  # opened once, for both shards of that block
    a.call(ipc_free, "second", devices=[0])


def test_devices_sharing_a_gpu_pull_every_slice_and_no_bytes_go_through_nccl(pair):
    from reshard.runtime.driver.resharding import lowered_reshard

    a, b = pair
    x = np.arange(64 * 40, dtype=np.float32).reshape(64, 40)
    t = distribute(x, Layout(a, (Shard(0),)))
    dst = Layout(b, (Shard(1),))
    compiled = lowered_reshard(t, dst)
    assert compiled.pulled and not compiled.groups  # every transfer a pull: no communicator
    y = reshard(t, a, dst)
    np.testing.assert_array_equal(y.to_numpy(), x)
    assert all(s["peer_maps"] >= 1 for s in b.stats())
    off = reshard(t, a, dst, shared_memory=False)  # through NCCL
    np.testing.assert_array_equal(off.to_numpy(), x)
    assert lowered_reshard(t, dst, shared_memory=False).groups


def test_a_tree_read_out_of_more_holder_blocks_than_a_device_keeps_open_lands_bit_exact(pair):
    """Six tensors loaded one by one (a holder block each), pulled in one call by devices that keep
    two peer blocks open: those past the limit stay open while the run reads them (closing one
    under its copy would read unmapped memory), and the next run that pulls closes them."""
    a, b = pair
    b.call(ipc_limit, 2)
    xs = {f"w{i}": np.arange(64 * 4, dtype=np.float32).reshape(64, 4) + 1000 * i for i in range(6)}
    tree = {k: distribute(x, Layout(a, (Shard(0),))) for k, x in xs.items()}
    y = reshard(tree, a, Layout(b, (Shard(1),)))
    for k, x in xs.items():
        np.testing.assert_array_equal(y[k].to_numpy(), x)
    assert all(retired > 0 for _, retired in b.call(ipc_counts))  # the run read more than it keeps
    one = distribute(np.ones((64, 4), np.float32), Layout(a, (Shard(0),)))
    np.testing.assert_array_equal(reshard(one, a, Layout(b, (Shard(1),))).to_numpy(), np.ones((64, 4)))
    assert b.call(ipc_counts) == [(2, 0), (2, 0)]  # the next run closed those it no longer reads
    b.call(ipc_limit, 4096)


def test_a_call_that_pulls_what_an_earlier_one_pulled_reuses_its_views_until_they_are_closed(pair):
    """A tree's pulled shards are viewed once and kept for the next call that pulls the same; after
    ``empty_cache`` closed every block opened (a kept view would read unmapped memory) the next
    call opens them again and lands bit-exact."""
    a, b = pair
    xs = {f"w{i}": np.arange(64 * 4, dtype=np.float32).reshape(64, 4) + 1000 * i for i in range(3)}
    tree = {k: distribute(x, Layout(a, (Shard(0),))) for k, x in xs.items()}
    dst = Layout(b, (Shard(1),))
    for _ in range(2):
        y = reshard(tree, a, dst)
        for k, x in xs.items():
            np.testing.assert_array_equal(y[k].to_numpy(), x)
        assert b.call(ipc_recent) == [1, 1]  # the second call took the first one's views
    b.empty_cache()
    assert b.call(ipc_recent) == [0, 0] and b.call(ipc_counts) == [(0, 0), (0, 0)]
    y = reshard(tree, a, dst)
    for k, x in xs.items():
        np.testing.assert_array_equal(y[k].to_numpy(), x)


def test_a_tree_resharded_into_its_outputs_is_committed_by_one_kernel_bit_exact(pair):
    """``out=`` on GPU devices: the tree's small staged results are copied into their outputs by
    one kernel per device, a large one by a copy of its own, bit-exact, with other shards freed
    in between."""
    a, b = pair
    xs = {f"w{i}": np.arange(64 * 4, dtype=np.float32).reshape(64, 4) * (i + 1) for i in range(3)}
    xs["big"] = np.arange(1024 * 1024, dtype=np.float32).reshape(1024, 1024)  # 2 MiB a device
    tree = {k: distribute(x, Layout(a, (Shard(0),))) for k, x in xs.items()}
    dst = Layout(b, (Shard(1),))
    out = reshard(tree, a, dst)
    before = b.call(kernel_commits)
    for k in xs:
        reshard(tree[k], a, dst).free()  # other shards come and go meanwhile
    tree = {k: distribute(x + 0.5, Layout(a, (Shard(0),))) for k, x in xs.items()}
    got = reshard(tree, a, dst, out=out)
    assert got is out
    for k, x in xs.items():
        np.testing.assert_array_equal(out[k].to_numpy(), x + 0.5)
    assert [n - m for n, m in zip(b.call(kernel_commits), before, strict=True)] == [1, 1]


def test_a_reshard_whose_holder_freed_its_shard_meanwhile_fails_and_says_so(pair):
    """A source handle copied into a task frees the shards for every handle; a replay that pulls
    from them then fails on the tenure check, naming the holder, and leaves nothing behind."""
    a, b = pair
    x = np.ones((32, 8), np.float32)
    t = distribute(x, Layout(a, (Shard(0),)))
    dst = Layout(b, (Replicate(),))
    reshard(t, a, dst).free()
    name = t.name
    a.call(lambda ctx, n: ctx.store.free(n), name)  # dropped on the devices behind the handle's back
    with pytest.raises(ReshardError, match="source shard|freed"):
        reshard(t, a, dst)


def test_a_device_array_shared_on_a_gpu_device_is_adopted_and_resharded(pair):
    """``share`` of the user's own device memory (as an engine's weights) on a GPU device: the
    shard is adopted by name, resharded onto other devices and read back."""
    from reshard import adopt

    a, b = pair
    a.call(share_device_array, "w", 256)
    t = adopt(Layout(a, (Replicate(),)), "w")
    y = reshard(t, a, Layout(b, (Shard(0),)))
    np.testing.assert_array_equal(y.to_numpy(), np.arange(256, dtype=np.float32))

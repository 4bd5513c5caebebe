"""The NCCL backend between processes, one GPU each: rank actors that hold an ``NcclBackend``
directly (tests/gpu/conftest.py: ``nccl_ranks``), independent of the runtime's actors. Broadcast
and all-reduce over all GPUs, grouped exchanges of strided torch/cupy buffers, a peer that never
sends (timeout, abort, the other member told, no crash), destroy on both members."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_bodies import lonely_recv, told_of_abort

pytestmark = pytest.mark.gpu(2)


@pytest.fixture(scope="module")
def ranks(nccl_ranks, gpus, require_pool):
    require_pool(2, gpus.total)
    return nccl_ranks(min(gpus.total, 4), 1.0, timeout_s=60)


@pytest.mark.gpu(2)
def test_broadcast_and_all_reduce_over_all_gpus(ranks, connect_ranks):
    group = tuple(sorted(ranks.actors))
    rdvs = ranks.rendezvous([group])
    connect_ranks(ranks, rdvs)

    def body(actor, group, root, n):
        import cupy

        comm = actor.backend.communicator(group)
        x = cupy.zeros(n, dtype=cupy.float32)
        if actor.device == root:
            x[...] = cupy.arange(n, dtype=cupy.float32) * 3
        comm.broadcast(x, group.index(root))
        y = cupy.full(n, actor.device + 1, dtype=cupy.int64)
        comm.all_reduce(y, "sum")
        return cupy.asnumpy(x), cupy.asnumpy(y)

    total = sum(d + 1 for d in group)
    for root in (group[-1], group[0]):
        for x, y in ranks.call(body, group, root, 1 << 20):
            np.testing.assert_array_equal(x, np.arange(1 << 20, dtype=np.float32) * 3)
            np.testing.assert_array_equal(y, np.full(1 << 20, total))


@pytest.mark.gpu(2, torch_cuda=True)
def test_grouped_exchange_with_strided_torch_and_cupy_buffers(ranks, connect_ranks):
    group = (0, 1)
    connect_ranks(ranks, ranks.rendezvous([group]))

    def body(actor, group, n):
        import cupy
        import torch

        me = group.index(actor.device)
        comm = actor.backend.communicator(group)
        src = torch.zeros((n, 3), dtype=torch.bfloat16, device="cuda")
        src[:, 1] = torch.arange(n, device="cuda") % 100 + me  # strided: staged
        got = torch.zeros((n, 3), dtype=torch.bfloat16, device="cuda")
        flags = cupy.arange(n) % (2 + me) == 0  # bool, travels as bytes
        got_flags = cupy.zeros(n, dtype=cupy.bool_)
        with actor.backend.grouped():  # both ranks send and receive at once: one NCCL group call
            comm.send(src[:, 1], 1 - me)
            comm.recv(got[:, 2], 1 - me)
            comm.send(flags, 1 - me)
            comm.recv(got_flags, 1 - me)
        return got[:, 2].float().cpu().numpy(), cupy.asnumpy(got_flags)

    (va, fa), (vb, fb) = ranks.call(body, group, 4099, devices=[0, 1])
    ref = np.arange(4099) % 100
    np.testing.assert_array_equal(va, ref + 1)
    np.testing.assert_array_equal(vb, ref)
    np.testing.assert_array_equal(fa, np.arange(4099) % 3 == 0)
    np.testing.assert_array_equal(fb, np.arange(4099) % 2 == 0)


@pytest.mark.gpu(2)
def test_a_peer_that_never_sends_times_out_tells_the_other_member_and_nothing_crashes(ranks, connect_ranks):
    group = (0, 1)
    pids = ranks.pids()
    connect_ranks(ranks, ranks.rendezvous([group]))
    kind, aborted = ranks.call(lonely_recv, group, 3.0, devices=[1])[0]
    assert (kind, aborted) == ("ReshardTimeout", True)
    assert ranks.call(told_of_abort, group, 30.0, devices=[0]) == [("PeerFailed", True)]
    assert ranks.pids() == pids  # no actor crashed
    connect_ranks(ranks, ranks.rendezvous([group]))  # a new generation of the pair works

    def ping(actor, group):
        import cupy

        x = cupy.full(64, actor.device == group[0], dtype=cupy.float32)
        actor.backend.communicator(group).broadcast(x, 0)
        return float(x.sum())

    assert ranks.call(ping, group, devices=[0, 1]) == [64.0, 64.0]


@pytest.mark.gpu(2)
def test_both_members_destroy_an_idle_communicator(ranks, connect_ranks):
    group = (0, 1)
    connect_ranks(ranks, ranks.rendezvous([group]))

    def destroy(actor, group):
        before, live = actor.backend.stats["destroyed"], actor.backend.live_groups().count(group)
        actor.backend.destroy([group])  # every channel of the group (earlier tests left live ones)
        return group in actor.backend.live_groups(), actor.backend.stats["destroyed"] - before - live, live

    (a, b) = ranks.call(destroy, group, devices=[0, 1])
    assert a[:2] == b[:2] == (False, 0) and a[2] >= 1

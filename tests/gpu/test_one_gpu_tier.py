"""The one-GPU tier: several Ray actors on ONE GPU (fractional ``num_gpus``) forming real
multi-rank NCCL communicators.

Each rank gets its own ``NCCL_HOSTID`` (``gpu_sharing="hostid"``): NCCL treats them as different
machines and connects them with sockets over loopback, which also exercises the network transport
and its remote error reporting; on NCCL >= 2.30 ``gpu_sharing="multi_rank"`` is tested as well.
Without MPS the ranks' kernels take turns on the GPU: this proves correctness, not speed.

What runs: bit-exact broadcast and all-reduce of every bit pattern, a peer that never sends
(timeout, abort, the other member told), creation with a member that never joins, a peer's abort
making a blocked member fail at once, an abort from another thread, two channels on the same
devices, and the comm stream waiting for a long kernel. Failure tests count actor crashes
(process ids before and after): there must be none.
"""

from __future__ import annotations

import pytest
from gpu_bodies import (
    abort_group,
    aborted_from_another_thread,
    blocked_recv,
    environment,
    exchange_bits,
    lonely_recv,
    recv_values,
    send_after_long_kernel,
    told_of_abort,
    try_connect,
    two_channels,
)

pytestmark = pytest.mark.gpu(1)

RANKS = 4


@pytest.fixture(scope="module")
def shared(nccl_ranks):
    """Four ranks, a quarter GPU each, each its own NCCL host."""
    return nccl_ranks(RANKS, 1.0 / RANKS, timeout_s=60, gpu_sharing="hostid")


def test_the_ranks_share_one_gpu_as_distinct_nccl_hosts(shared, gpus):
    envs = shared.call(environment)
    if gpus.total == 1:
        assert len({tuple(e["uuids"]) for e in envs}) == 1 and len(envs[0]["uuids"]) == 1
    assert len({e["NCCL_HOSTID"] for e in envs}) == RANKS and len({e["pid"] for e in envs}) == RANKS
    assert {e["NCCL_COMM_BLOCKING"] for e in envs} == {None} and {e["NCCL_SOCKET_IFNAME"] for e in envs} == {"lo"}


@pytest.mark.gpu(1, torch_cuda=True)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64", "int8", "bool"])
def test_broadcast_of_every_bit_pattern_and_all_reduce_are_exact(shared, connect_ranks, dtype):
    group = tuple(range(RANKS))
    pair = (1, 3)
    connect_ranks(shared, shared.rendezvous([group, pair]))
    results = shared.call(exchange_bits, group, dtype, 11)
    sent = [results[root][0][root] for root in range(RANKS)]
    for got, total in results:
        assert got == sent  # every rank holds every root's bytes, unchanged
        assert total == sum(d + 1 for d in group)
    a, b = shared.call(exchange_bits, pair, dtype, 5, devices=list(pair))
    assert a[0] == b[0]


def test_a_peer_that_never_sends_times_out_tells_the_other_and_nothing_crashes(shared, connect_ranks):
    group = (0, 1)
    pids = shared.pids()
    connect_ranks(shared, shared.rendezvous([group]))
    assert shared.call(lonely_recv, group, 3.0, devices=[1]) == [("ReshardTimeout", True)]
    assert shared.call(told_of_abort, group, 30.0, devices=[0]) == [("PeerFailed", True)]
    assert shared.pids() == pids


def test_a_member_that_never_joins_times_out_creation_without_crashes(shared):
    pids = shared.pids()
    (rdv,) = shared.rendezvous([(0, 1, 2)])  # device 2 never connects
    refs = [shared.submit(try_connect, [rdv], 5.0, device=d) for d in (0, 1)]
    results = shared.ray.get(refs, timeout=180)
    kinds = sorted(kind for kind, _, _ in results)
    # the first to reach its deadline aborts and tells the other, which may stop on that notice
    assert kinds in (["ReshardTimeout", "ReshardTimeout"], ["PeerFailed", "ReshardTimeout"]), results
    assert all((0, 1, 2) not in live for _, live, _ in results)
    assert shared.pids() == pids
    # NCCL's bootstrap root of this id waits for device 2 forever (documented in nccl.py)
    host = rdv.info["host"]
    if host in (0, 1):
        assert results[host][2] >= 1


def test_a_members_abort_makes_a_blocked_member_fail_at_once(shared, connect_ranks):
    group = (2, 3)
    pids = shared.pids()
    connect_ranks(shared, shared.rendezvous([group]))
    blocked = shared.submit(blocked_recv, group, 0, 600.0, device=3)  # would wait 60 s (backend timeout)
    assert shared.call(abort_group, group, devices=[2]) == [True]
    assert shared.ray.get(blocked, timeout=120) == "PeerFailed"  # the notice, not the deadline
    assert shared.pids() == pids


def test_an_abort_from_another_thread_ends_a_blocked_recv_and_tells_the_peer(shared, connect_ranks):
    group = (0, 2)
    pids = shared.pids()
    connect_ranks(shared, shared.rendezvous([group]))
    (((kind, message), aborted),) = shared.call(aborted_from_another_thread, group, 1, 600.0, devices=[0])
    assert (kind, aborted) == ("PeerFailed", True) and "the controller aborted" in message
    assert shared.call(told_of_abort, group, 30.0, devices=[2]) == [("PeerFailed", True)]
    assert shared.pids() == pids


def test_two_channels_on_the_same_devices_coexist(shared):
    group = (1, 2)
    rdvs = shared.rendezvous([group]) + shared.rendezvous([group])  # two unique ids: two channels
    assert rdvs[0].info["uid"] != rdvs[1].info["uid"]
    results = shared.call(two_channels, rdvs, 60.0, devices=list(group))
    for got, first_closed, second_closed, same in results:
        assert got == [10 + 1, 20 + 1, 10 + 1]  # rank 0 (device 1) broadcast each time
        assert (first_closed, second_closed, same) == (False, True, False)


@pytest.mark.gpu(1, torch_cuda=True)
def test_the_comm_stream_waits_for_a_long_kernel_across_actors(shared, connect_ranks):
    group = (0, 3)
    connect_ranks(shared, shared.rendezvous([group]))
    n = 1 << 20
    sender = shared.submit(send_after_long_kernel, group, 1, n, device=0)
    receiver = shared.submit(recv_values, group, 0, n, device=3)
    pending, values = shared.ray.get([sender, receiver], timeout=180)
    assert pending  # the write was still queued behind the sleep when NCCL was asked to send
    assert values == [7]

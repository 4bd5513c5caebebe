"""topology.simulator: hand-computed times for point-to-point, pipelined broadcast, NIC sharing
(max-min), intra-host copies, issue order, gloo's binomial tree, latency and accounting."""

import math

import pytest

from topology import Cluster, SimKind, SimTransfer, simulate_transfers
from topology.simulator import NCCL_BROADCAST_OVERHEAD_US, NCCL_CHUNK_BYTES

pytestmark = pytest.mark.unit

S = 10**9  # bytes
B = 1.0  # GB/s: S takes 1 s over a NIC
HOSTS = {d: d // 4 for d in range(40)}  # 10 hosts x 4 devices


def cluster(latency_us=0.0, intra=100.0, backend="nccl"):
    return Cluster.homogeneous(10, 4, B, intra, latency_us=latency_us, intra_host_latency_us=0.0, backend=backend)


def p2p(a, b, size=S):
    return SimTransfer(SimKind.P2P, a, (b,), size)


def bcast(root, receivers, size=S):
    return SimTransfer(SimKind.BROADCAST, root, tuple(receivers), size)


@pytest.mark.parametrize("k", [1, 2, 4, 6])
def test_one_sender_to_k_hosts_by_send_recv_takes_k_times_s_over_b(k):
    # one device sends to one device on each of k hosts, one after the other
    r = simulate_transfers([p2p(0, 4 * (j + 1)) for j in range(k)], HOSTS, cluster())
    assert r.makespan_s == pytest.approx(k * S / (B * 1e9))
    assert r.start_s == pytest.approx([j * 1.0 for j in range(k)])
    # k devices of the sender's host (k <= 4) send at once: they share its NIC, same total
    if k > 4:
        return
    r = simulate_transfers([p2p(j, 4 * (j + 1)) for j in range(k)], HOSTS, cluster())
    assert r.makespan_s == pytest.approx(k * 1.0)
    assert r.host(0).send_bytes == k * S and r.host(0).send_busy_s == pytest.approx(k * 1.0)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_pipelined_broadcast_to_k_hosts_takes_about_s_over_b(k):
    receivers = [4 * (j + 1) + x for j in range(k) for x in range(4)]  # every device of k hosts
    r = simulate_transfers([bcast(0, receivers)], HOSTS, cluster())
    chunk = NCCL_CHUNK_BYTES
    fill = (k - 1) * chunk / (B * 1e9) + 3 * k * chunk / 100e9  # every hop but the slowest forwards a chunk
    assert r.makespan_s == pytest.approx(1.0 + fill + NCCL_BROADCAST_OVERHEAD_US * 1e-6)
    assert r.makespan_s < 1.01
    # every host NIC on the ring carries the bytes once
    assert [r.host(h).recv_bytes for h in range(1, k + 1)] == [S] * k
    assert r.host(0).send_bytes == S and r.host(k).send_bytes == 0


def test_broadcast_ring_enters_each_host_once_whatever_the_receiver_order():
    receivers = [4, 8, 5, 9, 6]  # hosts 1 and 2 interleaved
    r = simulate_transfers([bcast(0, receivers)], HOSTS, cluster())
    assert [r.host(h).recv_bytes for h in (1, 2)] == [S, S]
    assert r.network_bytes == 2 * S


def test_max_min_fair_sharing_gives_spare_capacity_to_unconstrained_flows():
    # host 2 receives three flows (B/3 each); host 0 sends two: the one to host 1 takes the rest, 2B/3
    flows = [p2p(0, 4), p2p(1, 8), p2p(12, 9), p2p(16, 10)]
    r = simulate_transfers(flows, HOSTS, cluster())
    assert r.end_s[0] == pytest.approx(1.5)
    assert r.end_s[1:] == pytest.approx([3.0, 3.0, 3.0])
    # equal split would have given the first flow B/2 (2 s); the NIC of host 0 is never oversubscribed
    assert r.host(0).send_busy_s == pytest.approx(3.0)


def test_rates_rise_when_a_competing_flow_ends():
    # two flows share host 0's NIC; the short one ends at 2 * 0.5 = 1 s, the long one then runs alone
    r = simulate_transfers([p2p(0, 4, S // 2), p2p(1, 8, S)], HOSTS, cluster())
    assert r.end_s == pytest.approx([1.0, 1.5])


def test_intra_host_transfers_and_copies_use_the_device_links():
    c = cluster(intra=50.0)
    r = simulate_transfers([SimTransfer(SimKind.COPY, 1, (1,), S), p2p(2, 3, S)], HOSTS, c)
    assert r.end_s == pytest.approx([S / 50e9, S / 50e9])
    assert r.network_bytes == 0
    r = simulate_transfers([bcast(0, [1, 2, 3])], HOSTS, c)
    assert r.makespan_s == pytest.approx(S / 50e9 + 2 * NCCL_CHUNK_BYTES / 50e9 + NCCL_BROADCAST_OVERHEAD_US * 1e-6)


def test_every_device_runs_its_transfers_in_the_global_order():
    # device 4 first receives from device 0 (1 s), only then sends to host 2; device 12 is idle meanwhile
    r = simulate_transfers([p2p(0, 4), p2p(4, 8), p2p(12, 16)], HOSTS, cluster())
    assert r.start_s == pytest.approx([0.0, 1.0, 0.0])
    assert r.end_s == pytest.approx([1.0, 2.0, 1.0])
    # a broadcast waits for all of its members
    r = simulate_transfers([p2p(0, 4), bcast(8, [4, 12]), p2p(5, 9)], HOSTS, cluster())
    assert r.start_s[1] == pytest.approx(1.0)


def pull(root, receivers, size=S, after=None):
    return SimTransfer(SimKind.PULL, root, tuple(receivers), size, after)


def test_a_pulled_relay_starts_when_its_bytes_land_and_keeps_the_relaying_device_free():
    c = cluster(intra=10.0)
    # device 4 receives two slices (1 s each); device 5 pulls the first as soon as it landed, while
    # 4 receives the second; as a message (P2P 4 -> 5) the relay would wait for 4 to be free
    r = simulate_transfers([p2p(0, 4), p2p(1, 4), pull(4, [5, 6], after=0)], HOSTS, c)
    assert r.start_s[2] == pytest.approx(1.0)
    assert r.end_s == pytest.approx([1.0, 2.0, 1.0 + 2 * S / 10e9])  # both copies share 4's memory port
    as_message = simulate_transfers([p2p(0, 4), p2p(1, 4), bcast(4, [5, 6])], HOSTS, c)
    assert as_message.start_s[2] == pytest.approx(2.0)
    # a pull of a source shard goes at once; the holder's own transfers do not wait for it
    r = simulate_transfers([p2p(4, 8), pull(4, [5]), p2p(4, 9)], HOSTS, c)
    assert r.start_s == pytest.approx([0.0, 0.0, 1.0])
    assert r.network_bytes == 2 * S


def test_latency_per_message():
    c = cluster(latency_us=100.0)
    r = simulate_transfers([p2p(0, 4), p2p(0, 8)], HOSTS, c)
    assert r.makespan_s == pytest.approx(2 * (1.0 + 100e-6))
    r = simulate_transfers([p2p(0, 4, 0)], HOSTS, c)
    assert r.makespan_s == pytest.approx(100e-6)


def test_tiny_messages_and_two_rank_groups_cost_more_as_broadcasts():
    c = cluster(latency_us=25.0)
    tiny = 4096
    as_p2p = simulate_transfers([p2p(0, 4, tiny)], HOSTS, c).makespan_s
    as_bcast = simulate_transfers([bcast(0, [4], tiny)], HOSTS, c).makespan_s
    assert as_bcast > as_p2p
    # to one device on each of 4 hosts: 4 concurrent sends from 4 devices beat a 4-hop ring
    sends = simulate_transfers([p2p(j, 4 * (j + 1), tiny) for j in range(4)], HOSTS, c).makespan_s
    ring = simulate_transfers([bcast(0, [4, 8, 12, 16], tiny)], HOSTS, c).makespan_s
    assert sends < ring
    # large messages: the ring wins by far
    sends = simulate_transfers([p2p(j, 4 * (j + 1)) for j in range(4)], HOSTS, c).makespan_s
    ring = simulate_transfers([bcast(0, [4, 8, 12, 16])], HOSTS, c).makespan_s
    assert ring < sends / 3


def test_gloo_broadcast_is_a_store_and_forward_binomial_tree():
    # ranks = sorted devices (0, 4, 8, 12); round 0: 0 -> 4; round 1: 0 -> 8 and 4 -> 12.
    # The root's two sends are asynchronous: they share its NIC (B/2 each) until 4 has its copy.
    r = simulate_transfers([bcast(0, [4, 8, 12])], HOSTS, cluster(backend="gloo"))
    assert r.host(0).send_bytes == 2 * S
    assert r.host(1).send_bytes == S
    assert r.makespan_s == pytest.approx(3.0)
    # root in the middle of the sorted ranks: virtual ranks rotate
    r = simulate_transfers([bcast(8, [0, 4])], HOSTS, cluster(backend="gloo"))
    assert r.host(2).send_bytes == 2 * S  # ranks (0, 4, 8), root rank 2: sends to rank 0 and rank 1
    assert r.makespan_s == pytest.approx(2.0)
    nccl = simulate_transfers([bcast(0, [4, 8, 12])], HOSTS, cluster())
    assert nccl.makespan_s < 1.01


def test_result_accounting_and_empty_programs():
    r = simulate_transfers([], HOSTS, cluster())
    assert r.makespan_s == 0.0 and r.start_s == ()
    r = simulate_transfers([p2p(0, 4), bcast(8, [12, 16])], HOSTS, cluster())
    assert r.host(0).send_bytes == S and r.host(1).recv_bytes == S
    assert r.host(2).send_bytes == S and r.host(3).send_bytes == S and r.host(4).recv_bytes == S
    assert r.network_bytes == 3 * S
    assert r.backend == "nccl"
    with pytest.raises(KeyError):
        r.host(99)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="COPY"):
        SimTransfer(SimKind.COPY, 0, (1,), 1)
    with pytest.raises(ValueError, match="P2P"):
        SimTransfer(SimKind.P2P, 0, (0,), 1)
    with pytest.raises(ValueError, match="BROADCAST"):
        SimTransfer(SimKind.BROADCAST, 0, (1, 1), 1)
    with pytest.raises(ValueError, match="PULL"):
        SimTransfer(SimKind.PULL, 0, (0,), 1)
    with pytest.raises(ValueError, match="stays on one host"):
        simulate_transfers([pull(0, [4])], HOSTS, cluster())
    with pytest.raises(ValueError, match="only a PULL waits"):
        simulate_transfers([p2p(0, 4), SimTransfer(SimKind.P2P, 4, (8,), 1, after=0)], HOSTS, cluster())
    with pytest.raises(ValueError, match=">= 0"):
        SimTransfer(SimKind.P2P, 0, (1,), -1)
    with pytest.raises(ValueError, match="no host for devices"):
        simulate_transfers([p2p(0, 99)], HOSTS, cluster())
    with pytest.raises(ValueError, match="backend must name a backend"):
        simulate_transfers([p2p(0, 4)], HOSTS, cluster(), backend="")


def test_a_backend_other_than_nccl_broadcasts_as_gloo_does():
    """A registered backend (any name) is modelled as gloo: binomial trees, not NCCL's rings."""
    theirs = simulate_transfers([bcast(0, [4, 8, 12])], HOSTS, cluster(backend="mpi"))
    gloo = simulate_transfers([bcast(0, [4, 8, 12])], HOSTS, cluster(backend="gloo"))
    assert theirs.backend == "gloo" and theirs.makespan_s == gloo.makespan_s == pytest.approx(3.0)


def test_many_concurrent_flows_stay_feasible():
    # all-to-all between 8 hosts, every device busy: no NIC carries more than B at any time, so
    # the makespan is at least the busiest NIC's bytes / B
    flows = [p2p(4 * a + x, 4 * b + x, S // 16) for x in range(4) for a in range(8) for b in range(8) if a != b]
    hosts = {d: d // 4 for d in range(32)}
    r = simulate_transfers(flows, hosts, cluster())
    busiest = max(max(h.send_bytes, h.recv_bytes) for h in r.hosts)
    assert r.makespan_s >= busiest / 1e9 * (1 - 1e-9)
    assert all(h.send_busy_s <= r.makespan_s + 1e-9 for h in r.hosts)
    assert math.isfinite(r.makespan_s)


def test_every_host_nic_runs_at_its_own_rate():
    # host 1's NIC moves 0.5 GB/s, the others 1 GB/s
    c = Cluster.heterogeneous([1.0, 0.5, 1.0, 1.0], 4, 100.0, latency_us=0.0, intra_host_latency_us=0.0)
    hosts = {d: d // 4 for d in range(16)}
    r = simulate_transfers([p2p(4, 8), p2p(0, 12)], hosts, c)  # slow host -> host 2, fast host -> host 3
    assert r.end_s == pytest.approx([2.0, 1.0])
    assert r.host(1).send_busy_s == pytest.approx(2.0)
    # two flows into the slow host share its 0.5 GB/s; the fast sender gives its third flow the rest
    # (0.5 GB/s, not a third of its NIC), and that flow's end leaves the other two at 0.25 GB/s each
    r = simulate_transfers([p2p(0, 4), p2p(1, 5), p2p(2, 8)], hosts, c)
    assert r.end_s == pytest.approx([4.0, 4.0, 2.0])
    # a ring through the slow host runs at its rate; its pipeline fill counts the slower port of each hop
    r = simulate_transfers([bcast(0, [4, 8])], hosts, c)
    fill = NCCL_CHUNK_BYTES / 0.5e9
    assert r.makespan_s == pytest.approx(2.0 + fill + NCCL_BROADCAST_OVERHEAD_US * 1e-6)
    with pytest.raises(ValueError, match=r"uses hosts 0..4 but cluster 'custom' has hosts 0..3"):
        simulate_transfers([p2p(0, 16)], {**hosts, 16: 4}, c)


def test_a_window_overlaps_the_latencies_of_a_devices_messages():
    """Device 4 receives four empty messages from four hosts: one at a time they cost four
    latencies, in one window one; bytes still share its host's NIC."""
    c = cluster(latency_us=100.0)
    tiny = [p2p(src, 4, 0) for src in (0, 8, 12, 16)]
    for window, latencies in ((1, 4), (2, 2), (4, 1), (8, 1)):
        r = simulate_transfers(tiny, HOSTS, c, window=window)
        assert r.makespan_s == pytest.approx(latencies * 100e-6)
    full = [p2p(src, 4) for src in (0, 8, 12, 16)]
    assert simulate_transfers(full, HOSTS, c, window=4).makespan_s == pytest.approx(4.0 + 100e-6)
    with pytest.raises(ValueError, match="window must be >= 1"):
        simulate_transfers(tiny, HOSTS, c, window=0)


def test_a_window_closes_before_a_transfer_that_reads_what_it_wrote():
    """A relay (its root forwards what the window's receive brought) starts once that receive is
    done; a transfer that reads nothing of the window's rides along; the next window waits for
    every transfer of the one before."""
    c = cluster(latency_us=100.0)
    relay = SimTransfer(SimKind.P2P, 4, (8,), S, reads_landed=(4,))
    r = simulate_transfers([p2p(0, 4), relay], HOSTS, c, window=4)
    assert r.start_s[1] == pytest.approx(r.end_s[0])
    r = simulate_transfers([p2p(0, 4), p2p(4, 8)], HOSTS, c, window=4)
    assert r.start_s[1] == pytest.approx(0.0)
    r = simulate_transfers([p2p(0, 4), p2p(8, 4, 0), p2p(4, 12, 0)], HOSTS, c, window=2)
    assert r.start_s[2] == pytest.approx(r.end_s[0])


def test_the_root_of_a_pulled_relay_receives_one_slice_at_a_time():
    """Its peers pull each slice once it landed: in a window its two slices would land together."""
    c = cluster(latency_us=100.0, intra=10.0)
    program = [p2p(0, 4), p2p(8, 4), pull(4, [5], after=0), pull(4, [6], after=1)]
    r = simulate_transfers(program, HOSTS, c, window=4)
    assert r.end_s[0] == pytest.approx(1.0 + 100e-6) and r.start_s[2] == pytest.approx(r.end_s[0])
    assert r.start_s[1] == pytest.approx(r.end_s[0])


def test_a_window_holds_messages_of_at_most_window_bytes_together():
    """Bigger messages go one at a time (their order is the planner's schedule of the links)."""
    c = cluster(latency_us=100.0)
    full = [p2p(src, 4) for src in (0, 8, 12, 16)]
    r = simulate_transfers(full, HOSTS, c, window=4, window_bytes=S)
    assert r.makespan_s == pytest.approx(4 * (1.0 + 100e-6))
    assert r.start_s[1] == pytest.approx(r.end_s[0])
    tiny = [p2p(src, 4, 100) for src in (0, 8, 12, 16)]
    assert simulate_transfers(tiny, HOSTS, c, window=4, window_bytes=200).makespan_s == pytest.approx(
        2 * (100e-6 + 200 / 1e9)
    )


def test_a_forward_and_a_big_receive_share_a_window():
    """The byte bound is per direction of a device's link for a forward: device 4 forwards slice 0
    (a relay: it reads what it received) while slice 1 comes in, so the chain of two slices takes
    three steps, not four. A send of its own bytes takes both directions: it goes after the big
    receive, as two receives do."""
    c = cluster(latency_us=0.0)
    chain = [
        p2p(0, 4),
        SimTransfer(SimKind.P2P, 4, (8,), S, reads_landed=(4,)),
        p2p(12, 4),
        SimTransfer(SimKind.P2P, 4, (8,), S, reads_landed=(4,)),
    ]
    r = simulate_transfers(chain, HOSTS, c, window=4, window_bytes=S // 2)
    assert r.start_s[1] == pytest.approx(1.0) and r.start_s[2] == pytest.approx(1.0)
    assert r.makespan_s == pytest.approx(3.0)
    assert simulate_transfers(chain, HOSTS, c, window=1).makespan_s == pytest.approx(4.0)
    for second in (p2p(4, 8), p2p(8, 4)):
        r = simulate_transfers([p2p(0, 4), second], HOSTS, c, window=4, window_bytes=S // 2)
        assert r.start_s[1] == pytest.approx(r.end_s[0]) and r.makespan_s == pytest.approx(2.0)


def test_local_transfers_run_beside_the_messages_of_a_device_that_reads_nothing_it_received():
    """Device 5 pulls a slice out of 4's memory, then sends one to host 2: with ``local_beside``
    (the runtime's helper thread) the send does not wait for the pull. A device that forwards what
    it received keeps its order (the pull goes first)."""
    c = cluster(intra=1.0)
    program = [pull(4, [5]), p2p(5, 8)]
    assert simulate_transfers(program, HOSTS, c).start_s[1] == pytest.approx(1.0)
    beside = simulate_transfers(program, HOSTS, c, local_beside=True)
    assert beside.start_s == pytest.approx((0.0, 0.0)) and beside.makespan_s == pytest.approx(1.0)
    relay = [pull(4, [5]), p2p(0, 5), SimTransfer(SimKind.P2P, 5, (8,), S, reads_landed=(5,))]
    r = simulate_transfers(relay, HOSTS, c, local_beside=True)
    assert r.start_s[1] == pytest.approx(1.0)

"""Measured topology, pure part: ``LinkFigures`` (what a probe measured), clusters of Ray nodes with
job-wide host ids and per-node figures (``Cluster.from_nodes``, ``from_links``, ``for_hosts`` with a
rate per host), and the simulator's per-flow start and release rule for gloo binomial trees."""

from __future__ import annotations

import pytest

from topology.cluster import GUESSED_GLOO, Cluster
from topology.links import LinkFigures
from topology.simulator import SimKind, SimTransfer, simulate_transfers

pytestmark = pytest.mark.unit

GB = 1e9


def _links(nodes=("a", "b", "c"), nics=(0.125, 0.0625, 0.125), intra=0.85, latency=40.0, intra_latency=15.0):
    return LinkFigures(tuple(nodes), tuple(nics), intra, latency, intra_latency, 16 << 20)


def _node(node_id, cpus=1.0, gpus=0.0, alive=True):
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": cpus, **({"GPU": gpus} if gpus else {})}}


def test_link_figures_validate_and_answer_per_node():
    links = _links()
    assert links.nic_of("b") == 0.0625 and links.nic_of("zz") is None
    assert links.covers({"a", "c"}) and not links.covers({"a", "zz"})
    assert "NIC 0.0625-0.125 GB/s" in str(links) and "intra-node 0.85 GB/s" in str(links)
    with pytest.raises(ValueError, match="node_ids must be a non-empty sorted tuple"):
        LinkFigures(("b", "a"), (1.0, 1.0), None, None, None, 1)
    with pytest.raises(ValueError, match="one rate \\(or None\\) per node"):
        LinkFigures(("a", "b"), (1.0,), None, None, None, 1)
    with pytest.raises(ValueError, match="nic_GBps must be a positive finite GB/s"):
        LinkFigures(("a", "b"), (1.0, -2.0), None, None, None, 1)
    with pytest.raises(ValueError, match="latency_us must be a finite latency"):
        LinkFigures(("a",), (None,), None, float("inf"), None, 1)


def test_a_node_without_a_partner_covers_alone_but_not_with_others():
    alone = LinkFigures(("a", "b"), (None, 0.1), 1.0, None, None, 1)
    assert alone.covers({"a"}) and alone.covers({"b"})
    assert not alone.covers({"a", "b"}), "node a's NIC was not measured"


def test_from_nodes_numbers_hosts_with_the_given_ids_and_fills_gaps():
    nodes = [_node("n1"), _node("n2"), _node("dead", alive=False), _node("n3")]
    c = Cluster.from_nodes(nodes, host_ids={"n1": 3, "n2": 0, "n3": 1})
    assert c.num_hosts == 4
    assert c.host_names == ("n2", "n3", "logical", "n1")
    assert (c.backend, c.nic_GBps, c.intra_host_GBps) == ("gloo", GUESSED_GLOO["nic_GBps"], 5.0)
    with pytest.raises(ValueError, match="no host id for nodes \\['n3'\\]"):
        Cluster.from_nodes(nodes, host_ids={"n1": 0, "n2": 1})
    with pytest.raises(ValueError, match="distinct ints >= 0"):
        Cluster.from_nodes(nodes, host_ids={"n1": 0, "n2": 0, "n3": 1})


def test_from_nodes_counts_devices_per_node():
    nodes = [_node("a", cpus=96, gpus=8), _node("b", cpus=96, gpus=4), _node("head", cpus=8)]
    c = Cluster.from_nodes(nodes)
    assert c.backend == "nccl"
    assert [c.devices_on(h) for h in range(3)] == [8, 4, 1]
    assert c.num_devices == 13


def test_from_nodes_takes_measured_figures_per_node_and_explicit_ones_first():
    nodes = [_node("a"), _node("b"), _node("c")]
    c = Cluster.from_nodes(nodes, host_ids={"a": 0, "b": 1, "c": 2}, links=_links())
    assert c.name == "ray-probed"
    assert [c.nic_Bps_of(h) / GB for h in range(3)] == [0.125, 0.0625, 0.125]
    assert (c.intra_host_GBps, c.latency_us, c.intra_host_latency_us) == (0.85, 40.0, 15.0)
    forced = Cluster.from_nodes(nodes, links=_links(), nic_GBps=0.5, latency_us=7)
    assert [forced.nic_Bps_of(h) / GB for h in range(3)] == [0.5, 0.5, 0.5] and forced.latency_us == 7.0
    unprobed = Cluster.from_nodes([*nodes, _node("d")], links=_links())
    assert unprobed.nic_Bps_of(3) / GB == GUESSED_GLOO["nic_GBps"], "an unprobed node keeps the guess"


def test_for_hosts_with_one_rate_per_host():
    hosts = {0: 0, 1: 0, 2: 2, 3: 2}
    c = Cluster.for_hosts(hosts, nic_GBps={0: 0.1, 2: 0.05}, intra_host_GBps=1.0, latency_us=3, backend="gloo")
    assert (c.num_hosts, c.devices_per_host, c.backend, c.latency_us) == (3, 2, "gloo", 3.0)
    assert [c.nic_Bps_of(h) / GB for h in range(3)] == [0.1, 0.1, 0.05]
    assert Cluster.for_hosts(hosts, nic_GBps={0: 0.1, 2: 0.1}).host_nic_GBps is None
    with pytest.raises(ValueError, match="no rate for hosts \\[2\\]"):
        Cluster.for_hosts(hosts, nic_GBps={0: 0.1})


def test_from_links_gives_each_host_its_nodes_rate():
    hosts = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2}
    node_of = {0: "a", 1: "a", 2: "b", 3: "c", 4: "a"}  # host 1 spans nodes b and c
    c = Cluster.from_links(hosts, node_of, _links())
    assert [c.nic_Bps_of(h) / GB for h in range(3)] == [0.125, 0.0625, 0.125]
    assert (c.intra_host_GBps, c.latency_us, c.backend) == (0.85, 40.0, "gloo")
    partial = LinkFigures(("a", "b"), (None, 0.1), None, None, None, 1)
    p = Cluster.from_links({0: 0, 1: 1}, {0: "a", 1: "b"}, partial)
    assert [p.nic_Bps_of(h) / GB for h in range(2)] == [0.1, 0.1], "no partner: the fastest measured rate"
    assert (p.intra_host_GBps, p.latency_us) == (GUESSED_GLOO["intra_host_GBps"], GUESSED_GLOO["latency_us"])
    with pytest.raises(ValueError, match="no node for devices \\[1\\]"):
        Cluster.from_links({0: 0, 1: 1}, {0: "a"}, partial)


def _one_per_host(n: int, backend: str) -> tuple[dict[int, int], Cluster]:
    return {d: d for d in range(n)}, Cluster.homogeneous(n, 1, 1.0, 10.0, latency_us=0, backend=backend)


def test_a_gloo_tree_leaf_goes_on_while_the_tree_still_forwards():
    s = 10**9  # 1 s at 1 GB/s
    hosts, cluster = _one_per_host(5, "gloo")
    program = [SimTransfer(SimKind.BROADCAST, 0, (1, 2, 3), s), SimTransfer(SimKind.P2P, 2, (4,), s)]
    r = simulate_transfers(program, hosts, cluster)
    # tree over ranks 0..3: the root sends to 1 and 2 at once (half its NIC each, done at 2 s), then
    # 1 forwards to 3 (2 s -> 3 s); leaf 2 sends on to 4 from 2 s, beside that forward.
    assert r.end_s[0] == pytest.approx(3.0)
    assert r.start_s[1] == pytest.approx(2.0) and r.end_s[1] == pytest.approx(3.0)
    assert r.makespan_s == pytest.approx(3.0)
    nccl = simulate_transfers(program, hosts, Cluster.homogeneous(5, 1, 1.0, 10.0, latency_us=0, backend="nccl"))
    assert nccl.start_s[1] == pytest.approx(nccl.end_s[0]), "an NCCL ring holds every member until it drains"


def test_a_gloo_tree_edge_starts_when_its_two_ends_are_free():
    s = 10**9
    hosts, cluster = _one_per_host(4, "gloo")
    program = [SimTransfer(SimKind.P2P, 1, (3,), s), SimTransfer(SimKind.BROADCAST, 0, (1, 2), s)]
    r = simulate_transfers(program, hosts, cluster)
    # 0 -> 2 needs nobody busy: it runs 0..1 s at the full NIC; 0 -> 1 waits for device 1 (busy
    # until 1 s) and runs 1..2 s. A barrier at the start would give 1 s + 2 s of shared NIC = 3 s.
    assert r.start_s[1] == pytest.approx(0.0)
    assert r.end_s[1] == pytest.approx(2.0)
    assert r.makespan_s == pytest.approx(2.0)

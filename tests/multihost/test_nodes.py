"""The emulated cluster is what it claims: one Ray node per host on its own address, actors
pinned by node affinity run inside that host's namespace, data between nodes goes through the
shaped NICs and arrives bit-exact, and the raw network figures match the configured NIC."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import emulate

pytestmark = pytest.mark.multihost
SCENARIOS = Path(__file__).with_name("scenarios.py")
_LISTEN = (
    "import socket, sys; s = socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True); input()"
)


def _netns_id(cluster, host: int) -> list[int]:
    st = os.stat(f"/run/netns/{cluster.namespaces[host]}")
    return [st.st_dev, st.st_ino]


def test_one_node_per_host_on_its_own_address(cluster):
    got = cluster.scenario(SCENARIOS, "nodes")
    alive = {n["address"]: n for n in got["nodes"] if n["alive"]}
    assert len(set(cluster.addresses)) == cluster.hosts
    assert sorted(alive) == sorted(cluster.addresses)
    for k, address in enumerate(cluster.addresses):
        assert alive[address]["node_id"] == cluster.node_ids[k]
        assert alive[address]["resources"].get(f"host_{k}") == 1
    assert got["driver"]["node_ip"] == cluster.addresses[0]
    assert got["driver"]["netns"] == _netns_id(cluster, 0)


def test_addresses_live_inside_the_namespaces_only(cluster):
    root = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    assert not any(a in root.split() or f"{a}/" in root for a in cluster.addresses)
    for k in range(cluster.hosts):
        addrs = cluster.exec_in(k, ["ip", "-o", "-4", "addr", "show"], timeout_s=10).stdout
        inside = sorted(w.split("/")[0] for w in addrs.split() if "/" in w and w[0].isdigit())
        assert inside == sorted(["127.0.0.1", cluster.addresses[k]])
        routes = cluster.exec_in(k, ["ip", "-4", "route", "show"], timeout_s=10).stdout
        assert "default" not in routes


def test_actor_pinned_to_each_node_runs_in_that_namespace(cluster):
    got = cluster.scenario(SCENARIOS, "pinned_actors")
    assert len(got) == cluster.hosts
    for k, where in enumerate(got):
        assert where["node_ip"] == cluster.addresses[k]
        assert where["node_id"] == cluster.node_ids[k]
        assert where["netns"] == _netns_id(cluster, k)


def test_bytes_between_actors_on_two_nodes_arrive_bit_exact_through_the_shaped_nic(cluster, figures):
    size = 24 * 2**20
    got = cluster.scenario(SCENARIOS, "cross_node_bytes", size_bytes=size, src=1, dst=2, seed=11)
    assert got["source"]["node_id"] == cluster.node_ids[1]
    assert got["received"]["node_id"] == cluster.node_ids[2]
    assert got["source"]["sha256"] == got["expected"]
    assert got["received"]["sha256"] == got["expected"]
    assert got["received"]["size"] == size
    rate_GBps = size / got["seconds"] / 1e9
    figures["Ray object transfer between nodes"] = (
        f"{size >> 20} MiB in {got['seconds'] * 1e3:.0f} ms = {rate_GBps:.3f} GB/s "
        f"({rate_GBps / cluster.nic_GBps:.0%} of line)"
    )
    assert rate_GBps <= 1.05 * cluster.nic_GBps, "Ray's transfer beat the NIC: it did not go through the shaped link"


def test_shaped_stream_rate_and_round_trip(cluster, figures):
    line = cluster.nic_GBps
    one = cluster.stream_GBps(1, 0)
    two = cluster.stream_GBps([1, 2], 0)
    out = cluster.stream_GBps(0, 3)
    rtt_us = cluster.round_trip_us(0, 1)
    figures["TCP one stream 1->0"] = f"{one:.4f} GB/s ({one / line:.0%} of {cluster.nic_gbit:g} Gbit/s)"
    figures["TCP two senders 1,2->0"] = f"{two:.4f} GB/s together ({two / line:.0%})"
    figures["TCP one stream 0->3"] = f"{out:.4f} GB/s ({out / line:.0%})"
    figures["TCP round trip 0<->1"] = f"{rtt_us:.0f} us (median of 200)"
    for name, rate in (("one stream", one), ("two senders into one host", two), ("one stream out", out)):
        assert 0.80 * line <= rate <= 1.05 * line, f"{name}: {rate:.4f} GB/s against a {line} GB/s NIC"
    assert 0 < rtt_us < 10_000


def test_empty_actor_call_round_trip_to_another_node(cluster, figures):
    median_us = cluster.actor_call_us(1, calls=200)
    figures["empty Ray actor call, driver on host 0 -> actor on host 1"] = f"{median_us:.0f} us (median of 200)"
    assert 0 < median_us < 1e6


def test_listening_sockets_name_address_port_and_process(cluster):
    server = cluster.popen(
        2,
        [sys.executable, "-c", _LISTEN, cluster.addresses[2]],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(emulate.read_line(server, 30, "listener"))
        listeners = cluster.listening_sockets(2)
        ours = [x for x in listeners if x.port == port]
        assert [(x.address, x.port, x.pid) for x in ours] == [(cluster.addresses[2], port, server.pid)]
        assert ours[0].command.startswith("python") and not ours[0].wildcard
    finally:
        server.kill()
        server.wait(timeout=10)
    head = cluster.listening_sockets(0)
    assert any(x.port == cluster.head_port and x.command == "gcs_server" for x in head)


def test_a_failing_scenario_raises_with_its_error(cluster):
    with pytest.raises(emulate.EmulationError, match="NAME one of"):
        cluster.scenario(SCENARIOS, "no_such_scenario")
    with pytest.raises(emulate.EmulationError, match="LookupError: 0 alive Ray nodes at 10.255.255.255"):
        cluster.scenario(SCENARIOS, "node_of_address", address="10.255.255.255")


def test_ray_refuses_a_driver_without_the_clusters_token(cluster):
    """Ray's token auth is on in the emulated cluster: a driver with another token is turned away."""
    code = (
        "import ray\n"
        "try:\n"
        "    ray.init(address='auto')\n"
        "except Exception as e:\n"
        "    print('REFUSED', type(e).__name__, e)\n"
        "else:\n"
        "    print('JOINED')\n"
    )
    env = cluster.env(0) | {"RAY_AUTH_TOKEN": "0" * 64}
    done = cluster.run([sys.executable, "-c", code], env=env, timeout_s=120)
    assert "REFUSED" in done.stdout and "JOINED" not in done.stdout, done.stdout + done.stderr[-2000:]
    assert "auth" in (done.stdout + done.stderr).lower()

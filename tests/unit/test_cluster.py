"""topology.Cluster: presets, validation, meshes on a cluster, from_ray (with a stand-in ray module)."""

import math
import subprocess
import sys

import pytest

from topology import PRESETS, Cluster, Mesh
from topology.mesh import device_hosts

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "name, devices, nic_gbit",
    [("p3.8xlarge", 4, 10), ("p3.16xlarge", 8, 25), ("dgx-a100", 8, 8 * 200), ("dgx-h100", 8, 8 * 400)],
)
def test_presets_describe_the_machines(name, devices, nic_gbit):
    c = Cluster.preset(name, 3)
    assert (c.name, c.num_hosts, c.devices_per_host, c.num_devices) == (name, 3, devices, 3 * devices)
    assert c.nic_GBps == pytest.approx(nic_gbit / 8)
    assert c.nic_Bps == pytest.approx(nic_gbit / 8 * 1e9)
    assert c.intra_host_GBps > c.nic_GBps / devices  # NVLink beats each device's share of the NIC
    assert c.backend == "nccl"
    assert name in str(c)


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown cluster preset 'p4d'") as err:
        Cluster.preset("p4d", 2)
    for name in PRESETS:
        assert name in str(err.value)


@pytest.mark.parametrize("field", ["nic_GBps", "intra_host_GBps"])
@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, "fast"])
def test_bandwidth_must_be_positive_and_finite(field, value):
    kwargs = {"nic_GBps": 1.0, "intra_host_GBps": 10.0, field: value}
    with pytest.raises(ValueError, match=field):
        Cluster.homogeneous(2, 4, kwargs["nic_GBps"], kwargs["intra_host_GBps"])


def test_other_fields_are_validated():
    with pytest.raises(ValueError, match="num_hosts"):
        Cluster.homogeneous(0, 4, 1, 10)
    with pytest.raises(ValueError, match="devices_per_host"):
        Cluster.homogeneous(2, 1.5, 1, 10)
    with pytest.raises(ValueError, match="latency_us"):
        Cluster.homogeneous(2, 4, 1, 10, latency_us=-1)
    with pytest.raises(ValueError, match="backend must name a backend"):
        Cluster.homogeneous(2, 4, 1, 10, backend="")
    assert Cluster.homogeneous(2, 4, 1, 10, backend="mpi").backend == "mpi"  # a registered one: planned as gloo
    with pytest.raises(ValueError, match="host_names"):
        Cluster(2, 4, 1.0, 10.0, host_names=("a",))


def test_homogeneous_keeps_the_positional_api():
    c = Cluster(4, 2, 1.0, 10.0, 7.0, "lab")
    assert (c.latency_us, c.name, c.backend) == (7.0, "lab", "nccl")
    assert Cluster.homogeneous(4, 2, 1, 10, latency_us=7, name="lab") == c
    assert hash(c) == hash(Cluster.homogeneous(4, 2, 1, 10, latency_us=7, name="lab"))


def test_mesh_axis0_enumerates_hosts():
    c = Cluster.preset("p3.8xlarge", 4)
    m = c.mesh((2, 2), hosts=[1, 3], devices=[0, 2])
    assert m.device_ids == (4, 6, 12, 14)
    assert m.host_ids == (1, 1, 3, 3)
    m3 = c.mesh((2, 2, 2), hosts=[0, 2])
    assert m3.device_ids == (0, 1, 2, 3, 8, 9, 10, 11)
    assert c.mesh((4, 4)).hosts == (0, 1, 2, 3)


def test_meshes_larger_than_the_cluster_are_refused_with_the_numbers():
    c = Cluster.preset("p3.8xlarge", 2)
    with pytest.raises(ValueError, match=r"needs 3 hosts .* has 2 hosts"):
        c.mesh((3, 4))
    with pytest.raises(ValueError, match=r"asks for 8 devices per host .* has 4 devices per host"):
        c.mesh((2, 8))
    with pytest.raises(ValueError, match=r"hosts=\(0, 5\) must be distinct host indices in \[0, 2\)"):
        c.mesh((2, 2), hosts=[0, 5])
    with pytest.raises(ValueError, match="local indices 0..3"):
        c.mesh((1, 2), hosts=[0], devices=[0, 4])
    with pytest.raises(ValueError, match="needs 2 hosts on axis 0"):
        c.mesh((2, 2), hosts=[0])


def test_check_meshes_and_for_meshes():
    a = Mesh((2, 4))  # hosts 0, 1
    b = Mesh((3, 2), range(8, 14))  # hosts 4, 5, 6 (device // 2)
    c = Cluster.for_meshes(a, b)
    assert (c.num_hosts, c.devices_per_host, c.name) == (7, 4, "default")
    c.check_meshes(a, b)
    with pytest.raises(ValueError, match=r"uses host 6 but cluster 'p3.8xlarge' has 4 hosts"):
        Cluster.preset("p3.8xlarge", 4).check_meshes(a, b)
    crowded = Mesh((1, 8), range(8), [0] * 8)
    with pytest.raises(ValueError, match="8 distinct devices on host 0 .* 4 devices per host"):
        Cluster.preset("p3.8xlarge", 4).check_meshes(crowded)


def test_from_nodes_describes_gpu_nodes():
    nodes = [
        {"NodeID": "a", "Alive": True, "Resources": {"CPU": 96.0, "GPU": 8.0}},
        {"NodeID": "b", "Alive": True, "Resources": {"CPU": 96.0, "GPU": 8.0}},
        {"NodeID": "dead", "Alive": False, "Resources": {"CPU": 96.0, "GPU": 8.0}},
    ]
    c = Cluster.from_nodes(nodes, nic_GBps=50)
    assert (c.num_hosts, c.devices_per_host, c.backend, c.host_names, c.nic_GBps) == (2, 8, "nccl", ("a", "b"), 50.0)


def test_from_nodes_on_one_cpu_machine_is_one_gloo_host():
    c = Cluster.from_nodes([{"NodeID": "n", "Alive": True, "Resources": {"CPU": 2.0}}])
    assert (c.num_hosts, c.devices_per_host, c.backend, c.name) == (1, 2, "gloo", "ray")
    with pytest.raises(RuntimeError, match="no alive node"):
        Cluster.from_nodes([{"NodeID": "n", "Alive": False, "Resources": {"CPU": 2.0}}])


def test_from_ray_needs_a_connection():
    code = "from topology import Cluster\nCluster.from_ray()\n"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode != 0 and "call ray.init() first" in run.stderr


def test_topology_and_planning_stay_pure():
    code = (
        "import sys, topology, topology.simulator, reshard, reshard.planner, reshard.ir.cost\n"
        "bad = sorted(m for m in ('ray', 'torch', 'cupy') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------ heterogeneous


def test_heterogeneous_hosts_have_their_own_nic_rates_and_device_counts():
    c = Cluster.heterogeneous([1.0, 0.5, 2.0], [4, 2, 8], 50.0, latency_us=7, backend="gloo", name="lab")
    assert (c.num_hosts, c.nic_GBps, c.devices_per_host, c.num_devices) == (3, 2.0, 8, 14)
    assert [c.nic_Bps_of(h) for h in range(3)] == [1e9, 0.5e9, 2e9]
    assert [c.devices_on(h) for h in range(3)] == [4, 2, 8]
    assert (c.latency_us, c.backend, c.name) == (7.0, "gloo", "lab")
    assert "0.5-2 GB/s" in str(c) and "2-8 devices" in str(c)
    one_rate = Cluster.heterogeneous(1.0, [4, 2], 50.0)
    assert one_rate.host_nic_GBps is None and one_rate.nic_Bps_of(1) == 1e9 and one_rate.devices_on(1) == 2
    # uniform per-host figures are the homogeneous cluster
    assert Cluster.heterogeneous([1.0, 1.0], 4, 50.0) == Cluster.homogeneous(2, 4, 1.0, 50.0)
    with pytest.raises(ValueError, match=r"hosts 0..2, got host 3"):
        c.nic_Bps_of(3)


def test_heterogeneous_figures_are_validated():
    with pytest.raises(ValueError, match="nic_GBps"):
        Cluster.heterogeneous([1.0, 0.0], 4, 50.0)
    with pytest.raises(ValueError, match="nic_GBps"):
        Cluster.heterogeneous([1.0, "fast"], 4, 50.0)
    with pytest.raises(ValueError, match="host_devices must hold positive ints"):
        Cluster.heterogeneous(1.0, [4, 0], 50.0)
    with pytest.raises(ValueError, match="2 NIC rates but 3 device counts"):
        Cluster.heterogeneous([1.0, 2.0], [1, 2, 3], 50.0)
    with pytest.raises(ValueError, match="use Cluster.homogeneous"):
        Cluster.heterogeneous(1.0, 4, 50.0)
    with pytest.raises(ValueError, match="names no host"):
        Cluster.heterogeneous([], 4, 50.0)
    with pytest.raises(ValueError, match=r"tuple of 3 values \(one per host\)"):
        Cluster(3, 4, 2.0, 50.0, host_nic_GBps=(1.0, 2.0))
    with pytest.raises(ValueError, match="nic_GBps=1.0 must be the largest of host_nic_GBps"):
        Cluster(2, 4, 1.0, 50.0, host_nic_GBps=(1.0, 2.0))
    with pytest.raises(ValueError, match="devices_per_host=4 must be the largest of host_devices"):
        Cluster(2, 4, 1.0, 50.0, host_devices=(2, 2))


def test_meshes_on_a_heterogeneous_cluster_fit_each_host():
    c = Cluster.heterogeneous(1.0, [4, 2, 4], 50.0)
    m = c.mesh((2, 4), hosts=[0, 2])
    assert m.device_ids == (0, 1, 2, 3, 8, 9, 10, 11) and m.host_ids == (0, 0, 0, 0, 2, 2, 2, 2)
    assert c.mesh((3, 2)).device_ids == (0, 1, 4, 5, 8, 9)
    with pytest.raises(ValueError, match=r"asks for 4 devices per host .* has 2 devices per host on some of hosts"):
        c.mesh((2, 4), hosts=[0, 1])
    with pytest.raises(ValueError, match=r"local indices 0..1\) on some of hosts"):
        c.mesh((2, 1), hosts=[0, 1], devices=[3])
    c.check_meshes(m)
    with pytest.raises(ValueError, match="4 distinct devices on host 1 .* 2 devices there"):
        c.check_meshes(Mesh((1, 4), [4, 5, 6, 7], [1, 1, 1, 1]))


def test_check_hosts_and_for_hosts():
    hosts = {0: 0, 1: 0, 2: 0, 7: 3}
    c = Cluster.for_hosts(hosts)
    assert (c.num_hosts, c.devices_per_host, c.name) == (4, 3, "default")
    assert c == Cluster.for_meshes(Mesh((1, 3), [0, 1, 2], [0, 0, 0]), Mesh((1,), [7], [3]))
    c.check_hosts(hosts)
    with pytest.raises(ValueError, match=r"uses host 3 \(device 7\) but cluster 'p3.8xlarge' has 2 hosts"):
        Cluster.preset("p3.8xlarge", 2).check_hosts(hosts)
    with pytest.raises(ValueError, match="places 3 distinct devices on host 0 .* 2 devices per host"):
        Cluster.homogeneous(4, 2, 1.0, 10.0).check_hosts(hosts)


def test_device_hosts_over_meshes_and_with_an_override():
    a = Mesh((2, 2))  # devices 0..3 on hosts 0, 0, 1, 1
    b = Mesh((2,), [3, 9], [1, 4])
    assert device_hosts(a, b) == {0: 0, 1: 0, 2: 1, 3: 1, 9: 4}
    with pytest.raises(ValueError, match="device 3 sits on host 1 in one mesh but on host 2"):
        device_hosts(a, Mesh((1,), [3], [2]))
    override = {0: 5, 1: 5, 2: 5, 3: 5, 9: 6, 11: 0}
    assert device_hosts(a, b, hosts=override) == {0: 5, 1: 5, 2: 5, 3: 5, 9: 6}
    with pytest.raises(ValueError, match="no host for device 9"):
        device_hosts(a, b, hosts={0: 5, 1: 5, 2: 5, 3: 5})
    with pytest.raises(ValueError, match="maps device 0 to True"):
        device_hosts(a, hosts={0: True, 1: 0, 2: 0, 3: 0})

"""Clusters: hosts with a full-duplex NIC each and fast links between the devices of a host.

A ``Cluster`` is the cost model the planner and the network simulator (``topology.simulator``)
share:

- every host has one NIC that sends ``nic_GBps`` and receives ``nic_GBps`` at the same time (full
  duplex; a host with several NICs, like a DGX with one per GPU, is modelled as one NIC of their
  summed bandwidth, since NCCL stripes its channels over all of them);
- every device sends and receives ``intra_host_GBps`` to and from the other devices of its host
  (NVLink / NVSwitch, or shared memory for CPU "devices"); a local copy inside one device runs at
  that rate too;
- every network message pays ``latency_us`` and every intra-host message ``intra_host_latency_us``;
- ``backend`` names the collective library whose broadcast algorithm the simulator models
  (``"nccl"``: pipelined ring; ``"gloo"``: binomial tree).

``GBps`` is 1e9 bytes per second. Device ``d`` of a cluster built mesh lives on host
``d // devices_per_host`` (``Cluster.mesh``); plans may carry their own host ids, which must stay
below ``num_hosts`` (``check_meshes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from topology.mesh import Mesh

BACKENDS = ("nccl", "gloo")

# name: (devices per host, NIC GB/s per host, intra-host GB/s per device, network latency us)
# - p3.8xlarge / p3.16xlarge: V100 SXM2 with NVLink 2.0 (25 GB/s per link and direction); the
#   GPUs of a p3 host form a hybrid cube mesh where a pair is joined by one or two links, so a
#   device moves about 50 GB/s to its peers. "Up to 10 Gigabit" / "25 Gigabit" Ethernet:
#   1.25 / 3.125 GB/s. TCP over the AWS network: ~25 us per message.
# - dgx-a100: 8 x A100 with NVLink 3 through NVSwitch: 12 links x 25 GB/s = 300 GB/s per GPU and
#   direction. 8 x 200 Gbit/s HDR InfiniBand = 200 GB/s per host. ~5 us per IB message.
# - dgx-h100: 8 x H100 with NVLink 4 through NVSwitch: 18 links x 25 GB/s = 450 GB/s per GPU and
#   direction. 8 x 400 Gbit/s NDR InfiniBand = 400 GB/s per host. ~5 us per IB message.
PRESETS: dict[str, tuple[int, float, float, float]] = {
    "p3.8xlarge": (4, 10 / 8, 50.0, 25.0),
    "p3.16xlarge": (8, 25 / 8, 50.0, 25.0),
    "dgx-a100": (8, 8 * 200 / 8, 300.0, 5.0),
    "dgx-h100": (8, 8 * 400 / 8, 450.0, 5.0),
}

# Used when a plan is simulated or planned without a cluster: a 100 Gbit/s NIC per host and
# NVLink-class 100 GB/s between the devices of a host, a ratio typical of current GPU clusters.
DEFAULT_NIC_GBPS = 12.5
DEFAULT_INTRA_HOST_GBPS = 100.0
DEFAULT_LATENCY_US = 10.0


@dataclass(frozen=True, slots=True)
class Cluster:
    """``num_hosts`` hosts of ``devices_per_host`` devices; device ``d`` lives on host ``d // devices_per_host``.

    Each host's NIC sends and receives ``nic_GBps`` at once (full duplex); devices of one host
    exchange data at ``intra_host_GBps``; every network message pays ``latency_us`` and every
    intra-host message ``intra_host_latency_us``.
    """

    num_hosts: int
    devices_per_host: int
    nic_GBps: float
    intra_host_GBps: float
    latency_us: float = 5.0
    name: str = "custom"
    intra_host_latency_us: float = 2.0
    backend: str = "nccl"
    host_names: tuple[str, ...] | None = None

    def __post_init__(self):
        for name in ("num_hosts", "devices_per_host"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Cluster {name} must be a positive int, got {value!r}")
        for name in ("nic_GBps", "intra_host_GBps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
                raise ValueError(f"Cluster {name} must be a positive finite bandwidth in GB/s, got {value!r}")
        for name in ("latency_us", "intra_host_latency_us"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"Cluster {name} must be a finite latency >= 0 in microseconds, got {value!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"Cluster backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.host_names is not None and len(self.host_names) != self.num_hosts:
            raise ValueError(f"Cluster host_names names {len(self.host_names)} hosts, but num_hosts={self.num_hosts}")

    @classmethod
    def homogeneous(
        cls,
        num_hosts,
        devices_per_host,
        nic_GBps,
        intra_host_GBps,
        *,
        latency_us=5.0,
        intra_host_latency_us=2.0,
        backend="nccl",
        name="custom",
    ) -> Cluster:
        """``num_hosts`` identical hosts."""
        return cls(
            num_hosts, devices_per_host, _bandwidth("nic_GBps", nic_GBps),
            _bandwidth("intra_host_GBps", intra_host_GBps), float(latency_us), name,
            float(intra_host_latency_us), backend,
        )  # fmt: skip

    @classmethod
    def preset(cls, name: str, num_hosts: int) -> Cluster:
        """``num_hosts`` machines of a known kind: one of ``PRESETS`` (see the figures there)."""
        if name not in PRESETS:
            raise ValueError(f"unknown cluster preset {name!r}; choose one of {', '.join(PRESETS)}")
        devices, nic, intra, latency = PRESETS[name]
        return cls(num_hosts, devices, nic, intra, latency, name)

    @classmethod
    def for_meshes(cls, *meshes: Mesh, nic_GBps=DEFAULT_NIC_GBPS, intra_host_GBps=DEFAULT_INTRA_HOST_GBPS) -> Cluster:
        """The smallest homogeneous cluster holding ``meshes`` (by their host ids), with default figures.

        Planning and simulation use it when no cluster is given: ``DEFAULT_NIC_GBPS`` per host,
        ``DEFAULT_INTRA_HOST_GBPS`` per device, ``DEFAULT_LATENCY_US`` per network message.
        """
        per_host = _devices_per_host(meshes)
        num_hosts = 1 + max((h for m in meshes for h in m.host_ids), default=0)
        return cls(
            num_hosts, max(per_host.values(), default=1), float(nic_GBps), float(intra_host_GBps),
            DEFAULT_LATENCY_US, "default",
        )  # fmt: skip

    @classmethod
    def from_ray(cls, *, nic_GBps=None, intra_host_GBps=None, latency_us=None) -> Cluster:
        """The connected Ray cluster: one host per alive node (in ``ray.nodes()`` order).

        Devices per host: the most GPUs any node has, or, on a cluster without GPUs, the most CPUs
        (the runtime's CPU "devices"; backend gloo). Ray does not know link speeds, so the figures
        default to ``DEFAULT_NIC_GBPS`` / ``DEFAULT_INTRA_HOST_GBPS`` (GPUs) or 1.25 / 5 GB/s (gloo
        over TCP between CPU processes); pass the real ones when known. ``host_names`` holds the
        Ray node ids. Requires ``ray.init()`` to have been called.
        """
        from topology.runtime import alive_ray_nodes  # the runtime layer, loaded only here

        return cls.from_nodes(
            alive_ray_nodes(), nic_GBps=nic_GBps, intra_host_GBps=intra_host_GBps, latency_us=latency_us
        )

    @classmethod
    def from_nodes(cls, nodes, *, nic_GBps=None, intra_host_GBps=None, latency_us=None) -> Cluster:
        """A cluster of the alive nodes in ``nodes`` (``ray.nodes()`` records); see ``from_ray``."""
        nodes = [n for n in nodes if n.get("Alive", n.get("alive", False))]
        if not nodes:
            raise RuntimeError("the connected Ray cluster reports no alive node")
        gpus = [int(n.get("Resources", {}).get("GPU", 0)) for n in nodes]
        cpus = [int(n.get("Resources", {}).get("CPU", 0)) for n in nodes]
        has_gpus = max(gpus) > 0
        per_host = max(gpus) if has_gpus else max(max(cpus), 1)
        if nic_GBps is None:
            nic_GBps = DEFAULT_NIC_GBPS if has_gpus else 1.25
        if intra_host_GBps is None:
            intra_host_GBps = DEFAULT_INTRA_HOST_GBPS if has_gpus else 5.0
        if latency_us is None:
            latency_us = DEFAULT_LATENCY_US if has_gpus else 50.0
        names = tuple(str(n.get("NodeID", i)) for i, n in enumerate(nodes))
        return cls(
            len(nodes), per_host, _bandwidth("nic_GBps", nic_GBps), _bandwidth("intra_host_GBps", intra_host_GBps),
            float(latency_us), "ray", 2.0 if has_gpus else 10.0, "nccl" if has_gpus else "gloo", names,
        )  # fmt: skip

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host

    @property
    def nic_Bps(self) -> float:
        """NIC bandwidth per host and direction in bytes per second."""
        return self.nic_GBps * 1e9

    @property
    def intra_host_Bps(self) -> float:
        return self.intra_host_GBps * 1e9

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.num_hosts} hosts x {self.devices_per_host} devices, NIC {self.nic_GBps:g} GB/s "
            f"per host, intra-host {self.intra_host_GBps:g} GB/s, latency {self.latency_us:g} us, {self.backend}"
        )

    def check_meshes(self, *meshes: Mesh) -> None:
        """Raise ValueError unless the hosts and devices ``meshes`` use fit in this cluster."""
        for mesh in meshes:
            too_far = [h for h in mesh.hosts if h >= self.num_hosts]
            if too_far:
                raise ValueError(
                    f"{mesh} uses host {max(too_far)} but cluster {self.name!r} has {self.num_hosts} hosts "
                    f"(ids 0..{self.num_hosts - 1}); use a cluster with at least {max(too_far) + 1} hosts"
                )
        for host, count in _devices_per_host(meshes).items():
            if count > self.devices_per_host:
                raise ValueError(
                    f"the meshes place {count} distinct devices on host {host} but cluster {self.name!r} has "
                    f"{self.devices_per_host} devices per host"
                )

    def mesh(self, shape, hosts=None, *, devices=None, axis_names=None) -> Mesh:
        """An abstract mesh on this cluster: axis 0 enumerates ``hosts``, the other axes devices on each.

        ``devices`` picks which local devices of each host to use (default: the first ones), so a
        2x2 mesh may use 2 of a host's 4 devices.
        """
        shape = tuple(shape) if not isinstance(shape, int) else (shape,)
        if not shape or any(not isinstance(n, int) or isinstance(n, bool) or n <= 0 for n in shape):
            raise ValueError(f"mesh shape must be a tuple of positive ints, got {shape!r}")
        per_host = math.prod(shape[1:])
        if hosts is None and shape[0] > self.num_hosts:
            raise ValueError(
                f"mesh {shape} needs {shape[0]} hosts on axis 0 but cluster {self.name!r} has {self.num_hosts} hosts"
            )
        hosts = tuple(range(shape[0])) if hosts is None else tuple(hosts)
        if len(hosts) != shape[0]:
            raise ValueError(f"mesh {shape} needs {shape[0]} hosts on axis 0, got hosts={hosts}")
        if len(set(hosts)) != len(hosts) or any(not 0 <= h < self.num_hosts for h in hosts):
            raise ValueError(
                f"hosts={hosts} must be distinct host indices in [0, {self.num_hosts}) of cluster {self.name!r} "
                f"({self.num_hosts} hosts)"
            )
        if per_host > self.devices_per_host:
            raise ValueError(
                f"mesh {shape} asks for {per_host} devices per host but cluster {self.name!r} has "
                f"{self.devices_per_host} devices per host"
            )
        devices = tuple(range(per_host)) if devices is None else tuple(devices)
        if len(devices) != per_host or len(set(devices)) != per_host:
            raise ValueError(f"mesh {shape} needs {per_host} distinct devices per host, got devices={devices}")
        if any(not 0 <= d < self.devices_per_host for d in devices):
            raise ValueError(
                f"mesh {shape} asks for local devices {devices} but cluster {self.name!r} has "
                f"{self.devices_per_host} devices per host (local indices 0..{self.devices_per_host - 1})"
            )
        device_ids = [h * self.devices_per_host + d for h in hosts for d in devices]
        host_ids = [h for h in hosts for _ in devices]
        return Mesh(shape, device_ids, host_ids, axis_names=axis_names)


def _bandwidth(name: str, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"Cluster {name} must be a positive bandwidth in GB/s, got {value!r}") from None


def _devices_per_host(meshes) -> dict[int, int]:
    devices: dict[int, set[int]] = {}
    for mesh in meshes:
        for d, h in zip(mesh.device_ids, mesh.host_ids, strict=True):
            devices.setdefault(h, set()).add(d)
    return {h: len(ds) for h, ds in devices.items()}

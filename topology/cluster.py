"""Clusters: hosts with a full-duplex NIC each and fast links between the devices of a host."""

from __future__ import annotations

from dataclasses import dataclass

from topology.mesh import Mesh


@dataclass(frozen=True, slots=True)
class Cluster:
    """``num_hosts`` hosts of ``devices_per_host`` devices; device ``d`` lives on host ``d // devices_per_host``.

    Each host's NIC sends and receives ``nic_GBps`` at once (full duplex); devices of one host
    exchange data at ``intra_host_GBps``; every message pays ``latency_us``.
    """

    num_hosts: int
    devices_per_host: int
    nic_GBps: float
    intra_host_GBps: float
    latency_us: float = 5.0
    name: str = "custom"

    def __post_init__(self):
        for name in ("num_hosts", "devices_per_host"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Cluster {name} must be a positive int, got {value!r}")
        for name in ("nic_GBps", "intra_host_GBps"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"Cluster {name} must be a positive bandwidth in GB/s, got {value!r}")
        if not self.latency_us >= 0:
            raise ValueError(f"Cluster latency_us must be >= 0, got {self.latency_us!r}")

    @classmethod
    def homogeneous(cls, num_hosts, devices_per_host, nic_GBps, intra_host_GBps, *, latency_us=5.0, name="custom"):
        return cls(num_hosts, devices_per_host, float(nic_GBps), float(intra_host_GBps), float(latency_us), name)

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host

    def mesh(self, shape, hosts=None, *, devices=None, axis_names=None) -> Mesh:
        """An abstract mesh on this cluster: axis 0 enumerates ``hosts``, the other axes devices on each.

        ``devices`` picks which local devices of each host to use (default: the first ones), so a
        2x2 mesh may use 2 of a host's 4 devices.
        """
        shape = tuple(shape) if not isinstance(shape, int) else (shape,)
        if not shape or any(not isinstance(n, int) or n <= 0 for n in shape):
            raise ValueError(f"mesh shape must be a tuple of positive ints, got {shape!r}")
        per_host = 1
        for n in shape[1:]:
            per_host *= n
        hosts = tuple(range(shape[0])) if hosts is None else tuple(hosts)
        if len(hosts) != shape[0]:
            raise ValueError(f"mesh {shape} needs {shape[0]} hosts on axis 0, got hosts={hosts}")
        if len(set(hosts)) != len(hosts) or any(not 0 <= h < self.num_hosts for h in hosts):
            raise ValueError(
                f"hosts={hosts} must be distinct host indices in [0, {self.num_hosts}) of cluster {self.name!r} "
                f"({self.num_hosts} hosts)"
            )
        devices = tuple(range(per_host)) if devices is None else tuple(devices)
        if len(devices) != per_host or len(set(devices)) != per_host:
            raise ValueError(f"mesh {shape} needs {per_host} distinct devices per host, got devices={devices}")
        if per_host > self.devices_per_host or any(not 0 <= d < self.devices_per_host for d in devices):
            raise ValueError(
                f"mesh {shape} asks for {per_host} devices per host (local indices {devices}) but cluster "
                f"{self.name!r} has {self.devices_per_host} devices per host"
            )
        device_ids = [h * self.devices_per_host + d for h in hosts for d in devices]
        host_ids = [h for h in hosts for _ in devices]
        return Mesh(shape, device_ids, host_ids, axis_names=axis_names)

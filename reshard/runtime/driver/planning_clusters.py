"""The cost model ``auto`` plans a reshard with, per backend and set of hosts, cached."""

from __future__ import annotations

import dataclasses
import threading

from reshard.runtime.driver.device_registry import DeviceRegistry
from topology.cluster import Cluster

MAX_CACHED = 256


class PlanningClusters:
    """``get``: the hosts of a reshard (device -> host) with the link figures measured for their
    nodes (``reshard.runtime.probe_links``; ``Cluster.from_links``), else the live Ray cluster's
    guessed ones (``Cluster.from_ray``), and the backend that will run the plan. A new probe
    (``links_generation``) makes new entries."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cached: dict = {}
        self._live: Cluster | None = None

    def get(self, backend: str, hosts: dict[int, int], registry: DeviceRegistry) -> Cluster:
        from topology.runtime import cached_links, links_generation

        key = (backend, tuple(sorted(hosts.items())), links_generation())
        with self._lock:
            hit = self._cached.get(key)
            if hit is None:
                node_of = {d: r.node_id for d in hosts if (r := registry.devices.get(d)) is not None}
                links = cached_links(set(node_of.values())) if len(node_of) == len(hosts) else None
                if links is not None:
                    hit = Cluster.from_links(hosts, node_of, links, backend=backend)
            if hit is None:
                if self._live is None:
                    self._live = Cluster.from_ray()
                live = self._live
                sized = Cluster.for_hosts(hosts, nic_GBps=live.nic_GBps, intra_host_GBps=live.intra_host_GBps)
                hit = dataclasses.replace(
                    sized,
                    latency_us=live.latency_us,
                    intra_host_latency_us=live.intra_host_latency_us,
                    backend=backend,
                    name="ray",
                )
            if key not in self._cached:
                if len(self._cached) > MAX_CACHED:
                    self._cached.clear()
                self._cached[key] = hit
            return hit

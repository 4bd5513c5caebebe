"""Clusters: hosts with a full-duplex NIC each and fast links between the devices of a host.

A ``Cluster`` is the cost model the planner and the network simulator (``topology.simulator``)
share:

- every host has one NIC that sends and receives at its rate at the same time (full duplex; a host
  with several NICs, like a DGX with one per GPU, is modelled as one NIC of their summed bandwidth,
  since NCCL stripes its channels over all of them). Uniform clusters give every host
  ``nic_GBps``; heterogeneous ones (``Cluster.heterogeneous``) give each host its own rate
  (``host_nic_GBps``) and device count (``host_devices``); ``nic_Bps_of(host)`` and
  ``devices_on(host)`` read either;
- every device sends and receives ``intra_host_GBps`` to and from the other devices of its host
  (NVLink / NVSwitch, or shared memory for CPU "devices"); a local copy inside one device runs at
  that rate too;
- every network message pays ``latency_us`` and every intra-host message ``intra_host_latency_us``;
- ``backend`` names the communicator backend; the simulator models its broadcasts as the library
  it plans as (``topology.links.broadcast_model``: ``"nccl"``, a pipelined ring; gloo and any
  other backend, a binomial tree).

``GBps`` is 1e9 bytes per second. Device ``d`` of a cluster built mesh lives on host
``d // devices_per_host`` (``Cluster.mesh``); plans may carry their own host ids, which must stay
below ``num_hosts`` (``check_meshes``, ``check_hosts``).

A Ray cluster (``Cluster.from_ray`` / ``from_nodes``) has one host per node, numbered with the
job-wide host ids the runtime gives its meshes. Its link figures are MEASURED when a
``LinkFigures`` (``reshard.runtime.probe_links``) is given, and otherwise GUESSES: Ray does
not know link speeds (``GUESSED_GLOO``, ``DEFAULT_*``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from topology.links import LinkFigures, broadcast_model, check_backend, is_bandwidth, spread
from topology.mesh import Mesh

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

# Guesses for a Ray cluster of CPU nodes (gloo over TCP between CPU processes) that was not probed:
# a 10 Gbit/s NIC, 5 GB/s between two processes of a node, 50 us per network message and 10 us per
# message inside a node. Measured on emulated hosts, gloo between two actors of one node moved
# ~0.85 GB/s; probe (``LinkFigures``) to plan with real figures.
GUESSED_GLOO = {"nic_GBps": 1.25, "intra_host_GBps": 5.0, "latency_us": 50.0, "intra_host_latency_us": 10.0}


@dataclass(frozen=True, slots=True)
class Cluster:
    """``num_hosts`` hosts of ``devices_per_host`` devices; device ``d`` lives on host ``d // devices_per_host``.

    Each host's NIC sends and receives ``nic_GBps`` at once (full duplex); devices of one host
    exchange data at ``intra_host_GBps``; every network message pays ``latency_us`` and every
    intra-host message ``intra_host_latency_us``. A heterogeneous cluster also names every host's
    own NIC rate (``host_nic_GBps``; ``nic_GBps`` is then the fastest) and device count
    (``host_devices``; ``devices_per_host`` is then the largest).
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
    host_nic_GBps: tuple[float, ...] | None = None
    host_devices: tuple[int, ...] | None = None

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
        check_backend("Cluster", self.backend)
        if self.host_names is not None and len(self.host_names) != self.num_hosts:
            raise ValueError(f"Cluster host_names names {len(self.host_names)} hosts, but num_hosts={self.num_hosts}")
        self._check_per_host("host_nic_GBps", "nic_GBps", is_bandwidth, "positive finite bandwidths in GB/s")
        self._check_per_host("host_devices", "devices_per_host", _is_count, "positive ints")

    def _check_per_host(self, name: str, summary: str, valid, what: str) -> None:
        values = getattr(self, name)
        if values is None:
            return
        if not isinstance(values, tuple) or len(values) != self.num_hosts:
            raise ValueError(
                f"Cluster {name} must be a tuple of {self.num_hosts} values (one per host), got {values!r}"
            )
        if not all(valid(v) for v in values):
            raise ValueError(f"Cluster {name} must hold {what}, got {values!r}")
        if getattr(self, summary) != max(values):
            raise ValueError(
                f"Cluster {summary}={getattr(self, summary)!r} must be the largest of {name}={values!r}; "
                f"build per-host clusters with Cluster.heterogeneous"
            )

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
            num_hosts,
            devices_per_host,
            _bandwidth("nic_GBps", nic_GBps),
            _bandwidth("intra_host_GBps", intra_host_GBps),
            float(latency_us),
            name,
            float(intra_host_latency_us),
            backend,
        )

    @classmethod
    def heterogeneous(
        cls,
        nic_GBps,
        devices_per_host,
        intra_host_GBps,
        *,
        latency_us=5.0,
        intra_host_latency_us=2.0,
        backend="nccl",
        name="custom",
        host_names=None,
    ) -> Cluster:
        """Hosts that differ: ``nic_GBps`` and ``devices_per_host`` are each one value for every host
        or a sequence with one value per host (host ``h`` is index ``h``), at least one a sequence.
        Uniform sequences give the homogeneous cluster (equal to ``Cluster.homogeneous``)."""
        nics = _per_host("nic_GBps", nic_GBps)
        counts = _per_host("devices_per_host", devices_per_host)
        lengths = {len(v) for v in (nics, counts) if v is not None}
        if not lengths:
            raise ValueError(
                "Cluster.heterogeneous needs per-host nic_GBps or devices_per_host; use Cluster.homogeneous"
            )
        if len(lengths) > 1:
            raise ValueError(
                f"Cluster.heterogeneous got {len(nics or ())} NIC rates but {len(counts or ())} device counts; "
                f"give one per host"
            )
        num_hosts = lengths.pop()
        if nics is not None:
            nics = tuple(_bandwidth("nic_GBps", v) for v in nics)
        top_nic = max(nics) if nics else _bandwidth("nic_GBps", nic_GBps)
        top_count = max(counts) if counts else devices_per_host
        return cls(
            num_hosts,
            top_count,
            top_nic,
            _bandwidth("intra_host_GBps", intra_host_GBps),
            float(latency_us),
            name,
            float(intra_host_latency_us),
            backend,
            None if host_names is None else tuple(host_names),
            _unless_uniform(nics),
            _unless_uniform(counts),
        )

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
        pairs = [(d, h) for m in meshes for d, h in zip(m.device_ids, m.host_ids, strict=True)]
        return cls._smallest(pairs, nic_GBps, intra_host_GBps)

    @classmethod
    def for_hosts(
        cls,
        hosts: Mapping[int, int],
        *,
        nic_GBps=DEFAULT_NIC_GBPS,
        intra_host_GBps=DEFAULT_INTRA_HOST_GBPS,
        latency_us=DEFAULT_LATENCY_US,
        intra_host_latency_us=2.0,
        backend="nccl",
        name="default",
    ) -> Cluster:
        """The smallest cluster holding the devices of ``hosts`` (global device id -> host id), with
        default figures unless given: what a plan with that host map is costed on without a cluster.

        ``nic_GBps`` is one rate for every host or a mapping host -> rate (hosts it leaves out, which
        hold none of the devices, get the fastest rate)."""
        per_host = _devices_per_host(hosts.items())
        num_hosts = 1 + max(per_host, default=0)
        devices = max(per_host.values(), default=1)
        if isinstance(nic_GBps, Mapping):
            rates = {h: _bandwidth("nic_GBps", v) for h, v in nic_GBps.items()}
            missing = sorted(set(per_host) - set(rates))
            if missing:
                raise ValueError(f"Cluster.for_hosts nic_GBps has no rate for hosts {missing}; give one per host")
            top = max(rates.values())
            nics = tuple(rates.get(h, top) for h in range(num_hosts))
            return cls(
                num_hosts,
                devices,
                top,
                _bandwidth("intra_host_GBps", intra_host_GBps),
                float(latency_us),
                name,
                float(intra_host_latency_us),
                backend,
                None,
                _unless_uniform(nics),
            )
        return cls(
            num_hosts,
            devices,
            _bandwidth("nic_GBps", nic_GBps),
            _bandwidth("intra_host_GBps", intra_host_GBps),
            float(latency_us),
            name,
            float(intra_host_latency_us),
            backend,
        )

    @classmethod
    def _smallest(cls, pairs: Iterable[tuple[int, int]], nic_GBps, intra_host_GBps) -> Cluster:
        per_host = _devices_per_host(pairs)
        return cls(
            1 + max(per_host, default=0),
            max(per_host.values(), default=1),
            float(nic_GBps),
            float(intra_host_GBps),
            DEFAULT_LATENCY_US,
            "default",
        )

    @classmethod
    def from_ray(cls, *, links: LinkFigures | None = None, nic_GBps=None, intra_host_GBps=None, latency_us=None):
        """The connected Ray cluster: one host per alive node, numbered with the job-wide host ids
        the runtime gives its meshes' nodes (claimed in Ray's key-value store; on a single node,
        whose meshes have logical hosts, the node is host 0). See ``from_nodes`` for devices and
        figures: measured ones from ``links``, by default the latest this process measured for
        these nodes (``reshard.runtime.probe_links``), else guesses. ``host_names`` holds the
        Ray node ids. Requires ``ray.init()`` to have been called.
        """
        from topology.runtime import alive_ray_nodes, cached_links, node_host_ids  # runtime layer, loaded here

        nodes = [n for n in alive_ray_nodes() if n.get("Alive")]
        ids = node_host_ids([n["NodeID"] for n in nodes]) if len(nodes) > 1 else None
        if links is None:
            links = cached_links([n["NodeID"] for n in nodes])
        return cls.from_nodes(
            nodes, host_ids=ids, links=links, nic_GBps=nic_GBps, intra_host_GBps=intra_host_GBps, latency_us=latency_us
        )

    @classmethod
    def from_links(
        cls, hosts: Mapping[int, int], node_of: Mapping[int, str], links: LinkFigures, *, backend: str = "gloo"
    ) -> Cluster:
        """The smallest cluster holding the devices of ``hosts`` (device -> host), with the figures
        ``links`` measured on their Ray nodes (``node_of``: device -> node id): each host's NIC rate
        is its node's (the slowest when its devices sit on several nodes; the fastest measured for a
        node that had no partner to measure against), the intra-node rate and latencies as measured
        (``GUESSED_GLOO`` / ``DEFAULT_*`` where a figure was not measured)."""
        if not isinstance(links, LinkFigures):
            raise TypeError(f"links must be a topology.links.LinkFigures, got {type(links).__name__}")
        missing = sorted(d for d in hosts if d not in node_of)
        if missing:
            raise ValueError(f"Cluster.from_links: node_of has no node for devices {missing[:8]}")
        gloo = broadcast_model(backend) == "gloo"
        measured = [v for v in links.nic_GBps if v is not None]
        fallback = max(measured) if measured else GUESSED_GLOO["nic_GBps"] if gloo else DEFAULT_NIC_GBPS
        nic: dict[int, float] = {}
        for d, h in hosts.items():
            rate = links.nic_of(node_of[d]) or fallback
            nic[h] = min(nic.get(h, rate), rate)
        guess = (
            GUESSED_GLOO
            if gloo
            else {
                "intra_host_GBps": DEFAULT_INTRA_HOST_GBPS,
                "latency_us": DEFAULT_LATENCY_US,
                "intra_host_latency_us": 2.0,
            }
        )

        def figure(value, key):
            return guess[key] if value is None else value

        return cls.for_hosts(
            hosts,
            nic_GBps=nic,
            intra_host_GBps=figure(links.intra_host_GBps, "intra_host_GBps"),
            latency_us=figure(links.latency_us, "latency_us"),
            intra_host_latency_us=figure(links.intra_host_latency_us, "intra_host_latency_us"),
            backend=backend,
            name="ray-probed",
        )

    @classmethod
    def from_nodes(
        cls, nodes, *, host_ids=None, links=None, nic_GBps=None, intra_host_GBps=None, latency_us=None
    ) -> Cluster:
        """A cluster of the alive nodes in ``nodes`` (``ray.nodes()`` records).

        Hosts: ``host_ids`` maps node id -> host id (default: the nodes in order, 0..n-1); a host id
        no node has (a logical host the runtime numbered) becomes a placeholder host named
        "logical" with the largest device count. Devices per host: the node's GPUs, or, on a
        cluster without GPUs, its CPUs (the runtime's CPU "devices"; backend gloo). Figures, each:
        the value given here, else the measured one from ``links`` (per node NIC rates), else a
        guess: ``DEFAULT_*`` (GPUs) or ``GUESSED_GLOO`` (CPUs).
        """
        nodes = [n for n in nodes if n.get("Alive", n.get("alive", False))]
        if not nodes:
            raise RuntimeError("the connected Ray cluster reports no alive node")
        if links is not None and not isinstance(links, LinkFigures):
            raise TypeError(f"links must be a topology.links.LinkFigures, got {type(links).__name__}")
        names = [str(n.get("NodeID", i)) for i, n in enumerate(nodes)]
        if host_ids is None:
            host_ids = {name: i for i, name in enumerate(names)}
        missing = [name for name in names if name not in host_ids]
        if missing:
            raise ValueError(f"from_nodes host_ids has no host id for nodes {missing}")
        hosts = [host_ids[name] for name in names]
        if len(set(hosts)) != len(hosts) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hosts
        ):
            raise ValueError(f"from_nodes host_ids must give the nodes distinct ints >= 0, got {dict(host_ids)}")
        gpus = [int(n.get("Resources", {}).get("GPU", 0)) for n in nodes]
        cpus = [int(n.get("Resources", {}).get("CPU", 0)) for n in nodes]
        has_gpus = max(gpus) > 0
        counts = [max(g, 1) for g in gpus] if has_gpus else [max(c, 1) for c in cpus]
        guess = (
            {
                "nic_GBps": DEFAULT_NIC_GBPS,
                "intra_host_GBps": DEFAULT_INTRA_HOST_GBPS,
                "latency_us": DEFAULT_LATENCY_US,
                "intra_host_latency_us": 2.0,
            }
            if has_gpus
            else GUESSED_GLOO
        )

        def figure(given, measured, key):
            return given if given is not None else measured if measured is not None else guess[key]

        probed = links or LinkFigures((names[0],), (None,), None, None, None, 1, "nccl" if has_gpus else "gloo")
        nic_by_host = {
            h: _bandwidth("nic_GBps", figure(nic_GBps, probed.nic_of(name), "nic_GBps"))
            for h, name in zip(hosts, names, strict=True)
        }
        count_by_host = dict(zip(hosts, counts, strict=True))
        num_hosts = max(hosts) + 1
        top_count = max(max(counts), 1)
        top_nic = max(nic_by_host.values())
        nics = tuple(nic_by_host.get(h, top_nic) for h in range(num_hosts))
        devs = tuple(count_by_host.get(h, top_count) for h in range(num_hosts))
        by_host = dict(zip(hosts, names, strict=True))
        return cls(
            num_hosts,
            max(devs),
            top_nic,
            _bandwidth("intra_host_GBps", figure(intra_host_GBps, probed.intra_host_GBps, "intra_host_GBps")),
            float(figure(latency_us, probed.latency_us, "latency_us")),
            "ray" if links is None else "ray-probed",
            float(figure(None, probed.intra_host_latency_us, "intra_host_latency_us")),
            "nccl" if has_gpus else "gloo",
            tuple(by_host.get(h, "logical") for h in range(num_hosts)),
            _unless_uniform(nics),
            _unless_uniform(devs),
        )

    @property
    def num_devices(self) -> int:
        if self.host_devices is not None:
            return sum(self.host_devices)
        return self.num_hosts * self.devices_per_host

    @property
    def nic_Bps(self) -> float:
        """NIC bandwidth per direction in bytes per second: every host's, or the fastest host's."""
        return self.nic_GBps * 1e9

    def nic_Bps_of(self, host: int) -> float:
        """Host ``host``'s NIC bandwidth per direction in bytes per second."""
        self._check_host(host)
        return self.nic_Bps if self.host_nic_GBps is None else self.host_nic_GBps[host] * 1e9

    def devices_on(self, host: int) -> int:
        """How many devices host ``host`` has."""
        self._check_host(host)
        return self.devices_per_host if self.host_devices is None else self.host_devices[host]

    def _check_host(self, host: int) -> None:
        if not isinstance(host, int) or isinstance(host, bool) or not 0 <= host < self.num_hosts:
            raise ValueError(f"cluster {self.name!r} has hosts 0..{self.num_hosts - 1}, got host {host!r}")

    @property
    def intra_host_Bps(self) -> float:
        return self.intra_host_GBps * 1e9

    def __str__(self) -> str:
        devices = spread(self.host_devices) if self.host_devices else f"{self.devices_per_host:g}"
        nic = spread(self.host_nic_GBps) if self.host_nic_GBps else f"{self.nic_GBps:g}"
        return (
            f"{self.name}: {self.num_hosts} hosts x {devices} devices, NIC {nic} GB/s "
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
        pairs = [(d, h) for m in meshes for d, h in zip(m.device_ids, m.host_ids, strict=True)]
        self._check_counts(_devices_per_host(pairs), "the meshes place")

    def check_hosts(self, hosts: Mapping[int, int]) -> None:
        """Raise ValueError unless the device -> host map ``hosts`` fits in this cluster."""
        too_far = {h: d for d, h in hosts.items() if h >= self.num_hosts}
        if too_far:
            host = max(too_far)
            raise ValueError(
                f"the plan uses host {host} (device {too_far[host]}) but cluster {self.name!r} has {self.num_hosts} "
                f"hosts (ids 0..{self.num_hosts - 1}); use a cluster with at least {host + 1} hosts"
            )
        self._check_counts(_devices_per_host(hosts.items()), "the plan places")

    def _check_counts(self, per_host: Mapping[int, int], who: str) -> None:
        for host, count in per_host.items():
            if count > self.devices_on(host):
                raise ValueError(
                    f"{who} {count} distinct devices on host {host} but cluster {self.name!r} has "
                    f"{self.devices_on(host)} devices {'per host' if self.host_devices is None else 'there'}"
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
        fewest = min(self.devices_on(h) for h in hosts)
        if per_host > fewest:
            raise ValueError(
                f"mesh {shape} asks for {per_host} devices per host but cluster {self.name!r} has "
                f"{fewest} devices per host" + ("" if self.host_devices is None else f" on some of hosts {hosts}")
            )
        devices = tuple(range(per_host)) if devices is None else tuple(devices)
        if len(devices) != per_host or len(set(devices)) != per_host:
            raise ValueError(f"mesh {shape} needs {per_host} distinct devices per host, got devices={devices}")
        if any(not 0 <= d < fewest for d in devices):
            raise ValueError(
                f"mesh {shape} asks for local devices {devices} but cluster {self.name!r} has "
                f"{fewest} devices per host (local indices 0..{fewest - 1})"
                + ("" if self.host_devices is None else f" on some of hosts {hosts}")
            )
        device_ids = [h * self.devices_per_host + d for h in hosts for d in devices]
        host_ids = [h for h in hosts for _ in devices]
        return Mesh(shape, device_ids, host_ids, axis_names=axis_names)


def _bandwidth(name: str, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"Cluster {name} must be a positive bandwidth in GB/s, got {value!r}") from None


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _per_host(name: str, value) -> tuple | None:
    """``value`` as a tuple when it is a sequence (one value per host), None when it is one value."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return None
    if not value:
        raise ValueError(f"Cluster.heterogeneous {name} names no host")
    return tuple(value)


def _unless_uniform(values: tuple | None) -> tuple | None:
    return None if values is None or len(set(values)) == 1 else values


def _devices_per_host(pairs: Iterable[tuple[int, int]]) -> dict[int, int]:
    """(device, host) pairs -> host: how many distinct devices it holds."""
    devices: dict[int, set[int]] = {}
    for d, h in pairs:
        devices.setdefault(h, set()).add(d)
    return {h: len(ds) for h, ds in devices.items()}

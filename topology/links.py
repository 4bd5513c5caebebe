"""Link figures measured between the nodes of a Ray cluster (``reshard.runtime.probe_links``): what
``Cluster.from_ray`` plans with instead of guesses, and what ``topology.runtime`` remembers per node set."""

from __future__ import annotations

import math
from dataclasses import dataclass

BACKENDS = ("nccl", "gloo")  # the collective libraries whose broadcasts the simulator models


def broadcast_model(backend: str) -> str:
    """Which modelled library ``backend`` plans as: NCCL itself (pipelined rings, GPU figures), any
    other backend (gloo, one registered by a user) as gloo (binomial trees, CPU figures)."""
    return "nccl" if backend == "nccl" else "gloo"


def check_backend(what: str, backend) -> None:
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"{what} backend must name a backend (e.g. {', '.join(BACKENDS)}), got {backend!r}")


@dataclass(frozen=True, slots=True)
class LinkFigures:
    """Link figures measured between device actors on some Ray nodes (``reshard.runtime.driver.probe``).

    ``node_ids``: the probed nodes (sorted); ``nic_GBps[i]``: node ``i``'s NIC rate per direction
    (None when it had no partner node to measure against); ``intra_host_GBps``: one device to
    another of the same node through the backend (None: no node held two devices); latencies: one
    message, half a measured round trip (None: not measured). ``size_bytes``: bytes per timed
    transfer; ``backend``: the communicator backend measured (any name; ``broadcast_model``).
    """

    node_ids: tuple[str, ...]
    nic_GBps: tuple[float | None, ...]
    intra_host_GBps: float | None
    latency_us: float | None
    intra_host_latency_us: float | None
    size_bytes: int
    backend: str = "gloo"

    def __post_init__(self):
        if not isinstance(self.node_ids, tuple) or not self.node_ids or list(self.node_ids) != sorted(self.node_ids):
            raise ValueError(f"LinkFigures node_ids must be a non-empty sorted tuple, got {self.node_ids!r}")
        if len(set(self.node_ids)) != len(self.node_ids):
            raise ValueError(f"LinkFigures node_ids repeat a node: {self.node_ids!r}")
        if not isinstance(self.nic_GBps, tuple) or len(self.nic_GBps) != len(self.node_ids):
            raise ValueError(
                f"LinkFigures nic_GBps must be a tuple with one rate (or None) per node, got {self.nic_GBps!r} "
                f"for {len(self.node_ids)} nodes"
            )
        for name, value in (("intra_host_GBps", self.intra_host_GBps), *(("nic_GBps", v) for v in self.nic_GBps)):
            if value is not None and not is_bandwidth(value):
                raise ValueError(f"LinkFigures {name} must be a positive finite GB/s or None, got {value!r}")
        for name in ("latency_us", "intra_host_latency_us"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ValueError(f"LinkFigures {name} must be a finite latency >= 0 in us or None, got {value!r}")
        check_backend("LinkFigures", self.backend)
        if not isinstance(self.size_bytes, int) or self.size_bytes <= 0:
            raise ValueError(f"LinkFigures size_bytes must be a positive int, got {self.size_bytes!r}")

    def nic_of(self, node_id: str) -> float | None:
        """The measured NIC rate of ``node_id`` (None: not probed, or no partner to measure against)."""
        try:
            return self.nic_GBps[self.node_ids.index(node_id)]
        except ValueError:
            return None

    def covers(self, node_ids) -> bool:
        """Whether every node of ``node_ids`` was probed (with a NIC rate when there are several)."""
        nodes = set(node_ids)
        if not nodes <= set(self.node_ids):
            return False
        return len(nodes) < 2 or all(self.nic_of(n) is not None for n in nodes)

    def __str__(self) -> str:
        nics = [v for v in self.nic_GBps if v is not None]
        nic = "-" if not nics else spread(tuple(nics)) if len(set(nics)) > 1 else f"{nics[0]:.4g}"
        intra = "-" if self.intra_host_GBps is None else f"{self.intra_host_GBps:.3g}"
        lat = "-" if self.latency_us is None else f"{self.latency_us:.0f}"
        return (
            f"links of {len(self.node_ids)} node(s): NIC {nic} GB/s, intra-node {intra} GB/s, "
            f"latency {lat} us ({self.backend}, {self.size_bytes >> 20} MiB transfers)"
        )


def is_bandwidth(value) -> bool:
    """A positive, finite number (not a bool): a rate in GB/s."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def spread(values: tuple) -> str:
    """``values`` as "min-max" for messages."""
    return f"{min(values):g}-{max(values):g}"

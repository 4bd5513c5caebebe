"""Runtime layer of the topology: what the connected Ray cluster says about its nodes."""

from __future__ import annotations

import ray


def alive_ray_nodes() -> list[dict]:
    """``ray.nodes()`` of the connected cluster (``Cluster.from_ray`` keeps the alive ones)."""
    if not ray.is_initialized():
        raise RuntimeError("Cluster.from_ray() describes the connected Ray cluster: call ray.init() first")
    return ray.nodes()

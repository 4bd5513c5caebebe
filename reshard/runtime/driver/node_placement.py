"""Where a new mesh's device actors go: one Ray node per host of the mesh.

- ``nodes`` given (one per host, a node id hex string or a node IP address): each host's devices
  are pinned to its node with a hard node-affinity scheduling strategy. Unknown or dead nodes, and
  nodes that cannot hold the devices asked of them (their TOTAL resources), are refused at once.
- no ``nodes`` on a cluster of several alive nodes: a placement group with one bundle per host
  (the devices' resources summed), strategy ``SPREAD``: each host's devices land together on one
  node, hosts on distinct nodes as far as the cluster allows. On one node nothing is needed.

Device actors reserve ``num_cpus`` (a small fraction by default), GPUs as the backend needs, and
``resources`` each, so Ray's accounting sees them. A placement that cannot be satisfied fails
within ``timeout_s`` naming what was asked and what the cluster has.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reshard.errors import ReshardTimeout


@dataclass
class Placement:
    """Per device: the Ray actor options that place it; the placement group to remove at shutdown."""

    options: list[dict]
    placement_group: object | None = None
    planned_nodes: list[str | None] = field(default_factory=list)  # per host, when pinned


def demand(num_cpus: float, gpus: float, resources: dict | None) -> dict[str, float]:
    out = {"CPU": float(num_cpus), "GPU": float(gpus), **{k: float(v) for k, v in (resources or {}).items()}}
    return {k: v for k, v in out.items() if v > 0}


def alive_nodes() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def resolve_node(spec, nodes: list[dict]) -> dict:
    """The alive node named by ``spec`` (node id hex or IP address)."""
    if not isinstance(spec, str):
        raise TypeError(f"nodes must hold Ray node ids (hex strings) or node IP addresses, got {spec!r}")
    by_ip = [n for n in nodes if n.get("NodeManagerAddress") == spec]
    for n in nodes:
        if n.get("NodeID") == spec:
            return n
    if len(by_ip) == 1:
        return by_ip[0]
    if len(by_ip) > 1:
        ids = [n["NodeID"] for n in by_ip]
        raise ValueError(f"node address {spec} is shared by several Ray nodes {ids}; name one by its node id")
    known = ", ".join(f"{n.get('NodeManagerAddress')} ({n.get('NodeID', '')[:12]}...)" for n in nodes)
    raise ValueError(
        f"no alive Ray node is called {spec!r} (by node id or IP address) in this cluster; alive nodes: {known}"
    )


def place(n_hosts: int, per_host: int, nodes, per_device: dict[str, float], timeout_s: float) -> Placement:
    """Actor options for ``n_hosts * per_host`` devices, host-major (module docstring)."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    base: dict[str, object] = {"num_cpus": per_device.get("CPU", 0.0), "num_gpus": per_device.get("GPU", 0.0)}
    custom = {k: v for k, v in per_device.items() if k not in ("CPU", "GPU")}
    if custom:
        base["resources"] = custom
    alive = alive_nodes()
    if nodes is not None:
        nodes = list(nodes)
        if len(nodes) != n_hosts:
            raise ValueError(
                f"nodes names {len(nodes)} node(s) but the mesh has {n_hosts} host(s) on axis 0 "
                f"(devices_per_host={per_host}); give one Ray node per host"
            )
        chosen = [resolve_node(spec, alive) for spec in nodes]
        _check_fits(chosen, per_host, per_device)
        options = [
            {**base, "scheduling_strategy": NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)}
            for n in chosen
            for _ in range(per_host)
        ]
        return Placement(options, None, [n["NodeID"] for n in chosen])
    if len(alive) <= 1 or n_hosts == 1:
        return Placement([dict(base) for _ in range(n_hosts * per_host)])
    bundle = {k: v * per_host for k, v in per_device.items()}
    if not bundle:
        raise ValueError(
            "on a cluster of several nodes each host's devices are packed onto one node with a placement group, "
            "which needs resources to reserve: give the devices num_cpus > 0 or resources=..."
        )
    pg = placement_group([dict(bundle) for _ in range(n_hosts)], strategy="SPREAD")
    import ray

    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        have = [(n.get("NodeManagerAddress"), n.get("Resources", {})) for n in alive]
        raise ReshardTimeout(
            f"could not place {n_hosts} host(s) of {per_host} device(s) each within {timeout_s:g}s: every host needs "
            f"{bundle} on one node; the alive nodes have (total) {have} and Ray reports available "
            f"{ray.available_resources()}; lower num_cpus/resources per device or add nodes"
        )
    options = [
        {**base, "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=h)}
        for h in range(n_hosts)
        for _ in range(per_host)
    ]
    return Placement(options, pg)


def _check_fits(chosen: list[dict], per_host: int, per_device: dict[str, float]) -> None:
    need: dict[str, dict[str, float]] = {}
    for n in chosen:
        acc = need.setdefault(n["NodeID"], {})
        for k, v in per_device.items():
            acc[k] = acc.get(k, 0.0) + v * per_host
    for n in chosen:
        total = n.get("Resources", {})
        for k, v in need[n["NodeID"]].items():
            if total.get(k, 0.0) + 1e-9 < v:
                raise ValueError(
                    f"node {n.get('NodeManagerAddress')} ({n['NodeID'][:12]}...) has {total.get(k, 0.0):g} {k} in all "
                    f"but the mesh puts devices needing {v:g} {k} on it; lower num_cpus/resources per device, "
                    "spread the hosts over more nodes, or use a smaller mesh"
                )


def remove(placement_group) -> None:
    if placement_group is None:
        return
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(placement_group)
    except Exception:  # Ray is gone: so is the group
        pass

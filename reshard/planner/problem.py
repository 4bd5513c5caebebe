"""``Problem``: everything a strategy may look at, computed once per plan."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from reshard.ir.cost import resolve_cluster
from reshard.ir.layout import Layout
from reshard.ir.tasks import UnitTask, plan_unit_tasks
from topology.cluster import Cluster
from topology.mesh import device_hosts


@dataclass(frozen=True, slots=True)
class Problem:
    """A reshard to plan: the tensor, both layouts, the unit tasks, the device -> host map over both
    meshes (``hosts``: the meshes' host ids or the planner's override) and the cluster to plan for."""

    shape: tuple[int, ...]
    itemsize: int
    src: Layout
    dst: Layout
    tasks: tuple[UnitTask, ...]
    hosts: Mapping[int, int]
    cluster: Cluster

    @classmethod
    def build(
        cls,
        shape: tuple[int, ...],
        itemsize: int,
        src: Layout,
        dst: Layout,
        *,
        cluster: Cluster | None = None,
        hosts: Mapping[int, int] | None = None,
    ) -> Problem:
        """The problem of moving a tensor of ``shape`` from ``src`` to ``dst``: unit tasks, host map
        (``topology.mesh.device_hosts``) and cluster (``reshard.ir.cost.resolve_cluster``)."""
        host_map = device_hosts(src.mesh, dst.mesh, hosts=hosts)
        tasks = plan_unit_tasks(shape, itemsize, src, dst)
        return cls(shape, itemsize, src, dst, tasks, host_map, resolve_cluster(cluster, host_map))

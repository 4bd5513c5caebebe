"""``plan_reshard``: check the request, build the ``Problem``, run a strategy; plans are cached."""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

from reshard.dtypes import dtype_name, itemsize
from reshard.ir.layout import Layout
from reshard.ir.plan import ReshardPlan
from reshard.planner.problem import Problem
from reshard.planner.reduction import check_reducible, derived_problem, from_roots, plan_reductions
from reshard.planner.registry import STRATEGIES
from topology.cluster import Cluster
from topology.mesh import device_hosts


def plan_reshard(
    shape,
    dtype,
    src_layout: Layout,
    dst_layout: Layout,
    *,
    strategy: str = "auto",
    cluster: Cluster | None = None,
    hosts: Mapping[int, int] | None = None,
) -> ReshardPlan:
    """Plan moving a ``dtype`` tensor of ``shape`` from ``src_layout`` to ``dst_layout``.

    ``strategy`` names a registered planner (``reshard.STRATEGIES``); ``cluster`` (a
    ``topology.Cluster``) lets topology-aware strategies weigh links (default:
    ``Cluster.for_hosts`` of the hosts). ``hosts`` maps every global device id of both meshes to
    the host to plan with (e.g. the devices of one shared-memory machine on one host; None: the
    meshes' host ids); the plan carries it (``ReshardPlan.hosts``). Plans are cached.
    """
    shape = _as_tensor_shape(shape)
    name = dtype_name(dtype)
    for what, layout in (("src_layout", src_layout), ("dst_layout", dst_layout)):
        if not isinstance(layout, Layout):
            raise TypeError(f"{what} must be a reshard.Layout, got {type(layout).__name__}")
        layout.check_shape(shape)
    src_layout, dst_layout = src_layout.for_shape(shape), dst_layout.for_shape(shape)
    if src_layout.reduce_op is not None:
        check_reducible(name, src_layout.reduce_op)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(sorted(STRATEGIES))}")
    if cluster is not None and not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a topology.Cluster, got {type(cluster).__name__}")
    key = None if hosts is None else tuple(sorted(device_hosts(src_layout.mesh, dst_layout.mesh, hosts=hosts).items()))
    return _plan_cached(shape, name, src_layout, dst_layout, strategy, cluster, key)


def clear_plan_cache() -> None:
    """Forget every cached plan (e.g. to time cold planning)."""
    _plan_cached.cache_clear()


@lru_cache(maxsize=1024)
def _plan_cached(shape, dtype, src, dst, strategy, cluster, hosts) -> ReshardPlan:
    size = itemsize(dtype)
    problem = Problem.build(shape, size, src, dst, cluster=cluster, hosts=None if hosts is None else dict(hosts))
    if src.reduce_op is None:
        transfers = STRATEGIES[strategy](problem)
    else:  # combine the contributions on roots, then plan the multicast from them
        reductions, roots = plan_reductions(problem, src.reduce_op)
        derived, origin = derived_problem(problem, roots)
        spread = from_roots(STRATEGIES[strategy](derived), origin) if derived.tasks else ()
        transfers = (*reductions, *spread)
    return ReshardPlan(shape, dtype, src, dst, strategy, problem.tasks, transfers, tuple(sorted(problem.hosts.items())))


def _as_tensor_shape(shape) -> tuple[int, ...]:
    try:
        shape = tuple(shape)
    except TypeError:
        raise TypeError(f"tensor shape must be a tuple of ints, got {shape!r}") from None
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in shape):
        raise ValueError(f"tensor shape must hold non-negative ints, got {shape!r}")
    return shape

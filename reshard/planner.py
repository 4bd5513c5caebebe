"""plan_reshard: unit tasks -> a strategy's ordered transfers, cached by problem."""

from __future__ import annotations

from functools import lru_cache

from reshard.dtypes import dtype_name, itemsize
from reshard.layout import Layout
from reshard.plan import ReshardPlan
from reshard.strategies import STRATEGIES, Problem
from reshard.tasks import plan_unit_tasks


def plan_reshard(
    shape, dtype, src_layout: Layout, dst_layout: Layout, *, strategy: str = "auto", cluster=None
) -> ReshardPlan:
    """Plan moving a ``dtype`` tensor of ``shape`` from ``src_layout`` to ``dst_layout``.

    ``strategy`` names a registered planner (``reshard.STRATEGIES``); ``cluster`` (a
    ``topology.Cluster``) lets topology-aware strategies weigh links. Plans are cached.
    """
    shape = _as_tensor_shape(shape)
    name = dtype_name(dtype)
    for what, layout in (("src_layout", src_layout), ("dst_layout", dst_layout)):
        if not isinstance(layout, Layout):
            raise TypeError(f"{what} must be a reshard.Layout, got {type(layout).__name__}")
        layout.check_shape(shape)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(sorted(STRATEGIES))}")
    return _plan_cached(shape, name, src_layout, dst_layout, strategy, cluster)


@lru_cache(maxsize=1024)
def _plan_cached(shape, dtype, src, dst, strategy, cluster) -> ReshardPlan:
    tasks = plan_unit_tasks(shape, itemsize(dtype), src, dst)
    problem = Problem(shape, itemsize(dtype), src, dst, tasks, cluster)
    transfers = STRATEGIES[strategy](problem)
    return ReshardPlan(shape, dtype, src, dst, strategy, tasks, transfers)


def _as_tensor_shape(shape) -> tuple[int, ...]:
    try:
        shape = tuple(shape)
    except TypeError:
        raise TypeError(f"tensor shape must be a tuple of ints, got {shape!r}") from None
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in shape):
        raise ValueError(f"tensor shape must hold non-negative ints, got {shape!r}")
    return shape

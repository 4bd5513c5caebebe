"""The planner: ``plan_reshard`` turns a reshard into a ``ReshardPlan`` with a registered strategy.

Strategies register (``registry.register``) as their modules are imported, here, in this order:
the baselines (``send_recv`` and the paper's), then the topology-aware ``auto``.
"""

from reshard.planner import baselines, auto  # noqa: F401,I001  (registration order)
from reshard.planner.planning import clear_plan_cache, plan_reshard
from reshard.planner.problem import Problem
from reshard.planner.registry import STRATEGIES, Strategy, register

__all__ = ["STRATEGIES", "Problem", "Strategy", "clear_plan_cache", "plan_reshard", "register"]

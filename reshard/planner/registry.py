"""The strategy registry: a strategy turns a ``Problem`` into ordered transfers, under a name.

``reshard.planner`` imports the strategy modules in a fixed order, so ``STRATEGIES`` lists them in
that order once the package is imported.
"""

from __future__ import annotations

from collections.abc import Callable

from reshard.ir.plan import Transfer
from reshard.planner.problem import Problem

Strategy = Callable[[Problem], tuple[Transfer, ...]]
STRATEGIES: dict[str, Strategy] = {}
"""The planning strategies by name, what ``plan_reshard(strategy=...)`` takes: ``send_recv``,
``allgather``, ``broadcast``, ``broadcast_size``, ``broadcast_order`` and ``auto`` (README, Planning
without Ray)."""


def register(name: str) -> Callable[[Strategy], Strategy]:
    """Decorator: make ``fn`` the strategy called ``name``."""

    def deco(fn: Strategy) -> Strategy:
        if name in STRATEGIES:
            raise ValueError(f"strategy {name!r} is registered already ({STRATEGIES[name].__qualname__})")
        STRATEGIES[name] = fn
        return fn

    return deco

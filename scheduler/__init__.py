"""Pure pipeline-schedule layer: schedule IR, generators, validator, grid printer, timing simulator.

Imports only the standard library (numpy and msgpack where needed), never ray, torch or cupy, so
schedules are built, checked and simulated fast and at any scale without a cluster.
"""

from .generators import eager_one_f_one_b, gpipe, one_f_one_b, schedule_from_orders, with_skips
from .ir import (
    Action,
    Compute,
    Payload,
    Phase,
    Recv,
    Schedule,
    ScheduleError,
    Send,
    parse_action,
)
from .pipeline_plan import PipelinePlan, StagePlan, check_deadlock_free, global_transfer_order, plan_pipeline
from .simulate import Event, EventKind, SimulationResult, simulate
from .transfer_costs import Boundary, TransferCosts, transfer_costs
from .validate import SendSemantics, validate_schedule

_RUNTIME = {"Pipeline", "Stage", "IterationResult", "PipelineError", "PipelineTimeout"}

__all__ = [
    "Action",
    "Boundary",
    "IterationResult",
    "Pipeline",
    "PipelineError",
    "PipelinePlan",
    "PipelineTimeout",
    "Stage",
    "StagePlan",
    "TransferCosts",
    "check_deadlock_free",
    "global_transfer_order",
    "plan_pipeline",
    "transfer_costs",
    "Compute",
    "Event",
    "EventKind",
    "Payload",
    "Phase",
    "Recv",
    "Schedule",
    "ScheduleError",
    "Send",
    "SendSemantics",
    "SimulationResult",
    "eager_one_f_one_b",
    "gpipe",
    "one_f_one_b",
    "parse_action",
    "schedule_from_orders",
    "simulate",
    "validate_schedule",
    "with_skips",
]


def __getattr__(name):
    """The pipeline runtime (ray/torch) loads on first use, so ``import scheduler`` stays pure."""
    if name in _RUNTIME:
        from scheduler import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'scheduler' has no attribute {name!r}")

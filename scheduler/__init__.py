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
from .simulate import Event, EventKind, SimulationResult, simulate
from .validate import SendSemantics, validate_schedule

__all__ = [
    "Action",
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

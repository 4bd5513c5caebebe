"""Cross-mesh resharding: plan (pure) and execute (on Ray actors) moves of sharded tensors.

The planning names import without ray/torch; the runtime names (DeviceMesh, distribute,
reshard, ShardedTensor) load the runtime on first use.
"""

from reshard.dtypes import dtype_name
from reshard.errors import MeshClosed, PlanError, ReshardError, ReshardTimeout, WorkerDied
from reshard.layout import Layout
from reshard.lowering import DeviceProgram, Op, OpKind, Program, lower_plan
from reshard.placement import Placement, Replicate, Shard
from reshard.plan import ReshardPlan, Transfer, TransferKind
from reshard.planner import STRATEGIES, plan_reshard
from reshard.tasks import UnitTask, plan_unit_tasks
from reshard.validate import validate_plan, validate_program

_RUNTIME = {"DeviceMesh", "ShardedTensor", "distribute", "reshard"}

__all__ = [
    "STRATEGIES", "DeviceMesh", "DeviceProgram", "Layout", "MeshClosed", "Op", "OpKind", "Placement",
    "PlanError", "Program", "Replicate", "ReshardError", "ReshardPlan", "ReshardTimeout", "Shard",
    "ShardedTensor", "Transfer", "TransferKind", "UnitTask", "WorkerDied", "distribute", "dtype_name",
    "lower_plan", "plan_reshard", "plan_unit_tasks", "reshard", "validate_plan", "validate_program",
]  # fmt: skip


def __getattr__(name):
    if name in _RUNTIME:
        from reshard import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'reshard' has no attribute {name!r}")

"""Cross-mesh resharding: plan (pure) and execute (on Ray actors) moves of sharded tensors.

The planning names import without ray/torch; the runtime names (DeviceMesh, distribute,
reshard, adopt, ShardedTensor, Work) load the runtime on first use. ``reshard``, ``distribute``
and ``adopt`` take one tensor or a whole tree of them (a model's state dict).
"""

from reshard.dtypes import dtype_name
from reshard.errors import MeshClosed, PlanError, ReshardError, ReshardTimeout, WorkerDied
from reshard.ir.layout import Layout
from reshard.ir.placement import Partial, Placement, ReduceOp, Replicate, Shard, StridedShard
from reshard.ir.plan import ReshardPlan, Transfer, TransferKind
from reshard.ir.program import Broadcast, Copy, DeviceProgram, Op, Program, Pull, Recv, Send
from reshard.ir.tasks import UnitTask, plan_unit_tasks
from reshard.passes.compile import CompiledReshard, CompileOptions, compile_reshard
from reshard.passes.lowering import lower_plan
from reshard.passes.validate import validate_plan, validate_program
from reshard.planner import STRATEGIES, plan_reshard
from reshard.scaling import Scaled
from reshard.tp_plans import tensor_parallel_layouts

_RUNTIME = {"DeviceMesh", "ShardedTensor", "Work", "adopt", "distribute", "free", "reshard"}

__all__ = [
    "STRATEGIES",
    "Broadcast",
    "CompileOptions",
    "CompiledReshard",
    "Copy",
    "DeviceMesh",
    "DeviceProgram",
    "Layout",
    "MeshClosed",
    "Op",
    "Partial",
    "Placement",
    "PlanError",
    "Program",
    "Pull",
    "Recv",
    "ReduceOp",
    "Replicate",
    "ReshardError",
    "ReshardPlan",
    "ReshardTimeout",
    "Scaled",
    "Send",
    "Shard",
    "ShardedTensor",
    "StridedShard",
    "Transfer",
    "TransferKind",
    "UnitTask",
    "Work",
    "WorkerDied",
    "adopt",
    "compile_reshard",
    "distribute",
    "dtype_name",
    "free",
    "lower_plan",
    "plan_reshard",
    "plan_unit_tasks",
    "reshard",
    "tensor_parallel_layouts",
    "validate_plan",
    "validate_program",
]


def __getattr__(name):
    if name in _RUNTIME:
        from reshard import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'reshard' has no attribute {name!r}")

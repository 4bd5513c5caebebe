"""Runtime layer: device actors on Ray, communicators, and the program interpreter.

Modules: ``mesh`` (DeviceMesh, placement on nodes: ``placement``), ``tensor`` (ShardedTensor),
``loading`` (distribute, adopt), ``resharding`` (reshard of one tensor or a tree), ``work``
(reshards in flight), ``driver`` (this process's controller) with ``registry`` (devices, meshes,
ids, session), ``programs`` (the mirror of the devices' program caches), ``groups``
(communicator groups) and ``dispatch`` (waiting and failure classification); ``messages`` (what
controllers and actors say to each other), ``actor`` (the device actor) with ``inbox`` (ordered
calls), ``shards`` (a device's memory), ``binding`` (a run's buffers), ``batches`` and
``executor`` (run a device's batch program), ``communicator`` (interfaces), ``backends``
(registry), ``gloo`` (CPU backend), ``shared_memory`` (shards in shared memory, peers' shards
mapped for pulls); ``nccl`` (GPU backend) loads when a mesh asks for it.
"""

from reshard.runtime.backends import BACKENDS, register_backend
from reshard.runtime.communicator import Backend, Communicator, Rendezvous
from reshard.runtime.driver import runtime
from reshard.runtime.loading import adopt, distribute
from reshard.runtime.mesh import DeviceMesh
from reshard.runtime.resharding import compile_options, lowered_batch, lowered_reshard, reshard
from reshard.runtime.tensor import ShardedTensor
from reshard.runtime.work import Work


def ensure_groups(groups, *, channel: str = "", timeout_s: float = 60.0) -> list:
    """Set up communicator groups (iterables of global device ids) on their members and connect
    them, so that a function run through ``DeviceMesh.call`` can use ``ctx.communicator(group)``."""
    return runtime().ensure_groups(groups, channel=channel, timeout_s=timeout_s)


def settle(mesh, *, timeout_s: float = 60.0) -> None:
    """Wait until every device of ``mesh`` has done everything this process asked of it so far,
    including the releases of garbage-collected handles (which go out asynchronously): e.g. before
    reading ``mesh.stats()``."""
    runtime().flush_holds()
    mesh.call(_nothing, timeout_s=timeout_s)


def _nothing(ctx) -> None:
    return None


def device_of(actor_instance):
    """The ``DeviceContext`` of an actor attached as a device (``DeviceMesh.attach`` or
    ``from_actors``), from inside it: ``device_of(self).share_state_dict(...)``."""
    ctx = getattr(actor_instance, "_reshard_ctx", None)
    if ctx is None:
        raise RuntimeError("this actor is not a device of any mesh yet (DeviceMesh.attach attaches it)")
    return ctx


def runtime_stats() -> dict:
    """This process's controller counters: programs_shipped, runs, run_calls, rendezvous_calls,
    groups_created, failed_runs."""
    return dict(runtime().stats)


__all__ = [
    "BACKENDS", "Backend", "Communicator", "DeviceContext", "DeviceMesh", "DeviceRole", "Rendezvous", "ShardedTensor",
    "Work", "adopt", "compile_options", "device_of", "distribute", "ensure_groups", "lowered_batch", "lowered_reshard",
    "register_backend", "reshard", "runtime", "runtime_stats", "settle",
]  # fmt: skip


def __getattr__(name):
    """``DeviceRole`` and ``DeviceContext`` (the device side: executor, shards, backends) load on
    first use; a driver that only creates meshes and reshards never loads them."""
    if name in ("DeviceRole", "DeviceContext"):
        from reshard.runtime import actor

        return getattr(actor, name)
    raise AttributeError(f"module 'reshard.runtime' has no attribute {name!r}")

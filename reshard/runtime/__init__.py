"""The runtime: device actors on Ray, communicators, and the program interpreter, in three parts.

- ``reshard.runtime.driver``: the driver side (meshes, tensors, reshard, the controller);
- ``reshard.runtime.device``: the device side (the actor, its context, shards, the executor);
- ``reshard.runtime.backends``: how bytes move (gloo, NCCL);

and what both sides share: ``messages`` (what controllers and devices say to each other),
``deadlines``, ``arrays`` (numpy and torch buffers alike), ``device_options``, ``checksums``
(what ``verify`` compares) and ``processes`` (where a calling process runs).
"""

import importlib

from reshard.runtime.backends.communicator import Backend, Communicator, Rendezvous
from reshard.runtime.backends.registry import BACKENDS, register_backend
from reshard.runtime.deadlines import Deadline
from reshard.runtime.device.current import current_device

#: Names of the driver side and of the device side, loaded on first use (``__getattr__``): a device
#: actor never loads the driver, a driver that only creates meshes and reshards never loads the
#: executor.
_LAZY = {
    "runtime": "reshard.runtime.driver.controller",
    "adopt": "reshard.runtime.driver.loading",
    "distribute": "reshard.runtime.driver.loading",
    "DeviceMesh": "reshard.runtime.driver.mesh",
    "probe_links": "reshard.runtime.driver.probe",
    "compile_options": "reshard.runtime.driver.resharding",
    "lowered_batch": "reshard.runtime.driver.resharding",
    "lowered_reshard": "reshard.runtime.driver.resharding",
    "reshard": "reshard.runtime.driver.resharding",
    "ShardedTensor": "reshard.runtime.driver.tensor",
    "free": "reshard.runtime.driver.tensor",
    "Work": "reshard.runtime.driver.work",
    "DeviceRole": "reshard.runtime.device.actor",
    "DeviceContext": "reshard.runtime.device.actor",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'reshard.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def ensure_groups(groups, *, channel: str = "", timeout_s: float = 60.0) -> list:
    """Set up communicator groups (iterables of global device ids) on their members and connect
    them, so that a function run through ``DeviceMesh.call`` can use ``ctx.communicator(group)``."""
    from reshard.runtime.driver.controller import runtime

    return runtime().ensure_groups(groups, channel=channel, timeout_s=timeout_s)


def settle(mesh, *, timeout_s: float = 60.0) -> None:
    """Wait until every device of ``mesh`` has done everything this process asked of it so far,
    including the releases of garbage-collected handles (which go out asynchronously): e.g. before
    reading ``mesh.stats()``."""
    from reshard.runtime.driver.controller import runtime

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
    """This process's controller counters: programs_shipped, bindings_shipped (bindings_alike:
    of them, those shipped as outputs of a binding the device holds), runs, run_calls,
    rendezvous_calls, groups_created, failed_runs."""
    from reshard.runtime.driver.controller import runtime

    return dict(runtime().stats)


__all__ = [
    "BACKENDS",
    "Backend",
    "Communicator",
    "Deadline",
    "DeviceContext",
    "DeviceMesh",
    "DeviceRole",
    "Rendezvous",
    "ShardedTensor",
    "Work",
    "adopt",
    "compile_options",
    "current_device",
    "device_of",
    "distribute",
    "ensure_groups",
    "free",
    "lowered_batch",
    "lowered_reshard",
    "probe_links",
    "register_backend",
    "reshard",
    "runtime",
    "runtime_stats",
    "settle",
]

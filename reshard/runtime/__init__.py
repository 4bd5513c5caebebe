"""Runtime layer: device actors on Ray, communicators, and the program interpreter.

Modules: ``mesh`` (DeviceMesh), ``tensor`` (ShardedTensor, distribute, reshard), ``driver``
(driver-side bookkeeping, dispatch, failure handling), ``actor`` (the device actor and its
context), ``executor`` (DeviceProgram interpreter), ``groups`` (communicator caches),
``communicator`` (interfaces), ``backends`` (registry), ``gloo`` (CPU backend),
``shared_memory`` (shards in shared memory, peers' shards mapped for pulls); ``nccl`` (GPU
backend) is loaded by name when a mesh asks for it.
"""

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from reshard.runtime.backends import BACKENDS, register_backend  # noqa: E402
from reshard.runtime.communicator import Backend, Communicator, Rendezvous  # noqa: E402
from reshard.runtime.driver import runtime  # noqa: E402
from reshard.runtime.mesh import DeviceMesh  # noqa: E402
from reshard.runtime.tensor import ShardedTensor, distribute, lowered_reshard, reshard  # noqa: E402


def ensure_groups(groups, *, timeout_s: float = 60.0) -> None:
    """Set up communicator groups (iterables of global device ids) on their members, so that a
    function run through ``DeviceMesh.call`` can use ``ctx.communicator(group)``."""
    runtime().ensure_groups(groups, timeout_s)


def runtime_stats() -> dict:
    """Driver counters: programs_shipped, runs, run_calls, rendezvous_calls, groups_created, ..."""
    return dict(runtime().stats)


__all__ = [
    "BACKENDS", "Backend", "Communicator", "DeviceMesh", "Rendezvous", "ShardedTensor", "distribute",
    "ensure_groups", "lowered_reshard", "register_backend", "reshard", "runtime_stats",
]  # fmt: skip

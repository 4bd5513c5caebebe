"""The controller: what one process (the driver, or a Ray task or actor holding a handle) does to
run reshards on device actors. It never touches tensor bytes during a reshard; it decides, ships
small messages and waits with deadlines.

``Runtime`` holds its parts and wires them: ``DeviceRegistry`` (devices, meshes, ids, session),
``Dispatch`` (ordered calls, waits, failures into one error), ``Communicators`` (live groups:
admission, rendezvous, drops), ``Batches`` (the one cache of compiled calls, the programs each
device holds, a batch's submission, finish and cleanup), ``HoldQueue`` (holds and releases that
garbage collection asks for), ``WorkQueue`` (calls in flight) and ``PlanningClusters`` (the cost
model). A device mesh holds the ``Runtime`` of the process it lives in (``runtime()``), and every
handle reaches it through its mesh.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import Counter
from typing import TYPE_CHECKING

from reshard.errors import ReshardError
from reshard.runtime.driver.batches import CLEANUP_S, Batches
from reshard.runtime.driver.communicators import Communicators
from reshard.runtime.driver.device_registry import DeviceRegistry
from reshard.runtime.driver.dispatch import Dispatch
from reshard.runtime.driver.holds import HoldQueue
from reshard.runtime.driver.planning_clusters import PlanningClusters
from reshard.runtime.driver.work import WorkQueue
from reshard.runtime.messages import DeviceState, HoldChange, group_key
from topology.cluster import Cluster

if TYPE_CHECKING:
    from reshard.runtime.backends.communicator import Backend


class Runtime:
    """One process's controller (module docstring)."""

    def __init__(self):
        self.id = uuid.uuid4().hex[:12]
        self.registry = DeviceRegistry()
        self.backends: dict[str, Backend] = {}
        self.stats: Counter = Counter()
        self.dispatch = Dispatch(self.id, self.registry, self.mark_dead)
        self.communicators = Communicators(self.dispatch, self.registry, self.backends, self.stats)
        self.batches = Batches(self.dispatch, self.communicators, self.registry, self.stats, self.mark_dead)
        self.works = WorkQueue()
        self.holds = HoldQueue(self._submit_holds)
        self.clusters = PlanningClusters()
        self._names = itertools.count(1)

    @property
    def lock(self) -> threading.RLock:
        """The lock every ordered call is submitted under (``Dispatch``)."""
        return self.dispatch.lock

    def new_name(self) -> str:
        """A shard name unique in the job."""
        return f"{self.id}:{next(self._names)}"

    def ensure_groups(self, groups, *, channel: str = "", timeout_s: float = 60.0, pin: bool = False) -> list:
        """Set up communicator groups (device iterables) on their members and connect them there,
        in the given order; ``pin`` keeps them live until ``communicators.unpin``. Returns their keys."""
        return self.ensure_keys([group_key(g, channel) for g in groups], timeout_s=timeout_s, pin=pin)

    def ensure_keys(self, keys, *, timeout_s: float = 60.0, pin: bool = False) -> list:
        """``ensure_groups`` for group keys ``(channel, devices)`` (``Communicators.ensure``)."""
        return self.communicators.ensure(keys, self.batches.updates_for, timeout_s=timeout_s, pin=pin)

    # ---------------------------------------------------------------- devices

    def mark_dead(self, device: int, reason: str) -> None:
        with self.dispatch.lock:
            self.registry.mark([device], DeviceState.DEAD, reason)
            self.communicators.forget_device(device)
            self.batches.forget_device(device)

    def close_devices(self, devices, reason: str) -> None:
        with self.dispatch.lock:
            self.registry.mark(devices, DeviceState.CLOSED, reason)
            for d in devices:
                self.communicators.forget_device(d)
                self.batches.forget_device(d)

    def hold_later(self, acquire: bool, devices, name: str, holder: str) -> None:
        """``acquire`` or ``release`` queued (``HoldQueue``): from a finalizer, a pickler, an unpickler."""
        self.holds.put(acquire, devices, name, holder)

    def flush_holds(self) -> None:
        """Submit the queued holds now (in this thread), and look at the fired calls that finished
        (``Dispatch.sweep_fired``)."""
        self.holds.flush()
        self.dispatch.sweep_fired()

    def _submit_holds(self, changes) -> None:
        """Queued holds and releases, one ordered call per device for all of its (in queue order:
        a whole tree of handles let go costs one call per device)."""
        per_device: dict[int, list] = {}
        for acquire, devices, name, holder in changes:
            for d in devices:
                per_device.setdefault(d, []).append(HoldChange(acquire, name, holder))
        for d, calls in per_device.items():
            mine = tuple(calls)
            self.dispatch.fire([d], lambda rec, mine=mine: lambda t: rec.actor.reshard_holds.remote(t, mine))

    def acquire_many(self, holds) -> None:
        """Each ``(devices, name, holder)`` of ``holds`` takes its shard on its devices (fire and
        forget, ordered): one call per device for all (a whole tree adopted)."""
        self._submit_holds([(True, devices, name, holder) for devices, name, holder in holds])

    def free(self, devices, names) -> None:
        """Drop shards ``names`` on ``devices`` for every holder (fire and forget, ordered): one
        call per device for all of them, the names as one argument (Ray's cost is per argument),
        many of them put in Ray's object store once for every device (not serialized per call)."""
        import ray

        names, devices = tuple(names), list(devices)
        arg = names
        if len(devices) > 1 and len(names) >= SHARED_NAMES:
            try:
                arg = ray.put(names)
            except Exception:  # Ray is going away: each call fails alike, nothing left to free
                pass
        self.dispatch.fire(devices, lambda rec: lambda t: rec.actor.reshard_free.remote(t, arg))

    # ---------------------------------------------------------------- planning

    def planning_cluster(self, backend: str, hosts: dict[int, int]) -> Cluster:
        """The cost model "auto" plans for (``PlanningClusters``)."""
        return self.clusters.get(backend, hosts, self.registry)


SHARED_NAMES = 1024  # names freed at once from which they are put in the object store once for all devices
_RUNTIME: Runtime | None = None
_RUNTIME_LOCK = threading.Lock()


def runtime() -> Runtime:
    """This process's controller: the one ``Runtime`` that orders its calls to devices, caches
    programs and groups, and finishes its works (created on first use)."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            _RUNTIME = Runtime()
        return _RUNTIME


__all__ = ["CLEANUP_S", "ReshardError", "Runtime", "runtime"]

"""The controller's book of devices and meshes, and the ids every process of a job agrees on.

Every process that uses meshes (the driver, or a Ray task or actor that received a pickled handle)
is a CONTROLLER with its own ``DeviceRegistry``: a ``DeviceRecord`` per device it knows (its actor
handle, node, host, state) and the live meshes by abstract mesh. Records enter it when this
process creates a mesh or unpickles one.

Ids. Device ids and host ids must mean the same thing in every process of a job, so they are
claimed in Ray's internal key-value store (namespace ``reshard``, scoped to the Ray session):
device ids in blocks of ``ID_BLOCK`` per controller; a host id per Ray node (the same for every
process, compact in order of first use) or per logical host of a mesh whose devices share one
node. Session: the Ray session name and job id a mesh was made in; a handle used in another
session or job raises ``MeshClosed``.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from reshard.errors import MeshClosed, WorkerDied
from reshard.runtime.messages import DeviceState
from topology.runtime import claim, claim_named

ID_BLOCK = 1 << 12


@dataclass(frozen=True, slots=True)
class Session:
    """The Ray session and job a mesh belongs to."""

    name: str
    job: str

    @classmethod
    def current(cls) -> Session:
        import ray

        if not ray.is_initialized():
            raise MeshClosed(
                "Ray is not running (ray.shutdown() was called?): meshes of the old session are gone; "
                "create new meshes with DeviceMesh.create(...)"
            )
        rc = ray.get_runtime_context()
        return cls(rc.get_session_name(), rc.get_job_id())


@dataclass
class DeviceRecord:
    """What a controller knows about one device actor."""

    id: int
    actor: Any  # a Ray ActorHandle of a DeviceActor: its remote methods resolve at run time
    host: int
    backend: str
    node_id: str
    node_ip: str
    owner: str  # the mesh that created it, for messages
    session: Session
    shared_memory: bool = False  # its shards live in shared memory (peers on its node pull)
    max_communicators: int = 64
    max_programs: int = 256
    board: tuple | None = None  # its relay board's descriptor (peers on its node pull relays from it)
    memory_domain: str | None = None  # devices of one domain pull each other's shards (None: none)
    threaded: bool = False  # our DeviceActor: serves calls while a reshard runs (a user's actor may not)
    state: DeviceState = DeviceState.ALIVE
    reason: str = ""
    seq: int = 1  # the next ordered call's sequence number (``reshard.runtime.device.inbox``)
    lost: tuple[int, ...] = ()  # the latest ordered calls Ray failed before they reached it (``Ticket.lost``)

    def describe(self) -> dict:
        """What travels in a pickled mesh handle."""
        return {
            "id": self.id,
            "actor": self.actor,
            "host": self.host,
            "backend": self.backend,
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "owner": self.owner,
            "session": self.session,
            "shared_memory": self.shared_memory,
            "max_communicators": self.max_communicators,
            "max_programs": self.max_programs,
            "board": self.board,
            "memory_domain": self.memory_domain,
            "threaded": self.threaded,
        }


class DeviceRegistry:
    """Devices and meshes of one controller (module docstring). Thread-safe."""

    def __init__(self):
        self.lock = threading.RLock()
        self.devices: dict[int, DeviceRecord] = {}
        self.meshes: dict = {}  # abstract Mesh -> live DeviceMeshes over it (latest last)
        self.closed_meshes: dict = {}  # abstract Mesh -> why it is closed
        self._ids: itertools.count | None = None
        self._left_in_block = 0
        self._hosts: dict[str, int] = {}

    # ---------------------------------------------------------------- ids

    def new_device_ids(self, n: int) -> list[int]:
        with self.lock:
            out = []
            for _ in range(n):
                ids = self._ids
                if ids is None or not self._left_in_block:
                    ids = self._ids = itertools.count(claim("devices", uuid.uuid4().hex) * ID_BLOCK)
                    self._left_in_block = ID_BLOCK
                out.append(next(ids))
                self._left_in_block -= 1
            return out

    def host_of_node(self, node_id: str) -> int:
        """The job-wide host id of Ray node ``node_id``."""
        with self.lock:
            if node_id not in self._hosts:
                self._hosts[node_id] = claim_named("hosts", f"node:{node_id}")
            return self._hosts[node_id]

    def new_logical_hosts(self, n: int) -> list[int]:
        """Fresh host ids for logical hosts (devices of one node that a mesh declares apart)."""
        return [claim("hosts", f"logical:{uuid.uuid4().hex}") for _ in range(n)]

    # ---------------------------------------------------------------- devices

    def add(self, records) -> list[DeviceRecord]:
        """Register records (a pickled mesh may bring devices this process already knows: the
        known record wins, so the sequence of ordered calls goes on)."""
        with self.lock:
            return [self.devices.setdefault(r.id, r) for r in records]

    def get(self, device: int) -> DeviceRecord:
        return self.devices[device]

    def check(self, devices, what: str) -> list[DeviceRecord]:
        """The records of ``devices``; ``MeshClosed``/``WorkerDied``/``ValueError`` when unusable."""
        session = Session.current()
        with self.lock:
            out = []
            for d in devices:
                rec = self.devices.get(d)
                if rec is None:
                    raise ValueError(
                        f"{what}: device {d} belongs to no DeviceMesh this process knows; pass the mesh or tensor "
                        "handle itself (it pickles into Ray tasks and actors)"
                    )
                if rec.session != session:
                    raise MeshClosed(
                        f"{what}: device {d} belongs to Ray session {rec.session.name} job {rec.session.job}, "
                        f"not to this one ({session.name} job {session.job}); its mesh is gone: create a new one"
                    )
                if rec.state is DeviceState.CLOSED:
                    raise MeshClosed(f"{what}: device {d} is closed ({rec.reason}); use a live mesh")
                if rec.state is DeviceState.DEAD:
                    raise WorkerDied(
                        f"{what}: device {d} died earlier ({rec.reason}); its mesh ({rec.owner}) is broken: "
                        "shut it down and create a new one"
                    )
                out.append(rec)
            return out

    def check_session(self, devices, what: str) -> None:
        """``MeshClosed`` unless Ray runs the session these devices were made in."""
        session = Session.current()
        with self.lock:
            for d in devices:
                rec = self.devices.get(d)
                if rec is not None and rec.session != session:
                    raise MeshClosed(
                        f"{what}: device {d} belongs to Ray session {rec.session.name} job {rec.session.job}, "
                        f"not to this one ({session.name} job {session.job}); its shards are gone with it"
                    )

    def mark(self, devices, state: DeviceState, reason: str) -> None:
        with self.lock:
            for d in devices:
                rec = self.devices.get(d)
                if rec is not None and rec.state is DeviceState.ALIVE:
                    rec.state, rec.reason = state, reason

    # ---------------------------------------------------------------- meshes

    def register_mesh(self, dmesh) -> None:
        with self.lock:
            live = self.meshes.setdefault(dmesh.mesh, [])
            if dmesh not in live:
                live.append(dmesh)
            self.closed_meshes.pop(dmesh.mesh, None)

    def unregister_mesh(self, dmesh, reason: str) -> None:
        with self.lock:
            live = self.meshes.get(dmesh.mesh, [])
            if dmesh in live:
                live.remove(dmesh)
            if not live:
                self.meshes.pop(dmesh.mesh, None)
                self.closed_meshes[dmesh.mesh] = reason

    def local_mesh(self, mesh):
        """This process's live DeviceMeshes over abstract ``mesh`` (latest last) and why the last
        one closed (None: none closed, or one is live)."""
        with self.lock:
            return list(self.meshes.get(mesh, ())), self.closed_meshes.get(mesh)

"""Where the processes of a job find each other's meshes: one entry per abstract mesh in Ray's
key-value store, written as data and checked on read.

A ``Layout`` carries only its abstract mesh; a Ray task or actor that receives one finds the
``DeviceMesh`` here. An entry is msgpack: the session and job that wrote it (its key names the job
too), the backend's name and configuration, and every device's record. The one thing in it that is
not plain data is each device's actor handle: Ray's own pickle of that handle alone, read back by
an unpickler that resolves nothing but Ray's actor-handle deserializer. Any other global in it, an
entry of another session or job, of another format or of another mesh is refused: what another job
wrote into the store is never run here.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

import msgpack

from topology.mesh import Mesh
from topology.runtime import lookup, publish, unpublish

FORMAT = 1
# What Ray's pickle of an actor handle calls to rebuild it (ray._private.serialization registers it
# for ActorHandle); nothing else may be resolved while reading an entry.
_ACTOR_HANDLE = ("ray._private.serialization", "_actor_handle_deserializer")


@dataclass(frozen=True)
class Published:
    """A live mesh as another process of the job published it."""

    backend: str
    backend_state: dict | None  # the backend's ``__getstate__`` (None: not plain data)
    described: list[dict]  # ``DeviceRecord.describe()`` per device, actor handles rebuilt


class EntryRefused(ValueError):
    """An entry in the store is not one this job's processes write."""


def publish_mesh(mesh: Mesh, backend: str, backend_state: Any, described: list[dict], session, writer: str) -> None:
    """Let every process of ``session``'s job find this mesh by its abstract mesh; ``writer``:
    the publishing controller (only it removes the entry)."""
    state = backend_state if _plain(backend_state) else None
    devices = [_record_data(d) for d in described]
    entry = {
        "format": FORMAT,
        "session": [session.name, session.job],
        "mesh": _mesh_data(mesh),
        "backend": backend,
        "backend_state": state,
        "devices": devices,
        "writer": writer,
    }
    publish(_key(mesh, session), msgpack.packb(entry, use_bin_type=True))


def remove_mesh(mesh: Mesh, session, writer: str) -> None:
    """Remove the entry of ``mesh`` if ``writer`` wrote it (a view that closed: other processes
    no longer find it, and the store does not grow by one entry per view)."""
    blob = lookup(_key(mesh, session))
    if blob is None:
        return
    try:
        entry = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except Exception:  # not ours to judge: leave it
        return
    if isinstance(entry, dict) and entry.get("writer") == writer:
        unpublish(_key(mesh, session))


def publish_closed(mesh: Mesh, reason: str, session) -> None:
    entry = {"format": FORMAT, "session": [session.name, session.job], "mesh": _mesh_data(mesh), "closed": reason}
    publish(_key(mesh, session), msgpack.packb(entry, use_bin_type=True))


def find_mesh(mesh: Mesh, session) -> Published | str | None:
    """The entry of ``mesh`` in ``session``'s job: a ``Published`` mesh, why it closed (a str), or
    None. ``EntryRefused`` if the entry is not one this job wrote for this mesh."""
    blob = lookup(_key(mesh, session))
    if blob is None:
        return None
    try:
        entry = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for malformed input
        raise EntryRefused(f"the directory entry of mesh {mesh} is not msgpack ({type(e).__name__})") from None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        raise EntryRefused(f"the directory entry of mesh {mesh} has an unknown format")
    if entry.get("session") != [session.name, session.job]:
        raise EntryRefused(f"the directory entry of mesh {mesh} was written by another session or job")
    if entry.get("mesh") != _mesh_data(mesh):
        raise EntryRefused(f"the directory entry under mesh {mesh} describes another mesh")
    if "closed" in entry:
        return str(entry["closed"])
    devices = entry.get("devices")
    if not isinstance(devices, list) or len(devices) != mesh.size:
        raise EntryRefused(f"the directory entry of mesh {mesh} does not list its {mesh.size} devices")
    state = entry.get("backend_state")
    return Published(
        str(entry["backend"]), state if isinstance(state, dict) else None, [_record(d, session) for d in devices]
    )


def _key(mesh: Mesh, session) -> str:
    return f"mesh/{session.job}/{mesh.shape}/{mesh.device_ids}/{mesh.host_ids}/{mesh.axis_names}"


def _mesh_data(mesh: Mesh) -> list:
    names = None if mesh.axis_names is None else list(mesh.axis_names)
    return [list(mesh.shape), list(mesh.device_ids), list(mesh.host_ids), names]


def _record_data(described: dict) -> dict:
    from ray import cloudpickle

    out = dict(described)
    out["actor"] = cloudpickle.dumps(described["actor"])
    out["session"] = [described["session"].name, described["session"].job]
    out["board"] = None if described["board"] is None else list(described["board"])
    return out


def _record(data: Any, session) -> dict:
    if not isinstance(data, dict) or not isinstance(data.get("actor"), bytes):
        raise EntryRefused("a device record in the directory is malformed")
    if data.get("session") != [session.name, session.job]:
        raise EntryRefused(f"device {data.get('id')} in the directory belongs to another session or job")
    out = dict(data)
    out["actor"] = _HandleOnly(io.BytesIO(data["actor"])).load()
    out["session"] = session
    out["board"] = None if data.get("board") is None else tuple(data["board"])
    return out


class _HandleOnly(pickle.Unpickler):
    """Reads Ray's pickle of one actor handle and nothing else."""

    def find_class(self, module: str, name: str):
        if (module, name) != _ACTOR_HANDLE:
            raise EntryRefused(f"the directory entry names {module}.{name}; only Ray actor handles are read")
        return super().find_class(module, name)


def _plain(value: Any) -> bool:
    """msgpack-able data without custom types."""
    try:
        msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError):
        return False
    return True

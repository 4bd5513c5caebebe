"""The sockets a process listens on, read from ``/proc`` (its own descriptors and its network
namespace's tables): what the benchmarks record so that a run shows it opened nothing on every
interface. Ray's own core-worker server is told apart by its port.

    found = survey(mesh)        # {"driver": {...}, "device 0": {...}, ...}
    wildcards(found)            # {} when no socket of ours listens on every interface
"""

from __future__ import annotations

import os
import socket

WILDCARD = ("0.0.0.0", "::")
_TABLES = (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6), ("udp", socket.AF_INET), ("udp6", socket.AF_INET6))
_TCP_LISTEN = "0A"


def _socket_inodes() -> set[str]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _address(hex_address: str, family: int) -> tuple[str, int]:
    addr, port = hex_address.split(":")
    raw = bytes.fromhex(addr)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # per 32-bit word, little end
    return socket.inet_ntop(family, raw), int(port, 16)


def listeners(ctx=None) -> dict:
    """This process's listening TCP sockets and bound UDP sockets as ``[protocol, address, port]``,
    and the port of Ray's core-worker server in it (None outside Ray). ``ctx``: unused, so that it
    runs as a device call too."""
    inodes = _socket_inodes()
    found = []
    for table, family in _TABLES:
        with open(f"/proc/self/net/{table}") as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[9] not in inodes or (table.startswith("tcp") and fields[3] != _TCP_LISTEN):
                    continue
                address, port = _address(fields[1], family)
                if port:
                    found.append([table.rstrip("6"), address, port])
    return {"listening": sorted(found), "ray_core_worker_port": _ray_core_worker_port()}


def _ray_core_worker_port() -> int | None:
    import ray

    if not ray.is_initialized():
        return None
    from ray.core.generated import common_pb2

    owner = common_pb2.Address()
    owner.ParseFromString(ray._private.worker.global_worker.core_worker.get_owner_address(ray.put(0)))
    return owner.port


def survey(mesh=None, *, timeout_s: float = 60.0) -> dict[str, dict]:
    """``listeners`` of this process (``driver``) and of every device of ``mesh``."""
    found = {"driver": listeners()}
    if mesh is not None:
        got = mesh.call(listeners, timeout_s=timeout_s)
        found.update({f"device {d}": x for d, x in zip(mesh.device_ids, got, strict=True)})
    return found


def wildcards(found: dict[str, dict]) -> dict[str, list]:
    """The sockets of ``survey`` on a wildcard address, other than Ray's core-worker server."""
    out = {}
    for who, got in found.items():
        wild = [x for x in got["listening"] if x[1] in WILDCARD and x[2] != got["ray_core_worker_port"]]
        if wild:
            out[who] = wild
    return out

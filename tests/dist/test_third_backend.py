"""A third backend, written here as a user would write one: CPU communicators over Unix stream
sockets in Linux's abstract namespace (nothing on disk), one connection per pair of members, every
operation synchronous. It declares its own compile target (one message at a time, small buckets)
and plugs in with ``register_backend`` alone: no change to the driver or the device side.
"""

from __future__ import annotations

import socket
import time
import uuid

import numpy as np
import pytest
from dist_helpers import assert_bit_exact, random_array

from reshard import Layout, Replicate, Shard, distribute, free, reshard
from reshard.errors import ReshardTimeout
from reshard.runtime.backends.communicator import Backend, Communicator, PeerFailed, Rendezvous

pytestmark = pytest.mark.dist

NAME = "test-sockets"
BUCKET_BYTES = 64 << 10
_REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def _address(group_name: str, rank: int) -> str:
    return f"\0meshreshard-{NAME}-{group_name}-{rank}"


def _memory(tensor) -> memoryview:
    """The message's bytes (a torch CPU tensor or a numpy array over them), writable."""
    a = tensor.numpy() if hasattr(tensor, "numpy") else tensor
    return memoryview(a.reshape(-1).view(np.uint8))


class SocketCommunicator(Communicator):
    def __init__(self, group, rank: int, timeout_s: float, conns: dict, moved: list):
        super().__init__(group, rank, timeout_s)
        self.conns = conns  # peer rank -> its socket
        self.moved = moved  # [bytes sent], the backend's count

    def _peer(self, peer: int) -> socket.socket:
        conn = self.conns[peer]
        conn.settimeout(max(self.timeout_s, 1e-3))
        return conn

    def send(self, tensor, peer: int) -> None:
        data = _memory(tensor)
        try:
            self._peer(peer).sendall(data)
        except TimeoutError:
            raise ReshardTimeout(f"{NAME}: sending {data.nbytes} B to rank {peer} timed out") from None
        except OSError as e:
            raise PeerFailed(f"{NAME}: rank {peer} went away: {e}") from e
        self.moved[0] += data.nbytes

    def recv(self, tensor, peer: int) -> None:
        into, got = _memory(tensor), 0
        try:
            conn = self._peer(peer)
            while got < into.nbytes:
                n = conn.recv_into(into[got:])
                if n == 0:
                    raise PeerFailed(f"{NAME}: rank {peer} closed the connection")
                got += n
        except TimeoutError:
            raise ReshardTimeout(f"{NAME}: receiving from rank {peer} timed out ({got} of {into.nbytes} B)") from None
        except OSError as e:
            raise PeerFailed(f"{NAME}: rank {peer} went away: {e}") from e

    def broadcast(self, tensor, root: int) -> None:
        if self.rank == root:
            for peer in self.conns:
                self.send(tensor, peer)
        else:
            self.recv(tensor, root)

    def all_reduce(self, tensor, op: str = "sum") -> None:
        mine = tensor.numpy() if hasattr(tensor, "numpy") else tensor
        if self.rank == 0:
            other = np.empty_like(mine)
            for peer in self.conns:
                self.recv(other, peer)
                _REDUCE[op](mine, other, out=mine)
        else:
            self.send(tensor, 0)
        self.broadcast(tensor, 0)

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns = {}

    def abort(self) -> None:
        for conn in self.conns.values():
            try:
                conn.shutdown(socket.SHUT_RDWR)  # a peer blocked on it fails at once
            except OSError:
                pass
        self.close()


class SocketBackend(Backend):
    name = NAME
    device_type = "cpu"

    def __init__(self):
        self.moved = [0]

    def rendezvous(self, groups, actors) -> list[Rendezvous]:
        return [Rendezvous(g, {"name": uuid.uuid4().hex}) for g in groups]

    def connect(self, rendezvous: Rendezvous, device: int, timeout_s: float) -> SocketCommunicator:
        """Listen, dial every lower rank (which listened first), accept every higher one."""
        group, name = rendezvous.group, rendezvous.info["name"]
        rank, deadline = group.index(device), time.monotonic() + timeout_s
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conns: dict[int, socket.socket] = {}
        try:
            listener.bind(_address(name, rank))
            listener.listen(len(group))
            for peer in range(rank):
                conns[peer] = self._dial(_address(name, peer), deadline)
                conns[peer].sendall(rank.to_bytes(4, "little"))
            while len(conns) < len(group) - 1:
                listener.settimeout(max(deadline - time.monotonic(), 1e-3))
                conn, _ = listener.accept()
                conn.settimeout(max(deadline - time.monotonic(), 1e-3))
                conns[int.from_bytes(conn.recv(4, socket.MSG_WAITALL), "little")] = conn
        except TimeoutError:
            for conn in conns.values():
                conn.close()
            raise ReshardTimeout(f"{NAME}: group {group} did not connect within {timeout_s:g}s") from None
        finally:
            listener.close()
        return SocketCommunicator(group, rank, timeout_s, conns, self.moved)

    @staticmethod
    def _dial(address: str, deadline: float) -> socket.socket:
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(address)
                return conn
            except (ConnectionRefusedError, FileNotFoundError):
                conn.close()
                if time.monotonic() >= deadline:
                    raise TimeoutError from None
                time.sleep(1e-3)


def _moved(ctx) -> int:
    return ctx.backend.moved[0]


@pytest.fixture
def sockets_backend(ray_cluster):
    from reshard.ir.target import TARGETS, CompileTarget
    from reshard.runtime import register_backend
    from reshard.runtime.backends.registry import BACKENDS

    register_backend(NAME, SocketBackend, compile_target=CompileTarget(NAME, "cpu", bucket_bytes=BUCKET_BYTES))
    yield NAME
    BACKENDS.pop(NAME, None)
    TARGETS.pop(NAME, None)


def test_a_backend_registered_from_outside_moves_a_tree_bit_exact(sockets_backend):
    from reshard import DeviceMesh
    from reshard.runtime import lowered_batch

    mesh = DeviceMesh.create((4,), backend=sockets_backend, shared_memory=False, startup_timeout_s=180)
    try:
        a = DeviceMesh.from_devices(mesh.device_ids[:2], (2,))
        b = DeviceMesh.from_devices(mesh.device_ids[2:], (2,))
        sd = {f"w{i}": random_array((16, 8 * (i + 1)), "float32", i) for i in range(6)}
        sd["big"] = random_array((256, 256), "float32", 99)  # 256 KiB: beyond the bucket size
        src = distribute(sd, Layout(a, (Shard(0),)))
        dst = {k: Layout(b, (Shard(1),) if k != "big" else (Replicate(),)) for k in sd}
        out = reshard(src, a, dst)
        for k, v in sd.items():
            assert_bit_exact(out[k].to_numpy(), v)
        assert sum(mesh.call(_moved)) >= sum(v.nbytes for v in sd.values())  # through its sockets
        batch = lowered_batch(src, a, dst, shared_memory=False)
        buckets = [q for d in batch.participants for q in batch.program.for_device(d).buckets]
        assert buckets and max(q.nbytes for q in buckets) <= BUCKET_BYTES  # its own compile target
        free(out)
        free(src)
    finally:
        mesh.shutdown()

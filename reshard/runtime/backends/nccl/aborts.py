"""Abort notices between members: one UDP socket per process, so that peers of an aborted communicator fail at once."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import OrderedDict
from collections.abc import Iterable


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # not in a Ray process: loopback
        pass
    return "127.0.0.1"


class PeerAborts:
    """One UDP socket per process: receives "communicator X was aborted" notices from peers and
    sends them. A daemon thread only records digests; it never calls NCCL."""

    MAGIC = b"RSHA"
    KEEP = 4096  # digests remembered (oldest forgotten first)

    def __init__(self, host: str = "127.0.0.1"):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.address = (host, self.sock.getsockname()[1])
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name="reshard-nccl-aborts", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                data, _ = self.sock.recvfrom(64)
            except OSError:
                return  # closed
            if len(data) == 20 and data[:4] == self.MAGIC:
                with self._cv:
                    self._seen[data[4:]] = None
                    while len(self._seen) > self.KEEP:
                        self._seen.popitem(last=False)
                    self._cv.notify_all()

    def notify(self, addresses: Iterable, digest: bytes) -> None:
        """Tell ``addresses`` that the communicator ``digest`` was aborted (never blocks, never raises)."""
        msg = self.MAGIC + bytes(digest)
        for addr in addresses:
            with contextlib.suppress(OSError, TypeError, ValueError):
                self.sock.sendto(msg, (str(addr[0]), int(addr[1])))

    def aborted(self, digest: bytes) -> bool:
        with self._cv:
            return digest in self._seen

    def wait(self, digest: bytes, timeout_s: float) -> bool:
        """True once a notice for ``digest`` arrived (False after ``timeout_s``)."""
        with self._cv:
            return self._cv.wait_for(lambda: digest in self._seen, timeout_s)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


_PEER_ABORTS: PeerAborts | None = None


_PEER_ABORTS_LOCK = threading.Lock()


def peer_aborts() -> PeerAborts:
    """This process's abort side channel (started on first use, on the Ray node's address)."""
    global _PEER_ABORTS
    with _PEER_ABORTS_LOCK:
        if _PEER_ABORTS is None:
            _PEER_ABORTS = PeerAborts(_node_ip())
        return _PEER_ABORTS

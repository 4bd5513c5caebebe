"""Abort notices between members: one UDP socket per process, so that peers of an aborted
communicator fail at once; a notice is tagged with the communicator's unique id, which strangers lack."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
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
    sends them. A daemon thread only records notices; it never calls NCCL.

    A notice names the communicator by a digest of its unique id and carries a tag keyed by the
    unique id itself, which only its members (and Ray's messages to them) hold: a forged notice is
    ignored. Notices of communicators this process watches (being created or live) are checked as
    they arrive and kept until they are unwatched; others (a member that aborted before this one
    began creating) wait in a bounded queue, oldest dropped first, so a flood of datagrams can cost
    such a member its early notice (it then fails at its deadline) but never a watched one."""

    MAGIC = b"RSHA"
    KEEP = 4096  # early notices remembered (oldest forgotten first)
    _SIZE = 4 + 16 + 16

    def __init__(self, host: str = "127.0.0.1"):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.address = (host, self.sock.getsockname()[1])
        self._keys: dict[bytes, bytes] = {}  # watched: digest -> unique id
        self._confirmed: set[bytes] = set()  # watched digests with a valid notice
        self._early: OrderedDict[bytes, bytes] = OrderedDict()  # digest -> tag, not checked yet
        self._cv = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="reshard-nccl-aborts", daemon=True)
        self._thread.start()

    @classmethod
    def notice(cls, uid: bytes) -> bytes:
        """The datagram telling that the communicator of unique id ``uid`` was aborted."""
        digest = uid_digest(uid)
        return cls.MAGIC + digest + _tag(uid, digest)

    def _serve(self) -> None:
        while True:
            try:
                data, _ = self.sock.recvfrom(64)
            except OSError:
                return  # closed
            if self._closing:
                return
            if len(data) != self._SIZE or data[:4] != self.MAGIC:
                continue
            digest, tag = data[4:20], data[20:]
            with self._cv:
                uid = self._keys.get(digest)
                if uid is not None:
                    if hmac.compare_digest(tag, _tag(uid, digest)):
                        self._confirmed.add(digest)
                        self._cv.notify_all()
                    continue
                self._early[digest] = tag
                self._early.move_to_end(digest)
                while len(self._early) > self.KEEP:
                    self._early.popitem(last=False)

    def watch(self, uid: bytes) -> None:
        """Keep valid notices of ``uid``'s communicator from now on (a notice that came early counts)."""
        digest = uid_digest(uid)
        with self._cv:
            self._keys[digest] = bytes(uid)
            tag = self._early.pop(digest, None)
            if tag is not None and hmac.compare_digest(tag, _tag(uid, digest)):
                self._confirmed.add(digest)

    def unwatch(self, uid: bytes) -> None:
        """Forget ``uid``'s communicator (it was destroyed, aborted or never made)."""
        digest = uid_digest(uid)
        with self._cv:
            self._keys.pop(digest, None)
            self._confirmed.discard(digest)

    def notify(self, addresses: Iterable, uid: bytes) -> None:
        """Tell ``addresses`` that the communicator of ``uid`` was aborted (never blocks, never raises)."""
        msg = self.notice(uid)
        for addr in addresses:
            with contextlib.suppress(OSError, TypeError, ValueError):
                self.sock.sendto(msg, (str(addr[0]), int(addr[1])))

    def _heard(self, uid: bytes) -> bool:
        digest = uid_digest(uid)
        if digest in self._confirmed:
            return True
        tag = self._early.get(digest)
        return tag is not None and hmac.compare_digest(tag, _tag(uid, digest))

    def aborted(self, uid: bytes) -> bool:
        """A valid notice for the communicator of ``uid`` arrived."""
        with self._cv:
            return self._heard(uid)

    def wait(self, uid: bytes, timeout_s: float) -> bool:
        """True once a valid notice for ``uid`` arrived (False after ``timeout_s``). Watches it."""
        self.watch(uid)
        with self._cv:
            return self._cv.wait_for(lambda: self._heard(uid), timeout_s)

    def watched(self) -> int:
        with self._cv:
            return len(self._keys)

    def close(self) -> None:
        """Stop the thread, then close the socket: closed under a thread about to receive, its
        descriptor number could go to a new socket first, whose datagrams the old thread would take."""
        self._closing = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the receiving thread (it then sees _closing)
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self.sock.close()


def uid_digest(uid: bytes) -> bytes:
    """16 bytes naming one communicator (its unique id) in abort notices."""
    return hashlib.blake2b(bytes(uid), digest_size=16).digest()


def _tag(uid: bytes, digest: bytes) -> bytes:
    return hmac.new(bytes(uid), PeerAborts.MAGIC + digest, hashlib.sha256).digest()[:16]


_PEER_ABORTS: PeerAborts | None = None


_PEER_ABORTS_LOCK = threading.Lock()


def peer_aborts() -> PeerAborts:
    """This process's abort side channel (started on first use, on the Ray node's address)."""
    global _PEER_ABORTS
    with _PEER_ABORTS_LOCK:
        if _PEER_ABORTS is None:
            _PEER_ABORTS = PeerAborts(_node_ip())
        return _PEER_ABORTS

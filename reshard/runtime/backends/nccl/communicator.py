"""This device's NCCL communicator of one group."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from reshard.errors import ReshardError
from reshard.runtime.backends import cuda_buffers as cb
from reshard.runtime.backends.communicator import Communicator, Group
from reshard.runtime.backends.nccl.aborts import peer_aborts, uid_digest
from reshard.runtime.backends.nccl.ids import _uid_bytes


class NcclCommunicator(Communicator):
    """This device's NCCL communicator for one group. Operations block until the data has arrived
    (or raise); inside ``backend.grouped()`` they are queued and the block's end waits for all (or,
    ``wait=False``, for their launch). ``lock``: held by the thread queuing operations on it."""

    def __init__(self, backend, group: Group, rank: int, timeout_s: float, raw, info: Mapping[str, Any]):
        super().__init__(group, rank, timeout_s)
        self._backend = backend  # the NcclBackend that created it: operations go through it
        self.raw = raw  # cupy.cuda.nccl.NcclCommunicator
        self.uid = _uid_bytes(info["uid"])  # the rendezvous this communicator was created from
        self.digest = uid_digest(self.uid)
        peer_aborts().watch(self.uid)  # until the backend forgets it
        self.uid_host = int(info.get("host", -1))
        self.abort_to = [tuple(a) for a in info.get("abort_to", ())]
        self.aborted = False
        self.closed = False
        self.abort_requested = False  # another thread asked for an abort while a run held the communicator
        self.lock = threading.RLock()
        self.stream = None  # its operations' cupy stream (the backend makes it on first use)

    def __repr__(self) -> str:
        state = "aborted" if self.aborted else "closed" if self.closed else "live"
        return f"NcclCommunicator(group={self.group}, rank={self.rank}, {state})"

    def broadcast(self, tensor, root: int) -> None:
        self._check_peer(root)
        self._backend._issue(self, "broadcast", tensor, root)

    def send(self, tensor, peer: int) -> None:
        self._check_peer(peer)
        self._backend._issue(self, "send", tensor, peer)

    def recv(self, tensor, peer: int) -> None:
        self._check_peer(peer)
        self._backend._issue(self, "recv", tensor, peer)

    def all_reduce(self, tensor, op: str = "sum") -> None:
        if op not in cb.REDUCE_OPS:
            raise ValueError(f"unknown reduce op {op!r}; choose one of {', '.join(cb.REDUCE_OPS)}")
        self._check_peer(0)
        self._backend._issue(self, "all_reduce", tensor, op)

    def peer_aborted(self) -> bool:
        """A member of this group reported that it aborted its communicator."""
        return peer_aborts().aborted(self.uid)

    def _check_peer(self, r: int) -> None:
        if not 0 <= r < self.size:
            raise ValueError(f"rank {r} out of range for group {self.group} (size {self.size})")
        if self.aborted or self.closed:
            raise ReshardError(
                f"communicator for group {self.group} was {'aborted' if self.aborted else 'closed'}; "
                "run a new rendezvous for it"
            )

    def abort(self) -> None:
        """Abort in-flight operations, free the communicator and tell the other members (local
        ``ncclCommAbort``, never blocks on peers). From the thread that issues this actor's NCCL
        calls it happens at once; from another thread while a run holds the backend it is recorded,
        and the run's polling thread aborts within one poll (NCCL allows no abort under a caller)."""
        self._backend._abort(self)

    def close(self) -> None:
        self._backend._destroy([self])

    def retire(self) -> None:
        """Release it off the callers' path (the backend's reaper thread aborts it locally; never
        waits for peers, who drop it too)."""
        self._backend._retire(self)

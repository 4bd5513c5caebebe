"""Communicators: one group of devices that broadcast / send / recv tensors among themselves.

A group is named by the sorted tuple of its global device ids; a device's rank is its index in
that tuple. Each backend has a driver side (``Backend.rendezvous``: whatever the members need to
find each other, computed for many groups at once, never one blocking round trip per group) and
an actor side (``Backend.connect``: build this member's communicator from that information).
"""

from __future__ import annotations

import abc
import contextlib
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reshard.errors import ReshardError
from reshard.ir.program import Group


class PeerFailed(ReshardError):
    """An operation failed because a peer of the group went away or aborted the group: a
    consequence of a failure elsewhere (the driver reports the root cause instead)."""


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """What every member of ``group`` needs to join it; ``info`` is a msgpack-able map with backend-defined keys."""

    group: Group
    info: Mapping[str, Any]


class Done:
    """An operation that completed when it was issued."""

    def wait(self, timeout_s: float) -> None:
        pass


DONE = Done()


class Communicator(abc.ABC):
    """This device's handle on one group. Every blocking call returns when done or raises a
    ``reshard.ReshardError`` (``ReshardTimeout`` after ``timeout_s``); it never hangs.

    ``isend`` / ``irecv`` / ``ibroadcast`` issue an operation and return an object whose
    ``wait(timeout_s)`` completes it (the executor issues a window of ops, then waits for them); a
    backend without asynchronous operations runs them at once and returns ``DONE``."""

    def __init__(self, group: Group, rank: int, timeout_s: float):
        self.group = group
        self.rank = rank
        self.timeout_s = timeout_s

    @property
    def size(self) -> int:
        return len(self.group)

    @abc.abstractmethod
    def broadcast(self, tensor, root: int) -> None:
        """In place: ``tensor`` on rank ``root`` is copied into ``tensor`` on every other rank."""

    @abc.abstractmethod
    def send(self, tensor, peer: int) -> None:
        """Send ``tensor`` to rank ``peer``."""

    @abc.abstractmethod
    def recv(self, tensor, peer: int) -> None:
        """Receive into ``tensor`` from rank ``peer``."""

    @abc.abstractmethod
    def all_reduce(self, tensor, op: str = "sum") -> None:
        """In place: every rank's ``tensor`` becomes the reduction (``op``: "sum", "max", "min")
        of all ranks' tensors, the same bits on every rank."""

    def isend(self, tensor, peer: int):
        self.send(tensor, peer)
        return DONE

    def irecv(self, tensor, peer: int):
        self.recv(tensor, peer)
        return DONE

    def ibroadcast(self, tensor, root: int):
        self.broadcast(tensor, root)
        return DONE

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release the group's resources (sockets, GPU memory)."""

    def retire(self) -> None:
        """Release a communicator whose group was dropped (every member drops it), without
        holding up the caller. Default: ``close()``."""
        self.close()

    def abort(self) -> None:
        """Failure path: tear the group down without waiting for peers, so that peers blocked on
        it fail fast instead of waiting for their timeout. Default: ``close()``."""
        self.close()


class Backend(abc.ABC):
    """A communicator family (gloo on CPUs, NCCL on GPUs)."""

    name: str
    #: torch device type of the buffers this backend moves ("cpu" for gloo, "cuda" for NCCL).
    device_type: str = "cpu"
    #: whether ``grouped`` issues the operations inside it as one call (NCCL's group calls).
    batches: bool = False
    #: whether messages complete in the order of the calling thread's stream (GPU backends): a run
    #: queues its messages with ``grouped(wait=False)``, its copies behind them on the same stream,
    #: and waits once at its end (``synchronize``), instead of waiting for each message.
    stream_ordered: bool = False
    #: GPUs each device actor reserves (None: as the backend's registry entry says).
    gpus_per_device: float | None = None

    def grouped(self, timeout_s: float | None = None, *, wait: bool = True):
        """A context inside which operations are issued as one call and waited for together (only
        where ``batches``; elsewhere each runs as it is issued). ``wait=False`` (``stream_ordered``
        backends): return once they are queued on the calling thread's stream."""
        return contextlib.nullcontext()

    @property
    def batcher(self):
        """What a run issues each window of operations through: ``grouped`` where the backend
        ``batches`` (queued without waiting where it is ``stream_ordered``), else None (each
        operation runs as it is issued)."""
        if not self.batches:
            return None
        return functools.partial(self.grouped, wait=False) if self.stream_ordered else self.grouped

    def synchronize(self, deadline: float, what: str = "") -> None:  # noqa: B027 - nothing queued by default
        """``stream_ordered`` backends: return once what the calling thread queued on its stream is
        done (``deadline``: monotonic), or raise naming the failure. Default: nothing to wait for."""

    @abc.abstractmethod
    def rendezvous(self, groups: list[Group], actors: dict[int, object]) -> list[Rendezvous]:
        """Driver side: rendezvous information for ``groups`` (``actors`` maps device id -> actor handle)."""

    @abc.abstractmethod
    def connect(self, rendezvous: Rendezvous, device: int, timeout_s: float) -> Communicator:
        """Actor side: this device's communicator for the group."""

    def connect_many(self, rendezvous: list[Rendezvous], device: int, timeout_s: float) -> Sequence[Communicator]:
        """Actor side: this device's communicators for several groups, in order (a backend may
        set them up together; by default one after the other)."""
        return [self.connect(r, device, timeout_s) for r in rendezvous]

    def abort_rendezvous(self, rendezvous: list[Rendezvous], reason: str = "aborted") -> None:  # noqa: B027
        """Make members still waiting to join these groups give up at once (default: nothing to do;
        they wait until their deadline)."""

    def controller_ended(self, rendezvous: list[Rendezvous]) -> None:  # noqa: B027 - optional hook
        """Actor side: the controller that set up these groups ended (its groups are released
        already); drop whatever this process keeps for reaching it (default: nothing)."""

    def setup_actor(self, device: int, cuda_device: int | None) -> None:  # noqa: B027 - optional hook
        """Actor side, once when an actor becomes device ``device`` (its GPU: ``cuda_device``, the
        CUDA ordinal in this process; None on a CPU device): whatever the backend needs there."""

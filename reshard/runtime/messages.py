"""What the driver and the device actors say to each other: typed, small, picklable values.

Every call that changes a device's state is ORDERED: it carries a ``Ticket`` (the calling
process's controller id and a per-device sequence number) and the actor runs a controller's
ordered calls in sequence order (``reshard.runtime.inbox``), whatever order Ray delivers them in.
Deadlines are absolute wall-clock times (``time.time()``), so a call that waited in a queue has
less time left, and one whose deadline passed is answered at once without doing any work.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class DeviceState(enum.Enum):
    ALIVE = "alive"
    CLOSED = "closed"  # its mesh was shut down, or Ray was restarted
    DEAD = "dead"  # its actor died


class FailureKind(enum.IntEnum):
    """Why a call failed, in the order a root cause is chosen for the user's exception."""

    DIED = 0  # the actor died
    ERROR = 1  # the device's own error
    TIMEOUT = 2  # it did not finish in time
    PEER = 3  # a consequence of a peer's failure (a closed connection, an aborted group)


@dataclass(frozen=True, slots=True)
class Ticket:
    """Position of an ordered call among one controller's calls to one device."""

    controller: str
    seq: int


@dataclass(frozen=True, slots=True)
class Updates:
    """Driver bookkeeping that rides on an ordered call: communicator groups to drop
    (``(key, generation)``), new generations to set up (``(key, generation, rendezvous info)``),
    and cached program ids to forget."""

    group_drops: tuple = ()
    group_sets: tuple = ()
    program_drops: tuple = ()

    def __bool__(self) -> bool:
        return bool(self.group_drops or self.group_sets or self.program_drops)


@dataclass(frozen=True, slots=True)
class RunRequest:
    """Run program ``program_id`` (decoding ``blob`` first when given) over source shard
    ``src_name`` into a new destination shard ``dst_name`` before ``deadline``. ``pulls`` maps each
    device this one pulls from to its source shard's shared-memory descriptor, ``relays`` each
    device it pulls relays from to its relay board's. ``out``: an existing
    shard (a user's tensor) the result is for: written into directly when ``direct``, else kept
    under ``dst_name`` until ``reshard_commit``. ``meta``: what the destination shard is a shard of
    (global shape, placements, mesh shape, this device's coordinate)."""

    ticket: Ticket
    program_id: int
    blob: bytes | None
    updates: Updates | None
    src_name: str | None
    dst_name: str
    deadline: float
    pulls: dict | None = None
    out: str | None = None
    direct: bool = False
    meta: dict | None = None
    relays: dict | None = None


@dataclass(frozen=True, slots=True)
class RunResult:
    """``run_s``: the actor's whole call; ``elapsed_s``: its program; ``comm_s``: inside
    communication calls; ``peak_bytes``: destination (twice when assembled apart) + staging bytes
    it held; ``descriptor``: how peers map the new destination shard (None: not in shared memory)."""

    run_s: float
    elapsed_s: float
    comm_s: float
    peak_bytes: int
    descriptor: tuple | None = None


@dataclass(frozen=True, slots=True)
class Failure:
    """One participant's failure as the driver saw it."""

    kind: FailureKind
    error: BaseException = field(compare=False)

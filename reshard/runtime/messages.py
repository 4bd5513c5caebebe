"""What the driver and the device actors say to each other: typed, small, picklable values.

Every call that changes a device's state is ORDERED: it carries a ``Ticket`` (the calling
process's controller id and a per-device sequence number) and the actor runs a controller's
ordered calls in sequence order (``reshard.runtime.device.inbox``), whatever order Ray delivers them in.
Deadlines travel as budgets (seconds left when the call was sent) and count on the device from the
call's arrival (``reshard.runtime.deadlines``): a call that waited behind earlier ones has less time
left, and one whose deadline passed is answered at once without doing any work.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from reshard.ir.program import Group, group_of

#: How long after a run's deadline a destination device waits to read every participant's result
#: before it commits (all succeeded) or keeps its old values (one failed). Past it, the device keeps
#: its old values and says so. Longer than Ray takes to declare a silent node dead with its default
#: health checks (5 failed checks of 10 s, 3 s apart: 65 s measured between emulated hosts), so a
#: device cut off that long is lost with its node anyway.
COMMIT_WAIT_S = 120.0

#: The channel of reshards' communicators; the pipeline's lanes and stages use channels of their own,
#: so that users of the same devices who run concurrently get communicators of their own.
RESHARD_CHANNEL = ""
GroupKey = tuple[str, Group]


def group_key(devices, channel: str = RESHARD_CHANNEL) -> GroupKey:
    """The key of the communicator of ``devices`` (``reshard.ir.program.group_of``) on ``channel``."""
    return channel, group_of(devices)


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
    """Position of an ordered call among one controller's calls to one device. ``caller``: where
    its process runs (``reshard.runtime.device.callers``), with every call: the device frees what
    it kept for it once that process ended, also when the process died before its first call
    arrived (Ray sends a call whose arguments are still being resolved after later ones).
    ``lost``: numbers of earlier calls that Ray failed before they reached the device (an actor that
    could not allocate a call's arguments): they will never come, so their turns are given up."""

    controller: str
    seq: int
    caller: tuple | None = None
    lost: tuple[int, ...] = ()


class GroupDrop(NamedTuple):
    """Drop this generation of a group (a newer one of the same key stays)."""

    key: GroupKey
    generation: int


class GroupSet(NamedTuple):
    """Set up a new generation of a group: what its members need to connect (``Backend.rendezvous``)."""

    key: GroupKey
    generation: int
    info: Any


class Load(NamedTuple):
    """Keep ``data[array][box]`` (``reshard_load``; array None: zeros of the box's shape) as
    shard ``name`` of ``dtype``."""

    name: str
    array: int | None
    box: tuple
    dtype: str


class HoldChange(NamedTuple):
    """``holder`` takes (``acquire``) or lets go of shard ``name`` (``reshard_holds``)."""

    acquire: bool
    name: str
    holder: str


@dataclass(frozen=True, slots=True)
class Updates:
    """Driver bookkeeping that rides on an ordered call: communicator groups to drop, new
    generations to set up, and cached program and binding ids to forget."""

    group_drops: tuple[GroupDrop, ...] = ()
    group_sets: tuple[GroupSet, ...] = ()
    program_drops: tuple[int, ...] = ()
    binding_drops: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.group_drops or self.group_sets or self.program_drops or self.binding_drops)


def copy_holder(name: str, controller: str, tag: str) -> str:
    """The holder of shard ``name`` for a copy of its handle unpickled in ``controller``'s process."""
    return f"{name}/copy/{controller}/{tag}"


def held_in(controller: str, name: str, holder: str) -> bool:
    """Whether ``holder`` of shard ``name`` is a handle in ``controller``'s process: the original
    (its holder is its name, which the controller made: ``<controller>:<n>...``) or a copy
    unpickled there (``copy_holder``). Pickled handles still in flight are no process's yet."""
    return (holder == name and name.startswith(f"{controller}:")) or f"/copy/{controller}/" in holder


#: The first field of a descriptor of a shard in its process's private memory, which peers on its
#: machine read (``reshard.runtime.device.cross_memory``) but cannot map; a shared-memory block's
#: descriptor starts with its owner's pid.
CROSS_MEMORY = "cross-memory"


def maps_shared(descriptor) -> bool:
    """Whether ``descriptor`` names a shared-memory block (peers map it, and relays are published
    in it), not a shard that peers only read (``CROSS_MEMORY``)."""
    return descriptor is not None and descriptor[0] != CROSS_MEMORY


def shard_name(run: str, tensor: int) -> str:
    """The name of run ``run``'s new destination shard of tensor ``tensor`` (its index in the batch)."""
    return f"{run}/{tensor}"


def shard_names(run: str, tensors) -> list[str]:
    """``shard_name(run, t)`` of each of ``tensors`` (a run's thousands of new shards at once)."""
    return [f"{run}/{t}" for t in tensors]


@dataclass(frozen=True, slots=True)
class Bound:
    """What a run's parts on one device are bound to, per part in order: ``sources``, the name of
    its source shard (None: it holds none), and ``outs``, the user's shard its result is for (None:
    a new tensor); ``pulls`` maps each tensor to ``{holder: descriptor}`` of the source shards this
    device pulls, ``relays`` each device it pulls relays from to its relay board's descriptor;
    ``casts``, per part, the dtype its source shard is cast from into the program's (None: none);
    ``peers``, on a device whose results a commit copies into ``outs``: every participant of the
    run as ``(device, actor)`` (None: an actor that cannot answer while it runs), in the order of
    ``CommitRequest.votes``. ``like``: binding ``like``, which the device holds, reads the same
    (a sync's first call into other outputs), and only ``outs`` and ``peers`` are shipped.
    The same for every replay of one tree onto one output, so it is shipped once and then named by
    id (``RunRequest.binding``)."""

    sources: tuple
    pulls: dict | None
    outs: tuple | None
    relays: dict | None
    casts: tuple | None = None
    peers: tuple | None = None
    like: int | None = None


@dataclass(frozen=True, slots=True)
class RunRequest:
    """Run batch program ``program_id`` (decoding ``blob`` first when given) within ``budget_s``:
    run ``run``, whose new destination shard of tensor ``t`` is ``shard_name(run, t)``, its parts
    bound as binding ``binding`` says (``bound``: shipped with this call when the device may not
    have it). Results for users' shards are written into them ``direct``ly, else kept under their
    own names until ``reshard_commit``. ``commit``: results wait for a commit, and a run that ends
    after its deadline fails. ``verify``: return checksums (``reshard.runtime.device.batches``)."""

    ticket: Ticket
    program_id: int
    blob: bytes | None
    updates: Updates | None
    run: str
    budget_s: float
    binding: int
    bound: Bound | None = None
    direct: bool = False
    commit: bool = False
    verify: bool = False


@dataclass(frozen=True, slots=True)
class CommitRequest:
    """Commit run ``run`` of program ``program_id``, bound as ``binding`` (whose ``Bound.peers``
    names the participants), within ``budget_s``: ``votes``, each participant's run result, in
    that order. ``verify``: also compare what was received with what was sent."""

    run: str
    program_id: int
    binding: int
    votes: tuple
    budget_s: float
    verify: bool = False


@dataclass(frozen=True, slots=True)
class PlacedDescriptors:
    """The ``CROSS_MEMORY`` descriptors of a run's new shards that lie in its unit's block, as
    columns (integer arrays; thousands a run, made, sent and decoded without a tuple each): tensor
    ``tensors[k]``'s is ``descriptor(k)``. ``shape_ids`` index ``shapes``; ``files``: each one's
    ``(fd, inode, offset)`` in the block's file, or None for all (none mapped)."""

    pid: int
    fd: int
    inode: int
    tensors: Any
    cells: Any
    tenures: Any
    addresses: Any
    shape_ids: Any
    shapes: tuple
    files: tuple | None

    def descriptor(self, k: int) -> tuple:
        return (
            CROSS_MEMORY,
            self.pid,
            self.fd,
            self.inode,
            int(self.cells[k]),
            int(self.tenures[k]),
            int(self.addresses[k]),
            self.shapes[self.shape_ids[k]],
            None if self.files is None else self.files[k],
        )


@dataclass(frozen=True, slots=True)
class RunResult:
    """``run_s``: the actor's whole call; ``elapsed_s``: its program; ``comm_s``: inside
    communication calls; ``peak_bytes``: destinations (twice when assembled apart) + staging bytes
    it held; ``descriptors``: per tensor, how peers map its new destination shard (None: not in
    shared memory); ``placed``: those of its unit's shards, as columns; ``checks``: with
    ``verify``, ``[(tensor, step, "read" | "wrote", crc)]``."""

    run_s: float
    elapsed_s: float
    comm_s: float
    peak_bytes: int
    descriptors: dict = field(default_factory=dict)
    checks: list | None = None
    placed: PlacedDescriptors | None = None


@dataclass(frozen=True, slots=True)
class Failure:
    """One participant's failure as the driver saw it."""

    kind: FailureKind
    error: BaseException = field(compare=False)

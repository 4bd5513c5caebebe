"""Communicator caches: the driver's book of live groups and each actor's cache of communicators.

A group is the sorted tuple of its global device ids; a device's rank is its index in it. Every
(re-)creation of a group is a new GENERATION (a driver-wide counter) with its own rendezvous, so
a group re-created after a failure never meets its dead predecessor.

The DRIVER decides (``GroupTable``): which groups are live, at which generation, and which to evict
when a device would hold more than its bound (LRU over groups; the groups a program about to run
needs are never evicted, so the bound is exceeded only by a program that alone needs more). An
evicted or failed group is dropped on EVERY member, so members never disagree about a group.
The ACTORS obey (``GroupCache``): they apply ``set``/``drop`` updates and create communicators
lazily, on first use, through their backend.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from reshard.runtime.communicator import Backend, Communicator, Group, Rendezvous

log = logging.getLogger(__name__)


def group_key(devices) -> Group:
    """The communicator key of a set of devices: their sorted tuple."""
    return tuple(sorted(int(d) for d in devices))


# ------------------------------------------------------------------------------------- driver


@dataclass
class GroupTable:
    """Driver side: live groups (LRU order) with their generation, and per-device bounds."""

    live: OrderedDict = field(default_factory=OrderedDict)  # Group -> generation, least recent first
    next_generation: int = 1

    def count(self, device: int) -> int:
        return sum(1 for g in self.live if device in g)

    def admit(self, needed, capacity: dict[int, int]) -> tuple[list[Group], list[tuple[Group, int]]]:
        """Make ``needed`` live and most recently used. Returns ``(create, drop)``: the needed groups
        that need a new generation (rendezvous), and ``(group, generation)`` pairs to drop on every
        member because some member exceeds its bound ``capacity[device]``."""
        needed = list(dict.fromkeys(group_key(g) for g in needed))
        create = [g for g in needed if g not in self.live]
        for g in create:
            self.live[g] = None  # generation assigned by ``commit``
        for g in needed:
            self.live.move_to_end(g)
        counts: dict[int, int] = {}
        for g in self.live:
            for d in g:
                counts[d] = counts.get(d, 0) + 1
        keep = set(needed)
        drop = []
        for g in list(self.live):
            if not any(counts[d] > capacity.get(d, 1 << 30) for d in g) or g in keep:
                continue
            drop.append((g, self.live.pop(g)))
            for d in g:
                counts[d] -= 1
        over = {d: n for d, n in counts.items() if n > capacity.get(d, 1 << 30)}
        if over:
            log.warning("devices %s need more communicators at once than their bound; keeping them all", over)
        return create, drop

    def commit(self, groups) -> dict[Group, int]:
        """Assign a fresh generation to each of ``groups`` (after their rendezvous was made)."""
        out = {}
        for g in groups:
            gen = self.next_generation
            self.next_generation += 1
            self.live[g] = gen
            out[g] = gen
        return out

    def forget(self, groups) -> list[tuple[Group, int]]:
        """Groups that failed: no longer live. Returns ``(group, generation)`` to drop on members."""
        out = []
        for g in dict.fromkeys(group_key(g) for g in groups):
            if g in self.live:
                gen = self.live.pop(g)
                if gen is not None:
                    out.append((g, gen))
        return out

    def forget_device(self, device: int) -> list[tuple[Group, int]]:
        return self.forget([g for g in self.live if device in g])


# ------------------------------------------------------------------------------------- actor


@dataclass
class _Entry:
    generation: int
    rendezvous: Rendezvous
    comm: Communicator | None = None


class GroupCache:
    """Actor side: this device's communicators, keyed by group, created lazily on first use.

    ``capacity`` is the bound the driver enforces (it mirrors every member's cache so that a group
    is evicted on all its members at once); the actor only warns if it is ever exceeded.
    """

    def __init__(self, backend: Backend, device: int, capacity: int, timeout_s: float):
        self.backend = backend
        self.device = device
        self.capacity = capacity
        self.timeout_s = timeout_s
        self.entries: OrderedDict[Group, _Entry] = OrderedDict()
        self.stats = {"created": 0, "closed": 0, "aborted": 0}

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, group) -> bool:
        return group_key(group) in self.entries

    def generation(self, group) -> int | None:
        e = self.entries.get(group_key(group))
        return None if e is None else e.generation

    def live(self) -> dict[Group, int]:
        """Groups with a created communicator -> generation."""
        return {g: e.generation for g, e in self.entries.items() if e.comm is not None}

    def apply(self, drops=(), sets=()) -> None:
        """Driver updates: ``drops`` = ``(group, generation)`` (only that generation is dropped, in
        sorted group order), ``sets`` = ``(group, generation, rendezvous_info)``."""
        for g, gen in sorted((group_key(g), gen) for g, gen in drops):
            e = self.entries.get(g)
            if e is not None and e.generation == gen:
                self._release(g, abort=False)
        for g, gen, info in sets:
            g = group_key(g)
            e = self.entries.get(g)
            if e is not None and e.generation == gen:
                continue
            if e is not None:
                self._release(g, abort=False)
            self.entries[g] = _Entry(gen, Rendezvous(g, info))
        if len(self.entries) > self.capacity:
            log.warning("device %d holds %d groups (bound %d)", self.device, len(self.entries), self.capacity)

    def connect(self, groups, timeout_s: float | None = None) -> None:
        """Create the communicators of ``groups`` that do not exist yet (a backend with
        ``connect_many`` creates them in one call)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        todo = []
        for g in dict.fromkeys(group_key(g) for g in groups):
            e = self.entries.get(g)
            if e is None:
                raise KeyError(
                    f"device {self.device} has no rendezvous for group {g}; the driver must set it up first "
                    f"(reshard.runtime.ensure_groups)"
                )
            if e.comm is None:
                todo.append(e)
        if not todo:
            return
        many = getattr(self.backend, "connect_many", None)
        if many is not None:
            comms = many([e.rendezvous for e in todo], self.device, timeout)
        else:
            comms = [self.backend.connect(e.rendezvous, self.device, timeout) for e in todo]
        for e, c in zip(todo, comms, strict=True):
            e.comm = c
        self.stats["created"] += len(todo)

    def get(self, group) -> Communicator:
        """This device's communicator for ``group`` (created now if needed)."""
        g = group_key(group)
        e = self.entries.get(g)
        if e is None or e.comm is None:
            self.connect([g])
            e = self.entries[g]
        self.entries.move_to_end(g)
        return e.comm

    def abort(self, groups) -> None:
        """Failure path: tear these groups down at once (peers blocked on them fail fast)."""
        for g in dict.fromkeys(group_key(g) for g in groups):
            if g in self.entries:
                self._release(g, abort=True)

    def close_all(self) -> None:
        for g in sorted(self.entries):
            self._release(g, abort=False)

    def _release(self, g: Group, *, abort: bool) -> None:
        e = self.entries.pop(g)
        if e.comm is None:
            return
        try:
            if abort:
                e.comm.abort()
                self.stats["aborted"] += 1
            else:
                e.comm.close()
                self.stats["closed"] += 1
        except Exception as err:  # a broken communicator must not stop the cleanup of the others
            log.warning("device %d: releasing group %s failed: %s", self.device, g, err)

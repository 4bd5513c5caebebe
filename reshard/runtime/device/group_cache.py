"""A device's communicators, one cache per controller: the group updates the controller sends
(``reshard.runtime.driver.group_table``) applied, and communicators created when a program
connects them; an abort tears down only the generations of the run it ends."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

from reshard.ir.program import Group
from reshard.runtime.backends.communicator import Backend, Communicator, Rendezvous
from reshard.runtime.messages import GroupKey

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    generation: int
    rendezvous: Rendezvous
    comm: Communicator | None = None


class Channel:
    """The communicators of one channel of a ``GroupCache``, by group (``group_of``, as a
    prepared program's steps carry it: looked up as is, once per message op)."""

    def __init__(self, groups: GroupCache, channel: str):
        self.groups, self.channel = groups, channel

    def get(self, group: Group) -> Communicator:
        return self.groups.get((self.channel, group))


class GroupCache:
    """Actor side, one per controller: this device's communicators by group key, created when a
    program connects them. Thread-safe: the controller's ordered calls use it one at a time, and an
    abort may arrive on another thread at any moment."""

    def __init__(self, backend: Backend, device: int, timeout_s: float):
        self.backend = backend
        self.device = device
        self.timeout_s = timeout_s
        self.entries: OrderedDict[GroupKey, _Entry] = OrderedDict()
        self.stats = {"created": 0, "closed": 0, "aborted": 0}
        self.last_rendezvous: Rendezvous | None = None  # how the controller's groups met (``retire_all``)
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self.entries)

    def generation(self, key: GroupKey) -> int | None:
        e = self.entries.get(key)
        return None if e is None else e.generation

    def live(self) -> dict[GroupKey, int]:
        """Groups with a created communicator -> generation."""
        with self._lock:
            return {k: e.generation for k, e in self.entries.items() if e.comm is not None}

    def apply(self, drops=(), sets=()) -> None:
        """Controller updates: ``drops`` = ``(key, generation)`` (only that generation is dropped),
        ``sets`` = ``(key, generation, rendezvous info)``."""
        with self._lock:
            for k, gen in sorted(drops):
                e = self.entries.get(k)
                if e is not None and e.generation == gen:
                    self._release(k, abort=False)
            for k, gen, info in sets:
                e = self.entries.get(k)
                if e is not None and e.generation == gen:
                    continue
                if e is not None:
                    self._release(k, abort=False)
                self.entries[k] = _Entry(gen, Rendezvous(k[1], info))
                self.last_rendezvous = self.entries[k].rendezvous

    def connect(self, keys, timeout_s: float | None = None) -> None:
        """Create the communicators of ``keys`` that do not exist yet, in the given order."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            todo = []
            for k in dict.fromkeys(keys):
                e = self.entries.get(k)
                if e is None:
                    raise KeyError(
                        f"device {self.device} has no rendezvous for group {k}; the controller must set it up first"
                    )
                if e.comm is None:
                    todo.append((k, e))
        if not todo:
            return
        comms = self.backend.connect_many([e.rendezvous for _, e in todo], self.device, timeout)
        with self._lock:
            for (k, e), c in zip(todo, comms, strict=True):
                if self.entries.get(k) is e:
                    e.comm = c
                else:  # dropped or aborted meanwhile
                    c.abort()
            self.stats["created"] += len(todo)

    def channel(self, name: str) -> Channel:
        """The communicators of channel ``name``, by device tuple (``Channel``)."""
        return Channel(self, name)

    def get(self, key: GroupKey) -> Communicator:
        """This device's communicator for ``key`` (connected earlier by ``connect``)."""
        e = self.entries.get(key)
        if e is None or e.comm is None:
            self.connect([key])
            e = self.entries[key]
        if e.comm is None:
            raise KeyError(f"device {self.device}: group {key} was aborted")
        return e.comm

    def abort(self, keys, reason: str = "aborted") -> None:
        """Failure path: tear these groups down at once. Connected ones are aborted (peers blocked
        on them fail fast); members still waiting to connect one are told through its rendezvous."""
        self.abort_generations([(k, None) for k in keys], reason)

    def abort_generations(self, pairs, reason: str = "aborted") -> None:
        """``abort`` the groups of ``pairs`` = ``(key, generation)`` that are still at that
        generation (None: any), checked under the lock: an abort from another thread never tears
        down the generation a later call has set up meanwhile."""
        waiting = []
        with self._lock:
            for k, gen in dict.fromkeys(pairs):
                e = self.entries.get(k)
                if e is None or (gen is not None and e.generation != gen):
                    continue
                if e.comm is None:
                    waiting.append(e.rendezvous)
                    del self.entries[k]
                else:
                    self._release(k, abort=True)
        if waiting:
            self.backend.abort_rendezvous(waiting, f"device {self.device}: {reason}")

    def retire_all(self) -> None:
        """Release every group off the callers' path, and what the backend keeps for reaching the
        controller's rendezvous (its controller ended)."""
        with self._lock:
            for k in sorted(self.entries):
                self._release(k, abort=False)
            if self.last_rendezvous is not None:
                self.backend.controller_ended([self.last_rendezvous])

    def close_all(self) -> None:
        with self._lock:
            for k in sorted(self.entries):
                self._release(k, abort=False, now=True)

    def _release(self, k: GroupKey, *, abort: bool, now: bool = False) -> None:
        """Drop group ``k``: aborted (failure: peers fail fast), closed (``now``: the device leaves
        the mesh), or retired off the caller's path (a dropped group)."""
        e = self.entries.pop(k)
        if e.comm is None:
            return
        try:
            if abort:
                e.comm.abort()
                self.stats["aborted"] += 1
            else:
                e.comm.close() if now else e.comm.retire()
                self.stats["closed"] += 1
        except Exception as err:  # a broken communicator must not stop the cleanup of the others
            log.warning("device %d: releasing group %s failed: %s", self.device, k, err)

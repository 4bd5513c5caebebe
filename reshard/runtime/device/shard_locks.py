"""Reads of a device's shards kept apart from writes into them, by shard name.

A commit copies its staged results into the user's tensors, and a ``direct`` run lands messages
in them in place; ``reshard_fetch`` (``to_numpy``, ``local_shards``) runs on a thread of its own
and may come from any process. Without this, a read during a write returns a shard half old and
half new. A read waits while a write of its shard is under way or waiting (writers first, so that
reads cannot hold a commit back), and takes a copy; a write waits for the reads under way (copies:
never long). Writes do not exclude each other: their order is the callers' business
(``reshard.runtime.device.inbox``), and a run's write must not wait behind another caller's run
that waits on peers.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from reshard.errors import ReshardTimeout
from reshard.runtime.deadlines import Deadline


class ShardLocks:
    """The writes under way or waiting, each as the set of shard names it writes, and per shard
    name the reads under way (module docstring). A write of a tree's thousands of outputs costs a
    set made and dropped, not a count per name."""

    def __init__(self, device: int):
        self.device = device
        self._cond = threading.Condition()
        self._writes: list[frozenset[str]] = []
        self._reads: Counter[str] = Counter()
        self._reads_waiting = 0

    @contextmanager
    def writing(self, names: Iterable[str], until: Deadline, what: str) -> Iterator[None]:
        """Write shards ``names`` inside: new reads of them wait from now; waits for the reads under
        way (``ReshardTimeout`` when they outlast ``until``; nothing was written then)."""
        written = frozenset(names) - {None}
        with self._cond:
            self._writes.append(written)
            self._cond.notify_all()  # for ``state`` watchers
            if not self._cond.wait_for(lambda: self._reads.keys().isdisjoint(written), _timeout(until)):
                self._end(written)
                raise ReshardTimeout(f"device {self.device}: {what}: reads of its outputs did not end in time")
        try:
            yield
        finally:
            with self._cond:
                self._end(written)

    @contextmanager
    def reading(self, name: str, until: Deadline) -> Iterator[None]:
        """Read shard ``name`` inside, once no write of it is under way or waiting
        (``ReshardTimeout`` naming the shard when one lasts past ``until``)."""
        with self._cond:
            self._reads_waiting += 1
            self._cond.notify_all()  # for ``state`` watchers
            try:
                if not self._cond.wait_for(lambda: not any(name in w for w in self._writes), _timeout(until)):
                    raise ReshardTimeout(
                        f"device {self.device}: shard {name!r} was being written (a sync into it) for the whole "
                        "timeout of the read"
                    )
            finally:
                self._reads_waiting -= 1
            self._reads[name] += 1
        try:
            yield
        finally:
            with self._cond:
                self._reads[name] -= 1
                if self._reads[name] <= 0:
                    del self._reads[name]
                self._cond.notify_all()

    def state(self) -> dict:
        """Counts for ``reshard_stats``: shards being written, reads under way and waiting."""
        with self._cond:
            return {
                "shards_written": len(frozenset().union(*self._writes)),
                "reads": sum(self._reads.values()),
                "reads_waiting": self._reads_waiting,
            }

    def _end(self, written: frozenset[str]) -> None:
        self._writes.remove(written)  # one of the equal sets, if two writes name the same shards
        self._cond.notify_all()


def _timeout(until: Deadline) -> float | None:
    return None if until.at == math.inf else until.left()

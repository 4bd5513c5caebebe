"""The controller's table of live communicator groups.

A group is keyed by ``(channel, devices)`` (``reshard.runtime.messages.group_key``). Every
(re-)creation of a group is a new GENERATION with its own rendezvous, so a group re-created after a
failure never meets its dead predecessor. The controller decides which groups are live, at which
generation, and which to evict when a device would hold more than its bound (LRU; groups a program
about to run needs, and pinned groups, are never evicted). An evicted or failed group is dropped on
EVERY member, so members never disagree about a group; the devices obey
(``reshard.runtime.device.group_cache``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from reshard.runtime.messages import GroupDrop, GroupKey

log = logging.getLogger(__name__)


@dataclass
class GroupTable:
    """Controller side: live groups (LRU order) with their generation."""

    live: OrderedDict = field(default_factory=OrderedDict)  # GroupKey -> generation, least recent first
    pinned: dict = field(default_factory=dict)  # GroupKey -> pin count
    next_generation: int = 1

    def admit(self, needed, capacity: dict[int, int]) -> tuple[list[GroupKey], list[GroupDrop]]:
        """Make ``needed`` live and most recently used. Returns ``(create, drop)``: the needed groups
        that need a new generation (rendezvous), and the generations to drop on every
        member because some member exceeds its bound ``capacity[device]``."""
        needed = list(dict.fromkeys(needed))
        create = [k for k in needed if k not in self.live]
        for k in create:
            self.live[k] = None  # generation assigned by ``commit``
        for k in needed:
            self.live.move_to_end(k)
        counts: dict[int, int] = {}
        for _, g in self.live:
            for d in g:
                counts[d] = counts.get(d, 0) + 1
        keep = set(needed) | set(self.pinned)
        drop = []
        for k in list(self.live):
            if k in keep or not any(counts[d] > capacity.get(d, 1 << 30) for d in k[1]):
                continue
            drop.append((k, self.live.pop(k)))
            for d in k[1]:
                counts[d] -= 1
        over = {d: n for d, n in counts.items() if n > capacity.get(d, 1 << 30)}
        if over:
            log.warning("devices %s need more communicators at once than their bound; keeping them all", over)
        return create, [GroupDrop(k, gen) for k, gen in drop if gen is not None]

    def commit(self, keys) -> dict[GroupKey, int]:
        """Assign a fresh generation to each of ``keys`` (after their rendezvous was made)."""
        out = {}
        for k in keys:
            out[k] = self.live[k] = self.next_generation
            self.next_generation += 1
        return out

    def forget(self, keys) -> list[GroupDrop]:
        """Groups that failed: no longer live. Returns the generations to drop on members."""
        out = []
        for k in dict.fromkeys(keys):
            if k in self.live:
                gen = self.live.pop(k)
                if gen is not None:
                    out.append(GroupDrop(k, gen))
        return out

    def forget_device(self, device: int) -> list[GroupDrop]:
        return self.forget([k for k in self.live if device in k[1]])

    def pin(self, keys) -> None:
        for k in keys:
            self.pinned[k] = self.pinned.get(k, 0) + 1

    def unpin(self, keys) -> None:
        for k in keys:
            n = self.pinned.get(k, 0) - 1
            if n > 0:
                self.pinned[k] = n
            else:
                self.pinned.pop(k, None)

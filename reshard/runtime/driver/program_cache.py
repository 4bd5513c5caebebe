"""The controller's mirror of every device's program cache.

A compiled reshard gets a program id the first time this controller runs it; each device's part
is shipped with the first run that needs it on that device and then run by id. The mirror keeps
each device's cache as an LRU of ``max_programs`` ids: what falls out is dropped on the device
with the next call (``Updates.program_drops``), and a program a device may have lost (its run
failed before it cached it) is shipped again.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import TypeVar

T = TypeVar("T")

MAX_IDS = 1024  # compiled reshards this controller remembers ids for


class ProgramCache:
    def __init__(self):
        self._ids: OrderedDict = OrderedDict()  # CompiledReshard (by identity) -> program id
        self._next = itertools.count(1)
        self._cached: dict[int, OrderedDict[int, bool]] = {}  # device -> program id -> surely cached
        self._drops: dict[int, list[int]] = {}

    def program_id(self, compiled) -> int:
        pid = self._ids.get(compiled)
        if pid is None:
            pid = self._ids[compiled] = next(self._next)
            while len(self._ids) > MAX_IDS:
                self._ids.popitem(last=False)
        else:
            self._ids.move_to_end(compiled)
        return pid

    def to_ship(self, device: int, pid: int, blob: T, max_programs: int) -> T | None:
        """``blob`` when the device must receive program ``pid`` with this call, else None."""
        cache = self._cached.setdefault(device, OrderedDict())
        ship = not cache.get(pid, False)
        cache[pid] = True
        cache.move_to_end(pid)
        while len(cache) > max_programs:
            old, _ = cache.popitem(last=False)
            self._drops.setdefault(device, []).append(old)
        return blob if ship else None

    def surely(self, device: int, pid: int) -> bool:
        """Whether ``device`` surely holds ``pid`` and no call drops it before its next run."""
        cache = self._cached.get(device)
        return cache is not None and cache.get(pid, False)

    def unsure(self, device: int, pid: int) -> None:
        """The device's run of ``pid`` failed: it may not have cached it; ship it again next time
        (the entry stays, so that the mirror still evicts it if the device did cache it)."""
        cache = self._cached.get(device)
        if cache is not None and pid in cache:
            cache[pid] = False

    def unsure_all(self, device: int) -> None:
        """The device failed a run: ship whatever it needs again (it may have lost its cache)."""
        cache = self._cached.get(device)
        if cache is not None:
            for pid in cache:
                cache[pid] = False

    def forget_device(self, device: int) -> None:
        self._cached.pop(device, None)
        self._drops.pop(device, None)

    def take_drops(self, device: int) -> tuple[int, ...]:
        return tuple(self._drops.pop(device, ()))

    def cached(self, device: int) -> tuple[int, ...]:
        return tuple(self._cached.get(device, ()))

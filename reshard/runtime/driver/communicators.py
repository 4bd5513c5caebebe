"""The controller's communicator groups: which are live (``GroupTable``), their rendezvous, and the
drops each device learns with its next call.

A group becomes live when a call needs it: new ones get a rendezvous (one batched call to the
backend) and a generation, and every member is told with its next call (``GroupSet``). A group
evicted, failed or on a dead device is dropped on every member (``GroupDrop``), and a rendezvous
still being met is aborted, so no member waits for a peer that will never come.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from reshard.runtime.deadlines import Deadline
from reshard.runtime.driver.device_registry import DeviceRegistry
from reshard.runtime.driver.dispatch import Dispatch, Outcome
from reshard.runtime.driver.group_table import GroupTable
from reshard.runtime.messages import DeviceState, GroupDrop, GroupKey, GroupSet

if TYPE_CHECKING:
    from reshard.runtime.backends.communicator import Backend, Rendezvous


class Communicators:
    """Live groups with their rendezvous, and the drops queued for each device. Admission and the
    submission of the calls that set the groups up happen under ``dispatch.lock``, as one step."""

    def __init__(self, dispatch: Dispatch, registry: DeviceRegistry, backends: dict[str, Backend], stats: Counter):
        self.dispatch = dispatch
        self.registry = registry
        self.backends = backends
        self.stats = stats
        self.table = GroupTable()
        self._rendezvous: dict[GroupKey, Rendezvous] = {}  # live group -> its rendezvous (to abort it)
        self._drops: dict[int, list[GroupDrop]] = {}

    def admit(self, keys: list[GroupKey], backend_name: str) -> dict[int, list]:
        """Make ``keys`` live: new ones get a rendezvous (one batched call) and a generation.
        Returns ``{device: [GroupSet]}`` to set up with the device's next call."""
        if not keys:
            return {}
        recs = self.registry.devices
        capacity = {d: r.max_communicators for d, r in recs.items() if r.state is DeviceState.ALIVE}
        with self.dispatch.lock:
            create, drop = self.table.admit(keys, capacity)
            self._queue(drop)
            sets: dict[int, list] = {}
            if not create:
                return sets
            backend = self.backends[backend_name]
            members = sorted({d for _, g in create for d in g})
            try:
                rdvs = backend.rendezvous([g for _, g in create], {d: recs[d].actor for d in members})
            except BaseException:
                self.table.forget(create)
                raise
            gens = self.table.commit(create)
            self.stats["rendezvous_calls"] += 1
            self.stats["groups_created"] += len(create)
            for k, r in zip(create, rdvs, strict=True):
                self._rendezvous[k] = r
                for d in k[1]:
                    sets.setdefault(d, []).append(GroupSet(k, gens[k], r.info))
            return sets

    def take_drops(self, device: int) -> tuple[GroupDrop, ...]:
        """The drops ``device`` has not been told of yet (told with the call being made)."""
        return tuple(self._drops.pop(device, ()))

    def forget(self, keys) -> None:
        """Drop these groups on every member (with each member's next call); the next use sets up
        a new generation."""
        with self.dispatch.lock:
            self._queue(self.table.forget(keys))

    def forget_device(self, device: int) -> None:
        """A dead or closed device: every group it is in goes."""
        with self.dispatch.lock:
            self._queue(self.table.forget_device(device))

    def abort(self, keys, devices, reason: str) -> list[GroupDrop]:
        """A failed call's groups: forgotten, their rendezvous aborted (members still connecting give
        up). Returns the drops for ``devices`` to be told now; other members hear with their next call."""
        devices = set(devices)
        with self.dispatch.lock:
            rendezvous = [self._rendezvous[k] for k in keys if k in self._rendezvous]
            drops = self.table.forget(keys)
            for k, _ in drops:
                self._rendezvous.pop(k, None)
            backend = self._backend_of(devices)
            if backend is not None and rendezvous:
                backend.abort_rendezvous(rendezvous, reason)
            for k, gen in drops:
                for d in k[1]:
                    if d not in devices:
                        self._drops.setdefault(d, []).append(GroupDrop(k, gen))
            return drops

    def pin(self, keys) -> None:
        with self.dispatch.lock:
            self.table.pin(keys)

    def unpin(self, keys) -> None:
        with self.dispatch.lock:
            self.table.unpin(keys)

    def ensure(self, keys, updates, *, timeout_s: float = 60.0, pin: bool = False) -> list:
        """Set up groups ``(channel, devices)`` on their members and connect them there: every
        member connects its groups in the order given (one order for all members: no two groups
        wait on each other); ``pin`` keeps them live until ``unpin``. ``updates(device, sets)`` is
        what a device's next call carries (``Runtime.updates_for``). Returns the keys."""
        keys = list(dict.fromkeys((ch, tuple(sorted(g))) for ch, g in keys))
        members = sorted({d for _, g in keys for d in g})
        deadline = Deadline.after(timeout_s)
        what = f"ensure_groups({[list(g) for _, g in keys]})"

        def make(rec):
            mine = [k for k in keys if rec.id in k[1]]
            upd = updates(rec.id, sets.get(rec.id, ()))
            return lambda t: rec.actor.reshard_update.remote(t, upd, mine, deadline.budget)

        def forget(outcome: Outcome) -> None:
            with self.dispatch.lock:
                self.forget(keys)
                if pin:
                    self.table.unpin(keys)

        with self.dispatch.lock:  # admitted and submitted at once: no other call sees the groups half set up
            recs = self.registry.check(members, "ensure_groups")
            names = {r.backend for r in recs}
            if len(names) > 1:
                raise ValueError(f"ensure_groups: the devices use different backends {sorted(names)}")
            sets = self.admit(keys, names.pop()) if recs else {}
            if pin:
                self.table.pin(keys)
            refs = self.dispatch.submit_each(members, make, what)
        self.dispatch.results_of(refs, deadline, what, on_failure=forget)
        return keys

    def _queue(self, drops) -> None:
        for k, gen in drops:
            self._rendezvous.pop(k, None)
            for d in k[1]:
                self._drops.setdefault(d, []).append(GroupDrop(k, gen))

    def _backend_of(self, devices):
        for d in devices:
            rec = self.registry.devices.get(d)
            if rec is not None:
                return self.backends.get(rec.backend)
        return None


__all__ = ["Communicators"]

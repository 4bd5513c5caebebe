"""The controller: what one process (the driver, or a Ray task or actor holding a handle) does to
run reshards on device actors. It never touches tensor bytes during a reshard; it decides, ships
small messages and waits with deadlines.

Parts: ``DeviceRegistry`` (devices, meshes, ids, session), ``ProgramCache`` (which programs each
device holds), ``GroupTable`` (live communicator groups and generations), ``HoldQueue`` (holds and
releases that garbage collection asks for), ``PlanningClusters`` (the cost model), the backends,
and the dispatch helpers (``gather``, ``failure_error``).

Every state-changing call to a device is ORDERED: ``submit`` gives it the device's next ``Ticket``
under the controller's lock, so each device runs this controller's calls in the order they were
made, and the calls of one reshard are submitted to all its participants at once: no two reshards
of this controller interleave differently on two devices. ``broadcast_call`` makes one such call on
each of some devices, waits for them and raises their failure as one error, root cause first.

Failure. Whatever happens after a reshard was submitted (a device's error, a dead actor, the
deadline, an exception or KeyboardInterrupt in this process), ``abandon`` forgets the run's groups,
tells members still waiting to connect one of them to give up, asks every surviving participant
(on its control thread, never queued behind the run) to drop the run's destination shard and abort
its groups, and waits for those acknowledgements for at most ``CLEANUP_S``. The source shards are
never written, so the source tensor stays intact.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reshard.errors import ReshardError
from reshard.ir.regions import layout_regions
from reshard.runtime.deadlines import Deadline
from reshard.runtime.driver.device_registry import DeviceRecord, DeviceRegistry
from reshard.runtime.driver.dispatch import Outcome, failure_error, gather
from reshard.runtime.driver.group_table import GroupTable
from reshard.runtime.driver.holds import HoldQueue
from reshard.runtime.driver.planning_clusters import PlanningClusters
from reshard.runtime.driver.program_cache import ProgramCache
from reshard.runtime.driver.work import WorkQueue
from reshard.runtime.messages import (
    COMMIT_WAIT_S,
    Bound,
    DeviceState,
    FailureKind,
    GroupDrop,
    GroupKey,
    GroupSet,
    HoldChange,
    RunRequest,
    Staged,
    Ticket,
    Updates,
    group_key,
    shard_name,
)
from reshard.runtime.processes import process_of_this
from topology.cluster import Cluster

if TYPE_CHECKING:
    from reshard.passes.compile import CompiledBatch
    from reshard.runtime.backends.communicator import Backend, Rendezvous

log = logging.getLogger(__name__)

CLEANUP_S = 1.5  # how long a failed call waits for the survivors to drop its partial results (timeout + 2 s in all)
DESCRIBE_S = 1.0  # how long a failure message waits for the devices to say what they are doing
INTACT = "The source tensor is intact; the partial destination shards were freed."
_NOT_KNOWN = (
    "Whether the outputs changed is not known yet: some runs' results did not reach this process in time. Each "
    "destination device changes all of its outputs or none, as every run's outcome says, once it learns them "
    f"(within {COMMIT_WAIT_S:g} s of the deadline), so every output ends up old or every one new. "
)
_LEFT = "The outputs were left as they were. "
_COMMIT_FAILED = "Every run succeeded; a device whose commit failed kept its old values, the others hold the new ones. "
_COMMITTING = (
    "Every run succeeded, so the outputs change: each destination device applies the new values once it learns "
    f"how every run ended (within {COMMIT_WAIT_S:g} s of the deadline); its later calls wait for that. "
)


@dataclass
class Pending:
    """A submitted batch: its run calls and commit calls by device, and what finishing or
    abandoning it needs (``outs``: its results are for users' shards)."""

    compiled: CompiledBatch
    run: str
    refs: dict
    commits: dict
    pid: int
    deadline: Deadline
    what: str
    outs: bool
    results: dict | None = None  # every run's result, once all succeeded


class Runtime:
    def __init__(self):
        self.id = uuid.uuid4().hex[:12]
        self.lock = threading.RLock()
        self.registry = DeviceRegistry()
        self.programs = ProgramCache()
        self.bindings = ProgramCache()  # what each device's runs were bound to (``Bound``), by id
        self.groups = GroupTable()
        self.backends: dict[str, Backend] = {}
        self.stats: Counter = Counter()
        self.last_run: dict = {}  # device -> RunResult of the last successful reshard
        self.works = WorkQueue()
        self._names = itertools.count(1)
        self._group_drops: dict[int, list[GroupDrop]] = {}
        self._rendezvous: dict[GroupKey, Rendezvous] = {}  # live group -> its rendezvous (to abort it)
        self.clusters = PlanningClusters()
        self.holds = HoldQueue(self._submit_holds)
        self._submitting = False
        self._process: tuple | None = None  # told each device with its first call (``Ticket.caller``)

    def new_name(self) -> str:
        """A shard name unique in the job."""
        return f"{self.id}:{next(self._names)}"

    # ---------------------------------------------------------------- ordered calls

    def submit(self, rec: DeviceRecord, call):
        """``call(ticket)`` submits one ordered call to ``rec``'s actor; the ticket's number is
        used up only when the submission succeeded (a gap would stall the device's later calls).
        Submissions never nest (a second one from inside the first would take the same number):
        garbage collection and pickling change holds through ``hold_later``."""
        with self.lock:
            if self._submitting:
                raise RuntimeError("ordered calls must not be submitted from inside a submission")
            self._submitting = True
            try:
                if self._process is None:
                    self._process = process_of_this()
                ref = call(Ticket(self.id, rec.seq, self._process))
            finally:
                self._submitting = False
            rec.seq += 1
            return ref

    def submit_each(self, devices, make, what: str) -> dict:
        """One ordered call to each of ``devices`` (``make(rec)`` is the ``call(ticket)`` for
        ``submit``), all under the lock: every device sees this controller's calls in one order.
        Returns the calls' refs by device; ``MeshClosed``/``WorkerDied`` for an unusable device."""
        with self.lock:
            return {rec.id: self.submit(rec, make(rec)) for rec in self.registry.check(list(devices), what)}

    def updates_for(self, device: int, sets=()) -> Updates:
        return Updates(
            tuple(self._group_drops.pop(device, ())),
            tuple(sets),
            self.programs.take_drops(device),
            self.bindings.take_drops(device),
        )

    # ---------------------------------------------------------------- groups

    def admit_groups(self, keys: list[GroupKey], backend_name: str) -> dict[int, list]:
        """Make ``keys`` live: new ones get a rendezvous (one batched call) and a generation.
        Returns ``{device: [GroupSet]}`` to set up with the device's next call."""
        if not keys:
            return {}
        recs = self.registry.devices
        capacity = {d: r.max_communicators for d, r in recs.items() if r.state is DeviceState.ALIVE}
        create, drop = self.groups.admit(keys, capacity)
        self._queue_drops(drop)
        sets: dict[int, list] = {}
        if create:
            backend = self.backends[backend_name]
            members = sorted({d for _, g in create for d in g})
            try:
                rdvs = backend.rendezvous([g for _, g in create], {d: recs[d].actor for d in members})
            except BaseException:
                self.groups.forget(create)
                raise
            gens = self.groups.commit(create)
            self.stats["rendezvous_calls"] += 1
            self.stats["groups_created"] += len(create)
            for k, r in zip(create, rdvs, strict=True):
                self._rendezvous[k] = r
                for d in k[1]:
                    sets.setdefault(d, []).append(GroupSet(k, gens[k], r.info))
        return sets

    def _queue_drops(self, drops) -> None:
        for k, gen in drops:
            self._rendezvous.pop(k, None)
            for d in k[1]:
                self._group_drops.setdefault(d, []).append(GroupDrop(k, gen))

    def ensure_groups(self, groups, *, channel: str = "", timeout_s: float = 60.0, pin: bool = False) -> list:
        """Set up communicator groups (device iterables) on their members and connect them there,
        in the given order; ``pin`` keeps them live until ``unpin_groups``. Returns their keys."""
        return self.ensure_keys([group_key(g, channel) for g in groups], timeout_s=timeout_s, pin=pin)

    def ensure_keys(self, keys, *, timeout_s: float = 60.0, pin: bool = False) -> list:
        """``ensure_groups`` for group keys ``(channel, devices)``: every member connects its groups
        in the order given (one order for all members: no two groups wait on each other)."""
        keys = list(dict.fromkeys((ch, tuple(sorted(g))) for ch, g in keys))
        members = sorted({d for _, g in keys for d in g})
        deadline = Deadline.after(timeout_s)
        what = f"ensure_groups({[list(g) for _, g in keys]})"

        def make(rec):
            mine = [k for k in keys if rec.id in k[1]]
            upd = self.updates_for(rec.id, sets.get(rec.id, ()))
            return lambda t: rec.actor.reshard_update.remote(t, upd, mine, deadline.budget)

        def forget(outcome: Outcome) -> None:
            with self.lock:
                self._queue_drops(self.groups.forget(keys))
                if pin:
                    self.groups.unpin(keys)

        with self.lock:  # admitted and submitted at once: no other call sees the groups half set up
            recs = self.registry.check(members, "ensure_groups")
            names = {r.backend for r in recs}
            if len(names) > 1:
                raise ValueError(f"ensure_groups: the devices use different backends {sorted(names)}")
            sets = self.admit_groups(keys, names.pop()) if recs else {}
            if pin:
                self.groups.pin(keys)
            refs = self.submit_each(members, make, what)
        self.results_of(refs, deadline, what, on_failure=forget)
        return keys

    def unpin_groups(self, keys) -> None:
        with self.lock:
            self.groups.unpin(keys)

    def forget_keys(self, keys) -> None:
        """Drop these groups on every member (with each member's next call); the next use sets up
        a new generation."""
        with self.lock:
            self._queue_drops(self.groups.forget(keys))

    # ---------------------------------------------------------------- reshards

    def submit_batch(
        self,
        compiled: CompiledBatch,
        sources,
        run: str,
        deadline: Deadline,
        what: str,
        *,
        outs=None,
        direct: bool = False,
        verify: bool = False,
    ) -> Pending:
        """Submit a compiled batch (``reshard.passes.compile.compile_batch``): one ordered ``run`` call per
        participant. ``sources[t]``: tensor ``t``'s source shard name, ``{device: shared-memory
        descriptor}`` (for pulls) and the dtype it is cast from (None: none); ``outs[t]``: the
        user's shard its result is for (None: a new shard ``shard_name(run, t)``), written into
        ``direct``ly, else staged and committed by an
        ordered ``commit`` call on each destination device, submitted now behind its run, which
        waits for every participant's run (``reshard_commit``). ``finish_batch`` waits."""
        program = compiled.program
        commit = outs is not None and not direct
        with self.lock:
            recs = self.registry.check(compiled.participants, what)
            backend = recs[0].backend if recs else "gloo"
            sets = self.admit_groups([group_key(g) for g in compiled.groups], backend)
            pid = self.programs.program_id(compiled)
            shards = tuple((n, tuple(where.items()), cast) for n, where, cast in sources)  # a name shared anew: anew
            bid = self.bindings.program_id((pid, shards, None if outs is None else tuple(outs)))
            budget = deadline.budget
            refs = {}
            for rec in recs:
                blob = self.programs.to_ship(rec.id, pid, compiled.blobs[rec.id], rec.max_programs)
                self.stats["programs_shipped"] += blob is not None
                bound = None
                if self.bindings.to_ship(rec.id, bid, True, rec.max_programs):
                    bound = _bound(compiled, rec.id, sources, outs, self.registry.devices)
                upd = self.updates_for(rec.id, sets.get(rec.id, ()))
                req = functools.partial(
                    RunRequest,
                    program_id=pid,
                    blob=blob,
                    updates=upd or None,
                    run=run,
                    budget_s=budget,
                    binding=bid,
                    bound=bound,
                    direct=direct,
                    commit=commit,
                    verify=verify,
                )  # the ticket comes with the submission
                refs[rec.id] = self.submit(rec, lambda t, rec=rec, req=req: rec.actor.reshard_run.remote(req(ticket=t)))
            commits = {}
            if commit:
                participants = tuple((rec.id, rec.actor if rec.threaded else None, refs[rec.id]) for rec in recs)
                for rec in recs:
                    parts = program.for_device(rec.id).parts
                    pairs = tuple(
                        Staged(shard_name(run, p.tensor), outs[p.tensor])
                        for p in parts
                        if p.program.dst_shape is not None
                    )
                    if pairs:
                        commits[rec.id] = self.submit(
                            rec,
                            lambda t, rec=rec, pairs=pairs: rec.actor.reshard_commit.remote(
                                t, run, pairs, participants, budget, verify
                            ),
                        )
            self.stats["runs"] += 1
            self.stats["run_calls"] += len(refs) + len(commits)
        return Pending(compiled, run, refs, commits, pid, deadline, what, outs is not None)

    def finish_batch(self, pending: Pending) -> dict:
        """Wait for a submitted batch (and its commits): ``{device: RunResult}``; on failure,
        ``abandon`` it and raise a ``ReshardError`` (module docstring), at most ``CLEANUP_S`` after
        the deadline. With commits, every output changes or none does: each destination device
        commits once it has read every run's result and all succeeded (``reshard_commit``), so the
        outcome is fixed by the runs alone; the error says which it was, or that it is not known
        yet (the controller could not read every result in time)."""
        refs = pending.refs
        try:
            outcome = gather(refs, pending.deadline)
        except BaseException:  # KeyboardInterrupt, or Ray failing under us
            self.abandon_batch(pending, Outcome(pending=sorted(refs)))
            raise
        until = pending.deadline.or_in(CLEANUP_S)
        if not outcome.ok:
            asked = self.ask(outcome.pending)  # before the cleanup: a stuck device costs one wait, not two
            late = {d: refs[d] for d in outcome.pending} if pending.commits and not outcome.failures else {}
            self.abandon_batch(pending, outcome, late=late, until=until)
            if not outcome.ok:
                tail = "" if not pending.commits else _NOT_KNOWN if not outcome.failures else _LEFT
                tail = f"{self.describe(outcome.pending, asked)}{tail}{INTACT}"
                raise failure_error(outcome, pending.what, pending.deadline, tail=tail)
        pending.results = outcome.results
        if pending.commits:
            done = gather(pending.commits, until)
            if not done.ok:
                for d in done.died:
                    self.mark_dead(d, f"actor died while committing: {_first(done.failures[d].error)}")
                tail = _COMMITTING if not done.failures else _COMMIT_FAILED
                raise failure_error(done, f"{pending.what}: committing", pending.deadline, tail=tail)
        self.last_run = outcome.results
        return outcome.results

    def abandon_batch(
        self, pending: Pending, outcome: Outcome, late: dict | None = None, until: Deadline | None = None
    ) -> None:
        """``abandon`` a batch: the new shards it made are dropped (outputs staged for a commit
        are the commit's to drop). ``late``: runs still pending, collected into ``outcome`` if
        they end by ``until`` too: they decide whether the commits go on."""
        program = pending.compiled.program
        made = (
            {}
            if pending.outs
            else {
                d: tuple(
                    shard_name(pending.run, p.tensor)
                    for p in program.for_device(d).parts
                    if p.program.dst_shape is not None
                )
                for d in pending.refs
            }
        )
        groups = pending.compiled.groups
        acks = self.abandon(pending.refs, pending.run, made, groups, pending.pid, outcome, wait=not late)
        if late and until is not None:
            ended = gather(late, until, settle_s=None)
            outcome.results.update(ended.results)
            outcome.failures.update(ended.failures)
            outcome.pending = ended.pending
            self._wait_acks(acks, until)

    def abandon(
        self, devices, run: str | None, made: dict, groups, pid: int | None, outcome: Outcome, wait: bool = True
    ) -> dict:
        """Clean up after a failed call (module docstring); bounded by ``CLEANUP_S``. ``run``: what
        the devices must keep nothing of; ``made[device]``: the shards it made there, dropped now.
        ``devices``: those the call went to. Returns their acknowledgements (``wait=False``: not
        waited for; ``_wait_acks``)."""
        devices = list(devices)
        keys = [group_key(g) for g in groups]
        with self.lock:
            self.stats["failed_runs"] += 1
            for d in outcome.died:
                self.mark_dead(d, f"actor died: {_first(outcome.failures[d].error)}")
            if pid is not None:
                for d in devices:
                    if d not in outcome.results:
                        self.programs.unsure(d, pid)
                        self.bindings.unsure_all(d)
            rendezvous = [self._rendezvous[k] for k in keys if k in self._rendezvous]
            drops = self.groups.forget(keys)
            for k, _ in drops:
                self._rendezvous.pop(k, None)
            backend = self._backend_of(devices)
            if backend is not None and rendezvous:
                backend.abort_rendezvous(rendezvous, "the controller gave up on the reshard")
            acks = {}
            for d in devices:
                rec = self.registry.devices.get(d)
                if rec is None or rec.state is not DeviceState.ALIVE:
                    continue
                mine = [drop for drop in drops if d in drop.key[1]]
                try:
                    acks[d] = rec.actor.reshard_abort_run.remote(self.id, run, made.get(d, ()), mine)
                except Exception as e:  # the actor may be going away as well
                    log.warning("cleanup of device %d failed: %s", d, e)
            for k, gen in drops:  # members outside the call get the drops with their next one
                for d in k[1]:
                    if d not in devices:
                        self._group_drops.setdefault(d, []).append(GroupDrop(k, gen))
        if wait:
            self._wait_acks(acks, Deadline.after(CLEANUP_S))
        return acks

    def _wait_acks(self, acks: dict, until: Deadline) -> None:
        if not acks:
            return
        done = gather(acks, until, settle_s=None)
        for d, f in done.failures.items():
            if f.kind is FailureKind.DIED:
                self.mark_dead(d, f"actor died: {_first(f.error)}")

    def ask(self, devices) -> tuple[dict, float]:
        """Ask ``devices`` what they are doing (on their control threads); ``describe`` reads the
        answers. Returns the calls and when they were made."""
        refs = {}
        for d in devices:
            rec = self.registry.devices.get(d)
            if rec is not None and rec.state is DeviceState.ALIVE:
                refs[d] = rec.actor.reshard_stats.remote()
        return refs, time.monotonic()

    def describe(self, devices, asked: tuple[dict, float] | None = None) -> str:
        """What ``devices`` are doing (bounded: at most ``DESCRIBE_S`` after they were ``ask``ed):
        for messages about calls that did not finish."""
        refs, since = self.ask(devices) if asked is None else asked
        if not refs:
            return ""
        outcome = gather(refs, Deadline(since + DESCRIBE_S), settle_s=None)
        parts = []
        for d in sorted(refs):
            calls = outcome.results.get(d, {}).get("calls")
            if calls is None:
                parts.append(f"device {d} did not answer")
                continue
            mine = calls["running"].get(self.id)
            waiting = [w for k, w in calls["waiting"].items() if k.startswith(f"{self.id}#")]
            recent = [f"#{n} {w}: {o}" for c, n, w, o, _ in calls["recent"] if c == self.id][-3:]
            if mine:
                parts.append(f"device {d} is still running {mine[0]} ({mine[1]:.1f}s)")
            elif waiting:
                parts.append(f"device {d} waits for call #{calls['next'].get(self.id)} before {waiting[0]}")
            else:
                parts.append(f"device {d} runs nothing of ours now (recent: {'; '.join(recent) or 'none'})")
        return "; ".join(parts) + ". "

    def _backend_of(self, devices):
        for d in devices:
            rec = self.registry.devices.get(d)
            if rec is not None:
                return self.backends.get(rec.backend)
        return None

    def wait(self, refs: dict, deadline: Deadline, what: str) -> Outcome:
        """``gather`` that marks the devices whose actors died."""
        outcome = gather(refs, deadline)
        for d in outcome.died:
            self.mark_dead(d, f"actor died in {what}: {_first(outcome.failures[d].error)}")
        return outcome

    def broadcast_call(
        self,
        devices,
        make,
        deadline: Deadline,
        what: str,
        *,
        tail: str = "",
        on_failure: Callable[[Outcome], None] | None = None,
    ) -> dict:
        """One ordered call to each of ``devices`` (``make(rec)`` is the ``call(ticket)`` for
        ``submit``; all submitted under the lock), waited for until ``deadline``: ``{device: result}``.
        On failure, ``on_failure(outcome)`` runs first (to clean up, or to raise a more precise
        error), then the failure is raised as one error, root cause first (``failure_error``)."""
        return self.results_of(self.submit_each(devices, make, what), deadline, what, tail=tail, on_failure=on_failure)

    def results_of(
        self,
        refs: dict,
        deadline: Deadline,
        what: str,
        *,
        tail: str = "",
        on_failure: Callable[[Outcome], None] | None = None,
    ) -> dict:
        """The second half of ``broadcast_call``, for calls submitted under a lock held longer."""
        try:
            outcome = self.wait(refs, deadline, what)
        except BaseException:  # KeyboardInterrupt, or Ray failing under us
            if on_failure is not None:
                on_failure(Outcome(pending=sorted(refs)))
            raise
        if not outcome.ok:
            if on_failure is not None:
                on_failure(outcome)
            raise failure_error(outcome, what, deadline, tail=tail)
        return outcome.results

    def call(self, calls: dict, timeout_s: float, what: str) -> dict:
        """Ordered ``fn(ctx, *args, **kwargs)`` on each device: ``calls[device] = (fn, args, kwargs)``.
        Returns ``{device: result}``; a device's own exception is raised as is, other failures as
        a ``ReshardError``."""
        deadline = Deadline.after(timeout_s)

        def make(rec):
            fn, args, kwargs = calls[rec.id]
            return lambda t: rec.actor.reshard_call.remote(t, fn, args, kwargs, deadline.budget)

        return self.broadcast_call(calls, make, deadline, what, on_failure=_raise_own_error)

    # ---------------------------------------------------------------- devices

    def mark_dead(self, device: int, reason: str) -> None:
        with self.lock:
            self.registry.mark([device], DeviceState.DEAD, reason)
            self._queue_drops(self.groups.forget_device(device))
            self.programs.forget_device(device)
            self.bindings.forget_device(device)

    def close_devices(self, devices, reason: str) -> None:
        with self.lock:
            self.registry.mark(devices, DeviceState.CLOSED, reason)
            for d in devices:
                self._queue_drops(self.groups.forget_device(d))
                self.programs.forget_device(d)
                self.bindings.forget_device(d)

    def release(self, devices, name: str, holder: str) -> None:
        """``holder`` lets go of shard ``name`` on ``devices`` (fire and forget, ordered)."""
        self._fire(devices, lambda rec: lambda t: rec.actor.reshard_release.remote(t, name, holder))

    def hold_later(self, acquire: bool, devices, name: str, holder: str) -> None:
        """``acquire`` or ``release`` from a finalizer or a pickler (``HoldQueue``)."""
        self.holds.put(acquire, devices, name, holder)

    def flush_holds(self) -> None:
        """Submit the queued holds now (in this thread)."""
        self.holds.flush()

    def _submit_holds(self, changes) -> None:
        """Queued holds and releases, one ordered call per device for all of its (in queue order:
        a whole tree of handles let go costs one call per device)."""
        per_device: dict[int, list] = {}
        for acquire, devices, name, holder in changes:
            for d in devices:
                per_device.setdefault(d, []).append(HoldChange(acquire, name, holder))
        for d, calls in per_device.items():
            mine = tuple(calls)
            self._fire([d], lambda rec, mine=mine: lambda t: rec.actor.reshard_holds.remote(t, mine))

    def acquire(self, devices, name: str, holder: str) -> None:
        self._fire(devices, lambda rec: lambda t: rec.actor.reshard_acquire.remote(t, name, holder))

    def free(self, devices, *names: str) -> None:
        """Drop shards ``names`` on ``devices`` for every holder (fire and forget, ordered): one
        call per device for all of them."""
        self._fire(devices, lambda rec: lambda t: rec.actor.reshard_free.remote(t, *names))

    def _fire(self, devices, make) -> None:
        with self.lock:
            for d in devices:
                rec = self.registry.devices.get(d)
                if rec is not None and rec.state is DeviceState.ALIVE:
                    try:
                        self.submit(rec, make(rec))
                    except Exception as e:  # Ray is going away: nothing left to free
                        log.debug("device %d: %s", d, e)

    # ---------------------------------------------------------------- planning

    def planning_cluster(self, backend: str, hosts: dict[int, int]) -> Cluster:
        """The cost model "auto" plans for (``PlanningClusters``)."""
        return self.clusters.get(backend, hosts, self.registry)


def _bound(compiled, device: int, sources, outs, records) -> Bound:
    """What ``device``'s parts of a batch are bound to (``Bound``): ``sources[t]`` is tensor
    ``t``'s source shard name, ``{device: shared-memory descriptor}`` and the dtype it is cast
    from (None: none; ``(dtype, Scaled)``: a scaled cast, of which the device gets its shard's
    scales), ``outs[t]`` its output."""
    parts = compiled.program.for_device(device).parts
    names = tuple(sources[p.tensor][0] if p.program.src_shape is not None else None for p in parts)
    casts = tuple(
        _cast_for(sources[p.tensor][2], compiled.tensors[p.tensor].plan, device)
        if p.program.src_shape is not None
        else None
        for p in parts
    )
    pulls = {t: {h: sources[t][1][h] for h in holders} for t, holders in compiled.pull_sources.get(device, {}).items()}
    mine = None if outs is None else tuple(outs[p.tensor] if p.program.dst_shape is not None else None for p in parts)
    relaying = compiled.relay_sources.get(device)
    relays = {h: records[h].board for h in relaying} if relaying else None
    return Bound(names, pulls or None, mine, relays, casts if any(casts) else None)


def _cast_for(cast, plan, device: int):
    """What ``device`` casts its source shard of ``plan``'s tensor with: a dtype name, or its part
    of a scaled cast (``reshard.scaling.ScaledCast``)."""
    if not isinstance(cast, tuple):
        return cast
    src, scaled = cast
    box = layout_regions(plan.src, plan.shape)[plan.src.mesh.device_ids.index(device)]
    return scaled.for_box(src, box)


def _raise_own_error(outcome: Outcome) -> None:
    """A device's own exception (``fn`` raised it), raised as is where no actor died."""
    own = [f.error for _, f in sorted(outcome.failures.items()) if f.kind is FailureKind.ERROR]
    if own and not outcome.died:
        raise own[0]


def _first(err) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


_RUNTIME: Runtime | None = None
_RUNTIME_LOCK = threading.Lock()


def runtime() -> Runtime:
    """This process's controller: the one ``Runtime`` that orders its calls to devices, caches
    programs and groups, and finishes its works (created on first use)."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            _RUNTIME = Runtime()
        return _RUNTIME


__all__ = ["CLEANUP_S", "ReshardError", "Runtime", "runtime"]

"""A controller's batches: the one cache of compiled calls, the mirrors of what each device holds of
them, and the submission, finishing and abandoning of a batch's runs.

A call (one tensor or a tree) is compiled once per signature (``compiled``) and replayed. Its
program and what its runs are bound to are shipped to a device with the first run that needs them
there, then named by id (``ProgramCache``). ``submit`` makes one ordered ``run`` call per
participant, and for ``out=`` one ``commit`` call per destination device behind it; ``finish`` waits
for them with the call's one deadline.

Failure. Whatever happens after a batch was submitted (a device's error, a dead actor, the
deadline, an exception or KeyboardInterrupt in this process), ``abandon`` forgets the run's groups,
tells members still waiting to connect one of them to give up, asks every surviving participant
(on its control thread, never queued behind the run) to drop the run's destination shard and abort
its groups, and waits for those acknowledgements for at most ``CLEANUP_S``. The source shards are
never written, so the source tensor stays intact.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from reshard.ir.regions import layout_regions
from reshard.runtime.deadlines import Deadline
from reshard.runtime.driver.communicators import Communicators
from reshard.runtime.driver.device_registry import DeviceRegistry
from reshard.runtime.driver.dispatch import Dispatch, Outcome, failure_error, first_line
from reshard.runtime.driver.program_cache import MAX_IDS, ProgramCache
from reshard.runtime.driver.signed import Signed
from reshard.runtime.messages import (
    COMMIT_WAIT_S,
    Bound,
    CommitRequest,
    DeviceState,
    RunRequest,
    Updates,
    group_key,
    shard_names,
)

if TYPE_CHECKING:
    from reshard.passes.compile import CompiledBatch

log = logging.getLogger(__name__)

COMPILED_CALLS = 64  # compiled calls a controller keeps (least recently used first out)
ALIKE = 4  # bindings of one program and sources (a sync's outputs) a binding may be shipped as a delta of

CLEANUP_S = 1.5  # how long a failed call waits for the survivors to drop its partial results (timeout + 2 s in all)
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


class Sources(NamedTuple):
    """A call's source shards as columns, by tensor: each one's shard name, ``{device:
    shared-memory descriptor}`` (for pulls), the dtype it is cast from (None: none;
    ``(dtype, Scaled)``: a scaled cast) and a hashable key of its name and descriptors
    (``ShardedTensor._source_key``); ``key``, the keys and casts as one (what a binding depends
    on, hashed once). Columns, not a tuple each: a replay of a tree of tens of thousands makes no
    object per tensor for the collector to walk while the call waits."""

    names: list
    shared: list
    casts: list
    keys: list
    key: Signed


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


class Batches:
    """One controller's compiled calls and their runs (module docstring). ``mark_dead(device,
    reason)`` hears of every actor found dead."""

    def __init__(
        self,
        dispatch: Dispatch,
        communicators: Communicators,
        registry: DeviceRegistry,
        stats: Counter,
        mark_dead: Callable[[int, str], None],
    ):
        self.dispatch = dispatch
        self.communicators = communicators
        self.registry = registry
        self.stats = stats
        self._mark_dead = mark_dead
        self.programs = ProgramCache()
        self.bindings = ProgramCache()  # what each device's runs were bound to (``Bound``), by id
        self._alike_ids: OrderedDict = OrderedDict()  # (program id, sources key) -> binding ids, latest first
        self._compiled: OrderedDict = OrderedDict()  # a call's signature -> its CompiledBatch
        self.last_run: dict = {}  # device -> RunResult of the last successful batch

    def _alike(self, key: tuple, bid: int) -> list[int]:
        """The latest other bindings of ``key``'s program and sources (into other outputs),
        latest first; ``bid`` noted as the latest."""
        others = [b for b in self._alike_ids.pop(key, ()) if b != bid]
        self._alike_ids[key] = [bid, *others[: ALIKE - 1]]
        while len(self._alike_ids) > MAX_IDS:
            self._alike_ids.popitem(last=False)
        return others

    def compiled(self, signature, build: Callable[[], CompiledBatch]) -> CompiledBatch:
        """The compiled call of ``signature`` (everything its plan depends on), built by ``build()``
        the first time: a replay of a tree costs a lookup."""
        hit = self._compiled.get(signature)
        if hit is not None:
            self._compiled.move_to_end(signature)
            return hit
        compiled = self._compiled[signature] = build()
        while len(self._compiled) > COMPILED_CALLS:
            self._compiled.popitem(last=False)
        return compiled

    def updates_for(self, device: int, sets=()) -> Updates:
        """What ``device``'s next call carries: groups to set up (``sets``) and to drop, programs
        and bindings its cache lets go."""
        return Updates(
            self.communicators.take_drops(device),
            tuple(sets),
            self.programs.take_drops(device),
            self.bindings.take_drops(device),
        )

    def forget_device(self, device: int) -> None:
        self.programs.forget_device(device)
        self.bindings.forget_device(device)

    def submit(
        self,
        compiled: CompiledBatch,
        sources: Sources,
        run: str,
        deadline: Deadline,
        what: str,
        *,
        outs=None,
        direct: bool = False,
        verify: bool = False,
    ) -> Pending:
        """Submit a compiled batch (``reshard.passes.compile.compile_batch``): one ordered ``run`` call per
        participant, bound to ``sources`` (``Sources``); ``outs[t]``: the
        user's shard its result is for (None: a new shard ``shard_name(run, t)``), written into
        ``direct``ly, else staged and committed by an
        ordered ``commit`` call on each destination device, submitted now behind its run, which
        waits for every participant's run (``reshard_commit``). ``finish`` waits."""
        commit = outs is not None and not direct
        with self.dispatch.lock:
            recs = self.registry.check(compiled.participants, what)
            participants = tuple((rec.id, rec.actor if rec.threaded else None) for rec in recs)
            backend = recs[0].backend if recs else "gloo"
            sets = self.communicators.admit([group_key(g) for g in compiled.groups], backend)
            pid = self.programs.program_id(compiled)
            # a name shared anew binds anew
            bid = self.bindings.program_id(Signed((pid, sources.key, None if outs is None else tuple(outs))))
            alike = self._alike((pid, sources.key), bid)
            budget = deadline.budget
            refs = {}
            for rec in recs:
                blob = self.programs.to_ship(rec.id, pid, compiled.blobs[rec.id], rec.max_programs)
                self.stats["programs_shipped"] += blob is not None
                bound = None
                if self.bindings.to_ship(rec.id, bid, True, rec.max_programs):
                    peers = participants if outs is not None and compiled.results[rec.id] else None
                    like = next((b for b in alike if self.bindings.surely(rec.id, b)), None)
                    bound = _bound(compiled, rec.id, sources, outs, self.registry.devices, peers, like)
                    self.stats["bindings_shipped"] += 1
                    self.stats["bindings_alike"] += like is not None
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
                refs[rec.id] = self.dispatch.submit(
                    rec, lambda t, rec=rec, req=req: rec.actor.reshard_run.remote(req(ticket=t))
                )
            commits = {}
            if commit:  # the participants' actors came with the binding (``Bound.peers``); their results now
                order = CommitRequest(run, pid, bid, tuple(refs[rec.id] for rec in recs), budget, verify)
                for rec in recs:
                    if compiled.results[rec.id]:  # its outputs: those its run was bound to (``bid``)
                        commits[rec.id] = self.dispatch.submit(
                            rec, lambda t, rec=rec: rec.actor.reshard_commit.remote(t, order)
                        )
            self.stats["runs"] += 1
            self.stats["run_calls"] += len(refs) + len(commits)
        return Pending(compiled, run, refs, commits, pid, deadline, what, outs is not None)

    def finish(self, pending: Pending) -> dict:
        """Wait for a submitted batch (and its commits): ``{device: RunResult}``; on failure,
        ``abandon`` it and raise a ``ReshardError`` (module docstring), at most ``CLEANUP_S`` after
        the deadline. With commits, every output changes or none does: each destination device
        commits once it has read every run's result and all succeeded (``reshard_commit``), so the
        outcome is fixed by the runs alone; the error says which it was, or that it is not known
        yet (the controller could not read every result in time)."""
        refs = pending.refs
        try:
            outcome = self.dispatch.gather_ordered(refs, pending.deadline)
        except BaseException:  # KeyboardInterrupt, or Ray failing under us
            self.abandon_batch(pending, Outcome(pending=sorted(refs)))
            raise
        until = pending.deadline.or_in(CLEANUP_S)
        if not outcome.ok:
            asked = self.dispatch.ask(outcome.pending)  # before the cleanup: a stuck device costs one wait, not two
            late = {d: refs[d] for d in outcome.pending} if pending.commits and not outcome.failures else {}
            self.abandon_batch(pending, outcome, late=late, until=until)
            if not outcome.ok:
                tail = "" if not pending.commits else _NOT_KNOWN if not outcome.failures else _LEFT
                tail = f"{self.dispatch.describe(outcome.pending, asked)}{tail}{INTACT}"
                raise failure_error(outcome, pending.what, pending.deadline, tail=tail)
        pending.results = outcome.results
        if pending.commits:
            done = self.dispatch.gather_ordered(pending.commits, until)
            if not done.ok:
                for d in done.died:
                    self._mark_dead(d, f"actor died while committing: {first_line(done.failures[d].error)}")
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
        results = pending.compiled.results
        made = {} if pending.outs else {d: tuple(shard_names(pending.run, results[d])) for d in pending.refs}
        groups = pending.compiled.groups
        acks = self.abandon(pending.refs, pending.run, made, groups, pending.pid, outcome, wait=not late)
        if late and until is not None:
            ended = self.dispatch.gather_ordered(late, until, settle_s=None)
            outcome.results.update(ended.results)
            outcome.failures.update(ended.failures)
            outcome.pending = ended.pending
            self.dispatch.wait_acks(acks, until)

    def abandon(
        self, devices, run: str | None, made: dict, groups, pid: int | None, outcome: Outcome, wait: bool = True
    ) -> dict:
        """Clean up after a failed call (module docstring); bounded by ``CLEANUP_S``. ``run``: what
        the devices must keep nothing of; ``made[device]``: the shards it made there, dropped now.
        ``devices``: those the call went to. Returns their acknowledgements (``wait=False``: not
        waited for; ``_wait_acks``)."""
        devices = list(devices)
        keys = [group_key(g) for g in groups]
        with self.dispatch.lock:
            self.stats["failed_runs"] += 1
            for d in outcome.died:
                self._mark_dead(d, f"actor died: {first_line(outcome.failures[d].error)}")
            if pid is not None:
                for d in devices:
                    if d not in outcome.results:
                        self.programs.unsure(d, pid)
                        self.bindings.unsure_all(d)
            drops = self.communicators.abort(keys, devices, "the controller gave up on the reshard")
            acks = {}
            for d in devices:
                rec = self.registry.devices.get(d)
                if rec is None or rec.state is not DeviceState.ALIVE:
                    continue
                mine = [drop for drop in drops if d in drop.key[1]]
                try:
                    acks[d] = rec.actor.reshard_abort_run.remote(self.dispatch.id, run, made.get(d, ()), mine)
                except Exception as e:  # the actor may be going away as well
                    log.warning("cleanup of device %d failed: %s", d, e)
        if wait:
            self.dispatch.wait_acks(acks, Deadline.after(CLEANUP_S))
        return acks


def _bound(compiled, device: int, sources: Sources, outs, records, peers, like: int | None = None) -> Bound:
    """What ``device``'s parts of a batch are bound to (``Bound``): their ``sources``
    (``Sources``; of a scaled cast, the device gets its shard's scales), ``outs[t]`` tensor
    ``t``'s output, ``peers`` the participants its commit learns the runs' outcomes from; where
    the device holds binding ``like`` of the same sources, only the outputs and peers."""
    parts = compiled.program.for_device(device).parts
    mine = None if outs is None else tuple(outs[p.tensor] if p.program.dst_shape is not None else None for p in parts)
    if like is not None:
        return Bound((), None, mine, None, None, peers, like)
    names = tuple(sources.names[p.tensor] if p.program.src_shape is not None else None for p in parts)
    casts = tuple(
        _cast_for(sources.casts[p.tensor], compiled.tensors[p.tensor].plan, device)
        if p.program.src_shape is not None
        else None
        for p in parts
    )
    shared = sources.shared
    pulls = {t: {h: shared[t][h] for h in holders} for t, holders in compiled.pull_sources.get(device, {}).items()}
    relaying = compiled.relay_sources.get(device)
    relays = {h: records[h].board for h in relaying} if relaying else None
    return Bound(names, pulls or None, mine, relays, casts if any(casts) else None, peers)


def _cast_for(cast, plan, device: int):
    """What ``device`` casts its source shard of ``plan``'s tensor with: a dtype name, or its part
    of a scaled cast (``reshard.scaling.ScaledCast``)."""
    if not isinstance(cast, tuple):
        return cast
    src, scaled = cast
    box = layout_regions(plan.src, plan.shape)[plan.src.mesh.device_ids.index(device)]
    return scaled.for_box(src, box)


__all__ = ["CLEANUP_S", "INTACT", "Batches", "Pending", "Sources"]

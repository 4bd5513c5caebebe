"""The device actor: one Ray actor per device, holding shards and running programs.

Threads. The actor serves several calls at once (a threaded actor). Calls that change state carry
a ``Ticket`` and run in their controller's order (``reshard.runtime.device.inbox``), one at a time per
controller; ``reshard_ready``, ``reshard_fetch``, ``reshard_stats`` and ``reshard_abort_run`` run on
threads of their own (concurrency group ``control``), so they never wait behind a stuck run. The
calls live on ``DeviceRole``, which a user's own actor may mix in (``DeviceMesh.from_actors``). Each controller (a
process that uses this device) has communicators, programs and a staging buffer of its own
(``ControllerState``): two processes resharding over the same devices never wait on each other.

State: ``DeviceContext`` (``reshard.runtime.device.context``), also what ``call(fn, ...)`` hands
to ``fn``.

A run applies its controller's updates, decodes its program when shipped (then caches it by id),
allocates the destination, connects the program's groups, and executes it. If this device cannot
do its part (no source shard, a peer's shard gone, no memory, a failed op), it aborts the
program's groups at once, so peers fail within milliseconds instead of at their deadline, frees
what it allocated and raises a ``ReshardError``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import threading
import time

import numpy as np
import ray

from reshard.errors import ReshardError, ReshardTimeout
from reshard.ir.serialize import decode_batch_device_program
from reshard.runtime import arrays
from reshard.runtime.backends.communicator import Backend, PeerFailed
from reshard.runtime.checksums import first_mismatch
from reshard.runtime.deadlines import Deadline
from reshard.runtime.device.batches import BatchRun, execute_batch, prepare_batch
from reshard.runtime.device.binding import Binding
from reshard.runtime.device.context import ActiveRun, ControllerState, DeviceContext, set_torch_threads
from reshard.runtime.device.current import clear_current, set_current
from reshard.runtime.device.gpu_memory import GpuBlocks
from reshard.runtime.device.outcomes import Outcome
from reshard.runtime.device.outputs import Outputs, outputs_of
from reshard.runtime.device_options import DeviceOptions
from reshard.runtime.gc_paused import gc_paused
from reshard.runtime.messages import (
    COMMIT_WAIT_S,
    Bound,
    CommitRequest,
    HoldChange,
    Load,
    RunRequest,
    RunResult,
    Ticket,
    Updates,
    group_key,
)

log = logging.getLogger(__name__)

OUTCOME_RETRY_S = 0.05  # a commit asks an unreachable participant again after this pause
ASK_AFTER_S = 0.5  # a commit asks the participants whose votes are not in by then (``_failed_outcome``)
CONTROL = "control"  # the concurrency group of calls that must never wait behind a run
NO_DEADLINE = Deadline(math.inf)
FETCH_BUDGET_S = 60.0  # how long a read waits for a write into its shard, unless the caller says


class DeviceRole:
    """What makes a Ray actor a device: the calls the runtime makes (all named ``reshard_*``, so
    they do not clash with an actor's own methods) and ``reshard_device``, its ``DeviceContext``.

    Our ``DeviceActor`` is one; a user's actor class may mix it in to serve as a device of
    ``DeviceMesh.from_actors`` (the runtime then calls ``reshard_attach`` on it). A threaded actor
    (``max_concurrency`` > 1) runs each controller's calls in order and serves ``reshard_stats`` and
    aborts even while a reshard runs; a single-threaded one (Ray's default) serves them after it.
    A threaded one needs threads to spare (``DeviceActor`` has 32): Ray may deliver a controller's
    later calls first (a run's commit, releases), and each waits for its turn on a thread; with
    every thread waiting, the call whose turn it is cannot start before the deadlines pass.
    """

    _reshard_ctx: DeviceContext | None = None

    def reshard_attach(self, device: int, backend: Backend, options: DeviceOptions) -> dict:
        """Become device ``device`` (once): set up the device context; returns ``reshard_ready()``."""
        if (ctx := _attached_or_none(self)) is not None:
            raise RuntimeError(
                f"this actor is device {ctx.device} of a mesh already; "
                "detach it (DeviceMesh.shutdown) before attaching it again"
            )
        if not isinstance(options, DeviceOptions):
            raise TypeError(f"reshard_attach takes DeviceOptions, got a {type(options).__name__}")
        if options.torch_threads > 0:
            set_torch_threads(options.torch_threads)
        self._reshard_ctx = ctx = DeviceContext(device, backend, options)
        ctx.threaded = _on_a_pool_thread()
        ctx.actor = self  # the actor instance: ``mesh.call`` functions reach the user's objects through it
        set_current(ctx)
        backend.setup_actor(device, ctx.cuda_device)
        ctx.watch_callers()
        return DeviceRole.reshard_ready(self)  # ``self`` may be any actor (``DeviceMesh.attach``)

    @property
    def reshard_device(self) -> DeviceContext:
        """This actor's device context (shards, ``share``/``local``/``empty``/DTensor helpers)."""
        return _attached(self)

    def reshard_ready(self) -> dict:
        ctx = _attached(self)
        rc = ray.get_runtime_context()
        return {
            "device": ctx.device,
            "pid": os.getpid(),
            "node_id": rc.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "torch_device": ctx.device_type,
            "shared_memory": ctx.shared is not None,
            "memory_domain": ctx.memory_domain(rc.get_node_id()),
            "board": None if ctx.board is None else ctx.board.descriptor,
            "threaded": ctx.threaded,
        }

    def reshard_ping(self) -> None:
        """The empty call (a floor for latency measurements)."""

    # ---------------------------------------------------------------- shards

    def reshard_load(self, ticket: Ticket, entries: tuple[Load, ...], data, budget_s: float) -> dict:
        """Keep shards: per ``Load``, ``data[array][box]`` (arrays read only, from the object
        store; array None: zeros of the box's shape) as shard ``name``. All or none: a failure, or
        an abort of the load (named by its first shard), keeps nothing. Returns each shard's
        shared-memory descriptor (None: private) by name."""
        ctx = _attached(self)
        run = entries[0][0]
        until = Deadline.from_budget(budget_s)
        stream = ctx.controller(ticket.controller).stream
        with ctx.inbox.turn(ticket, until, f"loading {run}"):
            _check_deadline(ctx.device, until, f"loading {run}")
            made = []
            t = None
            try:
                with stream.running():
                    shapes = [tuple(hi - lo for lo, hi in box) for _, _, box, _ in entries]
                    gpu = (
                        ctx.store.allocate_many([(s, e.dtype) for s, e in zip(shapes, entries, strict=True)])
                        if (ctx.cuda_device is not None)
                        else None
                    )
                    for i, ((_, index, box, dtype), shape) in enumerate(zip(entries, shapes, strict=True)):
                        if gpu is not None:
                            t = gpu[i]
                        elif index is None:
                            t = ctx.store.allocate(shape, dtype)
                        else:
                            t = ctx.store.allocate_destination(shape, dtype)
                        if index is None:
                            t[...] = 0
                        else:
                            arrays.copy(t, data[index][tuple(slice(lo, hi) for lo, hi in box) + (Ellipsis,)])
                            t = ctx.store.settle(t)
                        made.append(t)
                        t = None
                    stream.finish(until.at, f"device {ctx.device}: loading {run}")
            except BaseException as e:
                ctx.store.abandon(t)
                if not isinstance(e, MemoryError | RuntimeError | OSError):
                    raise
                raise ReshardError(f"device {ctx.device}: could not allocate the shards of {run}: {e}") from e
            kept = [(e.name, a, e.dtype, None, False) for e, a in zip(entries, made, strict=True)]
            stored = ctx.store.put_run(run, kept)
            if stored is None:
                raise PeerFailed(f"device {ctx.device}: the controller aborted loading {run}")
            return {e[0]: d for e, d in zip(entries, stored[0], strict=True)}

    def reshard_fetch(self, name: str, budget_s: float = FETCH_BUDGET_S, versioned: bool = False):
        """A copy of shard ``name`` as a numpy array (bfloat16 as its int16 bit pattern), taken
        once no write into it is under way (a commit, a ``direct`` run): never half written.
        ``versioned``: ``(array, the last reshard that committed into it)``, which readers compare
        across devices."""
        ctx = _attached(self)
        ctx.counters["fetches"] += 1
        with ctx.shard_locks.reading(name, Deadline.from_budget(budget_s)):
            t = ctx.store.get(name)
            if t is None:
                raise KeyError(f"device {ctx.device} holds no shard {name!r} (it was freed)")
            a = np.array(t) if arrays.is_numpy(t) else arrays.as_numpy(t)  # a GPU shard: copied to the host
            return (a, ctx.store.version(name)) if versioned else a

    # A hold or free still in flight when the mesh closed finds no shards left: nothing to do.

    def reshard_acquire(self, ticket: Ticket, name: str, holder: str) -> bool:
        ctx = _attached_or_none(self)
        if ctx is None:
            return False
        with ctx.inbox.turn(ticket, NO_DEADLINE):
            return ctx.store.acquire(name, holder)

    def reshard_release(self, ticket: Ticket, name: str, holder: str) -> None:
        ctx = _attached_or_none(self)
        if ctx is None:
            return
        with ctx.inbox.turn(ticket, NO_DEADLINE):
            ctx.store.release(name, holder)

    def reshard_holds(self, ticket: Ticket, changes: tuple[HoldChange, ...]) -> None:
        """Holds taken and let go, in order."""
        ctx = _attached_or_none(self)
        if ctx is None:
            return
        with ctx.inbox.turn(ticket, NO_DEADLINE):
            for acquire, name, holder in changes:
                (ctx.store.acquire if acquire else ctx.store.release)(name, holder)

    def reshard_free(self, ticket: Ticket, names: tuple[str, ...]) -> int:
        ctx = _attached_or_none(self)
        if ctx is None:
            return 0
        with ctx.inbox.turn(ticket, NO_DEADLINE):
            return ctx.store.free_many(names)

    # ---------------------------------------------------------------- programs

    def reshard_update(self, ticket: Ticket, updates: Updates, connect=(), budget_s: float = math.inf) -> None:
        """Apply controller updates; then connect ``connect`` (group keys, in that order)."""
        ctx = _attached(self)
        until = Deadline.from_budget(budget_s)
        with ctx.inbox.turn(ticket, until, "a group update"):
            state = ctx.controller(ticket.controller)
            state.apply(updates)
            if connect:
                try:
                    state.groups.connect(list(connect), until.left())
                except BaseException:
                    state.groups.abort(list(connect), "it could not connect")
                    raise

    def reshard_run(self, req: RunRequest) -> RunResult:
        t0 = time.monotonic()
        ctx = _attached(self)
        state = ctx.controller(req.ticket.controller)
        until = Deadline.from_budget(req.budget_s)
        try:
            with ctx.inbox.turn(req.ticket, until, f"the reshard {req.run}"):
                state.apply(req.updates)  # bookkeeping is never lost, even when the run is dropped
                result = DeviceRole._reshard_run(self, req, state, t0, until)
        except BaseException as e:
            if req.commit:
                ctx.outcomes.record(req.ticket.controller, req.run, Outcome(False, _last_line(e), None))
            raise
        if req.commit:
            ctx.outcomes.record(req.ticket.controller, req.run, Outcome(True, "", result.checks))
        return result

    def reshard_outcome(self, controller: str, run: str, budget_s: float) -> Outcome | None:
        """How this device's part of ``run`` (of ``controller``) ended, once it did (None: not
        within ``budget_s``): what the destinations of a commit decide on (``reshard_commit``)."""
        return _attached(self).outcomes.wait(controller, run, budget_s)

    def _reshard_run(self, req: RunRequest, state: ControllerState, t0: float, until: Deadline) -> RunResult:
        ctx = _attached(self)
        deadline = until.at  # the executor and the backends take the instant
        keys: list = []
        binding = None
        try:
            if req.blob is not None:
                with gc_paused():  # a large tree's program: many acyclic objects at once
                    program, metas = decode_batch_device_program(req.blob)
                    state.programs[req.program_id] = prepare_batch(program, metas)
                ctx.counters["programs_received"] += 1
            prepared = state.programs.get(req.program_id)
            if prepared is None:
                raise ReshardError(
                    f"device {ctx.device}: program {req.program_id} is not cached here and was not shipped"
                )
            state.programs.move_to_end(req.program_id)
            keys = [group_key(g) for g in prepared.groups]
            gens = [(k, state.groups.generation(k)) for k in keys]
            active = state.active = ActiveRun(req.run, tuple((k, g) for k, g in gens if g is not None))
            if time.monotonic() >= deadline:
                ctx.counters["dropped_late"] += 1
                raise ReshardTimeout(f"device {ctx.device}: the reshard's deadline passed before it started here")
            if req.bound is not None:
                state.bindings[req.binding] = _whole(state, req.bound, ctx.device)
            bound = state.bindings.get(req.binding)
            if bound is None:
                raise ReshardError(f"device {ctx.device}: binding {req.binding} is not cached here and was not shipped")
            binding = Binding(ctx, req, bound, prepared)
            channel = state.groups.channel("")
            batch = ctx.backend.batcher
            with gc_paused():  # an object per part: a large tree's are many (not while the run waits on peers)
                runs = binding.runs(channel, state.staging, deadline, active.cancelled, ctx.before_op, batch)
            state.groups.connect(keys, deadline - time.monotonic())
            written = bound.outs if req.direct and bound.outs else ()  # reads of them wait meanwhile
            with ctx.shard_locks.writing(written, until, f"the reshard {req.run}"), state.stream.running():
                state.staging.reserve(prepared.staging_bytes)
                ctx.assembled = binding.assembled  # its shards are made at the end: twice their bytes then
                ctx.peak_bytes = binding.dst_bytes + state.staging.nbytes
                ctx.counters["runs"] += 1
                run = BatchRun(
                    prepared,
                    runs,
                    channel,
                    state.staging,
                    deadline,
                    ctx.before_op,
                    batch,
                    ctx.after_run,
                    binding.unit,
                    binding.sources,
                    state.stream.side if prepared.overlaps else None,
                )
                stats = execute_batch(run, verify=req.verify, finish=state.stream.finish)
                binding.deliver()
                del run, runs  # the scratch buffers' other references
            with gc_paused():
                binding.recycle()
                binding.settle(deadline, late_fails=req.commit)
                descriptors, placed = binding.keep(prepared.metas)
        except BaseException as e:
            ctx.counters["failed_runs"] += 1
            if binding is not None:
                binding.release()
            state.groups.abort(keys, f"it failed: {type(e).__name__}")  # peers fail fast
            if isinstance(e, ReshardError):
                raise
            if isinstance(e, Exception):
                raise ReshardError(f"device {ctx.device}: {type(e).__name__}: {e}") from e
            raise
        finally:
            state.active = None
            state.staging.trim()
        return RunResult(
            time.monotonic() - t0,
            stats["elapsed_s"],
            stats["comm_s"],
            ctx.peak_bytes,
            descriptors,
            stats["checks"],
            placed,
        )

    def reshard_describe(self, ticket: Ticket, names, budget_s: float) -> list[dict]:
        """What this device holds under each of ``names``: its local shape, dtype name,
        shared-memory descriptor, and what its owner said of it (``DeviceContext.share``: global
        ``shape``, ...)."""
        ctx = _attached(self)
        with ctx.inbox.turn(ticket, Deadline.from_budget(budget_s), f"describing {len(names)} shard(s)"):
            out = []
            for name in names:
                t = ctx.store.get(name)
                if t is None:
                    ctx.local(name)  # raises, naming the shard
                out.append(
                    {
                        "local_shape": tuple(t.shape),
                        "dtype": ctx.store.dtype(name),
                        "descriptor": ctx.store.descriptor(t),
                        **(ctx.store.meta.get(name) or {}),
                    }
                )
            return out

    def reshard_commit(self, ticket: Ticket, req: CommitRequest) -> bool:
        """The second half of a reshard into users' tensors: once every participant's run
        succeeded, copy each staged result into its output (the user's shard its run was bound
        to: ``req.program_id`` and ``req.binding``, the run's, say which; nothing per tensor is
        shipped again); if one failed, leave the outputs as they are. Drops the staged results
        either way. Every destination learns how the runs ended from the participants themselves
        where it must (see ``_failed_outcome``), so all decide alike even when the caller is gone;
        a device that cannot learn one waits, up to ``COMMIT_WAIT_S`` after the deadline, and only
        then keeps its old values."""
        ctx = _attached(self)
        run = req.run
        until = Deadline.from_budget(req.budget_s).later(COMMIT_WAIT_S)
        with ctx.inbox.turn(ticket, NO_DEADLINE, f"committing {run}"):
            state = ctx.controller(ticket.controller)
            outputs = _committed(state, req.program_id, req.binding)
            failed: str | None = None
            try:  # reads of the outputs wait from here until the outputs are all old or all new
                with ctx.shard_locks.writing(outputs.written if outputs else (), until, f"committing {run}"):
                    if ctx.commit_hook is not None:
                        ctx.commit_hook("before", run)
                    if outputs is None or outputs.peers is None:  # its own run failed early, or this is a bug
                        mine = ctx.outcomes.wait(ticket.controller, run, until.left())
                        if mine is None or mine.ok:
                            raise ReshardError(
                                f"device {ctx.device}: committing {run}: its program {req.program_id} or binding "
                                f"{req.binding} is not cached here"
                            )
                        failed = mine.reason
                    else:
                        participants = [(d, a, v) for (d, a), v in zip(outputs.peers, req.votes, strict=True)]
                        failed = _failed_outcome(ctx, ticket.controller, run, participants, until, req.verify)
                    if failed is None and outputs is not None:
                        with state.stream.running():
                            outputs.commit(ctx, run)  # all checked, first
                            state.stream.finish(
                                time.monotonic() + COMMIT_WAIT_S, f"device {ctx.device}: committing {run}"
                            )
                        ctx.store.wrote(outputs.names, run, outputs.version)
            finally:  # no reference here to a staged result: freed, its memory goes back to the pool
                ctx.store.free_staged(run, outputs.tensors if outputs else ())
                if ctx.commit_hook is not None:
                    ctx.commit_hook("after", run)
            if failed is not None:
                raise PeerFailed(f"device {ctx.device}: {run} not committed: {failed}")
            return True

    def reshard_abort_run(self, controller: str, run: str | None, drop=(), group_drops=()) -> None:
        """The controller gave up on run ``run``: a part of it still to come keeps nothing, shards
        it made (``drop``) go now, and if it is still running here its groups are aborted (peers
        blocked on them fail at once); then the given group generations are dropped."""
        ctx = _attached(self)
        if run is not None:
            ctx.store.tombstone(run, drop)
        state = ctx.controllers.get(controller)
        if state is None:
            return
        active = state.active
        if active is not None and active.run == run:
            active.cancelled.set()
            state.groups.abort_generations(active.groups, "the controller aborted the reshard")
        state.groups.abort_generations(group_drops, "dropped")

    # ---------------------------------------------------------------- extension point

    def reshard_call(self, ticket: Ticket, fn, args, kwargs, budget_s: float):
        """Run ``fn(ctx, *args, **kwargs)`` on this device in the controller's order."""
        ctx = _attached(self)
        with ctx.inbox.turn(ticket, Deadline.from_budget(budget_s), f"call({getattr(fn, '__name__', fn)})"):
            ctx._local.controller = ticket.controller
            try:
                return fn(ctx, *args, **kwargs)
            finally:
                ctx._local.controller = None

    def reshard_stats(self) -> dict:
        ctx = _attached(self)
        groups = {}
        programs = []
        for cid, state in list(ctx.controllers.items()):
            groups.update({(cid, k): gen for k, gen in state.groups.live().items()})
            programs += [(cid, pid) for pid in state.programs]
        return {
            "device": ctx.device,
            "programs": programs,
            "groups": groups,
            "staging_bytes": sum(s.staging.nbytes for s in ctx.controllers.values()),
            "controllers": len(ctx.controllers),
            "callers": ctx.inbox.known(),
            "last_run_peak_bytes": ctx.peak_bytes,
            "last_run_assembled": ctx.assembled,
            "peer_maps": len(ctx.peers.maps),
            "fds": len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else -1,
            "calls": ctx.inbox.state(),
            "shard_locks": ctx.shard_locks.state(),
            **ctx.counters,
            **ctx.store.memory(),
        }

    def reshard_close(self) -> None:
        """Leave the mesh: close the communicators and drop the shards (a user's own tensors it
        shared stay theirs); the actor may be attached again."""
        ctx = _attached_or_none(self)
        if ctx is None:
            return
        if ctx.watch is not None:
            ctx.watch.stop()
        for state in ctx.controllers.values():
            state.groups.close_all()
            state.staging.drop()
        ctx.store.clear()
        ctx.peers.clear()
        if ctx.board is not None:
            ctx.board.close()
        if isinstance(ctx.shared, GpuBlocks):
            ctx.shared.close()
        ctx.actor = None
        clear_current(ctx)
        self._reshard_ctx = None


class DeviceActor(DeviceRole):
    """Ray actor of one device (wrapped with ``ray.remote`` by ``DeviceMesh.create``): a
    ``DeviceRole`` whose quick calls run on their own threads (concurrency group ``control``)."""

    def __init__(self, device: int, backend: Backend, options: DeviceOptions):
        self.reshard_attach(device, backend, options)
        _attached(self).threaded = True  # MAX_CONCURRENCY threads (its constructor runs on the main one)

    @ray.method(concurrency_group=CONTROL)
    def reshard_ready(self) -> dict:  # type: ignore[override]  # ray.method makes it a remote method
        return DeviceRole.reshard_ready(self)

    @ray.method(concurrency_group=CONTROL)
    def reshard_ping(self) -> None:  # type: ignore[override]  # ray.method makes it a remote method
        """The empty call (a floor for latency measurements)."""

    @ray.method(concurrency_group=CONTROL)
    def reshard_fetch(self, name: str, budget_s: float = FETCH_BUDGET_S, versioned: bool = False):
        return DeviceRole.reshard_fetch(self, name, budget_s, versioned)

    @ray.method(concurrency_group=CONTROL)
    def reshard_abort_run(self, controller: str, run: str | None, drop=(), group_drops=()) -> None:
        DeviceRole.reshard_abort_run(self, controller, run, drop, group_drops)

    @ray.method(concurrency_group=CONTROL)
    def reshard_stats(self) -> dict:  # type: ignore[override]  # ray.method makes it a remote method
        return DeviceRole.reshard_stats(self)

    @ray.method(concurrency_group=CONTROL)
    def reshard_close(self) -> None:  # type: ignore[override]  # ray.method makes it a remote method
        DeviceRole.reshard_close(self)


def _attached_or_none(actor) -> DeviceContext | None:
    """The device context of ``actor`` (any actor the ``DeviceRole`` calls run on), None before it
    was attached."""
    return getattr(actor, "_reshard_ctx", None)


def _on_a_pool_thread() -> bool:
    """This call runs on one of the actor's pool threads (``max_concurrency`` > 1), not on the
    thread of a single-threaded actor (the main one) nor in an async actor's event loop: such an
    actor serves other calls while one runs."""
    if threading.current_thread() is threading.main_thread():
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return True
    return False


def _attached(actor) -> DeviceContext:
    ctx = _attached_or_none(actor)
    if ctx is None:
        raise RuntimeError("this actor is not a device of any mesh yet (DeviceMesh.from_actors attaches it)")
    return ctx


def _whole(state: ControllerState, bound: Bound, device: int) -> Bound:
    """``bound`` as the run takes it: one shipped as binding ``like`` with outputs of its own
    (``Bound.like``) reads what that one reads."""
    if bound.like is None:
        return bound
    base = state.bindings.get(bound.like)
    if base is None:
        raise ReshardError(
            f"device {device}: binding {bound.like}, whose sources a new binding reads, is not cached here"
        )
    return dataclasses.replace(base, outs=bound.outs, peers=bound.peers)


def _committed(state: ControllerState, program_id: int, binding: int) -> Outputs | None:
    """The outputs a commit copies its run's staged results into: those of its run's parts that
    write one (``PreparedBatch.written``), as its run bound them. None where the program or
    binding is not cached (a run that failed before it cached them staged nothing)."""
    prepared, bound = state.programs.get(program_id), state.bindings.get(binding)
    if prepared is None or bound is None or bound.outs is None:
        return None
    return outputs_of(prepared, bound)


def _failed_outcome(ctx, controller: str, run: str, participants, until: Deadline, verify: bool) -> str | None:
    """None once every participant's run succeeded (with ``verify``: and every received slice
    matches what its sender read); else why not: the first that failed, or the ones whose outcome
    could not be learned before ``until``.

    ``participants``: ``(device, actor, vote)`` each. Two sources say how a run ended: ``vote``, the
    run's result, which the caller owns (gone when the caller dies), and, where ``actor`` is given
    (a device that serves calls while it commits), the participant itself (gone when it dies). The
    votes are read first: they cost the participants nothing. A participant is asked as well once
    its vote is gone or when the votes are not all in after ``ASK_AFTER_S`` (a dead caller's may
    never come). The first that answers decides (both tell the same run); a cut or a slow fetch is
    asked again, so a device decides alone only when both sources are gone."""
    outcomes: dict[int, Outcome | None] = {}
    sources: dict = {}  # ref -> (device, "vote" | "asked")
    actors = {d: actor for d, actor, _ in participants}
    asked: set[int] = set()

    def ask(d: int) -> None:
        if actors[d] is not None:
            asked.add(d)
            sources[actors[d].reshard_outcome.remote(controller, run, until.left())] = (d, "asked")

    for d, _, vote in participants:
        if d == ctx.device:
            outcomes[d] = mine = ctx.outcomes.wait(controller, run, until.left())
            if mine is not None and not mine.ok:
                return mine.reason
            continue
        sources[vote] = (d, "vote")
    waiting = {d for d, _, _ in participants if d != ctx.device}
    ask_at = time.monotonic() + ASK_AFTER_S
    while waiting and not until.passed():
        if time.monotonic() >= ask_at:
            for d in waiting - asked:
                ask(d)
            ask_at = math.inf
        refs = [r for r, (d, _) in sources.items() if d in waiting]
        if not refs:
            break
        ready, _ = ray.wait(refs, num_returns=1, timeout=max(0.0, min(until.left(), ask_at - time.monotonic())))
        for ref in ready:
            d, kind = sources.pop(ref)
            if d not in waiting:
                continue
            got, again = _read_outcome(ref, kind, until)
            if again:
                if kind == "asked":
                    time.sleep(min(OUTCOME_RETRY_S, until.left()))  # a cut: Ray answers at once until it heals
                    ask(d)
                else:
                    sources[ref] = (d, kind)
            elif got is not None:
                if not got.ok:  # one failed run decides: no destination can learn that all succeeded
                    return got.reason
                outcomes[d] = got
                waiting.discard(d)
            elif kind == "vote" and d not in asked:  # the caller is gone: ask the participant
                ask(d)
    for d in waiting:
        outcomes[d] = None
    unknown = sorted(d for d, o in outcomes.items() if o is None)
    if unknown:
        return (
            f"how the runs on devices {unknown} ended was not learned within {COMMIT_WAIT_S:g} s of the deadline "
            "(neither the caller nor those devices could say)"
        )
    for _, o in sorted(outcomes.items()):
        if o is not None and not o.ok:
            return o.reason
    if verify:
        found = first_mismatch({d: o.checks for d, o in outcomes.items() if o is not None})
        if found is not None:
            return f"tensor {found[0]} step {found[1]}: a received slice differs from what its sender read"
    return None


def _read_outcome(ref, kind: str, until: Deadline) -> tuple[Outcome | None, bool]:
    """What a ready source says: ``(outcome, False)``; ``(None, True)``: ask it again (a cut, a
    slow fetch); ``(None, False)``: this source is gone (the caller or the participant died)."""
    from ray.exceptions import (
        ActorUnavailableError,
        GetTimeoutError,
        ObjectFetchTimedOutError,
        ObjectLostError,
        RayActorError,
    )

    try:
        got = ray.get(ref, timeout=max(until.left(), 0.001))
    except (GetTimeoutError, ObjectFetchTimedOutError, ActorUnavailableError):
        return None, True
    except ObjectLostError:  # the caller died: its results went with it
        return None, False
    except RayActorError as e:
        if kind == "vote":  # the participant died before its run returned: the run failed
            return Outcome(False, _last_line(e), None), False
        return None, False  # it died after: its result, if the caller still has it, says
    except Exception as e:  # the run raised
        return Outcome(False, _last_line(e), None), False
    if kind == "vote":
        return Outcome(True, "", got.checks), False
    return got, False  # None: it did not end within the budget (the deadline passed)


def _last_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


def _check_deadline(device: int, deadline: Deadline, what: str) -> None:
    if deadline.passed():
        raise ReshardTimeout(f"device {device}: the deadline of {what} passed before it started")

"""The device actor: one Ray actor per device, holding shards and running programs.

Threads. The actor serves several calls at once (a threaded actor). Calls that change state carry
a ``Ticket`` and run in their controller's order (``reshard.runtime.inbox``), one at a time per
controller; ``ready``, ``fetch``, ``stats`` and ``abort_run`` run on threads of their own
(concurrency group ``control``), so they never wait behind a stuck run. Each controller (a
process that uses this device) has communicators, programs and a staging buffer of its own
(``ControllerState``): two processes resharding over the same devices never wait on each other.

State (``DeviceContext``, also what ``call(fn, ...)`` hands to ``fn``): ``store`` (named shards,
their holders, the pool of freed memory; ``reshard.runtime.shards``), ``peers`` (peers' shards
mapped read-only for pulls), ``controllers``, ``backend``, ``before_op`` (a hook
``fn(run, op)`` run before every op: fault injection, tracing).

A run applies its controller's updates, decodes its program when shipped (then caches it by id),
allocates the destination, connects the program's groups, and executes it. If this device cannot
do its part (no source shard, a peer's shard gone, no memory, a failed op), it aborts the
program's groups at once, so peers fail within milliseconds instead of at their deadline, frees
what it allocated and raises a ``ReshardError``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict

import numpy as np
import ray
import torch

from reshard.errors import ReshardError, ReshardTimeout
from reshard.program import DeviceProgram
from reshard.runtime.communicator import Backend, Communicator, PeerFailed
from reshard.runtime.executor import PreparedProgram, Run, StagingBuffer, execute, prepare, torch_dtype
from reshard.runtime.groups import GroupCache, group_key
from reshard.runtime.inbox import OrderedInbox
from reshard.runtime.messages import RunRequest, RunResult, Ticket, Updates
from reshard.runtime.shards import ShardStore
from reshard.runtime.shared_memory import PeerShards, SharedShards
from reshard.serialize import decode_device_program

log = logging.getLogger(__name__)

CONTROL = "control"  # the concurrency group of calls that must never wait behind a run
BUFFER_POOL_BYTES = 256 << 20
STAGING_KEEP_BYTES = 64 << 20
NO_DEADLINE = float("inf")


class ControllerState:
    """What one controller has set up on this device: communicators, programs, staging."""

    def __init__(self, ctx: DeviceContext):
        self.groups = GroupCache(ctx.backend, ctx.device, float(ctx.options.get("op_timeout_s", 300.0)))
        self.programs: OrderedDict[int, PreparedProgram] = OrderedDict()
        self.staging = StagingBuffer(ctx.torch_device, int(ctx.options.get("staging_keep_bytes", STAGING_KEEP_BYTES)))
        self.active: tuple[str, tuple] | None = None  # (destination name, group keys) of the run in progress

    def apply(self, updates: Updates | None) -> None:
        if not updates:
            return
        for pid in updates.program_drops:
            self.programs.pop(pid, None)
        self.groups.apply(updates.group_drops, updates.group_sets)


class DeviceContext:
    """Everything a device actor owns; the first argument of functions run through ``call``."""

    def __init__(self, device: int, backend: Backend, options: dict):
        self.device = device
        self.backend = backend
        kind = options.get("device_type") or getattr(backend, "device_type", "cpu")
        self.torch_device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)
        self.options = dict(options)
        want_shared = options.get("shared_memory", False) and self.torch_device.type == "cpu"
        shared = SharedShards() if want_shared and SharedShards.available() else None
        self.store = ShardStore(
            device, self.torch_device, int(options.get("buffer_pool_bytes", BUFFER_POOL_BYTES)), shared
        )
        self.peers = PeerShards(device)
        self.controllers: dict[str, ControllerState] = {}
        self.inbox = OrderedInbox()
        self.before_op = None
        self.extensions: dict[str, object] = {}  # state that libraries on the runtime keep here (pipelines)
        self.peak_bytes = 0  # destination + staging bytes of the last run
        self.counters = {"programs_received": 0, "runs": 0, "failed_runs": 0, "dropped_late": 0}
        self._local = threading.local()
        self._lock = threading.Lock()

    @property
    def shared(self):
        return self.store.shared

    @property
    def caller(self) -> str | None:
        """The controller whose ``call`` runs on this thread (None outside ``call``)."""
        return getattr(self._local, "controller", None)

    def controller(self, cid: str) -> ControllerState:
        with self._lock:
            state = self.controllers.get(cid)
            if state is None:
                state = self.controllers[cid] = ControllerState(self)
            return state

    # ---------------------------------------------------------------- for functions run by ``call``

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """This device's shards by name."""
        return self.store.shards

    def communicator(self, group, channel: str = "") -> Communicator:
        """This device's communicator for ``group`` of the calling controller (set up by
        ``reshard.runtime.ensure_groups``), connected now if needed."""
        state = self.controller(self.caller)
        key = group_key(group, channel)
        state.groups.connect([key])
        return state.groups.get(key)

    def run_program(self, program: DeviceProgram, src, dst, *, dtype: str | None = None, timeout_s: float = 60.0,
                    groups=None, peers=None) -> dict:  # fmt: skip
        """Run one ``DeviceProgram`` over ``src``/``dst`` tensors with the calling controller's
        communicators (or ``groups``, an object with ``get(key)``). On failure the program's groups
        are aborted and the error raised."""
        if dtype is None:
            t = src if src is not None else dst
            if t is None:
                raise ValueError("run_program needs dtype= when neither src nor dst is given")
            dtype = str(t.dtype).removeprefix("torch.")
        prepared = prepare(program, dtype)
        state = self.controller(self.caller)
        keys = [group_key(g) for g in program.connect]
        deadline = time.monotonic() + timeout_s
        try:
            if groups is None:
                state.groups.connect(keys, timeout_s)
                groups = _Channel(state.groups, "")
            state.staging.reserve(program.staging_bytes)
            tmp = self.store.allocate(program.src_shape, torch_dtype(prepared.dtype)) if program.tmp else None
            run = Run(prepared, src, dst, peers or {}, groups, state.staging, deadline, self.before_op, tmp)
            return execute(run)
        except BaseException:
            state.groups.abort(keys, "its program failed")
            raise
        finally:
            state.staging.trim()


class _Channel:
    """The communicators of one channel of a ``GroupCache``, by device tuple (what a run uses)."""

    def __init__(self, groups: GroupCache, channel: str):
        self.groups, self.channel = groups, channel

    def get(self, devices) -> Communicator:
        return self.groups.get((self.channel, devices))


def _monotonic(wall_deadline: float) -> float:
    return time.monotonic() + (wall_deadline - time.time())


class DeviceActor:
    """Ray actor of one device (wrapped with ``ray.remote`` by the mesh, module docstring)."""

    def __init__(self, device: int, backend: Backend, options: dict):
        threads = int(options.get("torch_threads", 1))
        if threads > 0:
            torch.set_num_threads(threads)
        self.ctx = DeviceContext(device, backend, options)
        setup = getattr(backend, "setup_actor", None)  # optional backend hook
        if setup is not None:
            setup()

    @ray.method(concurrency_group=CONTROL)
    def ready(self) -> dict:
        rc = ray.get_runtime_context()
        return {
            "device": self.ctx.device,
            "pid": os.getpid(),
            "node_id": rc.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "torch_device": str(self.ctx.torch_device),
            "shared_memory": self.ctx.shared is not None,
        }

    @ray.method(concurrency_group=CONTROL)
    def ping(self) -> None:
        """The empty call (a floor for latency measurements)."""

    # ---------------------------------------------------------------- shards

    def load(self, ticket: Ticket, name: str, holder: str, array, box, dtype: str, deadline: float):
        """Keep ``array[box]`` (a read-only object-store array; None: zeros of the box's shape) as
        shard ``name`` held by ``holder``; returns its shared-memory descriptor (None: private)."""
        ctx = self.ctx
        with ctx.inbox.turn(ticket, deadline, f"loading {name}"):
            _check_deadline(ctx.device, deadline, f"loading {name}")
            shape = tuple(hi - lo for lo, hi in box)
            wire = "int16" if dtype == "bfloat16" else dtype
            try:
                on_host = ctx.torch_device.type == "cpu"
                t = (
                    ctx.store.allocate(shape, torch_dtype(wire))
                    if on_host
                    else torch.empty(shape, dtype=torch_dtype(wire))
                )
                if array is None:
                    t.zero_()
                else:
                    t.numpy()[...] = array[tuple(slice(lo, hi) for lo, hi in box)]
            except (MemoryError, RuntimeError, OSError) as e:
                raise ReshardError(
                    f"device {ctx.device}: could not allocate its shard {name} of shape {shape}: {e}"
                ) from e
            if dtype == "bfloat16":
                t = t.view(torch.bfloat16)
            if t.device != ctx.torch_device:
                t = t.to(ctx.torch_device)
            ctx.store.put(name, t, holder)
            return ctx.store.descriptor(t)

    @ray.method(concurrency_group=CONTROL)
    def fetch(self, name: str) -> np.ndarray:
        """Shard ``name`` as a numpy array (bfloat16 as its int16 bit pattern)."""
        t = self.ctx.store.get(name)
        if t is None:
            raise KeyError(f"device {self.ctx.device} holds no shard {name!r} (it was freed)")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        return t.numpy()

    def acquire(self, ticket: Ticket, name: str, holder: str) -> bool:
        with self.ctx.inbox.turn(ticket, NO_DEADLINE):
            return self.ctx.store.acquire(name, holder)

    def release(self, ticket: Ticket, name: str, holder: str) -> None:
        with self.ctx.inbox.turn(ticket, NO_DEADLINE):
            self.ctx.store.release(name, holder)

    def free(self, ticket: Ticket, *names: str) -> int:
        with self.ctx.inbox.turn(ticket, NO_DEADLINE):
            return sum(self.ctx.store.free(n) for n in names)

    # ---------------------------------------------------------------- programs

    def update(self, ticket: Ticket, updates: Updates, connect=(), deadline: float = NO_DEADLINE) -> None:
        """Apply controller updates; then connect ``connect`` (group keys, in that order)."""
        ctx = self.ctx
        with ctx.inbox.turn(ticket, deadline, "a group update"):
            state = ctx.controller(ticket.controller)
            state.apply(updates)
            if connect:
                try:
                    state.groups.connect(list(connect), _monotonic(deadline) - time.monotonic())
                except BaseException:
                    state.groups.abort(list(connect), "it could not connect")
                    raise

    def run(self, req: RunRequest) -> RunResult:
        t0 = time.monotonic()
        ctx = self.ctx
        state = ctx.controller(req.ticket.controller)
        with ctx.inbox.turn(req.ticket, req.deadline, f"the reshard into {req.dst_name}"):
            state.apply(req.updates)  # bookkeeping is never lost, even when the run is dropped
            return self._run(req, state, t0)

    def _run(self, req: RunRequest, state: ControllerState, t0: float) -> RunResult:
        ctx = self.ctx
        deadline = _monotonic(req.deadline)
        prepared = None
        dst = None
        keys: list = []
        try:
            if req.blob is not None:
                dtype, program = decode_device_program(req.blob)
                state.programs[req.program_id] = prepare(program, dtype)
                ctx.counters["programs_received"] += 1
            prepared = state.programs.get(req.program_id)
            if prepared is None:
                raise ReshardError(
                    f"device {ctx.device}: program {req.program_id} is not cached here and was not shipped"
                )
            state.programs.move_to_end(req.program_id)
            keys = [group_key(g) for g in prepared.groups]
            state.active = (req.dst_name, tuple(keys))
            if time.monotonic() >= deadline:
                ctx.counters["dropped_late"] += 1
                raise ReshardTimeout(f"device {ctx.device}: the reshard's deadline passed before it started here")
            prog = prepared.program
            tdtype = torch_dtype(prepared.dtype)
            src = None
            if prog.src_shape is not None:
                src = ctx.store.get(req.src_name)
                if src is None:
                    raise ReshardError(f"device {ctx.device}: source shard {req.src_name!r} is missing (tensor freed?)")
            peers = {}
            if req.pulls:
                peers = {h: ctx.peers.get(h, desc, tdtype) for h, desc in req.pulls.items()}
                ctx.peers.purge()  # mappings of shards their owners dropped since: let that memory go
            if prog.dst_shape is not None:
                try:
                    dst = ctx.store.allocate(prog.dst_shape, tdtype)
                except (MemoryError, RuntimeError, OSError) as e:
                    raise ReshardError(
                        f"device {ctx.device}: could not allocate its destination shard {prog.dst_shape}: {e}"
                    ) from e
            state.groups.connect(keys, deadline - time.monotonic())
            state.staging.reserve(prog.staging_bytes)
            tmp = ctx.store.allocate(prog.src_shape, tdtype) if prog.tmp else None
            ctx.peak_bytes = (0 if dst is None else dst.numel() * dst.element_size()) + state.staging.nbytes
            ctx.counters["runs"] += 1
            run = Run(
                prepared, src, dst, peers, _Channel(state.groups, ""), state.staging, deadline, ctx.before_op, tmp
            )
            stats = execute(run)
        except BaseException as e:
            ctx.counters["failed_runs"] += 1
            state.groups.abort(keys, f"it failed: {type(e).__name__}")  # peers fail fast
            dst = None
            if isinstance(e, ReshardError):
                raise
            if isinstance(e, Exception):
                raise ReshardError(f"device {ctx.device}: {type(e).__name__}: {e}") from e
            raise
        finally:
            state.active = None
            state.staging.trim()
        desc = None
        if dst is not None:
            if not ctx.store.put(req.dst_name, dst, req.dst_name):
                raise PeerFailed(f"device {ctx.device}: the controller aborted the reshard into {req.dst_name}")
            desc = ctx.store.descriptor(dst)
        return RunResult(time.monotonic() - t0, stats["elapsed_s"], stats["comm_s"], ctx.peak_bytes, desc)

    @ray.method(concurrency_group=CONTROL)
    def abort_run(self, controller: str, dst_name: str | None, group_drops=()) -> None:
        """The controller gave up on a reshard: drop its destination shard (now, or when the run
        finishes), abort its groups if it is still running (peers blocked on them fail at once)
        and drop the given group generations."""
        ctx = self.ctx
        if dst_name is not None:
            ctx.store.tombstone(dst_name)
        state = ctx.controllers.get(controller)
        if state is None:
            return
        active = state.active
        if active is not None and active[0] == dst_name:
            state.groups.abort(active[1], "the controller aborted the reshard")
        state.groups.abort([k for k, gen in group_drops if state.groups.generation(k) == gen], "dropped")

    # ---------------------------------------------------------------- extension point

    def call(self, ticket: Ticket, fn, args, kwargs, deadline: float):
        """Run ``fn(ctx, *args, **kwargs)`` on this device in the controller's order."""
        ctx = self.ctx
        with ctx.inbox.turn(ticket, deadline, f"call({getattr(fn, '__name__', fn)})"):
            ctx._local.controller = ticket.controller
            try:
                return fn(ctx, *args, **kwargs)
            finally:
                ctx._local.controller = None

    @ray.method(concurrency_group=CONTROL)
    def stats(self) -> dict:
        ctx = self.ctx
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
            "last_run_peak_bytes": ctx.peak_bytes,
            "peer_maps": len(ctx.peers.maps),
            "fds": len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else -1,
            "calls": ctx.inbox.state(),
            **ctx.counters,
            **ctx.store.memory(),
        }

    @ray.method(concurrency_group=CONTROL)
    def close(self) -> None:
        for state in self.ctx.controllers.values():
            state.groups.close_all()
            state.staging.buf = None
        self.ctx.store.clear()
        self.ctx.peers.clear()


def _check_deadline(device: int, deadline: float, what: str) -> None:
    if time.time() >= deadline:
        raise ReshardTimeout(f"device {device}: the deadline of {what} passed before it started")

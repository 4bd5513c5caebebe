"""The device actor: one Ray actor per device, holding shards and running programs.

Threads. The actor serves several calls at once (a threaded actor). Calls that change state carry
a ``Ticket`` and run in their controller's order (``reshard.runtime.inbox``), one at a time per
controller; ``reshard_ready``, ``reshard_fetch``, ``reshard_stats`` and ``reshard_abort_run`` run on
threads of their own (concurrency group ``control``), so they never wait behind a stuck run. The
calls live on ``DeviceRole``, which a user's own actor may mix in (``DeviceMesh.from_actors``). Each controller (a
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
import sys
import threading
import time
from collections import OrderedDict

import numpy as np
import ray

from reshard.dtypes import dtype_name
from reshard.errors import ReshardError, ReshardTimeout
from reshard.program import DeviceProgram
from reshard.runtime import arrays
from reshard.runtime.batches import BatchRun, PreparedBatch, execute_batch, first_mismatch, prepare_batch
from reshard.runtime.binding import Binding, checked_out
from reshard.runtime.communicator import Backend, Communicator, PeerFailed
from reshard.runtime.executor import Run, StagingBuffer, execute, prepare
from reshard.runtime.groups import GroupCache, group_key
from reshard.runtime.inbox import OrderedInbox
from reshard.runtime.messages import Bound, RunRequest, RunResult, Ticket, Updates
from reshard.runtime.shards import ShardStore
from reshard.runtime.shared_memory import PeerShards, RelayBoard, SharedShards
from reshard.serialize import decode_batch_device_program

log = logging.getLogger(__name__)

CONTROL = "control"  # the concurrency group of calls that must never wait behind a run
BUFFER_POOL_BYTES = 256 << 20
ASSEMBLY_BYTES = 256 << 20
STAGING_KEEP_BYTES = 64 << 20
NO_DEADLINE = float("inf")
#: How long after a run's deadline a commit still waits for the other participants' runs to end.
VOTE_GRACE_S = 5.0


class ControllerState:
    """What one controller has set up on this device: communicators, programs, staging."""

    def __init__(self, ctx: DeviceContext):
        self.groups = GroupCache(ctx.backend, ctx.device, float(ctx.options.get("op_timeout_s", 300.0)))
        self.programs: OrderedDict[int, PreparedBatch] = OrderedDict()
        self.bindings: dict[int, Bound] = {}  # the controller's mirror says which to drop
        self.staging = StagingBuffer(ctx.device_type, int(ctx.options.get("staging_keep_bytes", STAGING_KEEP_BYTES)))
        self.active: tuple[str, tuple] | None = None  # (destination name, group keys) of the run in progress
        self.cancelled = threading.Event()  # the run in progress was aborted by the controller

    def apply(self, updates: Updates | None) -> None:
        if not updates:
            return
        for pid in updates.program_drops:
            self.programs.pop(pid, None)
        for bid in updates.binding_drops:
            self.bindings.pop(bid, None)
        self.groups.apply(updates.group_drops, updates.group_sets)


class DeviceContext:
    """Everything a device actor owns; the first argument of functions run through ``call``."""

    def __init__(self, device: int, backend: Backend, options: dict):
        self.device = device
        self.backend = backend
        self.device_type = _device_type(options.get("device_type") or backend.device_type)
        self.options = dict(options)
        want_shared = options.get("shared_memory", False) and self.device_type == "cpu"
        shared = SharedShards() if want_shared and SharedShards.available() else None
        self.store = ShardStore(
            device,
            self.device_type,
            int(options.get("buffer_pool_bytes", BUFFER_POOL_BYTES)),
            shared,
            int(options.get("assembly_bytes", ASSEMBLY_BYTES)),
        )
        self.peers = PeerShards(device)
        self.board = RelayBoard() if shared is not None and RelayBoard.available() else None
        self.controllers: dict[str, ControllerState] = {}
        self.inbox = OrderedInbox()
        self.before_op = None
        self.after_run = None  # a test hook: fn(runs by tensor) after a batch ran, before its checksums
        self.extensions: dict[str, object] = {}  # state that libraries on the runtime keep here (pipelines)
        self.peak_bytes = 0  # destination (twice if assembled) + staging bytes of the last run
        self.assembled = False  # the last run assembled its destination apart (``ShardStore``)
        self.counters = {"programs_received": 0, "runs": 0, "failed_runs": 0, "dropped_late": 0}
        self._local = threading.local()
        self._lock = threading.Lock()

    @property
    def shared(self):
        return self.store.shared

    @property
    def torch_device(self):
        """This device as a ``torch.device`` (imports torch)."""
        import torch

        return torch.device(self.device_type)

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
    def buffers(self) -> dict:
        """This device's shards by name, as torch tensors over their memory."""
        return {name: self.local(name) for name in list(self.store.shards)}

    def communicator(self, group, channel: str = "") -> Communicator:
        """This device's communicator for ``group`` of the calling controller (set up by
        ``reshard.runtime.ensure_groups``), connected now if needed."""
        state = self.controller(self.caller)
        key = group_key(group, channel)
        state.groups.connect([key])
        return state.groups.get(key)

    def empty_cache(self) -> int:
        """Free what this device keeps for reuse and nobody uses now: freed shards' memory, the
        assembly buffer, the calling controller's staging buffer (its runs come before and after
        this call, never during it), mappings of peers' shards their owners let go of, and on a GPU
        torch's cached blocks. Returns the bytes freed of the first three (torch's are its own)."""
        freed = self.store.empty_cache()
        state = self.controllers.get(self.caller)
        if state is not None:
            freed += state.staging.nbytes
            state.staging.reserve(0)
        self.peers.purge()
        if self.device_type.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
        return freed

    # ---------------------------------------------------------------- for the user's code in an attached actor

    def empty(self, shape, dtype):
        """A new torch tensor in this device's shard memory (shared memory on CPU devices): keep
        the tensors you share in it, and peers on this machine pull from them without a copy."""
        name = dtype_name(dtype)
        a = self.store.allocate(tuple(shape), name)
        return arrays.as_torch(a, name) if arrays.is_numpy(a) else a

    def share(self, name: str, tensor, *, shape=None, placements=None, mesh_shape=None, coordinate=None) -> None:
        """Offer ``tensor`` (a torch tensor or numpy array: this device's shard of a sharded
        tensor; no copy) as shard ``name``, for ``reshard.runtime.adopt`` on the driver.
        ``shape``/``placements`` say what it is a shard of (the driver checks them against the
        layout it adopts it with); ``reshard`` may write into it in place (``out=``). Stays the
        user's: ``unshare`` takes it back."""
        if not arrays.is_numpy(tensor) and not hasattr(tensor, "untyped_storage"):
            raise TypeError(f"share needs a torch.Tensor or numpy array, got {type(tensor).__name__}")
        here = arrays.is_numpy(tensor) or str(tensor.device) == self.device_type or (
            tensor.device.type == "cuda" and self.device_type.startswith("cuda") and tensor.device.index is None
        )  # fmt: skip
        if not arrays.contiguous(tensor) or not here:
            where = "host memory" if arrays.is_numpy(tensor) else str(tensor.device)
            raise ValueError(
                f"device {self.device}: share({name!r}) needs a contiguous tensor on {self.device_type}, got one on "
                f"{where} with strides {tensor.strides if arrays.is_numpy(tensor) else tensor.stride()}; pass a "
                "contiguous copy or allocate it with reshard_device.empty(...)"
            )
        arrays.dtype_of(tensor)  # a dtype the runtime moves
        meta = {"shape": None if shape is None else tuple(shape), "placements": placements,
                "mesh_shape": mesh_shape, "coordinate": coordinate}  # fmt: skip
        if self.device_type == "cpu" and not arrays.is_numpy(tensor):
            tensor = arrays.as_numpy(tensor)  # the same memory
        self.store.share(name, tensor, meta)

    def unshare(self, name: str) -> None:
        self.store.unshare(name)

    def local(self, name: str):
        """This device's shard ``name`` as a torch tensor over its memory (a reshard's result, or
        a shared tensor)."""
        a = self.store.get(name)
        if a is None:
            raise KeyError(f"device {self.device} holds no shard {name!r} (never shared, freed, or not resharded here)")
        return arrays.as_torch(a, arrays.dtype_of(a)) if arrays.is_numpy(a) else a

    def from_dtensor(self, name: str, dt) -> None:
        """``share`` a torch DTensor's local shard (no copy) with its placements and global shape;
        the driver's ``adopt`` checks its device mesh against the mesh it adopts it on."""
        from reshard.placement import as_placement

        mesh = dt.device_mesh
        self.share(
            name, dt.to_local(), shape=tuple(dt.shape), placements=tuple(as_placement(p) for p in dt.placements),
            mesh_shape=tuple(mesh.shape), coordinate=tuple(mesh.get_coordinate() or ()),
        )  # fmt: skip

    def share_state_dict(self, state_dict, prefix: str = ""):
        """``share`` every tensor of a state dict (nested dicts, lists and tuples too), each under
        its key (``prefix`` first, e.g. ``"policy."``): a DTensor (FSDP2's ``model.state_dict()``)
        with its placements (``from_dtensor``), a plain tensor as it is. No copy. Returns the same
        tree of names, what ``adopt`` takes on the driver."""
        from reshard.pytree import flatten, unflatten

        def leaf(x) -> bool:
            return arrays.is_numpy(x) or hasattr(x, "untyped_storage")

        leaves, paths, treedef = flatten(state_dict, leaf)
        names = []
        for path, t in zip(paths, leaves, strict=True):
            name = f"{prefix}{path}"
            if type(t).__name__ == "DTensor":
                self.from_dtensor(name, t.detach())
            else:
                self.share(name, t.detach() if hasattr(t, "detach") else t)
            names.append(name)
        return unflatten(treedef, names)

    def to_dtensor(self, name: str, device_mesh):
        """Shard ``name`` as a torch DTensor over ``device_mesh`` (the user's torch DeviceMesh, whose
        shape and rank order must be this mesh's), no copy."""
        import torch
        from torch.distributed.tensor import DTensor

        local = self.local(name)
        meta = self.store.meta.get(name) or {}
        if meta.get("placements") is None or meta.get("shape") is None:
            raise ValueError(
                f"device {self.device}: shard {name!r} carries no layout to build a DTensor from (only reshard results "
                "and shards shared with placements do)"
            )
        placements = tuple(_torch_placement(p) for p in meta["placements"])
        if tuple(device_mesh.shape) != tuple(meta.get("mesh_shape") or device_mesh.shape):
            raise ValueError(
                f"device {self.device}: {name!r} lives on a mesh of shape {meta['mesh_shape']}, the DeviceMesh given "
                f"has shape {tuple(device_mesh.shape)}"
            )
        return DTensor.from_local(local, device_mesh, placements, shape=torch.Size(meta["shape"]),
                                  stride=_stride(meta["shape"]), run_check=False)  # fmt: skip

    def run_program(self, program: DeviceProgram, src, dst, *, dtype: str | None = None, timeout_s: float = 60.0,
                    groups=None, peers=None) -> dict:  # fmt: skip
        """Run one ``DeviceProgram`` over ``src``/``dst`` tensors with the calling controller's
        communicators (or ``groups``, an object with ``get(key)``). On failure the program's groups
        are aborted and the error raised."""
        if dtype is None:
            t = src if src is not None else dst
            if t is None:
                raise ValueError("run_program needs dtype= when neither src nor dst is given")
            dtype = arrays.dtype_of(t)
        prepared = prepare(program, dtype)
        state = self.controller(self.caller)
        keys = [group_key(g) for g in program.connect]
        deadline = time.monotonic() + timeout_s
        try:
            if groups is None:
                state.groups.connect(keys, timeout_s)
                groups = _Channel(state.groups, "")
            state.staging.reserve(program.staging_bytes)
            tmp = self.store.allocate(program.src_shape, prepared.dtype) if program.tmp else None
            run = Run(prepared, src, dst, peers or {}, groups, state.staging, deadline, self.before_op, tmp,
                      self.backend.grouped if self.backend.batches else None)  # fmt: skip
            stats = execute(run)
            run = None  # the scratch buffer's other reference
            self.store.recycle(tmp)
            return stats
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


def _torch_placement(p):
    from torch.distributed.tensor import Partial, Replicate, Shard

    from reshard.placement import Partial as OurPartial
    from reshard.placement import Shard as OurShard

    if isinstance(p, OurShard):
        return Shard(p.dim)
    if isinstance(p, OurPartial):
        return Partial(p.reduce_op.value)
    return Replicate()


def _stride(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(tuple(shape)):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _device_type(kind: str) -> str:
    """ "cpu", or "cuda:<index>" of the current GPU (the actor sees one)."""
    if kind != "cuda":
        return kind
    import torch

    return f"cuda:{torch.cuda.current_device()}"


def _set_threads(threads: int) -> None:
    """torch's intra-op threads for this actor: now if torch is loaded, else when it is."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    else:
        os.environ["OMP_NUM_THREADS"] = str(threads)


def _monotonic(wall_deadline: float) -> float:
    return time.monotonic() + (wall_deadline - time.time())


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

    def reshard_attach(self, device: int, backend: Backend, options: dict) -> dict:
        """Become device ``device`` (once): set up the device context; returns ``reshard_ready()``."""
        if getattr(self, "_reshard_ctx", None) is not None:
            raise RuntimeError(
                f"this actor is device {self._reshard_ctx.device} of a mesh already; "
                "detach it (DeviceMesh.shutdown) before attaching it again"
            )
        threads = int(options.get("torch_threads", 0))
        if threads > 0:
            _set_threads(threads)
        self._reshard_ctx = DeviceContext(device, backend, options)
        backend.setup_actor()
        return DeviceRole.reshard_ready(self)  # ``self`` may be any actor (``DeviceMesh.attach``)

    @property
    def reshard_device(self) -> DeviceContext:
        """This actor's device context (shards, ``share``/``local``/``empty``/DTensor helpers)."""
        if getattr(self, "_reshard_ctx", None) is None:
            raise RuntimeError("this actor is not a device of any mesh yet (DeviceMesh.from_actors attaches it)")
        return self._reshard_ctx

    def reshard_ready(self) -> dict:
        rc = ray.get_runtime_context()
        return {
            "device": self._reshard_ctx.device,
            "pid": os.getpid(),
            "node_id": rc.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "torch_device": self._reshard_ctx.device_type,
            "shared_memory": self._reshard_ctx.shared is not None,
            "board": None if self._reshard_ctx.board is None else self._reshard_ctx.board.descriptor,
        }

    def reshard_ping(self) -> None:
        """The empty call (a floor for latency measurements)."""

    # ---------------------------------------------------------------- shards

    def reshard_load(self, ticket: Ticket, entries, data, deadline: float) -> dict:
        """Keep shards: per entry ``(name, index, box, dtype)``, ``data[index][box]`` (arrays read
        only, from the object store; index None: zeros of the box's shape) as shard ``name``. All
        or none: a failure, or an abort of the load (named by its first shard), keeps nothing.
        Returns each shard's shared-memory descriptor (None: private) by name."""
        ctx = getattr(self, "_reshard_ctx", None)
        run = entries[0][0]
        with ctx.inbox.turn(ticket, deadline, f"loading {run}"):
            _check_deadline(ctx.device, deadline, f"loading {run}")
            made = []
            t = None
            try:
                for _, index, box, dtype in entries:
                    shape = tuple(hi - lo for lo, hi in box)
                    if index is None:
                        t = ctx.store.allocate(shape, dtype)
                        t[...] = 0
                    else:
                        t = ctx.store.allocate_destination(shape, dtype)
                        arrays.copy(t, data[index][(*(slice(lo, hi) for lo, hi in box), Ellipsis)])
                        t = ctx.store.settle(t)
                    made.append(t)
                    t = None
            except BaseException as e:
                ctx.store.abandon(t)
                if not isinstance(e, MemoryError | RuntimeError | OSError):
                    raise
                raise ReshardError(f"device {ctx.device}: could not allocate the shards of {run}: {e}") from e
            if not ctx.store.put_run(run, [(e[0], a, None, False) for e, a in zip(entries, made, strict=True)]):
                raise PeerFailed(f"device {ctx.device}: the controller aborted loading {run}")
            return {e[0]: ctx.store.descriptor(a) for e, a in zip(entries, made, strict=True)}

    def reshard_fetch(self, name: str) -> np.ndarray:
        """Shard ``name`` as a numpy array (bfloat16 as its int16 bit pattern)."""
        t = self._reshard_ctx.store.get(name)
        if t is None:
            raise KeyError(f"device {self._reshard_ctx.device} holds no shard {name!r} (it was freed)")
        return t if arrays.is_numpy(t) else arrays.as_numpy(t.detach().cpu())

    # A hold or free still in flight when the mesh closed finds no shards left: nothing to do.

    def reshard_acquire(self, ticket: Ticket, name: str, holder: str) -> bool:
        ctx = getattr(self, "_reshard_ctx", None)
        if ctx is None:
            return False
        with ctx.inbox.turn(ticket, NO_DEADLINE):
            return ctx.store.acquire(name, holder)

    def reshard_release(self, ticket: Ticket, name: str, holder: str) -> None:
        ctx = getattr(self, "_reshard_ctx", None)
        if ctx is None:
            return
        with ctx.inbox.turn(ticket, NO_DEADLINE):
            ctx.store.release(name, holder)

    def reshard_holds(self, ticket: Ticket, changes) -> None:
        """Holds taken and let go, in order: ``(acquire, name, holder)`` each."""
        ctx = getattr(self, "_reshard_ctx", None)
        if ctx is None:
            return
        with ctx.inbox.turn(ticket, NO_DEADLINE):
            for acquire, name, holder in changes:
                (ctx.store.acquire if acquire else ctx.store.release)(name, holder)

    def reshard_free(self, ticket: Ticket, *names: str) -> int:
        ctx = getattr(self, "_reshard_ctx", None)
        if ctx is None:
            return 0
        with ctx.inbox.turn(ticket, NO_DEADLINE):
            return sum(ctx.store.free(n) for n in names)

    # ---------------------------------------------------------------- programs

    def reshard_update(self, ticket: Ticket, updates: Updates, connect=(), deadline: float = NO_DEADLINE) -> None:
        """Apply controller updates; then connect ``connect`` (group keys, in that order)."""
        ctx = getattr(self, "_reshard_ctx", None)
        with ctx.inbox.turn(ticket, deadline, "a group update"):
            state = ctx.controller(ticket.controller)
            state.apply(updates)
            if connect:
                try:
                    state.groups.connect(list(connect), _monotonic(deadline) - time.monotonic())
                except BaseException:
                    state.groups.abort(list(connect), "it could not connect")
                    raise

    def reshard_run(self, req: RunRequest) -> RunResult:
        t0 = time.monotonic()
        ctx = getattr(self, "_reshard_ctx", None)
        state = ctx.controller(req.ticket.controller)
        with ctx.inbox.turn(req.ticket, req.deadline, f"the reshard {req.run}"):
            state.apply(req.updates)  # bookkeeping is never lost, even when the run is dropped
            return DeviceRole._reshard_run(self, req, state, t0)

    def _reshard_run(self, req: RunRequest, state: ControllerState, t0: float) -> RunResult:
        ctx = getattr(self, "_reshard_ctx", None)
        deadline = _monotonic(req.deadline)
        keys: list = []
        binding = None
        try:
            if req.blob is not None:
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
            state.cancelled = threading.Event()
            state.active = (req.run, tuple(keys))
            if time.monotonic() >= deadline:
                ctx.counters["dropped_late"] += 1
                raise ReshardTimeout(f"device {ctx.device}: the reshard's deadline passed before it started here")
            if req.bound is not None:
                state.bindings[req.binding] = req.bound
            bound = state.bindings.get(req.binding)
            if bound is None:
                raise ReshardError(f"device {ctx.device}: binding {req.binding} is not cached here and was not shipped")
            binding = Binding(ctx, req, bound, prepared)
            channel = _Channel(state.groups, "")
            batch = ctx.backend.grouped if ctx.backend.batches else None
            runs = binding.runs(channel, state.staging, deadline, state.cancelled, ctx.before_op, batch)
            state.groups.connect(keys, deadline - time.monotonic())
            state.staging.reserve(prepared.staging_bytes)
            ctx.assembled = binding.assembled  # its shards are made at the end: twice their bytes then
            ctx.peak_bytes = binding.dst_bytes + state.staging.nbytes
            ctx.counters["runs"] += 1
            run = BatchRun(prepared, runs, channel, state.staging, deadline, ctx.before_op, batch, ctx.after_run)
            stats = execute_batch(run, verify=req.verify)
            run = runs = None  # the scratch buffers' other references
            binding.recycle()
            binding.settle(deadline, late_fails=req.commit)
            descriptors = binding.keep(prepared.metas)
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
        return RunResult(time.monotonic() - t0, stats["elapsed_s"], stats["comm_s"], ctx.peak_bytes, descriptors,
                         stats["checks"])  # fmt: skip

    def reshard_describe(self, ticket: Ticket, names, deadline: float) -> list[dict]:
        """What this device holds under each of ``names``: its local shape, dtype name,
        shared-memory descriptor, and what its owner said of it (``DeviceContext.share``: global
        ``shape``, ...)."""
        ctx = getattr(self, "_reshard_ctx", None)
        with ctx.inbox.turn(ticket, deadline, f"describing {len(names)} shard(s)"):
            out = []
            for name in names:
                t = ctx.store.get(name)
                if t is None:
                    ctx.local(name)  # raises, naming the shard
                out.append({
                    "local_shape": tuple(t.shape), "dtype": arrays.dtype_of(t), "descriptor": ctx.store.descriptor(t),
                    **(ctx.store.meta.get(name) or {}),
                })  # fmt: skip
            return out

    def reshard_commit(self, ticket: Ticket, run: str, pairs, votes, deadline: float, verify: bool = False) -> bool:
        """The second half of a reshard into users' tensors: once every participant's run
        (``votes``, their result refs) succeeded, copy each staged result into its output
        (``pairs``: ``(staged, out)``); if one failed, or some did not end by ``deadline`` plus
        ``VOTE_GRACE_S``, leave the outputs as they are. Drops the staged results either way.
        Every device decides on the same votes, so all outputs change or none do."""
        ctx = getattr(self, "_reshard_ctx", None)
        with ctx.inbox.turn(ticket, NO_DEADLINE, f"committing {run}"):
            failed = _failed_vote(votes, _monotonic(deadline) + VOTE_GRACE_S, verify)
            try:
                if failed is None:
                    for staged, out in pairs:
                        src = ctx.store.get(staged)
                        if src is None:
                            raise ReshardError(f"device {ctx.device}: the staged result {staged!r} is gone")
                        arrays.copy(checked_out(ctx, out, src.shape, arrays.dtype_of(src)), src)
            finally:
                for staged, _ in pairs:
                    ctx.store.free(staged)
            if failed is not None:
                raise PeerFailed(f"device {ctx.device}: {run} not committed: {failed}")
            return True

    def reshard_abort_run(self, controller: str, run: str | None, drop=(), group_drops=()) -> None:
        """The controller gave up on run ``run``: a part of it still to come keeps nothing, shards
        it made (``drop``) go now, and if it is still running here its groups are aborted (peers
        blocked on them fail at once); then the given group generations are dropped."""
        ctx = getattr(self, "_reshard_ctx", None)
        if run is not None:
            ctx.store.tombstone(run, drop)
        state = ctx.controllers.get(controller)
        if state is None:
            return
        active = state.active
        if active is not None and active[0] == run:
            state.cancelled.set()
            state.groups.abort(active[1], "the controller aborted the reshard")
        state.groups.abort([k for k, gen in group_drops if state.groups.generation(k) == gen], "dropped")

    # ---------------------------------------------------------------- extension point

    def reshard_call(self, ticket: Ticket, fn, args, kwargs, deadline: float):
        """Run ``fn(ctx, *args, **kwargs)`` on this device in the controller's order."""
        ctx = getattr(self, "_reshard_ctx", None)
        with ctx.inbox.turn(ticket, deadline, f"call({getattr(fn, '__name__', fn)})"):
            ctx._local.controller = ticket.controller
            try:
                return fn(ctx, *args, **kwargs)
            finally:
                ctx._local.controller = None

    def reshard_stats(self) -> dict:
        ctx = getattr(self, "_reshard_ctx", None)
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
            "last_run_assembled": ctx.assembled,
            "peer_maps": len(ctx.peers.maps),
            "fds": len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else -1,
            "calls": ctx.inbox.state(),
            **ctx.counters,
            **ctx.store.memory(),
        }

    def reshard_close(self) -> None:
        """Leave the mesh: close the communicators and drop the shards (a user's own tensors it
        shared stay theirs); the actor may be attached again."""
        ctx = getattr(self, "_reshard_ctx", None)
        if ctx is None:
            return
        for state in ctx.controllers.values():
            state.groups.close_all()
            state.staging.buf = None
        ctx.store.clear()
        ctx.peers.clear()
        if ctx.board is not None:
            ctx.board.close()
        self._reshard_ctx = None


class DeviceActor(DeviceRole):
    """Ray actor of one device (wrapped with ``ray.remote`` by ``DeviceMesh.create``): a
    ``DeviceRole`` whose quick calls run on their own threads (concurrency group ``control``)."""

    def __init__(self, device: int, backend: Backend, options: dict):
        self.reshard_attach(device, backend, {"torch_threads": 1, **options})

    @ray.method(concurrency_group=CONTROL)
    def reshard_ready(self) -> dict:
        return DeviceRole.reshard_ready(self)

    @ray.method(concurrency_group=CONTROL)
    def reshard_ping(self) -> None:
        """The empty call (a floor for latency measurements)."""

    @ray.method(concurrency_group=CONTROL)
    def reshard_fetch(self, name: str) -> np.ndarray:
        return DeviceRole.reshard_fetch(self, name)

    @ray.method(concurrency_group=CONTROL)
    def reshard_abort_run(self, controller: str, run: str | None, drop=(), group_drops=()) -> None:
        DeviceRole.reshard_abort_run(self, controller, run, drop, group_drops)

    @ray.method(concurrency_group=CONTROL)
    def reshard_stats(self) -> dict:
        return DeviceRole.reshard_stats(self)

    @ray.method(concurrency_group=CONTROL)
    def reshard_close(self) -> None:
        DeviceRole.reshard_close(self)


def _failed_vote(votes, until: float, verify: bool) -> str | None:
    """None once every vote (a run's result ref) succeeded (with ``verify``: and every received
    slice matches what its sender read); else why not: the first that failed, or the ones that did
    not end before ``until`` (monotonic)."""
    waiting = list(votes)
    results = []
    while waiting:
        left = until - time.monotonic()
        if left <= 0:
            return f"{len(waiting)} participant(s) had not ended their run in time"
        ready, waiting = ray.wait(waiting, num_returns=1, timeout=left)
        for ref in ready:
            try:
                results.append(ray.get(ref, timeout=max(1.0, left)))
            except Exception as e:
                text = str(e).strip().splitlines()
                return text[-1] if text else type(e).__name__
    if verify:
        found = first_mismatch(dict(enumerate(r.checks for r in results)))
        if found is not None:
            return f"tensor {found[0]} step {found[1]}: a received slice differs from what its sender read"
    return None


def _check_deadline(device: int, deadline: float, what: str) -> None:
    if time.time() >= deadline:
        raise ReshardTimeout(f"device {device}: the deadline of {what} passed before it started")

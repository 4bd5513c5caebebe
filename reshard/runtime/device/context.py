"""What a device actor holds (``DeviceContext``: also what ``call(fn, ...)`` hands to ``fn``) and each
controller's part of it (``ControllerState``): the shard store, peers' mapped shards, the relay
board, communicators per controller and channel, staging, and the user-facing sharing of tensors
(``share``, ``local``, DTensor and state dicts)."""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reshard.dtypes import dtype_name
from reshard.errors import ReshardError
from reshard.ir.program import DeviceProgram
from reshard.runtime import arrays
from reshard.runtime.backends.communicator import Backend, Communicator
from reshard.runtime.device import box_copies, callers
from reshard.runtime.device.batches import PreparedBatch
from reshard.runtime.device.executor import Run, StagingBuffer, execute, prepare
from reshard.runtime.device.gpu_memory import GpuBlocks, GpuPeers
from reshard.runtime.device.group_cache import GroupCache
from reshard.runtime.device.inbox import OrderedInbox
from reshard.runtime.device.outcomes import RunOutcomes
from reshard.runtime.device.run_streams import RunStream
from reshard.runtime.device.shard_locks import ShardLocks
from reshard.runtime.device.shards import ShardStore
from reshard.runtime.device.shared_memory import PeerShards, RelayBoard, SharedShards
from reshard.runtime.device_options import DeviceOptions
from reshard.runtime.messages import Bound, Updates, group_key, held_in

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActiveRun:
    """A run in progress: its name, its groups at the generations it uses (an abort from the
    controller tears down those and no later ones), and whether the controller cancelled it."""

    run: str
    groups: tuple
    cancelled: threading.Event = field(default_factory=threading.Event)


class ControllerState:
    """What one controller has set up on this device: communicators, programs, staging."""

    def __init__(self, ctx: DeviceContext):
        self.groups = GroupCache(ctx.backend, ctx.device, ctx.options.op_timeout_s)
        self.programs: OrderedDict[int, PreparedBatch] = OrderedDict()
        self.bindings: dict[int, Bound] = {}  # the controller's mirror says which to drop
        self.staging = StagingBuffer(ctx.device_type, ctx.options.staging_keep_bytes)
        self.stream = RunStream(ctx.backend, ctx.cuda_device)  # where its runs queue GPU work
        self.active: ActiveRun | None = None  # the run in progress

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

    def __init__(self, device: int, backend: Backend, options: DeviceOptions):
        self.device = device
        self.backend = backend
        self.device_type = _device_type(options.device_type or backend.device_type)
        self.options = options
        pool_bytes = options.buffer_pool_bytes
        want_shared = options.shared_memory
        gpu = self.cuda_device
        shared: SharedShards | GpuBlocks | None = None
        if gpu is None and want_shared and SharedShards.available():
            shared = SharedShards()
        elif gpu is not None and want_shared and GpuBlocks.available():
            shared = GpuBlocks(gpu, pool_bytes)
        self.store = ShardStore(device, self.device_type, pool_bytes, shared, options.assembly_bytes)
        self.shard_locks = ShardLocks(device)  # reads of a shard wait for a write into it
        self.peers: PeerShards | GpuPeers = PeerShards(device) if gpu is None else GpuPeers(device, gpu)
        if gpu is not None:
            box_copies.load(gpu)
        cpu_shared = gpu is None and shared is not None
        self.board = RelayBoard() if cpu_shared and RelayBoard.available() else None
        self.controllers: dict[str, ControllerState] = {}
        self.inbox = OrderedInbox()
        self.before_op = None
        self.after_run = None  # a test hook: fn(runs by tensor) after a batch ran, before its checksums
        self.commit_hook = None  # a test hook: fn("before" | "after", run) around a commit's decision and copies
        self.outcomes = RunOutcomes()  # of this device's runs that wait for a commit
        self.threaded = False  # it serves calls while one runs (set when it attaches)
        self.actor: Any = None  # the actor instance this device is (its own objects: ``ctx.actor.model``)
        self._private_storages: set[int] = set()  # CPU torch storages shared in private memory (``share``)
        self.extensions: dict[str, object] = {}  # state that libraries on the runtime keep here (pipelines)
        self.peak_bytes = 0  # destination (twice if assembled) + staging bytes of the last run
        self.assembled = False  # the last run assembled its destination apart (``ShardStore``)
        self.counters = {"programs_received": 0, "runs": 0, "failed_runs": 0, "dropped_late": 0, "fetches": 0}
        self._local = threading.local()
        self._lock = threading.Lock()
        self._torch_device = None
        self.caller_check_s = options.caller_check_s
        self.watch: callers.Watch | None = None  # started by ``watch_callers`` (a device actor)

    @property
    def shared(self):
        return self.store.shared

    def memory_domain(self, node_id: str) -> str | None:
        """Which devices may pull this device's shards out of its memory: those of the same
        domain. CPU shared memory: the Ray node (``node_id``); GPU memory through CUDA IPC: the node
        and the GPU's UUID (no peer-to-peer access needed). None: no pulls."""
        if self.shared is None:
            return None
        gpu = self.cuda_device
        if gpu is None:
            return node_id
        import cupy

        uuid = cupy.cuda.runtime.getDeviceProperties(gpu)["uuid"]
        return f"{node_id}/gpu-{bytes(uuid).hex()}"

    @property
    def cuda_device(self) -> int | None:
        """This device's GPU (its CUDA ordinal in this process), None on a CPU device."""
        kind, _, index = self.device_type.partition(":")
        return int(index or 0) if kind == "cuda" else None

    @property
    def torch_device(self):
        """Where torch tensors over this device's memory live, as a ``torch.device`` (imports
        torch): the CPU, or the GPU torch sees when it looks at this device's memory (DLPack)."""
        import torch

        if self.cuda_device is None:
            return torch.device("cpu")
        if self._torch_device is None:
            self._torch_device = arrays.as_torch(self.store.allocate((1,), "uint8", shared=False), "uint8").device
        return self._torch_device

    def device_array(self, tensor):
        """The array this device's backend moves for ``tensor`` (a torch tensor on this device):
        the tensor itself on a CPU device, a cupy array over its memory on a GPU (DLPack)."""
        if self.cuda_device is None or not arrays.is_torch(tensor):
            return tensor
        return arrays.as_device(tensor)

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

    def _calling(self, what: str) -> ControllerState:
        """The state of the controller whose ``call`` runs on this thread (outside one: an error naming ``what``)."""
        cid = self.caller
        if cid is None:
            raise RuntimeError(
                f"device {self.device}: {what} uses the calling controller's state, and no controller is calling "
                "on this thread: use it inside a function run through DeviceMesh.call"
            )
        return self.controller(cid)

    # ---------------------------------------------------------------- callers

    def watch_callers(self) -> None:
        """Check the callers every ``caller_check_s`` from now on (``check_callers``)."""
        if self.watch is None:
            self.watch = callers.Watch(self.check_callers, self.caller_check_s, f"reshard-callers-{self.device}")

    def check_callers(self, idle_s: float | None = None) -> dict:
        """Free what this device keeps for controllers whose processes ended, and give back the
        staging of those idle for ``idle_s`` (default ``caller_check_s``); neither runs while a call
        of theirs runs. A controller whose calls wait for one that never came (its process died
        before Ray sent it) is forgotten too, and its waiting calls give up. Also drops mappings of
        peers' shards whose owners let go or died. Returns the controllers forgotten and the
        staging bytes freed."""
        if self.cuda_device is None:
            self.peers.purge()  # mappings of shards whose owners let go or died
        idle = self.inbox.idle(self.caller_check_s if idle_s is None else idle_s)
        stalled = self.inbox.stalled()
        known = self.inbox.callers
        gone = set(callers.ended({c: known[c] for c in (*idle, *stalled) if c in known}))
        forgotten, freed = [], 0
        for c in stalled:
            if c in gone:
                with self.inbox.reserve(c, waiting=True) as free:
                    if free:
                        self._forget(c)
                        forgotten.append(c)
        for c in idle:
            with self.inbox.reserve(c) as free:
                if not free:
                    continue
                if c in gone:
                    self._forget(c)
                    forgotten.append(c)
                elif (state := self.controllers.get(c)) is not None:
                    freed += state.staging.nbytes
                    state.staging.reserve(0)
        return {"forgotten": forgotten, "staging_freed": freed}

    def _forget(self, cid: str) -> None:
        """Drop controller ``cid``'s state (its process ended): its communicators are released off
        any peer's path (a local abort: never waits for members), its programs and staging freed,
        and the holds of its handles let go (shards only it held are dropped)."""
        with self._lock:
            state = self.controllers.pop(cid, None)
        if state is not None:
            state.groups.retire_all()
            state.staging.reserve(0)
        self.store.release_where(lambda name, holder: held_in(cid, name, holder))
        self.inbox.forget(cid, "its process ended")

    # ---------------------------------------------------------------- for functions run by ``call``

    @property
    def buffers(self) -> dict:
        """This device's shards by name, as torch tensors over their memory."""
        return {name: self.local(name) for name in list(self.store.shards)}

    def communicator(self, group, channel: str = "") -> Communicator:
        """This device's communicator for ``group`` of the calling controller (set up by
        ``reshard.runtime.ensure_groups``), connected now if needed."""
        state = self._calling("communicator()")
        key = group_key(group, channel)
        state.groups.connect([key])
        return state.groups.get(key)

    def empty_cache(self) -> int:
        """Free what this device keeps for reuse and nobody uses now: freed shards' memory, the
        assembly buffer, the calling controller's staging buffer (its runs come before and after
        this call, never during it), mappings of peers' shards their owners let go of, and on a GPU
        cupy's and torch's cached blocks. Returns the bytes freed of the first three (torch's are its own)."""
        freed = self.store.empty_cache()
        caller = self.caller
        state = None if caller is None else self.controllers.get(caller)
        if state is not None:
            freed += state.staging.nbytes
            state.staging.reserve(0)
        if self.cuda_device is None:
            self.peers.purge()
        else:
            self.peers.clear()  # close every peer block opened here: their holders may free them now
        if self.cuda_device is not None:
            import cupy

            with cupy.cuda.Device(self.cuda_device):
                cupy.get_default_memory_pool().free_all_blocks()
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
        return freed

    # ---------------------------------------------------------------- for the user's code in an attached actor

    def empty(self, shape, dtype):
        """A new torch tensor in this device's shard memory (shared memory on CPU devices, device
        memory on GPUs): keep the tensors you share in it, and peers on this machine pull from them
        without a copy."""
        name = dtype_name(dtype)
        return arrays.as_torch(self.store.allocate(tuple(shape), name), name)

    def shared_block(self, shape, dtype: str) -> tuple[np.ndarray, tuple] | None:
        """``(array, handle)``: a numpy array of ``shape`` and ``dtype`` (by name) in a block of this
        device's shared memory, which peers on this machine map read-only with ``peer_block(device,
        handle, dtype)`` and copy out of, as reshards pull shards (a pipeline lane's activations go
        so). The block lives while the array does. None where this device keeps no shared memory
        (GPU devices, meshes made with ``shared_memory=False``)."""
        if self.cuda_device is not None or self.shared is None:
            return None
        storage = arrays.storage(dtype)
        nbytes = math.prod(shape) * storage.itemsize
        flat = self.shared.allocate(max(1, nbytes))  # a block is never empty
        pid, fd, inode, _, tenure = self.shared.begin(flat)
        typed = flat[:nbytes].view(storage).reshape(tuple(shape))
        return typed, (pid, fd, inode, tuple(shape), tenure)

    def peer_block(self, holder: int, handle: tuple, dtype: str) -> np.ndarray:
        """Device ``holder``'s ``shared_block`` named by ``handle``, mapped here read-only (once)."""
        if not isinstance(self.peers, PeerShards):
            raise ReshardError(
                f"device {self.device}: peer_block maps host shared memory, which GPU devices keep none of"
            )
        return self.peers.view(holder, handle, arrays.storage(dtype))

    def share(
        self, name: str, tensor, *, shape=None, placements=None, mesh_shape=None, coordinate=None, reback: bool = False
    ) -> None:
        """Offer ``tensor`` (a torch tensor, numpy array or, on a GPU, cupy array: this device's
        shard of a sharded tensor; no copy) as shard ``name``, for ``reshard.runtime.adopt`` on the
        driver. ``shape``/``placements`` say what it is a shard of (the driver checks them against
        the layout it adopts it with); ``reshard`` may write into it in place (``out=``). Stays the
        user's: ``unshare`` takes it back.

        On a CPU device it may be a strided view, a region of a fused tensor (``qkv[:, :d]`` of a
        Conv1D's fused q, k and v): reshards write into it (``out=``, staged), never read from it.
        A region along the first dimension (``qkv[:d]`` of a Linear's) is contiguous: read and written.

        ``reback``: move a CPU torch tensor's storage into shared memory first, in place (torch's
        ``share_memory_()``: one copy, now; every view of it, a framework's own included, follows),
        so that peers on this machine map it instead of reading it by cross-memory attach. A
        tensor whose storage is shared so already (``model.share_memory()``) is mapped as well."""
        if not (arrays.is_numpy(tensor) or arrays.is_torch(tensor) or arrays.is_device(tensor)):
            raise TypeError(f"share needs a torch.Tensor or numpy array, got {type(tensor).__name__}")
        dtype = arrays.dtype_of(tensor)  # a dtype the runtime moves (TypeError naming them otherwise)
        file = None
        if arrays.is_torch(tensor) and tensor.device.type == "cpu" and self.cuda_device is None:
            file = self._shared_file(name, tensor, reback)  # it may move the memory: before any array over it
        held, where = self._held(tensor)
        if held is None or (not arrays.contiguous(tensor) and self.cuda_device is not None):
            strides = tensor.stride() if arrays.is_torch(tensor) else tensor.strides
            raise ValueError(
                f"device {self.device}: share({name!r}) needs a contiguous tensor on {self.device_type}, got one on "
                f"{where} with strides {strides}; pass a contiguous copy on {self.device_type} or allocate it with "
                "reshard_device.empty(...)"
            )
        meta = {
            "shape": None if shape is None else tuple(shape),
            "placements": placements,
            "mesh_shape": mesh_shape,
            "coordinate": coordinate,
        }
        self.store.share(name, held.view(arrays.storage(dtype)), dtype, meta, file=file)

    def _shared_file(self, name: str, tensor, reback: bool) -> tuple[int, int] | None:
        """``(descriptor, byte offset)`` of the shared-memory file under a CPU torch tensor's storage
        (torch's ``share_memory_()``, moved there now if ``reback``), or None: private memory. A
        storage is moved only before any tensor over it was shared: the arrays this device keeps of
        those would point at the memory torch lets go."""
        storage = tensor.untyped_storage()
        if not storage.is_shared() and reback:
            if storage.data_ptr() in self._private_storages:
                raise ValueError(
                    f"device {self.device}: share({name!r}, reback=True): a tensor over the same storage was shared "
                    "without reback; pass reback=True the first time (share_state_dict does it for a whole model)"
                )
            storage.share_memory_()
        if not storage.is_shared():
            self._private_storages.add(storage.data_ptr())
            return None
        return shared_file(tensor)

    def _held(self, tensor):
        """``(the array this device keeps for tensor, over its memory, or None; where it lives)``:
        a CPU device keeps numpy arrays, a GPU device cupy arrays of its own GPU (a torch tensor
        through DLPack, which cupy takes only from device memory)."""
        if self.cuda_device is None:
            if arrays.is_numpy(tensor):
                return tensor, "cpu"
            where = "cpu" if arrays.is_torch(tensor) and tensor.device.type == "cpu" else _location(tensor)
            return (arrays.as_numpy(tensor) if where == "cpu" else None), where
        if arrays.is_numpy(tensor):
            return None, "host memory"
        try:
            held = arrays.as_device(tensor) if arrays.is_torch(tensor) else tensor
        except Exception:  # not device memory cupy can see
            return None, _location(tensor)
        where = f"cuda:{held.device.id}"
        return (held if where == self.device_type else None), where

    def unshare(self, name: str) -> None:
        self.store.unshare(name)

    def local(self, name: str):
        """This device's shard ``name`` as a torch tensor over its memory (a reshard's result, or
        a shared tensor)."""
        a = self.store.get(name)
        if a is None:
            raise KeyError(f"device {self.device} holds no shard {name!r} (never shared, freed, or not resharded here)")
        return arrays.as_torch(a, self.store.dtype(name))

    def from_dtensor(self, name: str, dt, *, reback: bool = False) -> None:
        """``share`` a torch DTensor's local shard (no copy) with its placements and global shape;
        the driver's ``adopt`` checks its device mesh against the mesh it adopts it on."""
        from reshard.ir.placement import as_placement

        mesh = dt.device_mesh
        self.share(
            name,
            dt.to_local(),
            shape=tuple(dt.shape),
            placements=tuple(as_placement(p) for p in dt.placements),
            mesh_shape=tuple(mesh.shape),
            coordinate=tuple(mesh.get_coordinate() or ()),
            reback=reback,
        )

    def share_state_dict(self, state_dict, prefix: str = "", *, reback: bool = False):
        """``share`` every tensor of a state dict (nested dicts, lists and tuples too), each under
        its key (``prefix`` first, e.g. ``"policy."``): a DTensor (FSDP2's ``model.state_dict()``)
        with its placements (``from_dtensor``), a plain tensor as it is. No copy. Returns the same
        tree of names, what ``adopt`` takes on the driver. ``reback``: as ``share``'s, for each."""
        from reshard.pytree import flatten, unflatten

        def leaf(x) -> bool:
            return arrays.is_numpy(x) or hasattr(x, "untyped_storage")

        leaves, paths, treedef = flatten(state_dict, leaf)
        names = []
        for path, t in zip(paths, leaves, strict=True):
            name = f"{prefix}{path}"
            if type(t).__name__ == "DTensor":
                self.from_dtensor(name, t.detach(), reback=reback)
            else:
                self.share(name, t.detach() if hasattr(t, "detach") else t, reback=reback)
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
        return DTensor.from_local(
            local,
            device_mesh,
            placements,
            shape=torch.Size(meta["shape"]),
            stride=_stride(meta["shape"]),
            run_check=False,
        )

    def run_program(
        self,
        program: DeviceProgram,
        src,
        dst,
        *,
        dtype: str | None = None,
        timeout_s: float = 60.0,
        groups=None,
        peers=None,
    ) -> dict:
        """Run one ``DeviceProgram`` over ``src``/``dst`` tensors with the calling controller's
        communicators (or ``groups``, an object with ``get(key)``). On failure the program's groups
        are aborted and the error raised."""
        if dtype is None:
            t = src if src is not None else dst
            if t is None:
                raise ValueError("run_program needs dtype= when neither src nor dst is given")
            dtype = arrays.dtype_of(t)
        state = self._calling("run_program()")
        keys = [group_key(g) for g in program.connect]
        deadline = time.monotonic() + timeout_s
        try:
            if groups is None:
                state.groups.connect(keys, timeout_s)
                groups = state.groups.channel("")
            return ProgramRunner(self, program, dtype, groups, state.staging, state.stream)(src, dst, deadline, peers)
        except BaseException:
            state.groups.abort(keys, "its program failed")
            raise

    def runner(self, program: DeviceProgram, dtype: str, *, channel: str, staging_keep_bytes: int) -> ProgramRunner:
        """``program`` prepared once, to run many times on the calling controller's communicators
        of ``channel`` with a staging buffer of its own (a pipeline lane: one thread each)."""
        groups = self._calling("runner()").groups.channel(channel)
        staging = StagingBuffer(self.device_type, staging_keep_bytes)
        return ProgramRunner(self, program, dtype, groups, staging, RunStream(self.backend, self.cuda_device))


class ProgramRunner:
    """One ``DeviceProgram`` of this device, prepared once: ``runner(src, dst, deadline)`` runs it
    (monotonic ``deadline``) over ``src``/``dst`` tensors and returns its stats. Its buffers,
    communicators and hooks are this device's; on a GPU its work goes on ``stream`` and is done
    when it returns; the staging buffer is trimmed after each run."""

    def __init__(
        self, ctx: DeviceContext, program: DeviceProgram, dtype: str, groups, staging: StagingBuffer, stream: RunStream
    ):
        self.ctx, self.groups, self.staging, self.stream = ctx, groups, staging, stream
        self.prepared = prepare(program, dtype)

    @property
    def program(self) -> DeviceProgram:
        return self.prepared.program

    def __call__(self, src, dst, deadline: float, peers=None) -> dict:
        ctx, program = self.ctx, self.prepared.program
        try:
            with self.stream.running():
                src, dst = _on_device(ctx, src), _on_device(ctx, dst)
                self.staging.reserve(program.staging_bytes)
                tmp = ctx.store.allocate(program.src_shape, self.prepared.dtype) if program.tmp else None
                run = Run(
                    self.prepared,
                    src=src,
                    dst=dst,
                    groups=self.groups,
                    staging=self.staging,
                    deadline=deadline,
                    peers=peers,
                    tmp=tmp,
                    before_op=ctx.before_op,
                    batch=ctx.backend.batcher,
                )
                stats = execute(run)
                del run  # the scratch buffer's other reference
                self.stream.finish(deadline, f"device {ctx.device}: a program run")
                ctx.store.recycle(tmp)
            return stats
        finally:
            self.staging.trim()


def _on_device(ctx: DeviceContext, t):
    """A torch CUDA tensor the caller hands a GPU device's program, as a cupy array over its memory."""
    if t is None or ctx.cuda_device is None or not arrays.is_torch(t):
        return t
    return arrays.as_device(t)


def _torch_placement(p):
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from reshard.ir.placement import Partial as OurPartial
    from reshard.ir.placement import Shard as OurShard
    from reshard.ir.placement import StridedShard

    if isinstance(p, StridedShard):
        return _StridedShard(p.dim, split_factor=p.split_factor)
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


def _location(t) -> str:
    """Where ``t`` lives: "cpu", "cuda" (a GPU, which one left open) or "cuda:<index>"."""
    if arrays.is_numpy(t):
        return "cpu"
    if arrays.is_device(t):
        return f"cuda:{t.device.id}"
    return str(t.device)


def _device_type(kind: str) -> str:
    """ "cpu", or "cuda:<index>" of this device's GPU: the GPU the actor's torch works on where
    torch has started CUDA, else the current GPU of the attaching thread (0 under Ray's
    ``CUDA_VISIBLE_DEVICES``)."""
    if kind != "cuda":
        return kind
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return f"cuda:{int(torch.cuda.current_device())}"
    import cupy

    return f"cuda:{int(cupy.cuda.runtime.getDevice())}"


def set_torch_threads(threads: int) -> None:
    """torch's intra-op threads for this actor: now if torch is loaded, else when it is."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    else:
        os.environ["OMP_NUM_THREADS"] = str(threads)


def shared_file(tensor) -> tuple[int, int] | None:
    """``(descriptor, byte offset)`` of ``tensor`` in the shared-memory file its storage lies in
    (torch's ``share_memory_()`` made it), or None where torch keeps no descriptor of it."""
    storage = tensor.untyped_storage()
    try:
        fd, _ = storage._share_fd_cpu_()  # the descriptor torch's file_descriptor strategy keeps open
    except (RuntimeError, AttributeError):  # the file_system strategy, or a torch without it
        return None
    return int(fd), tensor.data_ptr() - storage.data_ptr()

"""ShardedTensor, distribute and reshard: the user-facing half of the runtime.

``distribute`` puts the whole array into the object store ONCE (``ray.put``); every actor reads
it zero-copy and keeps a copy of its own region. bfloat16 travels as its int16 bit pattern.
``reshard`` plans (cached), lowers and validates (cached per plan), then runs one call per
participating actor; the driver never touches tensor bytes. A ShardedTensor's shards live on its
mesh's actors under one buffer name until ``free()`` (or garbage collection of the handle).

bfloat16 and numpy: numpy has no bfloat16, so ``to_numpy()`` / ``local_shards()`` of a bfloat16
tensor raise TypeError; use ``to_torch()`` / ``local_shards(as_torch=True)``.
"""

from __future__ import annotations

import numpy as np
import ray

from reshard.dtypes import dtype_name
from reshard.errors import ReshardTimeout, WorkerDied
from reshard.layout import Layout
from reshard.planner import plan_reshard
from reshard.regions import box_volume, layout_regions
from reshard.runtime.driver import gather, runtime
from reshard.runtime.mesh import DeviceMesh

DEFAULT_TIMEOUT_S = 60.0


class ShardedTensor:
    """A tensor laid out over a DeviceMesh; its bytes live on the device actors.

    ``shape`` (tuple), ``dtype`` (canonical name, e.g. "float32"), ``layout``, ``mesh`` (the
    DeviceMesh), ``name`` (the actors' buffer name)."""

    def __init__(self, mesh: DeviceMesh, layout: Layout, shape: tuple[int, ...], dtype: str, name: str, shared=None):
        self.mesh = mesh
        self.layout = layout
        self.shape = tuple(shape)
        self.dtype = dtype
        self.name = name
        self._shared = dict(shared or {})  # device -> shared-memory descriptor of its shard
        self._freed = False

    def __repr__(self) -> str:
        state = ", freed" if self._freed else ""
        return f"ShardedTensor({self.dtype}{list(self.shape)}, {self.layout}, buffer={self.name!r}{state})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size_bytes(self) -> int:
        from reshard.dtypes import itemsize

        return box_volume(tuple((0, n) for n in self.shape)) * itemsize(self.dtype)

    @property
    def freed(self) -> bool:
        return self._freed

    def _check(self, what: str) -> None:
        if self._freed:
            raise ValueError(f"{what}: {self!r} was freed; its shards are gone")
        self.mesh.check_open()

    # ---------------------------------------------------------------- reading back

    def _fetch(self, indices, timeout_s: float) -> dict[int, np.ndarray]:
        refs = {i: self.mesh.actor(i).fetch.remote(self.name) for i in indices}
        results, errors, pending = gather(refs, timeout_s)
        rt = runtime()
        for i, (kind, err) in errors.items():
            if kind == "died":
                rt.mark_dead(self.mesh.device_ids[i], f"actor died: {err}")
        if errors:
            i, (kind, err) = min(errors.items())
            cls = WorkerDied if kind == "died" else type(err) if isinstance(err, Exception) else RuntimeError
            raise cls(f"reading {self!r} from device {self.mesh.device_ids[i]}: {err}")
        if pending:
            raise ReshardTimeout(
                f"reading {self!r}: devices at flat indices {pending} did not answer within {timeout_s:g}s"
            )
        return results

    def _assemble(self, timeout_s: float) -> np.ndarray:
        self._check("to_numpy")
        regions = layout_regions(self.layout, self.shape)
        first: dict = {}
        for i, box in enumerate(regions):
            if box_volume(box) and box not in first:
                first[box] = i
        wire = np.int16 if self.dtype == "bfloat16" else np.dtype(self.dtype)
        out = np.empty(self.shape, dtype=wire)
        shards = self._fetch(sorted(first.values()), timeout_s)
        for box, i in first.items():
            out[tuple(slice(lo, hi) for lo, hi in box)] = shards[i]
        return out

    def to_numpy(self, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> np.ndarray:
        """The full tensor, assembled on the driver (one holder per distinct region)."""
        if self.dtype == "bfloat16":
            raise TypeError(f"{self!r}: numpy has no bfloat16; use .to_torch() (or .to_torch().float().numpy())")
        return self._assemble(timeout_s)

    def to_torch(self, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        """The full tensor as a CPU torch tensor (any dtype, bfloat16 included)."""
        import torch

        out = torch.from_numpy(self._assemble(timeout_s))
        return out.view(torch.bfloat16) if self.dtype == "bfloat16" else out

    def local_shards(self, *, as_torch: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
        """``{flat device index in mesh: shard}`` as numpy arrays (torch tensors with ``as_torch``)."""
        if self.dtype == "bfloat16" and not as_torch:
            raise TypeError(f"{self!r}: numpy has no bfloat16; use .local_shards(as_torch=True)")
        self._check("local_shards")
        shards = self._fetch(range(self.mesh.size), timeout_s)
        if not as_torch:
            return {i: shards[i] for i in range(self.mesh.size)}
        import torch

        out = {}
        for i in range(self.mesh.size):
            t = torch.from_numpy(np.array(shards[i]))
            out[i] = t.view(torch.bfloat16) if self.dtype == "bfloat16" else t
        return out

    # ---------------------------------------------------------------- lifetime

    def free(self) -> None:
        """Drop the shards on every device (idempotent)."""
        if self._freed:
            return
        self._freed = True
        if ray.is_initialized():
            runtime().free(self.mesh.device_ids, self.name)

    def __del__(self):
        try:
            if not self._freed and ray.is_initialized():
                self.free()
        except Exception:  # interpreter shutdown, Ray gone: nothing to free
            pass


def _as_numpy(array) -> tuple[np.ndarray, str]:
    """(C-contiguous numpy array to ship, dtype name); bfloat16 becomes its int16 bit pattern."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a runtime dependency
        torch = None
    if torch is not None and isinstance(array, torch.Tensor):
        name = dtype_name(array.dtype)
        t = array.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if name == "bfloat16":
            t = t.view(torch.int16)
        arr = t.contiguous().numpy()
    elif isinstance(array, np.ndarray | np.generic):
        arr = np.asarray(array)
        name = dtype_name(arr.dtype)
    else:
        raise TypeError(f"distribute needs a numpy array or a torch tensor, got {type(array).__name__}")
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr).reshape(arr.shape)
    return arr, name


def distribute(array, layout: Layout, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> ShardedTensor:
    """Lay ``array`` (numpy array or CPU torch tensor) out over ``layout`` on its DeviceMesh."""
    if not isinstance(layout, Layout):
        raise TypeError(f"distribute needs a reshard.Layout, got {type(layout).__name__}")
    arr, dtype = _as_numpy(array)
    shape = tuple(arr.shape)
    layout.check_shape(shape)
    rt = runtime()
    dmesh = rt.resolve_mesh(layout.mesh, f"distribute onto {layout}")
    regions = layout_regions(layout, shape)
    name = rt.new_buffer_name()
    ref = ray.put(arr)
    refs = {i: dmesh.actor(i).load.remote(name, ref, box, dtype) for i, box in enumerate(regions)}
    results, errors, pending = gather(refs, timeout_s)
    if errors or pending:
        rt.free(dmesh.device_ids, name)
        for i, (kind, err) in errors.items():
            if kind == "died":
                rt.mark_dead(dmesh.device_ids[i], f"actor died: {err}")
        if any(kind == "died" for kind, _ in errors.values()):
            raise WorkerDied(f"distribute onto {layout}: device actor(s) died: {errors}")
        if pending:
            raise ReshardTimeout(
                f"distribute onto {layout}: devices at flat indices {pending} did not finish in {timeout_s:g}s"
            )
        raise next(iter(errors.values()))[1]
    shared = {dmesh.device_ids[i]: desc for i, desc in results.items() if desc is not None}
    return ShardedTensor(dmesh, layout, shape, dtype, name, shared)


def lowered_reshard(
    tensor: ShardedTensor, dst_layout: Layout, *, strategy: str = "auto", cluster=None, shared_memory: bool = True
):
    """What ``reshard(tensor, tensor.mesh, dst_layout, ...)`` runs: the ``Lowered`` program (plan,
    per-device programs with their PULL ops, groups), planned and cached as ``reshard`` does.

    Plans are made for ``cluster`` (a ``topology.Cluster``); by default for the meshes' hosts with
    the live Ray cluster's figures and the meshes' backend (``Runtime.planning_cluster``), where
    the devices of one machine count as one host when they share memory (their transfers become
    pulls, ``reshard.pulls``). ``shared_memory=False``: no pulls, everything through the backend."""
    return _prepare(tensor, dst_layout, strategy, cluster, shared_memory)[1]


def _prepare(tensor: ShardedTensor, dst_layout: Layout, strategy: str, cluster, shared_memory: bool):
    """(destination DeviceMesh, Lowered program) of a reshard."""
    rt = runtime()
    dmesh = rt.resolve_mesh(dst_layout.mesh, f"reshard destination {dst_layout}")
    if dmesh.backend != tensor.mesh.backend:
        raise ValueError(
            f"reshard from a {tensor.mesh.backend} mesh to a {dmesh.backend} mesh: both meshes must use one backend"
        )
    domain_of = rt.memory_domains(tensor.mesh, dmesh, tensor._shared) if shared_memory else {}
    src_l, dst_l = tensor.layout, dst_layout
    if cluster is None:
        src_l, dst_l = rt.planning_layouts(src_l, dst_l, domain_of)
        cluster = rt.planning_cluster(dmesh.backend, src_l.mesh, dst_l.mesh)
    plan = plan_reshard(tensor.shape, tensor.dtype, src_l, dst_l, strategy=strategy, cluster=cluster)
    return dmesh, rt.lower(plan, cluster, domain_of)


def reshard(
    tensor: ShardedTensor, src_mesh: DeviceMesh, dst_layout: Layout, *, strategy: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S, cluster=None, shared_memory: bool = True,
) -> ShardedTensor:  # fmt: skip
    """Move ``tensor`` (on ``src_mesh``, its own mesh) to ``dst_layout`` (on a DeviceMesh).

    Planning: see ``lowered_reshard`` (``cluster`` overrides the cost model "auto" plans for).
    Slices between actors of one machine are pulled through shared memory (see
    ``DeviceMesh``); ``shared_memory=False`` sends everything through the backend instead.

    Returns a new ShardedTensor; the source stays intact. Raises ValueError/TypeError for misuse,
    ``WorkerDied`` / ``ReshardTimeout`` / ``ReshardError`` if the run fails (within about
    ``timeout_s``), ``MeshClosed`` for a shut-down mesh."""
    if not isinstance(tensor, ShardedTensor):
        raise TypeError(f"reshard needs a ShardedTensor (from distribute or reshard), got {type(tensor).__name__}")
    if not isinstance(src_mesh, DeviceMesh):
        raise TypeError(f"src_mesh must be a DeviceMesh, got {type(src_mesh).__name__}")
    if not isinstance(dst_layout, Layout):
        raise TypeError(f"dst_layout must be a reshard.Layout, got {type(dst_layout).__name__}")
    if not (isinstance(timeout_s, int | float) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if src_mesh is not tensor.mesh and src_mesh.mesh != tensor.mesh.mesh:
        raise ValueError(
            f"src_mesh {src_mesh!r} is not the mesh of the tensor, which lives on {tensor.mesh!r}; "
            "pass tensor.mesh as src_mesh"
        )
    tensor._check("reshard source")
    dmesh, lowered = _prepare(tensor, dst_layout, strategy, cluster, shared_memory)
    rt = runtime()
    name = rt.new_buffer_name()
    what = f"reshard {tensor.dtype}{list(tensor.shape)} {tensor.layout} -> {dst_layout} (strategy {strategy!r})"
    results = rt.execute(lowered, tensor.name, name, float(timeout_s), what, tensor._shared)
    shared = {d: r[4] for d, r in results.items() if r[4] is not None}
    return ShardedTensor(dmesh, dst_layout, tensor.shape, tensor.dtype, name, shared)

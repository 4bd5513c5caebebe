"""ShardedTensor, distribute and reshard: the user-facing half of the runtime.

``distribute`` puts the whole array into the object store ONCE (``ray.put``); every actor reads it
zero-copy and keeps a copy of its own region. bfloat16 travels as its int16 bit pattern.
``reshard`` compiles the move (``reshard.compile``: plan, lower, pulls, sequencing, validation;
cached) and runs it: one ordered call per participating actor; the controller never touches tensor
bytes.

Ownership: a shard lives while some handle holds it (``reshard.runtime.shards``). The handle
``distribute``/``reshard`` return holds it, and so does every copy of it (pickled into a Ray task
or actor of the job, ``copy.deepcopy``); each lets go when garbage-collected. ``free()`` drops the
shards at once for every handle.

Timeouts: ``timeout_s`` is a positive finite number of seconds, or None for no limit; every wait
ends by then. bfloat16 and numpy: numpy has no bfloat16, so ``to_numpy()`` / ``local_shards()``
of a bfloat16 tensor raise TypeError; use ``to_torch()`` / ``local_shards(as_torch=True)``.
"""

from __future__ import annotations

import math
import time
import uuid

import numpy as np
import ray

from reshard.compile import CompiledReshard, CompileOptions, compile_reshard, planning_hosts
from reshard.dtypes import dtype_name, itemsize
from reshard.layout import Layout
from reshard.regions import box_volume, layout_regions
from reshard.runtime.backends import backend_spec
from reshard.runtime.dispatch import failure_error
from reshard.runtime.driver import INTACT, runtime
from reshard.runtime.mesh import DeviceMesh
from reshard.sequencing import window_ops_for
from topology.mesh import device_hosts

DEFAULT_TIMEOUT_S = 60.0


def check_timeout(timeout_s) -> float | None:
    """``timeout_s`` validated: a positive finite number, or None (no limit)."""
    if timeout_s is None:
        return None
    if not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool) or not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a positive finite number of seconds or None (no limit), got {timeout_s!r}")
    return float(timeout_s)


def deadline_of(timeout_s: float | None) -> float:
    return math.inf if timeout_s is None else time.monotonic() + timeout_s


class ShardedTensor:
    """A tensor laid out over a DeviceMesh; its bytes live on the device actors.

    ``shape`` (tuple), ``dtype`` (numpy dtype; ``dtype_name`` the canonical name, ``torch_dtype``
    torch's), ``layout``, ``mesh`` (the DeviceMesh), ``name`` (the actors' shard name). DTensor's
    vocabulary: ``placements``, ``device_mesh``, ``full_tensor()``. Reading it back is explicit
    (``full_tensor``, ``to_numpy``, ``to_torch``, ``local_shards``): ``np.asarray`` of a handle is
    refused rather than silently making an object array."""

    def __init__(self, mesh: DeviceMesh, layout: Layout, shape, dtype: str, name: str, shared=None, holder=None):
        self.mesh = mesh
        self.layout = layout
        self.shape = tuple(shape)
        self.dtype_name = dtype
        self.name = name
        self._shared = dict(shared or {})  # device -> shared-memory descriptor of its shard
        self._holder = name if holder is None else holder
        self._freed = False

    def __repr__(self) -> str:
        state = ", freed" if self._freed else ""
        return f"ShardedTensor({self.dtype_name}{list(self.shape)}, {self.layout}, shard={self.name!r}{state})"

    def __reduce__(self):
        """A copy holds the shards under a token until it is unpickled (module docstring)."""
        self._check("pickling")
        token = f"{self.name}/pickled/{uuid.uuid4().hex[:12]}"
        runtime().hold_later(True, self.mesh.device_ids, self.name, token)
        return _rebuild, (self.mesh, self.layout, self.shape, self.dtype_name, self.name, self._shared, token)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype (bfloat16: ``ml_dtypes.bfloat16`` when installed; ``torch_dtype`` always works)."""
        if self.dtype_name != "bfloat16":
            return np.dtype(self.dtype_name)
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(
                f"{self!r}: numpy has no bfloat16 (install ml_dtypes); use .torch_dtype or .dtype_name"
            ) from None
        return np.dtype(ml_dtypes.bfloat16)

    @property
    def torch_dtype(self):
        from reshard.runtime.arrays import torch_dtype

        return torch_dtype(self.dtype_name)

    @property
    def placements(self) -> tuple:
        """One placement per mesh axis (DTensor's name for ``layout.placements``)."""
        return self.layout.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        """The DeviceMesh the shards live on (DTensor's name)."""
        return self.mesh

    def full_tensor(self, *, timeout_s: float | None = DEFAULT_TIMEOUT_S):
        """The whole tensor gathered here as a torch tensor (DTensor's ``full_tensor``)."""
        return self.to_torch(timeout_s=timeout_s)

    def __array__(self, *args, **kwargs):
        raise TypeError(
            f"{self!r} lives on its device actors; gather it explicitly with .full_tensor() (torch) or .to_numpy()"
        )

    @property
    def size_bytes(self) -> int:
        return box_volume(tuple((0, n) for n in self.shape)) * itemsize(self.dtype_name)

    @property
    def freed(self) -> bool:
        return self._freed

    def _check(self, what: str) -> None:
        if self._freed:
            raise ValueError(f"{what}: {self!r} was freed; its shards are gone")
        self.mesh.check_open()

    # ---------------------------------------------------------------- reading back

    def _fetch(self, indices, timeout_s: float | None) -> dict[int, np.ndarray]:
        rt = runtime()
        ids = {i: self.mesh.device_ids[i] for i in indices}
        refs = {ids[i]: self.mesh.actor(i).reshard_fetch.remote(self.name) for i in indices}
        outcome = rt.wait(refs, deadline_of(timeout_s), "reading a tensor back")
        if not outcome.ok:
            gone = [d for d, f in outcome.failures.items() if isinstance(f.error, KeyError)]
            if gone and not outcome.died:
                raise ValueError(f"reading {self!r}: its shards are gone on devices {gone} (freed by another handle?)")
            raise failure_error(outcome, f"reading {self!r}", timeout_s)
        return {i: outcome.results[ids[i]] for i in indices}

    def _assemble(self, timeout_s: float | None) -> np.ndarray:
        self._check("to_numpy")
        regions = layout_regions(self.layout, self.shape)
        first: dict = {}
        for i, box in enumerate(regions):
            if box_volume(box) and box not in first:
                first[box] = i
        wire = np.int16 if self.dtype_name == "bfloat16" else np.dtype(self.dtype_name)
        out = np.empty(self.shape, dtype=wire)
        shards = self._fetch(sorted(first.values()), check_timeout(timeout_s))
        for box, i in first.items():
            out[tuple(slice(lo, hi) for lo, hi in box)] = shards[i]
        return out

    def to_numpy(self, *, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> np.ndarray:
        """The full tensor, assembled here (one holder per distinct region)."""
        if self.dtype_name == "bfloat16":
            raise TypeError(f"{self!r}: numpy has no bfloat16; use .to_torch() (or .to_torch().float().numpy())")
        return self._assemble(timeout_s)

    def to_torch(self, *, timeout_s: float | None = DEFAULT_TIMEOUT_S):
        """The full tensor as a CPU torch tensor (any dtype, bfloat16 included)."""
        import torch

        out = torch.from_numpy(self._assemble(timeout_s))
        return out.view(torch.bfloat16) if self.dtype_name == "bfloat16" else out

    def local_shards(self, *, as_torch: bool = False, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> dict:
        """``{flat device index in mesh: shard}`` as numpy arrays (torch tensors with ``as_torch``)."""
        if self.dtype_name == "bfloat16" and not as_torch:
            raise TypeError(f"{self!r}: numpy has no bfloat16; use .local_shards(as_torch=True)")
        self._check("local_shards")
        shards = self._fetch(range(self.mesh.size), check_timeout(timeout_s))
        if not as_torch:
            return {i: shards[i] for i in range(self.mesh.size)}
        import torch

        out = {}
        for i in range(self.mesh.size):
            t = torch.from_numpy(np.array(shards[i]))
            out[i] = t.view(torch.bfloat16) if self.dtype_name == "bfloat16" else t
        return out

    # ---------------------------------------------------------------- lifetime

    def free(self) -> None:
        """Drop the shards on every device, for every handle (idempotent). ``MeshClosed`` when the
        Ray session the tensor lived in is gone (its shards went with it)."""
        if self._freed:
            return
        self._freed = True
        runtime().registry.check_session(self.mesh.device_ids, f"freeing {self!r}")
        runtime().free(self.mesh.device_ids, self.name)

    def __del__(self):
        try:
            if not self._freed and ray.is_initialized():
                self._freed = True
                runtime().hold_later(False, self.mesh.device_ids, self.name, self._holder)
        except Exception:  # interpreter shutdown, Ray gone: nothing to release
            pass


def _rebuild(mesh, layout, shape, dtype, name, shared, token) -> ShardedTensor:
    holder = f"{name}/copy/{uuid.uuid4().hex[:12]}"
    rt = runtime()
    rt.acquire(mesh.device_ids, name, holder)
    rt.release(mesh.device_ids, name, token)
    return ShardedTensor(mesh, layout, shape, dtype, name, shared, holder)


def _as_numpy(array) -> tuple[np.ndarray, str]:
    """(C-contiguous numpy array to ship, dtype name); bfloat16 becomes its int16 bit pattern."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a runtime dependency
        torch = None
    if torch is not None and isinstance(array, torch.Tensor):
        name = dtype_name(array.dtype)
        if array.layout != torch.strided:
            raise TypeError(f"distribute needs a dense tensor, got a {array.layout} one; call .to_dense() first")
        if array.device.type == "meta":
            raise TypeError("distribute needs a tensor with data, got one on the meta device")
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


def distribute(array, layout: Layout, *, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> ShardedTensor:
    """Lay a tensor out over ``layout`` on its DeviceMesh.

    ``array``: the whole tensor (numpy array or CPU torch tensor); on a layout with Partial axes the
    devices at coordinate 0 of those axes hold it and the others zeros. Or every device's own shard:
    a dict ``{flat device index: array}`` or a list in flat device order (each of the shape the
    layout gives the device; on Partial axes, each device's contribution); the tensor's shape is
    inferred from them."""
    if not isinstance(layout, Layout):
        raise TypeError(f"distribute needs a reshard.Layout, got {type(layout).__name__}")
    timeout_s = check_timeout(timeout_s)
    rt = runtime()
    dmesh = rt.registry.resolve_mesh(layout.mesh, f"distribute onto {layout}")
    if isinstance(array, dict | list | tuple):
        shards, dtype, shape = _local_shards(array, layout)
        layout = layout.for_shape(shape)
        loads = {i: (ray.put(a), tuple((0, n) for n in a.shape)) for i, a in enumerate(shards)}
    else:
        arr, dtype = _as_numpy(array)
        shape = tuple(arr.shape)
        layout = layout.for_shape(shape)
        ref = ray.put(arr)
        zeros = ray.put(None)
        loads = {
            i: (zeros if any(layout.contribution(i)) else ref, box)
            for i, box in enumerate(layout_regions(layout, shape))
        }
    name = rt.new_name()
    deadline = deadline_of(timeout_s)
    wall = time.time() + (deadline - time.monotonic())
    refs = {}
    with rt.lock:
        for i, rec in enumerate(dmesh.records):
            src, box = loads[i]
            refs[rec.id] = rt.submit(
                rec,
                lambda t, rec=rec, src=src, box=box: rec.actor.reshard_load.remote(
                    t, name, name, src, box, dtype, wall
                ),
            )
    try:
        outcome = rt.wait(refs, deadline, f"distribute onto {layout}")
    except BaseException:
        rt.abandon(refs, name, (), None, _pending(refs))
        raise
    if not outcome.ok:
        rt.abandon(refs, name, (), None, outcome)
        raise failure_error(outcome, f"distribute onto {layout}", timeout_s, tail="Nothing was kept.")
    shared = {d: desc for d, desc in outcome.results.items() if desc is not None}
    return ShardedTensor(dmesh, layout, shape, dtype, name, shared)


def _local_shards(given, layout: Layout) -> tuple[list[np.ndarray], str, tuple[int, ...]]:
    """Every device's shard (numpy, C-contiguous) in flat order, their dtype and the tensor's shape
    (inferred, then each shard checked against the shape the layout gives its device)."""
    size = layout.mesh.size
    if isinstance(given, dict):
        missing = sorted(set(range(size)) - set(given))
        extra = sorted(set(given) - set(range(size)))
        if missing or extra:
            raise ValueError(
                f"distribute onto {layout}: local shards need exactly the flat device indices 0..{size - 1}; "
                f"missing {missing}, unknown {extra}"
            )
        given = [given[i] for i in range(size)]
    if len(given) != size:
        raise ValueError(f"distribute onto {layout}: {len(given)} local shards for a mesh of {size} devices")
    shards, dtypes = zip(*(_as_numpy(a) for a in given), strict=True)
    if len(set(dtypes)) > 1:
        raise TypeError(f"distribute onto {layout}: local shards of different dtypes {sorted(set(dtypes))}")
    shape = _infer_shape(layout, [a.shape for a in shards], f"distribute onto {layout}")
    return list(shards), dtypes[0], shape


def _pending(refs):
    from reshard.runtime.dispatch import Outcome

    return Outcome(pending=sorted(refs))


def compile_options(backend: str) -> CompileOptions:
    """How programs are sequenced for a backend's devices (GPUs copy on their streams; messages go
    in windows of ``window_ops_for(backend)``)."""
    window = window_ops_for(backend)
    if backend_spec(backend).device_type != "cpu":
        return CompileOptions(overlap_copy_bytes=None, window_ops=window)
    return CompileOptions(window_ops=window)


def lowered_reshard(
    tensor: ShardedTensor, dst_layout: Layout, *, strategy: str = "auto", cluster=None, shared_memory: bool = True
) -> CompiledReshard:
    """What ``reshard(tensor, tensor.mesh, dst_layout, ...)`` runs: its ``CompiledReshard`` (plan,
    validated per-device programs with their pulls, groups, encoded blobs), compiled and cached as
    ``reshard`` does.

    Plans are made for ``cluster`` (a ``topology.Cluster``); by default for the meshes' hosts with
    the live Ray cluster's figures and the meshes' backend (``Runtime.planning_cluster``), where
    the devices of one machine count as one host when they share memory (their transfers become
    pulls, ``reshard.pulls``). ``shared_memory=False``: no pulls, everything through the backend."""
    return _compile(tensor, dst_layout, strategy, cluster, shared_memory)[1]


def _compile(tensor: ShardedTensor, dst_layout: Layout, strategy: str, cluster, shared_memory: bool, direct_out=None):
    rt = runtime()
    dmesh = rt.registry.resolve_mesh(dst_layout.mesh, f"reshard destination {dst_layout}")
    if dmesh.backend != tensor.mesh.backend:
        raise ValueError(
            f"reshard from a {tensor.mesh.backend} mesh to a {dmesh.backend} mesh: both meshes must use one backend"
        )
    domains = memory_domains(tensor, dmesh) if shared_memory else {}
    publishers = relay_publishers(dmesh, domains, direct_out)
    if cluster is None:
        hosts = planning_hosts(tensor.layout, dst_layout, domains) or device_hosts(tensor.layout.mesh, dst_layout.mesh)
        cluster = rt.planning_cluster(dmesh.backend, hosts)
    compiled = compile_reshard(
        tensor.shape, tensor.dtype_name, tensor.layout, dst_layout, strategy=strategy, cluster=cluster, domains=domains,
        publishers=publishers, options=compile_options(dmesh.backend),
    )  # fmt: skip
    return dmesh, compiled


def memory_domains(tensor: ShardedTensor, dst_mesh: DeviceMesh) -> dict:
    """``{device: Ray node}`` of the devices that may take part in pulls: devices that keep their
    shards in shared memory, and of the source devices only those whose shard is in it."""
    out = {}
    src_devices = set(tensor.mesh.device_ids)
    for rec in (*tensor.mesh.records, *dst_mesh.records):
        if rec.shared_memory and (rec.id in tensor._shared or rec.id not in src_devices):
            out[rec.id] = rec.node_id
    return out


def relay_publishers(dst_mesh: DeviceMesh, domains: dict, direct_out: ShardedTensor | None) -> frozenset[int]:
    """The destination devices whose peers may pull relays out of their destination shard: those
    that share memory and have a relay board; writing ``direct`` into ``direct_out``, only those
    whose shard of it is in shared memory."""
    return frozenset(
        r.id
        for r in dst_mesh.records
        if r.id in domains and r.board is not None and (direct_out is None or r.id in direct_out._shared)
    )


def reshard(
    tensor: ShardedTensor, src_mesh: DeviceMesh, dst_layout: Layout, *, strategy: str = "auto",
    timeout_s: float | None = DEFAULT_TIMEOUT_S, cluster=None, shared_memory: bool = True,
    out: ShardedTensor | None = None, direct: bool = False,
) -> ShardedTensor:  # fmt: skip
    """Move ``tensor`` (on ``src_mesh``, its own mesh) to ``dst_layout`` (on a DeviceMesh).

    Planning: see ``lowered_reshard`` (``cluster`` overrides the cost model "auto" plans for).
    Slices between actors of one machine are pulled through shared memory (see ``DeviceMesh``);
    ``shared_memory=False`` sends everything through the backend instead.

    ``out``: write the result into these existing shards (``adopt``ed tensors of the destination
    actors, e.g. inference weights) and return ``out``. By default the result is staged and then
    copied into ``out`` once every device has it, so a failed reshard leaves ``out`` untouched;
    ``direct=True`` writes straight into ``out`` (no extra copy) and a failure leaves it partly
    written.

    Returns a new ShardedTensor (or ``out``); the source stays intact. Raises ValueError/TypeError
    for misuse, ``WorkerDied`` / ``ReshardTimeout`` / ``ReshardError`` if the run fails (within
    ``timeout_s`` plus a bounded cleanup), ``MeshClosed`` for a shut-down mesh or a Ray session
    that is gone."""
    if not isinstance(tensor, ShardedTensor):
        raise TypeError(f"reshard needs a ShardedTensor (from distribute or reshard), got {type(tensor).__name__}")
    if not isinstance(src_mesh, DeviceMesh):
        raise TypeError(f"src_mesh must be a DeviceMesh, got {type(src_mesh).__name__}")
    if not isinstance(dst_layout, Layout):
        raise TypeError(f"dst_layout must be a reshard.Layout, got {type(dst_layout).__name__}")
    timeout_s = check_timeout(timeout_s)
    if src_mesh is not tensor.mesh and src_mesh.mesh != tensor.mesh.mesh:
        raise ValueError(
            f"src_mesh {src_mesh!r} is not the mesh of the tensor, which lives on {tensor.mesh!r}; "
            "pass tensor.mesh as src_mesh"
        )
    tensor._check("reshard source")
    dst_layout.check_shape(tensor.shape)
    dst_layout = dst_layout.for_shape(tensor.shape)
    if out is not None:
        _check_out(out, tensor, dst_layout)
    elif direct:
        raise ValueError("direct=True writes into existing shards: pass them as out=")
    deadline = deadline_of(timeout_s)
    dmesh, compiled = _compile(tensor, dst_layout, strategy, cluster, shared_memory, out if direct else None)
    rt = runtime()
    name = rt.new_name()
    what = f"reshard {tensor.dtype_name}{list(tensor.shape)} {tensor.layout} -> {dst_layout} (strategy {strategy!r})"
    meta = _meta(dst_layout, tensor.shape)
    results = rt.execute(compiled, tensor.name, name, deadline, what, timeout_s, tensor._shared,
                         out=None if out is None else out.name, direct=direct, meta=meta)  # fmt: skip
    if out is None:
        shared = {d: r.descriptor for d, r in results.items() if r.descriptor is not None}
        return ShardedTensor(dmesh, dst_layout, tensor.shape, tensor.dtype_name, name, shared)
    if not direct:
        _commit(rt, dmesh, name, out, deadline, timeout_s, what)
    return out


def _check_out(out, tensor: ShardedTensor, layout: Layout) -> None:
    if not isinstance(out, ShardedTensor):
        raise TypeError(f"out must be a ShardedTensor (adopt() the destination's tensors), got {type(out).__name__}")
    out._check("reshard output")
    if out.layout.mesh != layout.mesh or out.layout.for_shape(out.shape) != layout:
        raise ValueError(f"out is laid out {out.layout}, the reshard produces {layout}; adopt it with that layout")
    if out.shape != tensor.shape or out.dtype_name != tensor.dtype_name:
        raise ValueError(
            f"out is {out.dtype_name}{list(out.shape)} but the reshard moves {tensor.dtype_name}{list(tensor.shape)}"
        )


def _meta(layout: Layout, shape) -> dict:
    """Per destination device, what its shard is a shard of (kept with the shard, for to_dtensor)."""
    return {
        d: {"shape": tuple(shape), "placements": layout.placements, "mesh_shape": layout.mesh.shape,
            "coordinate": layout.mesh.coords(flat)}
        for flat, d in enumerate(layout.mesh.device_ids)
    }  # fmt: skip


def _commit(rt, dmesh: DeviceMesh, staged: str, out: ShardedTensor, deadline: float, timeout_s, what: str) -> None:
    """Copy the staged result into ``out`` on every destination device (the second phase)."""
    wall = time.time() + (deadline - time.monotonic())
    refs = {}
    with rt.lock:
        for rec in dmesh.records:
            refs[rec.id] = rt.submit(rec, lambda t, rec=rec: rec.actor.reshard_commit.remote(t, staged, out.name, wall))
    outcome = rt.wait(refs, deadline, f"{what}: committing into {out.name}")
    if not outcome.ok:
        rt.free(dmesh.device_ids, staged)
        raise failure_error(
            outcome, f"{what}: committing into {out!r}", timeout_s,
            tail="Devices that did not fail hold the new values in out; the others may hold old or partial ones.",
        )  # fmt: skip


def adopt(layout, name: str, *, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> ShardedTensor:
    """A handle on tensors the devices' own code shared as ``name`` (``DeviceContext.share`` /
    ``from_dtensor`` inside attached actors), laid out as ``layout`` (a Layout, or the DeviceMesh
    when every device shared its placements, e.g. from a DTensor). The global shape is inferred
    from the shards and checked against what each device said; nothing is copied. Dropping the
    handle leaves the user's tensors where they are."""
    mesh = layout if isinstance(layout, DeviceMesh) else None
    timeout_s = check_timeout(timeout_s)
    rt = runtime()
    dmesh = mesh if mesh is not None else rt.registry.resolve_mesh(layout.mesh, f"adopt {name!r}")
    dmesh.check_open()
    deadline = deadline_of(timeout_s)
    wall = time.time() + (deadline - time.monotonic())
    refs = {}
    with rt.lock:
        for rec in dmesh.records:
            refs[rec.id] = rt.submit(rec, lambda t, rec=rec: rec.actor.reshard_describe.remote(t, name, wall))
    outcome = rt.wait(refs, deadline, f"adopt {name!r}")
    if not outcome.ok:
        raise failure_error(outcome, f"adopt {name!r} on {dmesh!r}", timeout_s)
    infos = [outcome.results[d] for d in dmesh.device_ids]
    if mesh is not None:
        said = {tuple(i.get("placements") or ()) for i in infos}
        if len(said) != 1 or not next(iter(said)):
            raise ValueError(
                f"adopt {name!r}: the devices did not all share their placements ({sorted(map(str, said))}); "
                "pass a Layout"
            )
        layout = Layout(dmesh, next(iter(said)))
    dtypes = {i["dtype"] for i in infos}
    if len(dtypes) > 1:
        raise TypeError(f"adopt {name!r}: the devices' shards have different dtypes {sorted(dtypes)}")
    shape = _infer_shape(layout, [i["local_shape"] for i in infos], f"adopt {name!r} as {layout}")
    for flat, i in enumerate(infos):
        if i.get("shape") is not None and i.get("placements") is not None:
            if tuple(i["shape"]) != shape or Layout(dmesh, i["placements"]).for_shape(shape) != layout.for_shape(shape):
                raise ValueError(
                    f"adopt {name!r}: flat device {flat} shared a shard of {tuple(i['shape'])} laid out "
                    f"{tuple(map(str, i['placements']))}, not of {shape} laid out {layout}"
                )
        if i.get("mesh_shape") and tuple(i["mesh_shape"]) != dmesh.shape:
            raise ValueError(
                f"adopt {name!r}: flat device {flat} shared a DTensor of a device mesh of shape {i['mesh_shape']}, "
                f"but this DeviceMesh has shape {dmesh.shape}; build the DeviceMesh like the DTensor's"
            )
        if i.get("coordinate") and tuple(i["coordinate"]) != dmesh.mesh.coords(flat):
            raise ValueError(
                f"adopt {name!r}: flat device {flat} sits at {dmesh.mesh.coords(flat)} in this mesh but at "
                f"{tuple(i['coordinate'])} in its DTensor's device mesh; order the actors like the DTensor's ranks"
            )
    shared = {d: i["descriptor"] for d, i in zip(dmesh.device_ids, infos, strict=True) if i["descriptor"] is not None}
    holder = f"{name}/adopted/{uuid.uuid4().hex[:12]}"
    rt.acquire(dmesh.device_ids, name, holder)
    return ShardedTensor(dmesh, layout.for_shape(shape), shape, dtypes.pop(), name, shared, holder)


def _infer_shape(layout: Layout, shapes, what: str) -> tuple[int, ...]:
    """The global shape of shards ``shapes`` (flat device order) laid out as ``layout``, checked."""
    ndims = {len(s) for s in shapes}
    if len(ndims) != 1:
        raise ValueError(f"{what}: shards of different ranks {sorted(ndims)}")
    ndim = ndims.pop()
    norm = layout.for_shape((0,) * ndim)
    shape = []
    for dim in range(ndim):
        axes = norm.sharded_axes(dim)
        seen: dict[tuple[int, ...], int] = {}
        for flat, s in enumerate(shapes):
            coords = layout.mesh.coords(flat)
            seen.setdefault(tuple(coords[x] for x in axes), s[dim])
        shape.append(sum(seen.values()))
    shape = tuple(shape)
    for flat, (s, box) in enumerate(zip(shapes, layout_regions(norm, shape), strict=True)):
        want = tuple(hi - lo for lo, hi in box)
        if tuple(s) != want:
            raise ValueError(
                f"{what}: the shard of flat device {flat} has shape {tuple(s)}, but a tensor of shape {shape} in this "
                f"layout gives that device {want}"
            )
    return shape


__all__ = ["INTACT", "ShardedTensor", "adopt", "distribute", "lowered_reshard", "reshard"]

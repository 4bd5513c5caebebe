"""reshard: move one tensor, or a whole tree of them (a model's state dict), to new layouts.

Every call is one compiled reshard (``reshard.passes.compile.compile_batch``): the tree's tensors are
compiled together, their small messages packed into buckets, planned once per tree signature and
replayed; the controller makes one ordered call per participating device (and, writing into users'
tensors, one commit call behind it), whatever the number of tensors. ``async_op=True`` returns a
``Work`` at once (``reshard.runtime.driver.work``).
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from reshard.dtypes import cast_name
from reshard.errors import ReshardError
from reshard.ir.layout import Layout
from reshard.ir.target import CompileTarget
from reshard.passes.compile import (
    BatchItem,
    CompiledBatch,
    CompiledReshard,
    CompileOptions,
    compile_batch,
    domain_hosts,
)
from reshard.pytree import flatten, per_leaf, unflatten
from reshard.runtime.backends.registry import backend_spec
from reshard.runtime.checksums import first_mismatch
from reshard.runtime.deadlines import DEFAULT_TIMEOUT_S, Deadline, check_timeout
from reshard.runtime.driver.batches import Sources
from reshard.runtime.driver.mesh import DeviceMesh, resolve_mesh
from reshard.runtime.driver.signed import Signed
from reshard.runtime.driver.tensor import _FREED, _MESH, _NAME, Frees, ShardedTensor
from reshard.runtime.driver.unit_descriptors import UnitDescriptors
from reshard.runtime.gc_paused import gc_paused
from reshard.runtime.messages import maps_shared, shard_names
from reshard.scaling import Scaled
from topology.mesh import device_hosts


def compile_target(backend: str) -> CompileTarget:
    """What a backend's devices are compiled for (``reshard.ir.target``)."""
    return backend_spec(backend).compile_target(backend)


def compile_options(backend: str) -> CompileOptions:
    """How programs are sequenced for a backend's devices (``CompileOptions.for_target``)."""
    return CompileOptions.for_target(compile_target(backend))


def memory_domains(tensor: ShardedTensor, dst_mesh: DeviceMesh) -> dict[int, str]:
    """``{device: memory domain}`` of the devices that may take part in pulls: devices that keep
    their shards where peers read them (shared memory on a node, GPU memory through CUDA IPC on one
    GPU), and of the source devices only those whose shard is there."""
    out = {}
    src_devices = set(tensor.mesh.device_ids)
    for rec in (*tensor.mesh.records, *dst_mesh.records):
        if rec.memory_domain is not None and (rec.id in tensor._shared or rec.id not in src_devices):
            out[rec.id] = rec.memory_domain
    return out


def relay_publishers(dst_mesh: DeviceMesh, domains, direct_out: ShardedTensor | None) -> frozenset[int]:
    """The destination devices whose peers may pull relays out of their destination shard: those
    that share memory and have a relay board; writing ``direct`` into ``direct_out``, only those
    whose shard of it is in shared memory (not one peers only read: ``CROSS_MEMORY``)."""
    shared = {d for d, _ in domains}
    return frozenset(
        r.id
        for r in dst_mesh.records
        if r.id in shared and r.board is not None and (direct_out is None or maps_shared(direct_out._shared.get(r.id)))
    )


class _Call:
    """One reshard call's tensors, checked, with what compiling and running them needs (``derived``:
    what is worked out from them once, ``_derived``)."""

    def __init__(self, tensors, src_mesh, dst_layouts, out, direct: bool, dtype=None):
        self.derived: dict = {}
        if not isinstance(src_mesh, DeviceMesh):
            raise TypeError(f"src_mesh must be a DeviceMesh, got {type(src_mesh).__name__}")
        self.single = isinstance(tensors, ShardedTensor)
        self.leaves, self.paths, self.treedef = _flatten_tensors(tensors)
        self.shapes = list(map(_SHAPE, self.leaves))
        self.layouts = _layouts(dst_layouts, self.leaves, self.paths, self.treedef, self.single, self.shapes)
        self.outs = None if out is None else _outs(out, self.treedef, self.single, len(self.leaves))
        self.dtypes, self.scalings = _dtypes(dtype, self.leaves, self.paths, self.treedef)
        if direct and out is None:
            raise ValueError("direct=True writes into existing shards: pass them as out=")
        if set(map(id, map(_MESH, self.leaves))) != {id(src_mesh)} or any(map(_FREED, self.leaves)):
            for path, t in zip(self.paths, self.leaves, strict=True):  # which, and how
                if t.mesh is not src_mesh and t.mesh.mesh != src_mesh.mesh:
                    raise ValueError(
                        f"src_mesh {src_mesh!r} is not the mesh of {_at(path)}{t!r}, which lives on {t.mesh!r}; "
                        "pass tensor.mesh as src_mesh (the tensors of one call share their source mesh)"
                    )
                if t._freed:
                    raise ValueError(f"reshard source {_at(path)}{t!r} was freed; its shards are gone")
        src_mesh.check_open()
        meshes = {}
        layout_meshes = list(map(_MESH, self.layouts))
        by_id: dict[int, DeviceMesh] = {}  # a tree's layouts share a few mesh objects: looked up once each
        for key, layout in dict(zip(map(id, layout_meshes), self.layouts, strict=True)).items():
            if layout.mesh not in meshes:
                meshes[layout.mesh] = resolve_mesh(layout.mesh, f"reshard destination {layout}")
            by_id[key] = meshes[layout.mesh]
        for dmesh in meshes.values():
            if dmesh.backend != src_mesh.backend:
                raise ValueError(
                    f"reshard from a {src_mesh.backend} mesh to a {dmesh.backend} mesh: "
                    "both meshes must use one backend"
                )
        self.src_mesh = src_mesh
        self.dst_meshes = list(map(by_id.__getitem__, map(id, layout_meshes)))
        out_meshes = self._checked_outs() if self.outs is not None else []
        for m in out_meshes:
            m.check_open()
        self.direct = direct
        self._remember(tensors, dst_layouts, out, dtype, tuple(meshes.items()), out_meshes)

    def _remember(self, tensors, dst_layouts, out, dtype, meshes: tuple, out_meshes: list) -> None:
        """Keep this call among the latest (``_recent``) where ``again`` can tell a call of the
        same objects cheaply: a flat dict of tensors (into a flat dict, if any), a Layout or a flat
        dict of them, each its own dtype."""
        flat = type(tensors) is dict and len(tensors) > 1 and self.treedef.keys == tuple(tensors)
        if not (
            flat
            and dtype is None
            and (
                isinstance(dst_layouts, Layout)
                or (type(dst_layouts) is dict and tuple(dst_layouts) == self.treedef.keys)
            )
            and (out is None or (type(out) is dict and tuple(out) == self.treedef.keys))
        ):
            return
        given = dst_layouts if isinstance(dst_layouts, Layout) else list(dst_layouts.values())
        state = {k: v for k, v in vars(self).items() if k not in ("leaves", "outs")}
        replay = _Replay(
            self.src_mesh,
            self.direct,
            self.treedef.keys,
            Held(self.leaves),
            given,
            None if self.outs is None else Held(self.outs),
            meshes,
            out_meshes,
            state,
        )
        _recent[:] = [replay, *_recent[: RECENT - 1]]

    @classmethod
    def again(cls, tensors, src_mesh, dst_layouts, out, direct: bool, dtype) -> _Call | None:
        """One of the latest calls (``_recent``) made again where these are the same objects: the
        same tensors under the same keys, the same layouts, the same outputs, none freed, every
        mesh still the live one. Handles and layouts are immutable, so what was checked and worked
        out from them holds (a sync loop's replay costs a few identity checks per tensor, not a few
        checks and tables). None: make the call anew (``_Call``), which says what is wrong."""
        if dtype is not None or type(tensors) is not dict:
            return None
        keys = tuple(tensors)
        for m in list(_recent):
            if src_mesh is m.src_mesh and direct == m.direct and (out is None) == (m.outs is None) and keys == m.keys:
                call = cls._again(m, tensors, src_mesh, dst_layouts, out)
                if call is not None:
                    return call
        return None

    @classmethod
    def _again(cls, m: _Replay, tensors: dict, src_mesh, dst_layouts, out) -> _Call | None:
        leaves = list(tensors.values())
        if not m.leaves.live(leaves):
            return None
        if isinstance(m.given, Layout):
            if dst_layouts is not m.given:
                return None
        elif not (
            type(dst_layouts) is dict
            and tuple(dst_layouts) == m.keys
            and all(map(operator.is_, dst_layouts.values(), m.given))
        ):
            return None
        outs = None
        if m.outs is not None:
            if type(out) is not dict or tuple(out) != m.keys:
                return None
            outs = list(out.values())
            if not m.outs.live(outs):
                return None
        elif out is not None:
            return None
        registry = src_mesh.runtime.registry
        for mesh, dmesh in m.meshes:  # each still the live one (``resolve_mesh``)
            live, _ = registry.local_mesh(mesh)
            if not live or live[-1] is not dmesh:
                return None
        src_mesh.check_open()
        for dmesh in (*(d for _, d in m.meshes), *m.out_meshes):
            dmesh.check_open()
        call = object.__new__(cls)
        call.__dict__.update(m.state)
        call.leaves, call.outs = leaves, outs
        return call

    def _derived(self, key: str, make):
        """``make()`` once for this call and those that make it again (``again``)."""
        hit = self.derived.get(key)
        if hit is None:
            hit = self.derived[key] = make()
        return hit

    @property
    def reads(self) -> frozenset:
        return self._derived("reads", lambda: frozenset(map(_NAME, self.leaves)))

    @property
    def writes(self) -> frozenset:
        return self._derived("writes", lambda: frozenset(map(_NAME, self.outs or ())))

    @property
    def out_names(self) -> list[str] | None:
        return None if self.outs is None else self._derived("out names", lambda: list(map(_NAME, self.outs)))

    @property
    def sources(self) -> Sources:
        """The source shards (``Sources``)."""
        return self._derived("sources", self._sources)

    def _sources(self) -> Sources:
        leaves = self.leaves
        casts = [
            (t.dtype_name, s) if s is not None else None if d == t.dtype_name else t.dtype_name
            for t, d, s in zip(leaves, self.dtypes, self.scalings, strict=True)
        ]
        names, shared, keys = list(map(_NAME, leaves)), list(map(_SHARED, leaves)), list(map(_SOURCE_KEY, leaves))
        return Sources(names, shared, casts, keys, Signed((tuple(keys), tuple(casts))))

    @property
    def tensors_key(self) -> Signed:
        """What a compiled reshard depends on of the tensors, their layouts and dtypes, and the
        outputs of a ``direct`` write (``_compile``)."""

        def make() -> Signed:
            outs = self.outs if self.direct and self.outs is not None else [None] * len(self.leaves)
            return Signed(
                (
                    tuple(map(_SIGNATURE, self.leaves)),
                    tuple(self.layouts),
                    tuple(self.dtypes),
                    tuple(None if o is None else frozenset(o._shared) for o in outs),
                )
            )

        return self._derived("tensors key", make)

    def _checked_outs(self) -> list[DeviceMesh]:
        """Each output checked against what is written into it (``_check_out``); the meshes they
        live on, once each (a state dict's outputs share a few). The same outputs for the same
        layouts, dtypes and shapes as the latest call that passed check the same, but for whether
        one was freed since (``_last_outs``)."""
        global _last_outs
        outs, shapes = self.outs or [], self.shapes
        last = _last_outs
        if not (
            last is not None
            and last[0].live(outs)
            and all(map(operator.is_, self.layouts, last[1]))
            and last[2] == self.dtypes
            and last[3] == shapes
        ):
            for path, t, layout, o, d in zip(self.paths, self.leaves, self.layouts, outs, self.dtypes, strict=True):
                _check_out(o, t, layout, path, d)
            _last_outs = (Held(outs), list(self.layouts), list(self.dtypes), shapes)
        meshes = list(map(_MESH, outs))
        return list(dict(zip(map(id, meshes), meshes, strict=True)).values())

    @property
    def what(self) -> str:
        if self.single:
            t, layout = self.leaves[0], self.layouts[0]
            to = "" if self.dtypes[0] == t.dtype_name else f" as {self.dtypes[0]}"
            return f"reshard {t.dtype_name}{list(t.shape)} {t.layout} -> {layout}{to}"
        return f"reshard of {len(self.leaves)} tensors from {self.src_mesh!r}"

    def items(self, shared_memory: bool) -> tuple[BatchItem, ...]:
        out = []
        outs: Sequence[ShardedTensor | None] = self.outs or [None] * len(self.leaves)
        hosts = self.planning_hosts(shared_memory)
        pairs = tuple(sorted(hosts.items()))
        for t, layout, dmesh, o, dtype in zip(
            self.leaves, self.layouts, self.dst_meshes, outs, self.dtypes, strict=True
        ):
            cast = dtype != t.dtype_name  # cast by its senders: no pulls (a puller reads the source's dtype)
            domains = tuple(sorted(memory_domains(t, dmesh).items())) if shared_memory and not cast else ()
            publishers = relay_publishers(dmesh, domains, o if self.direct else None)
            out.append(BatchItem(t.shape, dtype, t.layout, layout, domains, publishers, pairs))
        return tuple(out)

    def planning_hosts(self, shared_memory: bool) -> dict[int, int]:
        """The device -> host map every tensor of the call is planned on: the meshes' hosts, the
        devices of one memory domain on one host (``shared_memory``), whichever shards of each
        tensor peers can pull."""
        meshes = [self.src_mesh, *dict.fromkeys(self.dst_meshes)]
        domain_of = {r.id: r.memory_domain for m in meshes for r in m.records if r.memory_domain is not None}
        topologies = [m.mesh for m in meshes]
        merged = domain_hosts(topologies, domain_of) if shared_memory else None
        return merged or device_hosts(*topologies)


def _at(path: str) -> str:
    return f"{path!r}: " if path else ""


def _flatten_tensors(tensors):
    def leaf(x) -> bool:
        if isinstance(x, ShardedTensor):
            return True
        if hasattr(x, "shape") and hasattr(x, "dtype"):  # an array or a tensor where a handle belongs
            raise TypeError(
                f"reshard moves ShardedTensors (from distribute, adopt or reshard), got a {type(x).__name__}; "
                "distribute() it onto a mesh first"
            )
        return False

    try:
        leaves, paths, treedef = flatten(tensors, leaf, ShardedTensor)
    except TypeError as e:
        raise TypeError(f"reshard: {e}") from None
    return leaves, paths, treedef


#: ``(outputs, layouts, dtypes, shapes)`` of the latest call into kept outputs whose outputs checked
#: right (``_Call._checked_outs``): handles and layouts are immutable, so the same ones for the same
#: dtypes and shapes check the same (a sync loop's replay); only a free can change that. The
#: outputs by weak reference: a handle the user dropped is released as before.
_last_outs: tuple[Held, list, list, list] | None = None
_SHAPE = operator.attrgetter("shape")
_SHARED = operator.attrgetter("_shared")
_SOURCE_KEY = operator.attrgetter("_source_key")
_SIGNATURE = operator.attrgetter("_signature")


class Held:
    """A list of handles held by weak reference (a handle the user dropped is released as before),
    and whether a list holds the same handles: while none of them died, the same ids are the same
    objects, so a check of thousands costs a comparison of ints, not a dereference each; and
    whether none is freed, looked at again only after a free (``Frees``)."""

    __slots__ = ("ids", "refs", "alive", "unfreed_at")

    def __init__(self, objs: list):
        self.ids = list(map(id, objs))
        self.refs = list(map(weakref.ref, objs, itertools.repeat(self._died)))
        self.alive = True
        self.unfreed_at = -1  # ``Frees.count`` when none was freed

    def _died(self, _ref) -> None:
        self.alive = False

    def holds(self, objs: list) -> bool:
        return self.alive and list(map(id, objs)) == self.ids

    def live(self, objs: list) -> bool:
        """Whether ``objs`` are the same handles, none freed."""
        if not self.holds(objs):
            return False
        count = Frees.count
        if self.unfreed_at != count:
            if any(map(_FREED, objs)):
                return False
            self.unfreed_at = count
        return True


@dataclass(frozen=True)
class _Replay:
    """One of the latest calls of a tree (``_Call.again``): its source mesh, ``direct``, the tree's keys,
    its tensors (by weak reference: a handle the user dropped is released as before), the layouts
    given (a Layout, or a flat dict's values), its outputs (by weak reference; None: none), the
    destination meshes as resolved (``(mesh, DeviceMesh)`` each) and the outputs' meshes, and the
    call's other attributes (``derived`` among them, shared by every call made again from it)."""

    src_mesh: DeviceMesh
    direct: bool
    keys: tuple
    leaves: Held
    given: Layout | list
    outs: Held | None
    meshes: tuple
    out_meshes: list
    state: dict


RECENT = 4  # calls kept to be made again: a loop may sync a few trees a step
_recent: list[_Replay] = []  # the latest first

#: ``(given layouts, shapes, checked layouts)`` of the latest call of a tree: Layouts are immutable,
#: so the same layout objects for the same shapes check the same (thousands per call otherwise)
_last_layouts: tuple[list, list, list] | None = None


def _layouts(dst_layouts, leaves, paths, treedef, single: bool, shapes: list) -> list[Layout]:
    """One destination Layout per leaf: from the same tree of Layouts, one Layout for every
    tensor, or a callable ``(path, tensor) -> Layout``; each checked against its tensor's shape."""
    if single and not isinstance(dst_layouts, Layout) and not callable(dst_layouts):
        raise TypeError(f"dst_layout must be a reshard.Layout, got {type(dst_layouts).__name__}")
    global _last_layouts
    what = "reshard: the tree of layouts does not match the tree of tensors"
    given = per_leaf(dst_layouts, leaves, paths, treedef, lambda x: isinstance(x, Layout), what)
    last = _last_layouts
    if last is not None and len(last[0]) == len(given) and all(map(operator.is_, given, last[0])) and last[1] == shapes:
        return list(last[2])  # the same layouts for the same shapes as the latest call: a sync loop's replay
    out: list[Layout] = []
    seen: dict[tuple, Layout] = {}  # (id of a given layout, shape) -> it for that shape: a state dict has few of each
    for path, t, layout in zip(paths, leaves, given, strict=True):
        key = (id(layout), t.shape)
        hit = seen.get(key)
        if hit is None:
            if not isinstance(layout, Layout):
                raise TypeError(
                    f"reshard: the layout for {_at(path)}is a {type(layout).__name__}, not a reshard.Layout"
                )
            hit = seen[key] = layout.for_shape(t.shape)  # checked
        out.append(hit)
    if len(out) > 1:
        _last_layouts = (given, shapes, out)
    return list(out)


def _dtypes(dtype, leaves, paths, treedef) -> tuple[list[str], list[Scaled | None]]:
    """The dtype each leaf arrives as: its own (``dtype`` None), one dtype for all, the same tree
    of dtypes, or a callable ``(path, tensor) -> dtype`` (None: its own); checked castable. And
    each leaf's ``Scaled`` (float8 with its scales; None: a plain cast or none)."""
    if dtype is None:
        return [t.dtype_name for t in leaves], [None] * len(leaves)
    what = "reshard: the tree of dtypes does not match the tree of tensors"
    given = per_leaf(dtype, leaves, paths, treedef, _one_dtype, what)
    names, scalings = [], []
    for path, t, d in zip(paths, leaves, given, strict=True):
        try:
            if isinstance(d, Scaled):
                d.check(t.dtype_name, t.shape)
            names.append(
                t.dtype_name if d is None else d.dtype if isinstance(d, Scaled) else cast_name(t.dtype_name, d)
            )
        except (TypeError, ValueError) as e:
            raise type(e)(f"reshard: dtype for {_at(path)}{e}") from None
        scalings.append(d if isinstance(d, Scaled) else None)
    return names, scalings


def _one_dtype(x) -> bool:
    return isinstance(x, str | Scaled) or hasattr(x, "itemsize")


def _outs(out, treedef, single: bool, n: int) -> list[ShardedTensor]:
    if single:
        return [out]
    what = "reshard: out= does not match the tree of tensors; nothing was written"
    return per_leaf(out, [None] * n, [""] * n, treedef, lambda x: False, what)


def _check_out(out, tensor: ShardedTensor, layout: Layout, path: str, dtype: str) -> None:
    where = f" at {path!r}" if path else ""
    if not isinstance(out, ShardedTensor):
        raise TypeError(
            f"out{where} must be a ShardedTensor (adopt() the destination's tensors), got {type(out).__name__}"
        )
    if out._freed:  # its mesh: checked once per call (``_Call``)
        raise ValueError(f"reshard output{where}: {out!r} was freed; its shards are gone. Nothing was written")
    if out.layout.mesh != layout.mesh or out.layout.for_shape(out.shape) != layout:
        raise ValueError(
            f"out{where} is laid out {out.layout}, the reshard produces {layout}; adopt it with that layout. "
            "Nothing was written"
        )
    if out.shape != tensor.shape or out.dtype_name != dtype:
        raise ValueError(
            f"out{where} is {out.dtype_name}{list(out.shape)} but the reshard moves "
            f"{dtype}{list(tensor.shape)}{'' if dtype == tensor.dtype_name else f' (cast from {tensor.dtype_name})'}"
            "; pass dtype= to cast in flight. Nothing was written"
        )


def _compile(call: _Call, strategy: str, cluster, shared_memory: bool, bucket_bytes: int | None) -> CompiledBatch:
    """The call's compiled batch, cached by the controller (``Batches.compiled``) under its
    signature: the tensors' shapes, dtypes, layouts and which of their source shards are in shared
    memory, the destination layouts, the options, the backend's compile target as registered now
    (``register_target`` replaces it) and the link figures' generation."""
    from topology.runtime import links_generation

    rt = call.src_mesh.runtime
    backend = call.src_mesh.backend
    target = compile_target(backend)
    signature = (strategy, cluster, shared_memory, bucket_bytes, links_generation(), backend, target, call.tensors_key)

    def build() -> CompiledBatch:
        items = call.items(shared_memory)
        planned = cluster
        if planned is None:
            planned = rt.planning_cluster(backend, dict(items[0].hosts or ()) if items else {})
        with gc_paused():  # a large tree's plans: millions of acyclic objects at once
            return compile_batch(
                items,
                strategy=strategy,
                cluster=planned,
                options=CompileOptions.for_target(target),
                bucket_bytes=target.bucket_bytes if bucket_bytes is None else bucket_bytes,
            )

    return rt.batches.compiled(Signed(signature), build)  # hashed once: thousands of tensors' keys


def lowered_reshard(
    tensor: ShardedTensor,
    dst_layout: Layout,
    *,
    strategy: str = "auto",
    cluster=None,
    shared_memory: bool = True,
    dtype=None,
) -> CompiledReshard:
    """What ``reshard(tensor, tensor.mesh, dst_layout, ...)`` runs: its ``CompiledReshard`` (plan,
    validated per-device programs with their pulls, groups, encoded blobs), compiled and cached as
    ``reshard`` does.

    Plans are made for ``cluster`` (a ``topology.Cluster``); by default for the meshes' hosts with
    the live Ray cluster's figures and the meshes' backend (``Runtime.planning_cluster``), where
    the devices of one machine count as one host when they share memory (their transfers become
    pulls, ``reshard.passes.pulls``). ``shared_memory=False``: no pulls, everything through the backend."""
    call = _Call(tensor, tensor.mesh, dst_layout, None, False, dtype)
    return _compile(call, strategy, cluster, shared_memory, None).tensors[0]


def lowered_batch(
    tensors,
    src_mesh: DeviceMesh,
    dst_layouts,
    *,
    strategy: str = "auto",
    cluster=None,
    shared_memory: bool = True,
    bucket_bytes: int | None = None,
    dtype=None,
) -> CompiledBatch:
    """What ``reshard(tensors, src_mesh, dst_layouts, ...)`` of a tree runs: its ``CompiledBatch``
    (each tensor's compiled reshard, the packed batch program, blobs), compiled and cached as
    ``reshard`` does; e.g. ``.lower_bound_s(cluster)``."""
    call = _Call(tensors, src_mesh, dst_layouts, None, False, dtype)
    return _compile(call, strategy, cluster, shared_memory, bucket_bytes)


def reshard(
    tensors,
    src_mesh: DeviceMesh,
    dst_layouts,
    *,
    strategy: str = "auto",
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    cluster=None,
    shared_memory: bool = True,
    out=None,
    direct: bool = False,
    async_op: bool = False,
    verify: bool = False,
    bucket_bytes: int | None = None,
    dtype=None,
):
    """Move ``tensors`` (a ShardedTensor, or a tree of them: dicts, lists, tuples, nested, all on
    ``src_mesh``) to ``dst_layouts`` (a Layout; for a tree: the same tree of Layouts, one Layout
    for all, or a callable ``(path, tensor) -> Layout``, ``path`` the state-dict key such as
    ``"h.0.attn.weight"``). Returns the same tree of new ShardedTensors (or ``out``).

    One call is one compiled reshard whatever the number of tensors: planned once per tree
    signature and replayed; slices of tensors of at most ``bucket_bytes`` (None: the backend's,
    ``reshard.ir.target``: 1 MiB on gloo, 64 MiB on NCCL) that one device sends another travel
    packed together. Slices between actors of one machine are pulled through
    shared memory (see ``DeviceMesh``); ``shared_memory=False`` sends everything through the
    backend. ``cluster`` overrides the cost model "auto" plans for (``lowered_reshard``).

    ``out``: the same tree of existing shards (``adopt``ed tensors of the destination actors, e.g.
    inference weights) to write into; returns ``out``. By default results are staged and committed
    all at once: a failed reshard leaves every output as it was. ``direct=True`` writes straight
    into ``out`` (no staged copy, no commit; a large tree's small tensors are read into one block
    and copied over); a failure leaves it partly written.

    ``dtype``: the dtype the results arrive as (one for all, the same tree of dtypes, or a
    callable ``(path, tensor) -> dtype``, None for its own; None: each its own): a cast between
    float64, float32, float16 and bfloat16, rounded as torch's ``Tensor.to`` rounds, applied by
    the senders before anything crosses (fewer bytes for a narrower dtype; cast leaves are sent,
    not pulled; CPU devices only).

    ``async_op=True``: return a ``Work`` at once (``wait()``, ``done()``, awaitable). ``verify``:
    check every received slice against a checksum of the slice it was read from, and raise naming
    tensor, device and slice on a mismatch (with ``out``, before anything is committed).

    The sources stay intact. Raises ValueError/TypeError for misuse (before anything moves),
    ``WorkerDied`` / ``ReshardTimeout`` / ``ReshardError`` if the run fails (within ``timeout_s``
    plus a bounded cleanup), ``MeshClosed`` for a shut-down mesh or a Ray session that is gone."""
    timeout_s = check_timeout(timeout_s)
    if bucket_bytes is not None and (
        not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1
    ):
        raise ValueError(f"bucket_bytes must be a positive int (or None: the backend's), got {bucket_bytes!r}")
    with gc_paused():  # a tree's objects, a few per tensor: collected after the call, not during it
        call = _Call.again(tensors, src_mesh, dst_layouts, out, direct, dtype) or _Call(
            tensors, src_mesh, dst_layouts, out, direct, dtype
        )
        reads, writes = call.reads, call.writes
    rt = call.src_mesh.runtime
    deadline = Deadline.after(timeout_s)  # one for the whole call: the wait for earlier works counts
    rt.works.after(reads, writes, deadline)
    with gc_paused():
        rt.flush_holds()  # releases of dropped handles first: their memory is pooled for this run's shards
        compiled = _compile(call, strategy, cluster, shared_memory, bucket_bytes)
        run = rt.new_name()
        what = call.what if strategy == "auto" else f"{call.what} (strategy {strategy!r})"
        outs = call.out_names
        pending = rt.batches.submit(
            compiled, call.sources, run, deadline, what, outs=outs, direct=direct, verify=verify
        )

    def finish():
        try:
            results = rt.batches.finish(pending)
        except ReshardError:
            if verify and pending.results:  # every run succeeded; the commit refused a mismatch
                _raise_mismatch(call, compiled, {d: r.checks for d, r in pending.results.items()})
            raise
        if verify:
            _raise_mismatch(call, compiled, {d: r.checks for d, r in results.items()})
        if call.outs is not None:
            return out  # the user's own tree
        with gc_paused():
            return _results(call, run, results)

    if async_op:
        return rt.works.start(finish, reads, writes, what)
    return finish()


def _results(call: _Call, run: str, results: dict):
    """The call's tree of new handles, each with the descriptors its devices returned."""
    n = len(call.leaves)
    shared: list[dict] = [{} for _ in range(n)]  # tensor -> {device: descriptor}
    for d, r in results.items():
        for i, desc in r.descriptors.items():
            if desc is not None:
                shared[i][d] = desc
    columns = {d: r.placed for d, r in results.items() if r.placed is not None}
    placed = UnitDescriptors(columns, n) if columns else None
    names = shard_names(run, range(n))
    leaves = [
        ShardedTensor(dmesh, layout, t.shape, dtype, name, where, copy=False, placed=placed, index=i)
        for i, (t, layout, dmesh, dtype, name, where) in enumerate(
            zip(call.leaves, call.layouts, call.dst_meshes, call.dtypes, names, shared, strict=True)
        )
    ]
    return leaves[0] if call.single else unflatten(call.treedef, leaves)


def _raise_mismatch(call: _Call, compiled: CompiledBatch, checks_by_device: dict) -> None:
    """Raise ``ReshardError`` naming the first slice whose received checksum differs from what its
    sender read (``verify``)."""
    found = first_mismatch(checks_by_device)
    if found is None:
        return
    tensor, step, d, crc, read = found
    box = compiled.tensors[tensor].plan.transfers[step].box
    path = call.paths[tensor]
    raise ReshardError(
        f"{call.what}: verify: tensor {path or tensor!r} on device {d}: the slice {list(box)} it received differs "
        f"from what its sender read (checksum {crc:#010x} against {', '.join(f'{c:#010x}' for c in sorted(read))})"
        + ("; no output was changed" if call.outs is not None and not call.direct else "")
    )


__all__ = ["compile_options", "lowered_batch", "lowered_reshard", "memory_domains", "relay_publishers", "reshard"]

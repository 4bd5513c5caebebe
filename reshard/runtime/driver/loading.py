"""Putting tensors under handles: ``distribute`` (the driver's data laid out over a mesh) and
``adopt`` (tensors the devices' own code shared), for one tensor or a whole tree of them.

``distribute`` puts the data into the object store ONCE (``ray.put``; a tree as one object); every
actor reads it zero-copy and keeps a copy of its own regions, one call per device for the whole
tree. bfloat16 and float8 travel as their bit patterns. ``adopt`` asks every device once what it holds
under the given names. Both are all or nothing: a failure keeps no shard.
"""

from __future__ import annotations

import sys
import uuid

import numpy as np
import ray

from reshard.dtypes import BIT_PATTERN, dtype_name, storage_name
from reshard.ir.layout import Layout
from reshard.ir.regions import layout_regions
from reshard.pytree import flatten, per_leaf, unflatten
from reshard.runtime.deadlines import DEFAULT_TIMEOUT_S, Deadline, check_timeout
from reshard.runtime.driver.controller import runtime
from reshard.runtime.driver.dispatch import Outcome, failure_error
from reshard.runtime.driver.mesh import DeviceMesh, resolve_mesh
from reshard.runtime.driver.tensor import ShardedTensor
from reshard.runtime.messages import Load


def _is_dtensor(x) -> bool:
    return type(x).__name__ == "DTensor" and hasattr(x, "device_mesh") and hasattr(x, "to_local")


def _is_array(x) -> bool:
    if isinstance(x, np.ndarray | np.generic):
        return True
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _torch():
    return sys.modules.get("torch")


def _as_numpy(array) -> tuple[np.ndarray, str]:
    """(C-contiguous numpy array to ship, dtype name); bfloat16 and float8 become their bit
    patterns. Refused before anything moves: a dtype the runtime does not move, a byte order that
    is not this machine's."""
    torch = _torch()
    if torch is not None and isinstance(array, torch.Tensor):
        name = dtype_name(array.dtype)
        if array.layout != torch.strided:
            raise TypeError(f"distribute needs a dense tensor, got a {array.layout} one; call .to_dense() first")
        if array.device.type == "meta":
            raise TypeError("distribute needs a tensor with data, got one on the meta device")
        t = array.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if name in BIT_PATTERN:
            t = t.view(getattr(torch, BIT_PATTERN[name]))
        arr = t.contiguous().numpy()
    elif isinstance(array, np.ndarray | np.generic):
        arr = np.asarray(array)
        if arr.dtype.byteorder == (">" if sys.byteorder == "little" else "<"):
            raise TypeError(
                f"distribute got an array of byte order {arr.dtype.str!r}, not this machine's: convert it first "
                "(array.astype(array.dtype.newbyteorder('=')))"
            )
        name = dtype_name(arr.dtype)  # an ml_dtypes bfloat16 or float8 array by its name
        arr = arr.view(storage_name(name))
    else:
        raise TypeError(f"distribute needs a numpy array or a torch tensor, got {type(array).__name__}")
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr).reshape(arr.shape)
    return arr, name


def _from_dtensor(dt, layout, path: str):
    """A DTensor's data and the layout to put it in: its whole value when this process holds it all
    (a mesh of one rank, or every placement Replicate), laid out as ``layout`` or, given a
    DeviceMesh, with the DTensor's own placements; else TypeError naming the route."""
    from reshard.ir.placement import Replicate, as_placement

    placements = tuple(as_placement(p) for p in dt.placements)
    where = f" at {path!r}" if path else ""
    if dt.device_mesh.size() != 1 and any(p != Replicate() for p in placements):
        raise TypeError(
            f"distribute got a DTensor{where} sharded over {dt.device_mesh.size()} ranks "
            f"({', '.join(map(str, placements))}); this process holds only its own shard. Share the shards where "
            "they live instead: inside each actor, self.reshard_device.from_dtensor(name, dt) (or "
            "share_state_dict(model.state_dict()) for a whole model), then adopt(mesh, name) on the driver"
        )
    if isinstance(layout, DeviceMesh):
        if tuple(dt.device_mesh.shape) != layout.shape:
            raise ValueError(
                f"distribute: the DTensor{where} lives on a device mesh of shape {tuple(dt.device_mesh.shape)}, the "
                f"DeviceMesh given has shape {layout.shape}; pass a Layout to choose the placements"
            )
        layout = Layout(layout, placements)
    return dt.to_local(), layout


def distribute(array, layout, *, timeout_s: float | None = DEFAULT_TIMEOUT_S):
    """Lay a tensor, or a tree of them, out over DeviceMeshes.

    ``array``: the whole tensor (numpy array, CPU torch tensor, or a DTensor this process holds
    whole); on a layout with Partial axes the devices at coordinate 0 of those axes hold it and the
    others zeros. Or a tree (a state dict: dicts, lists, tuples, nested) of such tensors, with
    ``layout`` the same tree of Layouts, one Layout for all, or a callable ``(path, array) ->
    Layout``: returns the same tree of ShardedTensors. Or, with one Layout, every device's own
    shard: a dict ``{flat device index: array}`` or a list in flat device order (each of the shape
    the layout gives the device; on Partial axes, each device's contribution); the tensor's shape is
    inferred from them. A DTensor given with a DeviceMesh keeps its own placements."""
    timeout_s = check_timeout(timeout_s)
    if isinstance(layout, Layout | DeviceMesh) and isinstance(array, dict | list | tuple) and _local_form(array):
        if not isinstance(layout, Layout):
            raise TypeError(f"distribute of local shards needs a reshard.Layout, got {type(layout).__name__}")
        return _distribute_local(array, layout, timeout_s)
    try:
        leaves, paths, treedef = flatten(array, lambda x: _is_array(x) or _is_dtensor(x))
    except TypeError as e:
        raise TypeError(f"distribute needs a numpy array or a torch tensor, or a tree of them: {e}") from None
    single = treedef.kind == "leaf"
    given = per_leaf(
        layout,
        leaves,
        paths,
        treedef,
        _one_layout,
        "distribute: the tree of layouts does not match the tree of tensors",
    )
    arrays: list[np.ndarray] = []
    specs: list[tuple] = []
    for path, a, lay in zip(paths, leaves, given, strict=True):
        if _is_dtensor(a):
            a, lay = _from_dtensor(a, lay, path)
        if not isinstance(lay, Layout):
            raise TypeError(f"distribute needs a reshard.Layout for {path or 'the tensor'!r}, got {type(lay).__name__}")
        arr, dtype = _as_numpy(a)
        lay.check_shape(arr.shape)
        specs.append(_whole(len(arrays), arr, lay.for_shape(arr.shape), dtype))
        arrays.append(arr)
    if not specs:
        return unflatten(treedef, [])
    out = _load(arrays, specs, timeout_s)
    return out[0] if single else unflatten(treedef, out)


def _one_layout(x) -> bool:
    return isinstance(x, Layout | DeviceMesh)


def _local_form(given) -> bool:
    """Whether a dict or list is one tensor's local shards (int keys, or a list of arrays), not a tree."""
    if isinstance(given, dict):
        return bool(given) and all(isinstance(k, int) for k in given)
    return bool(given) and all(_is_array(a) for a in given)


def _load(arrays: list[np.ndarray], specs: list[tuple], timeout_s) -> list[ShardedTensor]:
    """Every device keeps its shard of each tensor: one ordered call per device, ``arrays`` put into
    the object store once. ``specs[t]``: ``(layout, dtype, shape, sources)``, ``sources[i]`` what
    flat device ``i`` copies: ``(index into arrays, box of it)``, index None for zeros."""
    rt = runtime()
    meshes = {}
    for lay, *_ in specs:
        if lay.mesh not in meshes:
            meshes[lay.mesh] = resolve_mesh(lay.mesh, f"distribute onto {lay}")
    ref = ray.put(arrays)
    names = [rt.new_name() for _ in specs]
    loads: dict[int, list] = {}  # device -> [(name, index into arrays or None, box, dtype)]
    for name, (lay, dtype, _, sources) in zip(names, specs, strict=True):
        for d, (index, box) in zip(meshes[lay.mesh].device_ids, sources, strict=True):
            loads.setdefault(d, []).append(Load(name, index, box, dtype))
    deadline = Deadline.after(timeout_s)
    what = f"distribute onto {specs[0][0]}" if len(specs) == 1 else f"distribute of {len(specs)} tensors"
    made = {d: tuple(e[0] for e in entries) for d, entries in loads.items()}

    def load(rec):
        return lambda t, mine=tuple(loads[rec.id]): rec.actor.reshard_load.remote(t, mine, ref, deadline.budget)

    def drop(outcome: Outcome) -> None:
        rt.batches.abandon(loads, names[0], made, (), None, outcome)

    results = rt.dispatch.broadcast_call(loads, load, deadline, what, tail="Nothing was kept.", on_failure=drop)
    out = []
    for name, (lay, dtype, shape, _) in zip(names, specs, strict=True):
        dmesh = meshes[lay.mesh]
        shared = {d: desc for d in dmesh.device_ids if (desc := results[d].get(name)) is not None}
        out.append(ShardedTensor(dmesh, lay, shape, dtype, name, shared))
    return out


def _whole(t: int, arr: np.ndarray, layout: Layout, dtype: str) -> tuple:
    """The spec of tensor ``t`` given whole as ``arr`` (devices holding other contributions of a
    Partial layout start from zeros)."""
    shape = tuple(arr.shape)
    sources = [(None if any(layout.contribution(i)) else t, box) for i, box in enumerate(layout_regions(layout, shape))]
    return layout, dtype, shape, sources


def _distribute_local(given, layout: Layout, timeout_s) -> ShardedTensor:
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
    shape = infer_shape(layout, [a.shape for a in shards], f"distribute onto {layout}")
    sources = [(i, tuple((0, n) for n in a.shape)) for i, a in enumerate(shards)]
    return _load(list(shards), [(layout.for_shape(shape), dtypes[0], shape, sources)], timeout_s)[0]


def adopt(layout, name, *, timeout_s: float | None = DEFAULT_TIMEOUT_S):
    """A handle on tensors the devices' own code shared as ``name`` (``DeviceContext.share`` /
    ``from_dtensor`` / ``share_state_dict`` inside attached actors), laid out as ``layout`` (a
    Layout, or the DeviceMesh when every device shared its placements, e.g. from a DTensor). For a
    whole model, ``name`` is a tree of names (what ``share_state_dict`` returns) and ``layout`` one
    Layout or DeviceMesh for all or the same tree of them: returns the same tree of handles, with
    one call per device. Global shapes are inferred from the shards and checked against what each
    device said; nothing is copied. Dropping a handle leaves the user's tensors where they are."""
    timeout_s = check_timeout(timeout_s)
    names, paths, treedef = flatten(name, lambda x: isinstance(x, str))
    if not names:
        return unflatten(treedef, [])
    given = per_leaf(
        layout, names, paths, treedef, _one_layout, "adopt: the tree of layouts does not match the tree of names"
    )
    rt = runtime()
    meshes: dict = {}
    per_device: dict[int, list[str]] = {}
    for n, lay in zip(names, given, strict=True):
        dmesh = lay if isinstance(lay, DeviceMesh) else resolve_mesh(lay.mesh, f"adopt {n!r}")
        meshes[n] = dmesh
        for d in dmesh.device_ids:
            per_device.setdefault(d, []).append(n)
    for dmesh in {id(m): m for m in meshes.values()}.values():
        dmesh.check_open()
    deadline = Deadline.after(timeout_s)
    what = f"adopt {names[0]!r}" if len(names) == 1 else f"adopt {len(names)} tensors"

    def describe(rec):
        return lambda t, mine=tuple(per_device[rec.id]): rec.actor.reshard_describe.remote(t, mine, deadline.budget)

    def unknown_name(outcome: Outcome) -> None:  # a name a device does not have: the error says just that
        if any(isinstance(getattr(f.error, "cause", f.error), KeyError) for f in outcome.failures.values()):
            raise failure_error(outcome, what, deadline)

    results = rt.dispatch.broadcast_call(
        per_device, describe, deadline, what, tail="Nothing was adopted.", on_failure=unknown_name
    )
    said = {d: dict(zip(per_device[d], infos, strict=True)) for d, infos in results.items()}
    found = [
        _adopted(n, lay, meshes[n], [said[d][n] for d in meshes[n].device_ids])
        for n, lay in zip(names, given, strict=True)
    ]  # every one checked before any is held
    holders = [f"{n}/adopted/{uuid.uuid4().hex[:12]}" for n in names]
    rt.acquire_many([(meshes[n].device_ids, n, h) for n, h in zip(names, holders, strict=True)])
    out = [
        ShardedTensor(meshes[n], layout, shape, dtype, n, shared, h)
        for n, h, (layout, shape, dtype, shared) in zip(names, holders, found, strict=True)
    ]
    return out[0] if treedef.kind == "leaf" else unflatten(treedef, out)


def _adopted(name: str, layout, dmesh: DeviceMesh, infos: list[dict]) -> tuple:
    """``(layout, shape, dtype, descriptors)`` of ``name``'s handle, from what each device of
    ``dmesh`` (flat order) said of it, checked."""
    if isinstance(layout, DeviceMesh):
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
    shape = infer_shape(layout, [i["local_shape"] for i in infos], f"adopt {name!r} as {layout}")
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
    return layout.for_shape(shape), shape, dtypes.pop(), shared


def infer_shape(layout: Layout, shapes, what: str) -> tuple[int, ...]:
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
    out = tuple(shape)
    for flat, (s, box) in enumerate(zip(shapes, layout_regions(norm, out), strict=True)):
        want = tuple(hi - lo for lo, hi in box)
        if tuple(s) != want:
            raise ValueError(
                f"{what}: the shard of flat device {flat} has shape {tuple(s)}, but a tensor of shape {out} in this "
                f"layout gives that device {want}"
            )
    return out


__all__ = ["adopt", "distribute", "infer_shape"]

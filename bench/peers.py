"""What a user would use instead of our reshard, and the memcpy ceiling, measured beside it by
``python -m bench`` (``bench.local``) on the same data and, where Ray allows, the same actors.

* ``ObjectStore``: the Ray object store as a user writes it. Each source actor ``ray.put``s the
  contiguous pieces of its numpy shard that other devices need; each destination actor
  ``ray.get``s its pieces and assembles its own shard (``np.empty`` and slice assignment; pieces it
  holds itself are copied locally). Runs on the pool's device actors through Ray's
  ``actor.__ray_call__.remote(fn, *args)`` (``fn(actor, *args)``) rather than the runtime's
  ``call``: the sources' lists of references reach the destinations as top-level arguments, so a
  destination starts once its sources have put their pieces, with no round trip to the driver in
  between, as a user's own actor methods would do.
* ``DirectTransport``: Ray Direct Transport (``tensor_transport="gloo"``) over one torch_gloo
  collective group, on plain Ray actors of the pool's count (``RdtActor``, one per pool position):
  Ray needs ``enable_tensor_transport=True`` on the actor class, which the device actors lack, and
  lets an actor join one group per backend, so one group spans all of them. Per (source,
  destination) pair the source returns a list of contiguous torch pieces; the destination gets
  them as arguments and assembles its shard.
* ``DTensorPeer``: torch DTensor ``redistribute`` for same-mesh cases: a default gloo world over the
  pool's device actors (``init_process_group`` through the runtime's ``call``), every source shard
  wrapped by ``DTensor.from_local`` (no copy, untimed); timed around ``redistribute(...).to_local()``.
* ``Memcpy``: the shared-memory path's ceiling. Each destination actor copies its destination
  shard's byte count from one resident buffer into another, all destination actors at once (as
  pulls run). The gloo path's ceiling is ``bench.ceiling`` (raw gloo of the bytes that cross).
* ``bare_startup_s``: seconds until a new pool of bare Ray actors that import numpy answers a first
  call (the reference of the mesh start-up target).
* Whole trees (``bench.weights``; a ``TreeSpec`` says what moves): ``ObjectStoreTree`` (each source
  actor ``ray.put``s its whole shard of every tensor a destination needs from it, each destination
  ``ray.get``s the shards that overlap its own and copies the overlaps), ``NaiveRefit``
  (torch.distributed gloo as a refit loop writes it: per tensor, gather to one rank, broadcast to
  every destination, each keeps its slice), ``DirectTransportTree`` (RDT, one call per (source,
  destination) pair carrying that pair's pieces of every tensor, on ``TreeRdtActor``s).

Which source supplies which piece (``assign_pieces``): a destination that holds a piece in its own
source shard copies it; otherwise the holder with the fewest bytes assigned so far sends it. Each
peer keeps its outputs alive inside the actors until ``release`` (``run(keep=True)``), as a user
keeps activations or weights; ``last`` returns the latest output of every destination for checks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import ray

from reshard.ir.regions import Box, box_shape, box_volume, intersect, relative

_KEPT: dict[str, list] = {}  # in an actor: key -> outputs kept alive, oldest first
_STATE: dict[str, object] = {}  # in an actor: per-key state (DTensor sources, memcpy buffers)


@dataclass(frozen=True, slots=True)
class Piece:
    """Part ``box`` (global coordinates) of a destination's shard, supplied by device ``src``."""

    src: int
    box: Box


def assign_pieces(src_boxes: dict[int, Box], dst_boxes: dict[int, Box]) -> dict[int, tuple[Piece, ...]]:
    """For each destination device, the pieces of its shard and the source device of each.

    Source devices holding the same box (replicas) are alternatives; a destination that is one of
    them copies locally, otherwise the least loaded holder (bytes assigned so far) sends it."""
    holders: dict[Box, list[int]] = {}
    for d, box in sorted(src_boxes.items()):
        holders.setdefault(box, []).append(d)
    load = dict.fromkeys(src_boxes, 0)
    out = {}
    for d, dbox in sorted(dst_boxes.items()):
        pieces = []
        for sbox, devices in holders.items():
            part = intersect(sbox, dbox)
            if part is None:
                continue
            src = d if d in devices else min(devices, key=lambda s: (load[s], s))
            if src != d:
                load[src] += box_volume(part)
            pieces.append(Piece(src, part))
        out[d] = tuple(pieces)
    return out


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


def _keep(key: str, out, keep: bool) -> None:
    kept = _KEPT.setdefault(key, [])
    if not keep:
        kept.clear()
    kept.append(out)


def _drop(key: str) -> None:
    _KEPT.pop(key, None)
    _STATE.pop(key, None)


def _last(key: str):
    import numpy as np

    out = _KEPT[key][-1]
    return out if isinstance(out, np.ndarray) else out.numpy()


# ------------------------------------------------------------------ the object store


def _os_put(actor, name: str, boxes: list) -> list:
    """In a source actor: ``ray.put`` each piece (local box of its shard ``name``) as a contiguous
    numpy array; returns the references."""
    import numpy as np

    shard = actor.reshard_device.local(name).numpy()
    return [ray.put(np.ascontiguousarray(shard[_slices(b)])) for b in boxes]


def _os_assemble(actor, key: str, name: str, shape, dtype: str, local: list, remote: list, keep: bool, *ref_lists):
    """In a destination actor: its shard of ``shape``, from its own source shard (``local``: pairs
    of source and destination local boxes) and the pieces the sources put (``remote``: (index of
    the source's reference list, index in it, destination local box))."""
    import numpy as np

    out = np.empty(shape, dtype=dtype)
    if remote:
        arrays = ray.get([ref_lists[i][j] for i, j, _ in remote])
        for (_, _, box), a in zip(remote, arrays, strict=True):
            out[_slices(box)] = a
        del arrays
    if local:
        own = actor.reshard_device.local(name).numpy()
        for sbox, dbox in local:
            out[_slices(dbox)] = own[_slices(sbox)]
    _keep(key, out, keep)


def _actor_last(actor, key: str):
    return _last(key)


def _actor_drop(actor, key: str) -> None:
    _drop(key)


class ObjectStore:
    """The object store between the device actors ``actors`` (global device id -> handle)."""

    def __init__(
        self,
        key: str,
        actors: dict,
        src_name: str,
        src_boxes: dict,
        dst_boxes: dict,
        pieces: dict,
        dtype: str,
        timeout_s: float,
    ):
        self.key, self.actors, self.name, self.dtype, self.timeout_s = key, actors, src_name, dtype, timeout_s
        self.dst_shapes = {d: box_shape(b) for d, b in dst_boxes.items()}
        self.sends: dict[int, list] = {}  # source -> its local boxes to put, in order
        self.plan: dict[int, tuple[list, list, list]] = {}  # dst -> (sources in arg order, local, remote)
        for d, ps in pieces.items():
            srcs: list[int] = []
            local, remote = [], []
            for p in ps:
                dbox = relative(p.box, dst_boxes[d])
                if p.src == d:
                    local.append((relative(p.box, src_boxes[d]), dbox))
                    continue
                if p.src not in srcs:
                    srcs.append(p.src)
                boxes = self.sends.setdefault(p.src, [])
                boxes.append(relative(p.box, src_boxes[p.src]))
                remote.append((srcs.index(p.src), len(boxes) - 1, dbox))
            self.plan[d] = (srcs, local, remote)

    def run(self, keep: bool) -> float:
        t0 = time.perf_counter()
        refs = {s: self.actors[s].__ray_call__.remote(_os_put, self.name, boxes) for s, boxes in self.sends.items()}
        done = []
        for d, (srcs, local, remote) in self.plan.items():
            args = (self.key, self.name, self.dst_shapes[d], self.dtype, local, remote, keep)
            done.append(self.actors[d].__ray_call__.remote(_os_assemble, *args, *(refs[s] for s in srcs)))
        _get(done, self.timeout_s)
        dt = time.perf_counter() - t0
        del refs
        return dt

    def last(self) -> dict:
        return dict(
            zip(
                self.plan,
                _get([self.actors[d].__ray_call__.remote(_actor_last, self.key) for d in self.plan], self.timeout_s),
                strict=True,
            )
        )

    def release(self) -> None:
        _get([self.actors[d].__ray_call__.remote(_actor_drop, self.key) for d in self.plan], self.timeout_s)


def _get(refs, timeout_s: float):
    return ray.get(refs, timeout=timeout_s)


# ------------------------------------------------------------------ Ray Direct Transport


class RdtActor:
    """A plain Ray actor with Ray Direct Transport enabled (``rdt_actor_class`` wraps it)."""

    def __init__(self):
        import torch

        torch.set_num_threads(1)  # as the device actors
        self.sources: dict = {}

    def ping(self) -> None:
        return None

    def load(self, key: str, shard) -> None:
        import torch

        self.sources[key] = torch.from_numpy(shard.copy())

    @ray.method(tensor_transport="gloo")
    def pieces(self, key: str, boxes: list) -> list:
        """Contiguous torch pieces (local boxes) of source shard ``key``, sent by RDT."""
        src = self.sources[key]
        return [src[_slices(b)].contiguous() for b in boxes]

    def assemble(self, key: str, shape, local: list, remote: list, keep: bool, *lists) -> None:
        import torch

        src = self.sources.get(key)
        out = torch.empty(shape, dtype=src.dtype if src is not None else lists[0][0].dtype)
        for i, j, box in remote:
            out[_slices(box)] = lists[i][j]
        for sbox, dbox in local:
            out[_slices(dbox)] = src[_slices(sbox)]
        _keep(key, out, keep)

    def last(self, key: str):
        return _last(key)

    def drop(self, key: str, sources: bool = False) -> None:
        _KEPT.pop(key, None)
        if sources:
            self.sources.pop(key, None)


_RDT_CLASS = None


def rdt_actor_class():
    global _RDT_CLASS
    if _RDT_CLASS is None:
        _RDT_CLASS = ray.remote(num_cpus=0, enable_tensor_transport=True)(RdtActor)
    return _RDT_CLASS


class RdtPool:
    """``n`` RDT actors (one per pool position) in one torch_gloo collective group; ``actor_class``:
    a Ray actor class of an ``RdtActor`` subclass (default ``rdt_actor_class()``). A transfer may
    take up to ``timeout_s``: Ray's own bound, ``RAY_rdt_fetch_fail_timeout_milliseconds`` (60 s),
    was passed on a loaded 2-core machine. Ray reads it once per process, in the receiving actor
    (set through its runtime env) and in the driver, whose monitor aborts a transfer it submitted
    (raised here while the pool is open)."""

    def __init__(self, n: int, timeout_s: float = 180.0, actor_class=None):
        from ray._private import ray_constants
        from ray.experimental.collective import create_collective_group

        t0 = time.perf_counter()
        self._driver_bound = ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS
        ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS = max(self._driver_bound, timeout_s)
        cls = actor_class or rdt_actor_class()
        fetch = {"RAY_rdt_fetch_fail_timeout_milliseconds": str(int(timeout_s * 1000))}
        self.actors = [cls.options(runtime_env={"env_vars": fetch}).remote() for _ in range(n)]
        try:
            ray.get([a.ping.remote() for a in self.actors], timeout=timeout_s)
            self.group = create_collective_group(self.actors, backend="torch_gloo")
        except BaseException:
            self.close()
            raise
        self.setup_s = time.perf_counter() - t0

    def close(self) -> None:
        from ray._private import ray_constants
        from ray.experimental.collective import destroy_collective_group

        ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS = self._driver_bound
        group, self.group = getattr(self, "group", None), None
        if group is not None:
            try:
                destroy_collective_group(group)
            except Exception:
                pass
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []


class DirectTransport:
    """Ray Direct Transport between the RDT actors of pool positions (``position`` of each global
    device id), moving the same pieces as the object store."""

    def __init__(
        self,
        key: str,
        pool: RdtPool,
        position: dict,
        source,
        src_boxes: dict,
        dst_boxes: dict,
        pieces: dict,
        timeout_s: float,
    ):
        self.key, self.timeout_s = key, timeout_s
        self.actor = {d: pool.actors[position[d]] for d in (*src_boxes, *dst_boxes)}
        self.dst_shapes = {d: box_shape(b) for d, b in dst_boxes.items()}
        self.plan: dict[int, tuple[list, list, list]] = {}  # dst -> ((src, boxes) per arg, local, remote)
        for d, ps in pieces.items():
            args: list[tuple[int, list]] = []
            local, remote = [], []
            for p in ps:
                dbox = relative(p.box, dst_boxes[d])
                if p.src == d:
                    local.append((relative(p.box, src_boxes[d]), dbox))
                    continue
                srcs = [s for s, _ in args]
                if p.src not in srcs:
                    args.append((p.src, []))
                    srcs.append(p.src)
                i = srcs.index(p.src)
                args[i][1].append(relative(p.box, src_boxes[p.src]))
                remote.append((i, len(args[i][1]) - 1, dbox))
            self.plan[d] = (args, local, remote)
        _get([self.actor[d].load.remote(key, ray.put(source[_slices(b)])) for d, b in src_boxes.items()], timeout_s)

    def run(self, keep: bool) -> float:
        t0 = time.perf_counter()
        done = []
        for d, (args, local, remote) in self.plan.items():
            refs = [self.actor[s].pieces.remote(self.key, boxes) for s, boxes in args]
            done.append(self.actor[d].assemble.remote(self.key, self.dst_shapes[d], local, remote, keep, *refs))
        _get(done, self.timeout_s)
        return time.perf_counter() - t0

    def last(self) -> dict:
        return dict(
            zip(self.plan, _get([self.actor[d].last.remote(self.key) for d in self.plan], self.timeout_s), strict=True)
        )

    def release(self) -> None:
        _get([self.actor[d].drop.remote(self.key) for d in self.plan], self.timeout_s)

    def close(self) -> None:
        _get([a.drop.remote(self.key, True) for a in set(self.actor.values())], self.timeout_s)


# ------------------------------------------------------------------ torch DTensor (same mesh)


def _dt_init(ctx, store_port: int, prefix: str, rank: int, world: int, timeout_s: float) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", store_port, world, is_master=False, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def _dt_exit(ctx) -> None:
    import torch.distributed as dist

    _STATE.pop("dtensor_meshes", None)
    if dist.is_initialized():
        dist.destroy_process_group()


def _torch_placements(placements) -> list:
    from torch.distributed.tensor import Replicate, Shard

    from reshard.ir.placement import Shard as OurShard

    return [Shard(p.dim) if isinstance(p, OurShard) else Replicate() for p in placements]


def _dt_load(ctx, key: str, name: str, mesh_shape, placements, shape) -> None:
    """Wrap this device's source shard ``name`` as a DTensor over the world, shaped ``mesh_shape``."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    meshes = _STATE.setdefault("dtensor_meshes", {})
    mesh = meshes.get(tuple(mesh_shape))
    if mesh is None:
        n = 1
        for s in mesh_shape:
            n *= s
        mesh = meshes[tuple(mesh_shape)] = DeviceMesh("cpu", torch.arange(n).reshape(tuple(mesh_shape)))
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    dt = DTensor.from_local(
        ctx.local(name),
        mesh,
        _torch_placements(placements),
        shape=torch.Size(shape),
        stride=tuple(stride),
        run_check=False,
    )
    _STATE[key] = (dt, mesh)


def _dt_run(ctx, key: str, placements, keep: bool) -> float:
    dt, mesh = _STATE[key]
    target = _torch_placements(placements)
    t0 = time.perf_counter()
    out = dt.redistribute(mesh, target).to_local()
    dt_s = time.perf_counter() - t0
    _keep(key, out, keep)
    return dt_s


def _dt_last(ctx, key: str):
    return _last(key)


def _dt_release(ctx, key: str) -> None:
    _KEPT.pop(key, None)


def _dt_drop(ctx, key: str) -> None:
    _drop(key)


class DTensorWorld:
    """A default gloo world over ``devices`` (rank = position in the list), through ``call_each``
    (the runtime's ordered ``call``: ``{device: (fn, args, kwargs)}, timeout_s -> {device: result}``)."""

    def __init__(self, devices: list[int], call_each, store_port: int, timeout_s: float = 120.0):
        import uuid

        self.devices, self.call_each, self.timeout_s = list(devices), call_each, timeout_s
        prefix = f"bench-dtensor/{uuid.uuid4().hex}"
        world = len(self.devices)
        self.call_each(
            {d: (_dt_init, (store_port, prefix, r, world, timeout_s), {}) for r, d in enumerate(self.devices)},
            timeout_s,
        )

    def close(self) -> None:
        self.call_each({d: (_dt_exit, (), {}) for d in self.devices}, 30.0)


class DTensorPeer:
    """``redistribute`` of the case's source DTensor to the destination placements (same mesh)."""

    def __init__(self, key: str, world: DTensorWorld, src_name: str, mesh_shape, src_placements, dst_placements, shape):
        self.key, self.world, self.dst_placements = key, world, tuple(dst_placements)
        self.in_actor: list[float] = []
        args = (key, src_name, tuple(mesh_shape), tuple(src_placements), tuple(shape))
        world.call_each({d: (_dt_load, args, {}) for d in world.devices}, world.timeout_s)

    def run(self, keep: bool) -> float:
        t0 = time.perf_counter()
        inner = self.world.call_each(
            {d: (_dt_run, (self.key, self.dst_placements, keep), {}) for d in self.world.devices}, self.world.timeout_s
        )
        dt = time.perf_counter() - t0
        self.in_actor.append(max(inner.values()))
        return dt

    def last(self) -> dict:
        return self.world.call_each({d: (_dt_last, (self.key,), {}) for d in self.world.devices}, self.world.timeout_s)

    def release(self) -> None:
        self.world.call_each({d: (_dt_release, (self.key,), {}) for d in self.world.devices}, self.world.timeout_s)

    def close(self) -> None:
        self.world.call_each({d: (_dt_drop, (self.key,), {}) for d in self.world.devices}, self.world.timeout_s)


# ------------------------------------------------------------------ memcpy ceiling


def _mc_setup(ctx, key: str, nbytes: int) -> None:
    import numpy as np

    _STATE[key] = (np.ones(nbytes, dtype=np.uint8), np.ones(nbytes, dtype=np.uint8))  # resident pages


def _mc_run(ctx, key: str) -> float:
    import numpy as np

    src, dst = _STATE[key]
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t0


def _mc_release(ctx, key: str) -> None:
    _STATE.pop(key, None)


class Memcpy:
    """Each destination device copies ``nbytes[device]`` between two resident buffers, all at once."""

    def __init__(self, key: str, nbytes: dict, call_each, timeout_s: float):
        self.key, self.nbytes, self.call_each, self.timeout_s = key, dict(nbytes), call_each, timeout_s
        self.in_actor: list[float] = []
        self.call_each({d: (_mc_setup, (key, n), {}) for d, n in self.nbytes.items()}, timeout_s)

    def run(self) -> float:
        t0 = time.perf_counter()
        inner = self.call_each({d: (_mc_run, (self.key,), {}) for d in self.nbytes}, self.timeout_s)
        dt = time.perf_counter() - t0
        self.in_actor.append(max(inner.values()))
        return dt

    def release(self) -> None:
        self.call_each({d: (_mc_release, (self.key,), {}) for d in self.nbytes}, 30.0)


# ------------------------------------------------------------------ start-up reference

_BARE_CLASS = None


def bare_startup_s(n: int, timeout_s: float = 180.0) -> float:
    """Start ``n`` bare Ray actors that import numpy; seconds until every one answered a first
    call. The actors are killed before this returns."""
    global _BARE_CLASS
    if _BARE_CLASS is None:

        @ray.remote(num_cpus=0)
        class BareActor:
            def __init__(self):
                import numpy  # noqa: F401

            def ping(self) -> None:
                return None

        _BARE_CLASS = BareActor
    t0 = time.perf_counter()
    actors = [_BARE_CLASS.remote() for _ in range(n)]
    try:
        ray.get([a.ping.remote() for a in actors], timeout=timeout_s)
        return time.perf_counter() - t0
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


# ------------------------------------------------------------------ whole trees (``bench.weights``)

_TREES: dict[str, list] = {}  # in an actor: a tree peer's latest output (one array per tensor), per key


@dataclass(frozen=True, slots=True, eq=False)
class TreeSpec:
    """A tree of tensors to move, as plain data: tensor ``names``, the source ``shards``' names on
    the device actors, the source ``arrays`` (numpy), per tensor each device's box of it on the
    source and destination side (``src_boxes[t][device]``, ``dst_boxes[t][device]``)."""

    names: tuple
    shards: tuple
    arrays: tuple
    src_boxes: tuple
    dst_boxes: tuple
    src_devices: tuple
    dst_devices: tuple
    timeout_s: float

    def dst_shapes(self) -> dict[int, list]:
        return {d: [box_shape(b[d]) for b in self.dst_boxes] for d in self.dst_devices}

    def route(self) -> tuple[dict, dict]:
        """Who sends what (``assign_pieces`` per tensor): ``pairs[(src, dst)]``, the pieces of every
        tensor that ``src`` sends ``dst`` as ``(tensor, box local to src's shard)``; per destination
        ``(sources in argument order, local pieces (tensor, src-local box, dst-local box), remote
        pieces (argument, index in that pair's list, tensor, dst-local box))``."""
        pairs: dict[tuple[int, int], list] = {}
        plans: dict[int, tuple[list, list, list]] = {d: ([], [], []) for d in self.dst_devices}
        for t, (src, dst) in enumerate(zip(self.src_boxes, self.dst_boxes, strict=True)):
            for d, pieces in assign_pieces(src, dst).items():
                srcs, local, remote = plans[d]
                for p in pieces:
                    dbox = relative(p.box, dst[d])
                    if p.src == d:
                        local.append((t, relative(p.box, src[d]), dbox))
                        continue
                    if p.src not in srcs:
                        srcs.append(p.src)
                    items = pairs.setdefault((p.src, d), [])
                    items.append((t, relative(p.box, src[p.src])))
                    remote.append((srcs.index(p.src), len(items) - 1, t, dbox))
        return pairs, plans

    def pieces_bytes(self, pairs: dict) -> int:
        return sum(box_volume(box) * self.arrays[t].itemsize for items in pairs.values() for t, box in items)

    def min_bytes(self) -> int:
        """Bytes that must cross between devices: each destination's box less what the same device
        holds of it in its source shard."""
        total = 0
        for a, src, dst in zip(self.arrays, self.src_boxes, self.dst_boxes, strict=True):
            for d, box in dst.items():
                own = intersect(box, src[d]) if d in src else None
                total += (box_volume(box) - (box_volume(own) if own else 0)) * a.itemsize
        return total

    def compare(self, got: dict) -> tuple[bool, str]:
        """Whether every destination's arrays (``got[device]``, in tensor order: a method's
        ``last()``) equal their boxes of the source arrays, bit for bit; and what differs."""
        import numpy as np

        for d in self.dst_devices:
            have = got.get(d)
            if have is None or len(have) != len(self.names):
                return False, f"device {d}: got {0 if have is None else len(have)} arrays, want {len(self.names)}"
            for name, a, boxes, g in zip(self.names, self.arrays, self.dst_boxes, have, strict=True):
                want, g = np.ascontiguousarray(a[_slices(boxes[d])]), np.ascontiguousarray(g)
                if g.shape != want.shape or g.dtype != want.dtype:
                    return (
                        False,
                        f"{name!r} on device {d}: got {g.dtype}{list(g.shape)}, want {want.dtype}{list(want.shape)}",
                    )
                if not np.array_equal(g.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)):
                    return False, f"{name!r} on device {d}: {int(np.count_nonzero(g != want))} elements differ"
        return True, f"{len(self.names)} tensors on {len(self.dst_devices)} devices bit-exact"


def _tree_last(actor, key: str) -> list:
    import numpy as np

    return [o if isinstance(o, np.ndarray) else o.numpy() for o in _TREES[key]]


def _tree_drop(actor, key: str) -> None:
    _TREES.pop(key, None)


class _TreePeer:
    """A tree peer on Ray actors (``actors``: global device id -> handle; ``fn(actor, ...)`` runs
    there through ``__ray_call__``): ``last()`` ({destination: arrays in tensor order}) and
    ``release()``."""

    def __init__(self, key: str, spec: TreeSpec, actors: dict):
        self.key, self.spec, self.actors, self.timeout_s = key, spec, actors, spec.timeout_s

    def _on(self, devices, fn, *args) -> list:
        return _get([self.actors[d].__ray_call__.remote(fn, *args) for d in devices], self.timeout_s)

    def last(self) -> dict:
        return dict(zip(self.spec.dst_devices, self._on(self.spec.dst_devices, _tree_last, self.key), strict=True))

    def release(self) -> None:
        self._on(self.spec.dst_devices, _tree_drop, self.key)

    def close(self) -> None:
        self.release()


def _os_put_tree(actor, shards: list, tensors: list) -> dict:
    """In a source actor: ``ray.put`` its whole shard of each tensor in ``tensors``."""
    return {t: ray.put(actor.reshard_device.local(shards[t]).numpy()) for t in tensors}


def _os_assemble_tree(actor, key: str, shards, shapes, dtype, local, remote, timeout_s: float, *puts) -> None:
    """In a destination actor: its shard of every tensor, from its own source shards (``local``)
    and the source shards that overlap it (``remote``: (argument, tensor, source-local box,
    destination-local box); ``puts[i]``: source i's references, by tensor)."""
    import numpy as np

    outs = [np.empty(s, dtype=dtype) for s in shapes]
    needed = sorted({(i, t) for i, t, _, _ in remote})
    got = dict(zip(needed, ray.get([puts[i][t] for i, t in needed], timeout=timeout_s), strict=True))
    for i, t, sbox, dbox in remote:
        outs[t][_slices(dbox)] = got[(i, t)][_slices(sbox)]
    del got
    for t, sbox, dbox in local:
        outs[t][_slices(dbox)] = actor.reshard_device.local(shards[t]).numpy()[_slices(sbox)]
    _TREES[key] = outs


class ObjectStoreTree(_TreePeer):
    """The object store as a user writes it for a tree, on the device actors: one call per source
    (``ray.put`` of its whole shard of every tensor some destination needs from it) and one per
    destination (``ray.get`` of the shards that overlap its own, the overlaps copied into its
    shards), the sources' references passed as top-level arguments. Moved bytes: the shards the
    destinations get (what would cross between machines)."""

    def __init__(self, key: str, spec: TreeSpec, actors: dict):
        super().__init__(key, spec, actors)
        pairs, self.plans = spec.route()
        self.tensors: dict[int, list] = {}  # source -> the tensors whose shard it puts
        self.moved = 0
        for d, (srcs, _, remote) in self.plans.items():
            whole = {(i, t) for i, _, t, _ in remote}
            self.moved += sum(box_volume(spec.src_boxes[t][srcs[i]]) * spec.arrays[t].itemsize for i, t in whole)
            remote[:] = [(i, t, pairs[(srcs[i], d)][j][1], dbox) for i, j, t, dbox in remote]
        for (s, _), items in pairs.items():
            self.tensors[s] = sorted({*self.tensors.get(s, ()), *(t for t, _ in items)})

    def run(self) -> float:
        spec, dtype, shapes = self.spec, str(self.spec.arrays[0].dtype), self.spec.dst_shapes()
        t0 = time.perf_counter()
        puts = {
            s: self.actors[s].__ray_call__.remote(_os_put_tree, list(spec.shards), tensors)
            for s, tensors in self.tensors.items()
        }
        done = [
            self.actors[d].__ray_call__.remote(
                _os_assemble_tree,
                self.key,
                list(spec.shards),
                shapes[d],
                dtype,
                local,
                remote,
                self.timeout_s,
                *(puts[s] for s in srcs),
            )
            for d, (srcs, local, remote) in self.plans.items()
        ]
        _get(done, self.timeout_s)
        return time.perf_counter() - t0

    def moved_bytes(self) -> int:
        return self.moved


def _naive_join(actor, key: str, port: int, rank: int, world: int, bcast_rank, bcast_size: int, timeout_s: float):
    """In a device actor: join the refit's world group and, if a member, its broadcast group."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timedelta(seconds=timeout_s))

    def group(name: str, r: int, n: int):
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1", lazy_init=True)]
        return dist.ProcessGroupGloo(dist.PrefixStore(f"bench-naive/{key}/{name}", store), r, n, opts)

    _STATE[key] = (group("world", rank, world), None if bcast_rank is None else group("bcast", bcast_rank, bcast_size))


def _naive_run(actor, key: str, steps: list) -> None:
    """In a device actor, per tensor in order: the root gathers the whole tensor (its own shard and
    the other sources' messages) or a source sends the root its shard; the broadcast group gets the
    whole tensor from the root; a destination keeps a copy of its slice. Waits are bounded by the
    groups' timeout."""
    import numpy as np
    import torch
    import torch.distributed as dist

    ctx, (world, bcast) = actor.reshard_device, _STATE[key]
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    outs = []
    for tag, (shard, shape, dtype, own, recvs, send, in_bcast, keep) in enumerate(steps):
        full = None
        if own is not None:
            full = torch.from_numpy(np.empty(shape, dtype=dtype))
            full[_slices(own)] = ctx.local(shard)
            for peer, box in recvs:
                buf = torch.from_numpy(np.empty(box_shape(box), dtype=dtype))
                world.recv([buf], peer, tag).wait()
                full[_slices(box)] = buf
        elif send:
            world.send([ctx.local(shard).contiguous()], 0, tag).wait()
        if in_bcast:
            full = torch.from_numpy(np.empty(shape, dtype=dtype)) if full is None else full
            bcast.broadcast([full], opts).wait()
        if keep is not None:
            outs.append(full[_slices(keep)].clone())
    _TREES[key] = outs


def _naive_leave(actor, key: str) -> None:
    _STATE.pop(key, None)
    _TREES.pop(key, None)


class NaiveRefit(_TreePeer):
    """torch.distributed gloo as a refit loop writes it, on the device actors (ranks: sources
    first; rank 0, the first source, is the root): per tensor, gather to the root, broadcast from
    the root to every destination (a group of the root and the destinations)."""

    def __init__(self, key: str, spec: TreeSpec, actors: dict, store_port: int):
        super().__init__(key, spec, actors)
        srcs, dsts = list(spec.src_devices), list(spec.dst_devices)
        members = srcs + [d for d in dsts if d not in srcs]
        rank = {d: i for i, d in enumerate(members)}
        root, bcast = srcs[0], [srcs[0]] + [d for d in dsts if d != srcs[0]]
        self.steps: dict[int, list] = {d: [] for d in members}
        self.moved = 0
        for shard, a, src, dst in zip(spec.shards, spec.arrays, spec.src_boxes, spec.dst_boxes, strict=True):
            gather, held = [], {src[root]}
            for s in srcs[1:]:  # each box the root lacks, from its first holder
                if src[s] not in held and box_volume(src[s]):
                    gather.append((s, src[s]))
                    held.add(src[s])
            self.moved += sum(box_volume(b) for _, b in gather) * a.itemsize + a.nbytes * (len(bcast) - 1)
            senders = {s for s, _ in gather}
            for d in members:
                own, recvs = (src[root], [(rank[s], b) for s, b in gather]) if d == root else (None, [])
                self.steps[d].append((shard, a.shape, str(a.dtype), own, recvs, d in senders, d in bcast, dst.get(d)))
        _get(
            [
                self.actors[d].__ray_call__.remote(
                    _naive_join,
                    key,
                    store_port,
                    rank[d],
                    len(members),
                    bcast.index(d) if d in bcast else None,
                    len(bcast),
                    self.timeout_s,
                )
                for d in members
            ],
            self.timeout_s,
        )

    def run(self) -> float:
        t0 = time.perf_counter()
        _get(
            [self.actors[d].__ray_call__.remote(_naive_run, self.key, steps) for d, steps in self.steps.items()],
            self.timeout_s,
        )
        return time.perf_counter() - t0

    def moved_bytes(self) -> int:
        return self.moved

    def close(self) -> None:
        self._on(list(self.steps), _naive_leave, self.key)


class TreeRdtActor(RdtActor):
    """``RdtActor`` for trees: its source shards of every tensor; one RDT call per (source,
    destination) pair carries that pair's pieces of every tensor."""

    def load_tree(self, key: str, shards: list) -> None:
        import numpy as np
        import torch

        self.sources[key] = [torch.from_numpy(np.array(s)) for s in shards]

    @ray.method(tensor_transport="gloo")
    def tree_pieces(self, key: str, items: list) -> list:
        src = self.sources[key]
        return [src[t][_slices(box)].contiguous() for t, box in items]

    def tree_assemble(self, key: str, shapes: list, dtype: str, local: list, remote: list, *lists) -> None:
        import numpy as np
        import torch

        outs = [torch.from_numpy(np.empty(s, dtype=dtype)) for s in shapes]
        for i, j, t, box in remote:
            outs[t][_slices(box)] = lists[i][j]
        for t, sbox, dbox in local:
            outs[t][_slices(dbox)] = self.sources[key][t][_slices(sbox)]
        _TREES[key] = outs


_TREE_RDT_CLASS = None


def tree_rdt_pool(n: int, timeout_s: float = 180.0) -> RdtPool:
    """``n`` ``TreeRdtActor``s in one torch_gloo group."""
    global _TREE_RDT_CLASS
    if _TREE_RDT_CLASS is None:
        _TREE_RDT_CLASS = ray.remote(num_cpus=0, enable_tensor_transport=True)(TreeRdtActor)
    return RdtPool(n, timeout_s, actor_class=_TREE_RDT_CLASS)


class DirectTransportTree(_TreePeer):
    """Ray Direct Transport between RDT actors (``actors``: global device id -> the RDT actor of
    its pool position); the sources' shards are loaded once, untimed."""

    def __init__(self, key: str, spec: TreeSpec, actors: dict):
        super().__init__(key, spec, actors)
        self.pairs, self.plans = spec.route()
        _get(
            [
                actors[s].load_tree.remote(
                    key, [a[_slices(b[s])] for a, b in zip(spec.arrays, spec.src_boxes, strict=True)]
                )
                for s in spec.src_devices
            ],
            self.timeout_s,
        )

    def run(self) -> float:
        dtype, shapes = str(self.spec.arrays[0].dtype), self.spec.dst_shapes()
        t0 = time.perf_counter()
        done = []
        for d, (srcs, local, remote) in self.plans.items():
            refs = [self.actors[s].tree_pieces.remote(self.key, self.pairs[(s, d)]) for s in srcs]
            done.append(self.actors[d].tree_assemble.remote(self.key, shapes[d], dtype, local, remote, *refs))
        _get(done, self.timeout_s)
        return time.perf_counter() - t0

    def moved_bytes(self) -> int:
        return self.spec.pieces_bytes(self.pairs)

    def close(self) -> None:
        self.release()
        _get([self.actors[s].drop.remote(self.key, True) for s in self.spec.src_devices], self.timeout_s)

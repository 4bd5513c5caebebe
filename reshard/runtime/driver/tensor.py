"""ShardedTensor: the handle on a tensor laid out over a DeviceMesh.

Ownership: a shard lives while some handle holds it (``reshard.runtime.device.shards``). The handle
``distribute``/``reshard`` return holds it, and so does every copy of it (pickled into a Ray task
or actor of the job, ``copy.deepcopy``); each lets go when garbage-collected. ``free()`` drops the
shards at once for every handle.

Timeouts: ``timeout_s`` is a positive finite number of seconds, or None for no limit; every wait
ends by then. bfloat16, float8 and numpy: numpy has no such types, so ``to_numpy()`` /
``local_shards()`` of such a tensor raise TypeError; use ``to_torch()`` / ``local_shards(as_torch=True)``.
"""

from __future__ import annotations

import itertools
import operator
import time
import uuid
from collections import deque

import numpy as np
import ray

from reshard.dtypes import BIT_PATTERN, itemsize, storage_name
from reshard.errors import ReshardError
from reshard.ir.layout import Layout
from reshard.ir.regions import box_volume, layout_regions
from reshard.runtime.deadlines import DEFAULT_TIMEOUT_S, Deadline, check_timeout
from reshard.runtime.driver.dispatch import failure_error
from reshard.runtime.driver.mesh import DeviceMesh
from reshard.runtime.driver.signed import Signed
from reshard.runtime.driver.unit_descriptors import UnitDescriptors
from reshard.runtime.messages import copy_holder

FETCH_RETRY_S = 0.005  # a read whose shards disagree reads again after this pause, then twice as long
FETCH_RETRY_MAX_S = 0.2
VERSIONS_WAIT_S = 10.0  # how long a read waits for its shards' devices to agree on the last sync


class ShardedTensor:
    """A tensor laid out over a DeviceMesh; its bytes live on the device actors.

    ``shape`` (tuple), ``dtype`` (numpy dtype; ``dtype_name`` the canonical name, ``torch_dtype``
    torch's), ``layout``, ``mesh`` (the DeviceMesh), ``name`` (the actors' shard name). DTensor's
    vocabulary: ``placements``, ``device_mesh``, ``full_tensor()``. Reading it back is explicit
    (``full_tensor``, ``to_numpy``, ``to_torch``, ``local_shards``): ``np.asarray`` of a handle is
    refused rather than silently making an object array."""

    # a tree call makes tens of thousands at once: no per-handle dict to allocate and collect
    __slots__ = (
        "__weakref__",
        "_descriptors",
        "_freed",
        "_holder",
        "_index",
        "_key",
        "_placed",
        "_source",
        "dtype_name",
        "layout",
        "mesh",
        "name",
        "shape",
    )

    def __init__(
        self,
        mesh: DeviceMesh,
        layout: Layout,
        shape,
        dtype: str,
        name: str,
        shared=None,
        holder=None,
        *,
        copy=True,
        placed: UnitDescriptors | None = None,
        index: int = -1,
    ):
        self.mesh = mesh
        self.layout = layout
        self.shape = tuple(shape)
        self.dtype_name = dtype
        self.name = name
        # device -> shared-memory descriptor of its shard (``copy`` False: a dict made for this handle alone)
        self._descriptors = dict(shared or {}) if copy or shared is None else shared
        self._placed, self._index = placed, index  # more of them, as its call's columns (``_shared``)
        self._holder = name if holder is None else holder
        self._freed = False
        self._key: Signed | None = None
        self._source: Signed | None = None

    @property
    def _shared(self) -> dict:
        """Device -> shared-memory descriptor of its shard: those its devices returned as columns
        are read out of them the first time (``unit_descriptors``)."""
        placed = self._placed
        if placed is not None:
            self._descriptors.update(placed.of(self._index))
            self._placed = None
        return self._descriptors

    @property
    def _signature(self) -> Signed:
        """What a compiled reshard depends on of this tensor: its layout, shape, dtype and the
        devices whose shard peers can map; made once, its hash kept (a tree's replay looks its
        plan up by thousands of them)."""
        if self._key is None:
            self._key = Signed((self.layout, self.shape, self.dtype_name, frozenset(self._shared)))
        return self._key

    @property
    def _source_key(self) -> Signed:
        """What a binding depends on of this tensor as a source: its shard name and descriptors;
        made once, its hash kept (a replay looks its binding up by thousands of them)."""
        if self._source is None:
            self._source = Signed((self.name, tuple(self._shared.items())))
        return self._source

    def __repr__(self) -> str:
        state = ", freed" if self._freed else ""
        return f"ShardedTensor({self.dtype_name}{list(self.shape)}, {self.layout}, shard={self.name!r}{state})"

    def __reduce__(self):
        """A copy holds the shards under a token until it is unpickled (module docstring)."""
        self._check("pickling")
        token = f"{self.name}/pickled/{uuid.uuid4().hex[:12]}"
        self.mesh.runtime.hold_later(True, self.mesh.device_ids, self.name, token)
        return _rebuild, (self.mesh, self.layout, self.shape, self.dtype_name, self.name, self._shared, token)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype (bfloat16, float8: ``ml_dtypes``' when installed; ``torch_dtype`` always works)."""
        if self.dtype_name not in BIT_PATTERN:
            return np.dtype(self.dtype_name)
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(
                f"{self!r}: numpy has no {self.dtype_name} (install ml_dtypes); use .torch_dtype or .dtype_name"
            ) from None
        return np.dtype(getattr(ml_dtypes, self.dtype_name))

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
        """The shards of flat ``indices``, each whole and all last committed into by the same sync:
        a read from another process while a sync's commits reach some devices before others reads
        again (with a growing pause) until they agree, for at most ``VERSIONS_WAIT_S``; then it
        raises (a split: a commit failed on some devices)."""
        rt = self.mesh.runtime
        deadline = Deadline.after(timeout_s)
        rt.works.after(frozenset({self.name}), frozenset(), deadline)  # this process's pending writes first
        ids = {i: self.mesh.device_ids[i] for i in indices}
        regions = layout_regions(self.layout, self.shape)
        compared = [i for i in indices if box_volume(regions[i])]  # an empty shard is written by none
        pause = FETCH_RETRY_S
        agree_by = time.monotonic() + VERSIONS_WAIT_S
        split: dict | None = None  # sync -> devices, as the last read found them disagree
        while True:
            refs = {ids[i]: self.mesh.actor(i).reshard_fetch.remote(self.name, deadline.budget, True) for i in indices}
            outcome = rt.dispatch.wait(refs, deadline, "reading a tensor back")
            if not outcome.ok:
                gone = [d for d, f in outcome.failures.items() if isinstance(f.error, KeyError)]
                if gone and not outcome.died:
                    raise ValueError(
                        f"reading {self!r}: its shards are gone on devices {gone} (freed by another handle?)"
                    )
                if split is not None and not outcome.failures:  # the deadline came while it read again
                    raise self._split(split)
                raise failure_error(outcome, f"reading {self!r}", deadline)
            got = {i: outcome.results[ids[i]] for i in indices}
            split = {}
            for i in compared:
                split.setdefault(got[i][1], []).append(ids[i])
            if len(split) <= 1:
                return {i: a for i, (a, _) in got.items()}
            if deadline.left() <= pause or time.monotonic() + pause >= agree_by:
                raise self._split(split)
            time.sleep(pause)
            pause = min(2 * pause, FETCH_RETRY_MAX_S)

    def _split(self, by_version: dict) -> ReshardError:
        """The error of a read whose devices hold different syncs (``by_version``: sync -> devices)."""
        held = "; ".join(
            f"devices {d} hold {'values no sync wrote' if v is None else f'sync {v}'}" for v, d in by_version.items()
        )
        return ReshardError(
            f"reading {self!r}: its shards were last committed into by different syncs ({held}), for "
            f"{VERSIONS_WAIT_S:g} s or the read's timeout: a commit failed on some devices (its sync's error "
            "said which), or another process's sync is still committing (wait for its Work)"
        )

    def _assemble(self, timeout_s: float | None) -> np.ndarray:
        self._check("to_numpy")
        regions = layout_regions(self.layout, self.shape)
        first: dict = {}
        for i, box in enumerate(regions):
            if box_volume(box) and box not in first:
                first[box] = i
        out = np.empty(self.shape, dtype=storage_name(self.dtype_name))
        shards = self._fetch(sorted(first.values()), check_timeout(timeout_s))
        for box, i in first.items():
            out[tuple(slice(lo, hi) for lo, hi in box)] = shards[i]
        return out

    def to_numpy(self, *, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> np.ndarray:
        """The full tensor, assembled here (one holder per distinct region). It waits for this
        process's pending works that write it, and each shard is read whole: a write into it (a
        commit, a ``direct`` run) from any process is waited for, never read halfway; and every
        device read holds the same ``out=`` sync's values (``_fetch``)."""
        if self.dtype_name in BIT_PATTERN:
            raise TypeError(
                f"{self!r}: numpy has no {self.dtype_name}; use .to_torch() (or .to_torch().float().numpy())"
            )
        return self._assemble(timeout_s)

    def to_torch(self, *, timeout_s: float | None = DEFAULT_TIMEOUT_S):
        """The full tensor as a CPU torch tensor (any dtype, bfloat16 included)."""
        import torch

        out = torch.from_numpy(self._assemble(timeout_s))
        return out.view(self.torch_dtype) if self.dtype_name in BIT_PATTERN else out

    def local_shards(self, *, as_torch: bool = False, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> dict:
        """``{flat device index in mesh: shard}`` as numpy arrays (torch tensors with ``as_torch``)."""
        if self.dtype_name in BIT_PATTERN and not as_torch:
            raise TypeError(f"{self!r}: numpy has no {self.dtype_name}; use .local_shards(as_torch=True)")
        self._check("local_shards")
        shards = self._fetch(range(self.mesh.size), check_timeout(timeout_s))
        if not as_torch:
            return {i: shards[i] for i in range(self.mesh.size)}
        import torch

        out = {}
        for i in range(self.mesh.size):
            t = torch.from_numpy(np.array(shards[i]))
            out[i] = t.view(self.torch_dtype) if self.dtype_name in BIT_PATTERN else t
        return out

    # ---------------------------------------------------------------- lifetime

    def free(self) -> None:
        """Drop the shards on every device, for every handle (idempotent). ``MeshClosed`` when the
        Ray session the tensor lived in is gone (its shards went with it)."""
        if self._freed:
            return
        self._freed = True
        Frees.count += 1
        self.mesh.runtime.registry.check_session(self.mesh.device_ids, f"freeing {self!r}")
        self.mesh.runtime.free(self.mesh.device_ids, (self.name,))

    def __del__(self):
        try:
            if not self._freed and ray.is_initialized():
                self._freed = True
                self.mesh.runtime.hold_later(False, self.mesh.device_ids, self.name, self._holder)
        except Exception:  # interpreter shutdown, Ray gone: nothing to release
            pass


def free(tree) -> None:
    """``free()`` every ShardedTensor of ``tree`` (one, or a tree of them: dicts, lists, tuples, as
    ``reshard`` returns them), with one call per device for all of them (a model's state dict: not
    one call per tensor). Idempotent; ``MeshClosed`` when their Ray session is gone (then none is
    freed). A tree's handles are taken as columns, a few meshes among tens of thousands of them."""
    from reshard.pytree import flatten

    leaves, _, _ = flatten(tree, lambda x: isinstance(x, ShardedTensor), ShardedTensor)
    live = list(itertools.compress(leaves, map(operator.not_, map(_FREED, leaves))))
    meshes = list(map(_MESH, live))
    some = dict(zip(map(id, meshes), live, strict=True))  # a handle of each mesh
    for t in some.values():
        t.mesh.runtime.registry.check_session(t.mesh.device_ids, f"freeing {t!r}")
    names: dict[int, list[str]] = {}  # id of a mesh -> its handles' names
    if len(some) == 1:
        names = dict.fromkeys(some, list(map(_NAME, live)))
    else:
        for key, name in zip(map(id, meshes), map(_NAME, live), strict=True):
            names.setdefault(key, []).append(name)
    deque(map(setattr, live, itertools.repeat("_freed"), itertools.repeat(True)), maxlen=0)
    Frees.count += 1
    for key, t in some.items():  # a call per device of each mesh
        t.mesh.runtime.free(t.mesh.device_ids, names[key])


class Frees:
    """How many times this process freed handles (``free``): that none of a list of handles is
    freed, once checked, holds until this changes (a replay's thousands: ``resharding.Held``)."""

    count = 0


_FREED = operator.attrgetter("_freed")  # the attribute, not the property: thousands of handles a call
_MESH = operator.attrgetter("mesh")
_NAME = operator.attrgetter("name")


def _rebuild(mesh, layout, shape, dtype, name, shared, token) -> ShardedTensor:
    rt = mesh.runtime
    holder = copy_holder(name, rt.id, uuid.uuid4().hex[:12])
    rt.hold_later(True, mesh.device_ids, name, holder)  # queued: a tree's copies cost a call per device
    rt.hold_later(False, mesh.device_ids, name, token)
    return ShardedTensor(mesh, layout, shape, dtype, name, shared, holder)


__all__ = ["ShardedTensor", "free"]

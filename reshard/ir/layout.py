"""Layouts: a mesh plus one placement per mesh axis.

Several axes may shard the same tensor dim; the lower-numbered axis splits outermost, except a
``StridedShard`` axis (torch's ``_StridedShard``, FSDP2 over tensor parallelism), which splits
after the later axes that shard its dim. ``Partial``
axes hold contributions whose reduction is the tensor (all ``Partial`` axes of a layout use one
reduce op); for region math a ``Partial`` axis is like ``Replicate``. Placements may be given by
mesh axis name (``Layout.from_spec``). ``Shard(-1)`` and friends are resolved against the tensor's
rank by ``for_shape``, which every user of a layout applies before planning.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass, field

from reshard.ir.chunking import chunk
from reshard.ir.placement import Partial, Placement, ReduceOp, Replicate, Shard, StridedShard, as_placement
from topology.mesh import Mesh


@dataclass(frozen=True, slots=True, init=False)
class Layout:
    """How a tensor is laid out over ``mesh``: ``placements[a]`` says what mesh axis ``a`` does."""

    mesh: Mesh
    placements: tuple[Placement, ...]
    _hash: int = field(compare=False, repr=False)

    def __init__(self, mesh, placements):
        mesh = getattr(mesh, "mesh", mesh)  # a runtime DeviceMesh carries its abstract Mesh
        if not isinstance(mesh, Mesh):
            raise TypeError(f"Layout needs a topology.Mesh or reshard.DeviceMesh, got {type(mesh).__name__}")
        if isinstance(placements, Placement) or not isinstance(placements, tuple | list):
            placements = (placements,)
        placements = tuple(as_placement(p) for p in placements)
        if len(placements) != mesh.ndim:
            raise ValueError(
                f"Layout for mesh of shape {mesh.shape} needs {mesh.ndim} placements (one per mesh axis), "
                f"got {len(placements)}: {_fmt(placements, None)}; e.g. {_fmt((Replicate(),) * mesh.ndim, None)}"
            )
        ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
        if len(ops) > 1:
            raise ValueError(
                f"layout {_fmt(placements, mesh.axis_names)}: Partial axes with different reduce ops "
                f"{sorted(o.value for o in ops)}; one layout reduces its contributions one way"
            )
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "placements", placements)
        object.__setattr__(self, "_hash", hash((mesh, placements)))  # layouts key many caches

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return f"{_fmt(self.placements, self.mesh.axis_names)} on mesh {self.mesh.shape}"

    @classmethod
    def replicated(cls, mesh) -> Layout:
        mesh = getattr(mesh, "mesh", mesh)
        return cls(mesh, (Replicate(),) * mesh.ndim)

    @classmethod
    def from_spec(cls, mesh, spec) -> Layout:
        """A layout by mesh axis names: ``{"tp": Shard(0)}`` (axes not named are replicated) or a
        PartitionSpec-like sequence over the TENSOR dims, each entry a mesh axis name, a tuple of
        names (outermost first, as JAX reads it) or None: ``("dp", None)`` shards dim 0 over axis
        ``dp``. The names of one entry come in mesh order, or in mesh order but for the first axis
        of the mesh last (``("tp", "dp")`` on a ``("dp", "tp")`` mesh: a ``StridedShard``, as
        FSDP2 over tensor parallelism); any other order raises ValueError (no layout here)."""
        mesh_ = getattr(mesh, "mesh", mesh)
        names = mesh_.axis_names
        if not names:
            raise ValueError(f"Layout.from_spec needs a mesh with axis_names, got {mesh_}; name its axes at creation")

        def axis(name) -> int:
            if name not in names:
                raise ValueError(f"{name!r} is not an axis of mesh {mesh_} (axes {list(names)})")
            return names.index(name)

        placements: list[Placement] = [Replicate()] * mesh_.ndim
        if isinstance(spec, dict):
            for name, p in spec.items():
                placements[axis(name)] = as_placement(p)
            return cls(mesh_, placements)
        for dim, entry in enumerate(spec):
            entry_names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            order = [axis(name) for name in entry_names]
            strided = len(order) > 1 and order == [*sorted(order)[1:], min(order)]
            if order != sorted(order) and not strided:
                in_mesh = tuple(names[a] for a in sorted(order))
                raise ValueError(
                    f"spec {tuple(spec)}: entry {tuple(entry_names)} splits dim {dim} by {entry_names[0]!r} outermost "
                    f"(as JAX and DTensor read it), but a layout here splits the axes of one dim in mesh order, "
                    f"{in_mesh[0]!r} outermost, or in mesh order with the first last (a StridedShard): that order has "
                    f"no placement here. List them as {in_mesh} (a different layout of the data) or build the mesh "
                    "with its axes in the spec's order"
                )
            for name, a in zip(entry_names, order, strict=True):
                if placements[a] != Replicate():
                    raise ValueError(f"spec {tuple(spec)} uses mesh axis {name!r} twice")
                placements[a] = Shard(dim)
            if strided:  # the mesh's first axis of the entry splits last
                later = math.prod(mesh_.shape[a] for a in order[:-1])
                placements[order[-1]] = StridedShard(dim, later)
        return cls(mesh_, placements)

    def check_shape(self, shape: tuple[int, ...]) -> None:
        """Raise ValueError if a tensor of ``shape`` cannot take this layout."""
        n = len(shape)
        for axis, p in enumerate(self.placements):
            if isinstance(p, Shard) and not -n <= p.dim < n:
                raise ValueError(
                    f"layout {self}: mesh axis {axis} shards dim {p.dim} but the tensor of shape {tuple(shape)} "
                    f"has {n} dims; use Shard(d) with {-n} <= d < {n} or Replicate()"
                )
        for axis, p in enumerate(self.placements):
            if isinstance(p, StridedShard):
                self._check_strided(axis, p, tuple(shape))

    def _check_strided(self, axis: int, p: StridedShard, shape: tuple[int, ...]) -> None:
        """A ``StridedShard`` axis must be the first to shard its dim, the later axes that shard it
        must multiply to its split factor, and torch's split must give each device the box this
        layout's regions give it (true for even splits; not for every uneven one)."""
        dim = p.dim % len(shape)
        on_dim = [a for a, q in enumerate(self.placements) if isinstance(q, Shard) and q.dim % len(shape) == dim]
        later = [a for a in on_dim if a > axis]
        if on_dim[0] != axis or any(isinstance(self.placements[a], StridedShard) for a in later):
            raise ValueError(
                f"layout {self}: a StridedShard axis must be the only one and the first to shard dim {dim}"
            )
        sizes = [self.mesh.shape[a] for a in later]
        if math.prod(sizes) != p.split_factor:
            raise ValueError(
                f"layout {self}: StridedShard on mesh axis {axis} has split_factor {p.split_factor}, but the later "
                f"axes that shard dim {dim} have {math.prod(sizes)} devices; they must be equal"
            )
        n, parts = shape[dim], self.mesh.shape[axis]
        for outer in range(parts):
            for inner in itertools.product(*(range(k) for k in sizes)):
                if _torch_strided(n, p.split_factor, parts, outer, sizes, inner) != _nested(
                    n, sizes, inner, parts, outer
                ):
                    raise ValueError(
                        f"layout {self}: torch's strided split of dim {dim} of size {n} does not give each device "
                        "the box that splitting by the later axes first gives it (an uneven size); redistribute to "
                        "plain Shard placements first"
                    )

    def for_shape(self, shape: tuple[int, ...]) -> Layout:
        """This layout for a tensor of ``shape``: checked, negative shard dims resolved (worked out
        once per layout and shape: a state dict asks for thousands of tensors of a few shapes)."""
        return _for_shape(self, tuple(shape))

    def sharded_axes(self, dim: int) -> tuple[int, ...]:
        """Mesh axes that split tensor dim ``dim``, outermost first (a ``StridedShard`` axis after
        the others)."""
        axes = [a for a, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == dim]
        return tuple(sorted(axes, key=lambda a: isinstance(self.placements[a], StridedShard)))

    @property
    def partial_axes(self) -> tuple[int, ...]:
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, Partial))

    @property
    def reduce_op(self) -> ReduceOp | None:
        """The reduce op of the Partial axes (None: no Partial axis)."""
        return next((p.reduce_op for p in self.placements if isinstance(p, Partial)), None)

    def contribution(self, flat: int) -> tuple[int, ...]:
        """Which contribution the device at flat index ``flat`` holds: its coordinates on the
        Partial axes (``()`` without Partial axes)."""
        coords = self.mesh.coords(flat)
        return tuple(coords[a] for a in self.partial_axes)


def _nested(n: int, sizes, inner, parts: int, outer: int) -> tuple[int, int]:
    """The interval a device holds when the later axes (``sizes``, at ``inner``) split ``[0, n)``
    first and the strided axis (``parts``, at ``outer``) then splits that piece ((0, 0): none)."""
    lo, hi = 0, n
    for k, c in zip(sizes, inner, strict=True):
        lo, hi = chunk(lo, hi, k, c)
    lo, hi = chunk(lo, hi, parts, outer)
    return (lo, hi) if lo < hi else (0, 0)


def _torch_strided(n: int, split: int, parts: int, outer: int, sizes, inner) -> tuple[int, int] | None:
    """The interval torch gives the same device (``_StridedShard._split_tensor``: ``[0, n)`` cut in
    ``split`` pieces, each cut in ``parts``, the ``outer``-th of each concatenated, which the later
    axes then split as a plain tensor; (0, 0): none); None when that is not one interval."""
    runs = [chunk(*chunk(0, n, split, j), parts, outer) for j in range(split)]
    lo, hi = 0, sum(b - a for a, b in runs)
    for k, c in zip(sizes, inner, strict=True):
        lo, hi = chunk(lo, hi, k, c)
    pos, out = 0, []
    for a, b in runs:
        s, e = max(lo, pos), min(hi, pos + b - a)
        if s < e:
            out.append((a + s - pos, a + e - pos))
        pos += b - a
    return (0, 0) if not out else out[0] if len(out) == 1 else None


def _fmt(placements, names) -> str:
    if names:
        return "(" + ", ".join(f"{n}: {p}" for n, p in zip(names, placements, strict=False)) + ")"
    return "(" + ", ".join(str(p) for p in placements) + ")"


@functools.lru_cache(maxsize=8192)
def _for_shape(layout: Layout, shape: tuple[int, ...]) -> Layout:
    layout.check_shape(shape)
    n = len(shape)
    if not any(isinstance(p, Shard) and p.dim < 0 for p in layout.placements):
        return layout
    return Layout(
        layout.mesh,
        tuple(
            dataclasses.replace(p, dim=p.dim + n) if isinstance(p, Shard) and p.dim < 0 else p
            for p in layout.placements
        ),
    )

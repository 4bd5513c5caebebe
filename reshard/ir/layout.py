"""Layouts: a mesh plus one placement per mesh axis.

Several axes may shard the same tensor dim; the lower-numbered axis splits outermost. ``Partial``
axes hold contributions whose reduction is the tensor (all ``Partial`` axes of a layout use one
reduce op); for region math a ``Partial`` axis is like ``Replicate``. Placements may be given by
mesh axis name (``Layout.from_spec``). ``Shard(-1)`` and friends are resolved against the tensor's
rank by ``for_shape``, which every user of a layout applies before planning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reshard.ir.placement import Partial, Placement, ReduceOp, Replicate, Shard, as_placement
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
        names (outermost first, as JAX reads it; the names of one entry must come in mesh order,
        else ValueError: that split has no layout here) or None: ``("dp", None)`` shards dim 0 over
        axis ``dp``."""
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
            if order != sorted(order):
                in_mesh = tuple(names[a] for a in sorted(order))
                raise ValueError(
                    f"spec {tuple(spec)}: entry {tuple(entry_names)} splits dim {dim} by {entry_names[0]!r} outermost "
                    f"(as JAX and DTensor read it), but a layout here splits the axes of one dim in mesh order, "
                    f"{in_mesh[0]!r} outermost: that order has no placement here. List them as {in_mesh} (a "
                    "different layout of the data) or build the mesh with its axes in the spec's order"
                )
            for name, a in zip(entry_names, order, strict=True):
                if placements[a] != Replicate():
                    raise ValueError(f"spec {tuple(spec)} uses mesh axis {name!r} twice")
                placements[a] = Shard(dim)
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

    def for_shape(self, shape: tuple[int, ...]) -> Layout:
        """This layout for a tensor of ``shape``: checked, negative shard dims resolved."""
        self.check_shape(shape)
        n = len(shape)
        if not any(isinstance(p, Shard) and p.dim < 0 for p in self.placements):
            return self
        return Layout(self.mesh, tuple(Shard(p.dim + n) if isinstance(p, Shard) and p.dim < 0 else p
                                       for p in self.placements))  # fmt: skip

    def sharded_axes(self, dim: int) -> tuple[int, ...]:
        """Mesh axes that split tensor dim ``dim``, outermost first."""
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == dim)

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


def _fmt(placements, names) -> str:
    if names:
        return "(" + ", ".join(f"{n}: {p}" for n, p in zip(names, placements, strict=False)) + ")"
    return "(" + ", ".join(str(p) for p in placements) + ")"

"""Layouts: a mesh plus one placement per mesh axis."""

from __future__ import annotations

from dataclasses import dataclass

from reshard.placement import Placement, Replicate, Shard
from topology.mesh import Mesh


@dataclass(frozen=True, slots=True)
class Layout:
    """How a tensor is laid out over ``mesh``: ``placements[a]`` says what mesh axis ``a`` does.

    Several axes may shard the same tensor dim; the lower-numbered axis splits outermost.
    """

    mesh: Mesh
    placements: tuple[Placement, ...]

    def __init__(self, mesh, placements):
        mesh = getattr(mesh, "mesh", mesh)  # a runtime DeviceMesh carries its abstract Mesh
        if not isinstance(mesh, Mesh):
            raise TypeError(f"Layout needs a topology.Mesh or reshard.DeviceMesh, got {type(mesh).__name__}")
        if isinstance(placements, Placement):
            placements = (placements,)
        placements = tuple(placements)
        for p in placements:
            if not isinstance(p, Placement):
                raise TypeError(f"placements must be Shard(dim) or Replicate() values, got {p!r}")
        if len(placements) != mesh.ndim:
            raise ValueError(
                f"Layout for mesh of shape {mesh.shape} needs {mesh.ndim} placements (one per mesh axis), "
                f"got {len(placements)}: {_fmt(placements)}; e.g. {_fmt((Replicate(),) * mesh.ndim)}"
            )
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "placements", placements)

    def __str__(self) -> str:
        return f"{_fmt(self.placements)} on mesh {self.mesh.shape}"

    @classmethod
    def replicated(cls, mesh) -> Layout:
        mesh = getattr(mesh, "mesh", mesh)
        return cls(mesh, (Replicate(),) * mesh.ndim)

    def check_shape(self, shape: tuple[int, ...]) -> None:
        """Raise ValueError if a tensor of ``shape`` cannot take this layout."""
        for axis, p in enumerate(self.placements):
            if isinstance(p, Shard) and p.dim >= len(shape):
                raise ValueError(
                    f"layout {self}: mesh axis {axis} shards dim {p.dim} but the tensor of shape {tuple(shape)} "
                    f"has {len(shape)} dims; use Shard(d) with 0 <= d < {len(shape)} or Replicate()"
                )

    def sharded_axes(self, dim: int) -> tuple[int, ...]:
        """Mesh axes that split tensor dim ``dim``, outermost first."""
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == dim)


def _fmt(placements) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"

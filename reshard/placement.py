"""Placements: how one mesh axis lays a tensor out (DTensor convention)."""

from __future__ import annotations

from dataclasses import dataclass


class Placement:
    """Base of the placement values; a layout has one per mesh axis."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """The mesh axis splits tensor dim ``dim`` (torch.chunk semantics: leading shards take the ceiling)."""

    dim: int

    def __post_init__(self):
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim) needs an int tensor dim, got {self.dim!r}")
        if self.dim < 0:
            raise ValueError(f"Shard(dim={self.dim}): negative dims are not accepted; count dims from 0")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every device along the mesh axis holds the same data."""

    def __str__(self) -> str:
        return "R"

"""Placements: how one mesh axis lays a tensor out (DTensor convention).

``Shard(dim)`` splits a tensor dim over the axis (``Shard(-1)``: the last dim, resolved once the
tensor's rank is known), ``Replicate()`` copies it, ``Partial(op)`` leaves each device along the axis
one contribution, the tensor being their reduction. torch's own placement objects
(``torch.distributed.tensor.Shard/Replicate/Partial``) are accepted wherever ours are
(``as_placement``) without importing torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Placement:
    """Base of the placement values; a layout has one per mesh axis."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """The mesh axis splits tensor dim ``dim`` (torch.chunk semantics: leading shards take the
    ceiling). A negative ``dim`` counts from the last dim."""

    dim: int

    def __post_init__(self):
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim) needs an int tensor dim, got {self.dim!r}")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class StridedShard(Shard):
    """torch's ``_StridedShard``: the mesh axis splits tensor dim ``dim`` after the later axes that
    shard it (whose sizes multiply to ``split_factor``), not before them: FSDP2 over tensor
    parallelism, where the tensor-parallel axis splits a weight first and the data-parallel axis
    (listed first) splits each piece. Each device still holds one box (``Layout.check_shape``
    refuses a shape for which torch's split would not give one)."""

    split_factor: int = 1

    def __post_init__(self):
        Shard.__post_init__(self)
        if not isinstance(self.split_factor, int) or isinstance(self.split_factor, bool) or self.split_factor < 1:
            raise ValueError(f"StridedShard needs a positive int split_factor, got {self.split_factor!r}")

    def __str__(self) -> str:
        return f"_S({self.dim}, {self.split_factor})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every device along the mesh axis holds the same data."""

    def __str__(self) -> str:
        return "R"


class ReduceOp(str, enum.Enum):
    """How the contributions of a ``Partial`` axis combine."""

    SUM = "sum"
    AVG = "avg"  # the sum divided by the number of contributions (floating point dtypes)
    MAX = "max"
    MIN = "min"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Every device along the mesh axis holds a contribution of the whole (unsharded along this
    axis) region; the tensor is their reduction by ``reduce_op`` (DTensor's pending reduction)."""

    reduce_op: ReduceOp = ReduceOp.SUM

    def __init__(self, reduce_op: ReduceOp | str = ReduceOp.SUM):
        try:
            op = ReduceOp(getattr(reduce_op, "value", reduce_op))
        except ValueError:
            ops = ", ".join(o.value for o in ReduceOp)
            raise ValueError(f"Partial(reduce_op={reduce_op!r}): unknown reduce op; choose one of {ops}") from None
        object.__setattr__(self, "reduce_op", op)

    def __str__(self) -> str:
        return f"P({self.reduce_op.value})"


_TORCH_OPS = {"sum": "sum", "avg": "avg", "mean": "avg", "max": "max", "min": "min"}


def as_placement(p) -> Placement:
    """``p`` as one of our placements: ours as is, torch's ``Shard``, ``_StridedShard``,
    ``Replicate`` and ``Partial`` converted (recognised by type, without importing torch);
    TypeError for anything else."""
    if isinstance(p, Placement):
        return p
    cls = type(p)
    if cls.__module__.startswith("torch.distributed"):
        name = cls.__name__
        if name == "Shard":
            return Shard(int(p.dim))
        if name == "Replicate":
            return Replicate()
        if name == "Partial":
            op = str(getattr(p, "reduce_op", "sum")).lower().removeprefix("reduceop.")
            if op not in _TORCH_OPS:
                raise ValueError(
                    f"torch Partial with reduce op {op!r} has no counterpart; use one of sum, avg, max, min"
                )
            return Partial(_TORCH_OPS[op])
        if name == "_StridedShard":
            return StridedShard(int(p.dim), int(p.split_factor))
    raise TypeError(
        f"placements must be Shard(dim), Replicate() or Partial(op) values (ours or torch.distributed.tensor's), "
        f"got {p!r}"
    )

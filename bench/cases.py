"""Benchmark cases: layout pairs over a small pool of devices (pure: numpy-free, no ray/torch).

A case names a source and a destination mesh *view* over global device ids ``0..n-1`` (the device
actors of one pool, reused by every case), one placement per mesh axis on each side, and how to
shape a tensor of a requested byte size. The same definitions serve any suite that wants them
(local Ray runs, simulation): they are plain data over ``topology.Mesh`` and ``reshard.Layout``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from reshard.dtypes import itemsize
from reshard.ir.layout import Layout
from reshard.ir.placement import Placement, Replicate, Shard
from topology.mesh import Mesh

R = Replicate()


def S(dim: int) -> Shard:  # noqa: N802 - reads like the placement's own str
    return Shard(dim)


@dataclass(frozen=True, slots=True)
class MeshView:
    """A mesh over pool positions ``device_ids``.

    ``host_ids=None``: the view gets hosts of its own, axis 0 enumerating them (a pipeline stage on
    its own machines). Given ``host_ids`` must be the pool's own hosts of those devices
    (``POOL_HOST_IDS``): the view shares hosts with the pool (overlapping meshes).
    """

    shape: tuple[int, ...]
    device_ids: tuple[int, ...]
    host_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if len(self.device_ids) != math.prod(self.shape):
            raise ValueError(f"mesh view {self.shape} needs {math.prod(self.shape)} devices, got {self.device_ids}")

    @property
    def resolved_host_ids(self) -> tuple[int, ...]:
        if self.host_ids is not None:
            return self.host_ids
        # Hosts of its own: named after their first device, apart from the pool's hosts.
        per_host = self.devices_per_host
        return tuple(100 + self.device_ids[i - i % per_host] for i in range(len(self.device_ids)))

    @property
    def devices_per_host(self) -> int:
        return math.prod(self.shape[1:])

    def mesh(self) -> Mesh:
        return Mesh(self.shape, self.device_ids, self.resolved_host_ids)

    def __str__(self) -> str:
        return "x".join(map(str, self.shape)) + "[" + ",".join(map(str, self.device_ids)) + "]"


@dataclass(frozen=True, slots=True)
class Case:
    """One layout pair. ``uneven`` shapes the tensor so that no sharded dim divides evenly."""

    name: str
    what: str
    src: MeshView
    src_placements: tuple[Placement, ...]
    dst: MeshView
    dst_placements: tuple[Placement, ...]
    ndim: int = 2
    uneven: bool = False

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device either side uses, sorted."""
        return tuple(sorted(set(self.src.device_ids) | set(self.dst.device_ids)))

    def layouts(self) -> tuple[Layout, Layout]:
        """Abstract layouts (topology meshes); the runtime binds them to its device actors."""
        return Layout(self.src.mesh(), self.src_placements), Layout(self.dst.mesh(), self.dst_placements)

    def shape_for(self, size_bytes: int, dtype: str = "float32") -> tuple[int, ...]:
        return tensor_shape(size_bytes, itemsize(dtype), self.ndim, uneven=self.uneven)

    def __str__(self) -> str:
        def fmt(p):
            return "(" + ",".join(map(str, p)) + ")"

        return f"{self.src}{fmt(self.src_placements)} -> {self.dst}{fmt(self.dst_placements)}"


def tensor_shape(size_bytes: int, item: int, ndim: int, *, uneven: bool = False) -> tuple[int, ...]:
    """A C-ordered shape of about ``size_bytes`` (exact when even): last dim 256 or 1024 wide."""
    numel = max(1, size_bytes // item)
    if uneven:
        # Odd primes everywhere: 2-, 3- and 4-way chunks are all uneven, trailing shards short.
        inner = 1021 if numel >= 1021 * 64 else 61
        rest = max(7, numel // inner)
        if ndim == 2:
            rows = _odd_not_multiple_of_3(rest)
            return (rows, inner)
        mid = 13
        rows = _odd_not_multiple_of_3(max(7, rest // mid))
        return (rows, mid, inner)[: max(ndim, 1)]
    inner = 1024 if numel >= 1024 * 64 else 256
    inner = min(inner, numel)
    if ndim == 2:
        return (numel // inner, inner)
    mid = 8
    return (numel // inner // mid, mid, inner)


def _odd_not_multiple_of_3(n: int) -> int:
    n |= 1
    while n % 3 == 0:
        n += 2
    return n


POOL_SHAPE = (2, 4)  # the device actors the local suite creates once, reused by every case
POOL_SIZE = math.prod(POOL_SHAPE)
POOL_HOST_IDS = (0, 0, 0, 0, 1, 1, 1, 1)  # pool positions -> host (axis 0 of the pool = hosts)


def _pool_hosts(*devices: int) -> tuple[int, ...]:
    return tuple(POOL_HOST_IDS[d] for d in devices)


_A = MeshView((2, 2), (0, 1, 2, 3))  # "stage i": 2 hosts x 2 devices
_B = MeshView((2, 2), (4, 5, 6, 7))  # "stage i+1", disjoint
_ALL = MeshView(POOL_SHAPE, tuple(range(POOL_SIZE)), POOL_HOST_IDS)  # the pool itself: 2 hosts x 4 devices

CASES: tuple[Case, ...] = (
    Case("rep-to-shard", "replicate -> shard (single sender per slice, 2-D sharded out)", _A, (R, R), _B, (S(0), S(1))),
    Case("shard-to-rep", "shard -> replicate (every slice multicast to 4 devices)", _A, (S(0), S(1)), _B, (R, R)),
    Case("shard-dim", "shard dim change on hosts, replicated in host (paper case 3)", _A, (S(1), R), _B, (S(0), R)),
    Case(
        "flat-dim",
        "1-D meshes, shard dim 1 -> dim 0: all-to-all (paper case 4)",
        MeshView((4,), (0, 1, 2, 3)),
        (S(1),),
        MeshView((4,), (4, 5, 6, 7)),
        (S(0),),
    ),
    Case("2d-transpose", "2-D meshes, (S0,S1) -> (S1,S0)", _A, (S(0), S(1)), _B, (S(1), S(0))),
    Case(
        "uneven",
        "uneven 3-D shape, 1x3 S(0) -> 2x2 (S2,S0)",
        MeshView((1, 3), (0, 1, 2)),
        (R, S(0)),
        _B,
        (S(2), S(0)),
        ndim=3,
        uneven=True,
    ),
    Case("2x2-to-1x3", "mesh size change 2x2 -> 1x3", _A, (S(0), S(1)), MeshView((1, 3), (4, 5, 6)), (R, S(1))),
    Case("1x4-to-2x2", "mesh size change 1x4 -> 2x2", MeshView((1, 4), (0, 1, 2, 3)), (R, S(0)), _B, (S(0), S(1))),
    Case(
        "2x4-to-2x2",
        "mesh size change 2x4 -> 2x2 on a subset of the same devices",
        _ALL,
        (S(0), R),
        MeshView((2, 2), (0, 1, 4, 5), _pool_hosts(0, 1, 4, 5)),
        (R, S(1)),
    ),
    Case(
        "same-mesh",
        "same-mesh reshard on 2x4, dim1 on hosts -> dim0 on hosts (paper case 3)",
        _ALL,
        (S(1), R),
        _ALL,
        (S(0), R),
    ),
)

CASES_BY_NAME = {c.name: c for c in CASES}


def select_cases(names: list[str] | None) -> tuple[Case, ...]:
    if not names:
        return CASES
    unknown = [n for n in names if n not in CASES_BY_NAME]
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES_BY_NAME)}")
    return tuple(CASES_BY_NAME[n] for n in names)


_UNITS = {
    "b": 1,
    "kib": 1 << 10,
    "k": 1 << 10,
    "kb": 1 << 10,
    "mib": 1 << 20,
    "m": 1 << 20,
    "mb": 1 << 20,
    "gib": 1 << 30,
    "g": 1 << 30,
    "gb": 1 << 30,
}


def parse_size(text: str) -> int:
    """'64KiB', '16MiB', '16' (MiB by default), '1G' -> bytes."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num) :] or "mib"
    if unit not in _UNITS or not num:
        raise ValueError(f"bad size {text!r}: use e.g. 64KiB, 16MiB, 1GiB (a bare number means MiB)")
    return int(float(num) * _UNITS[unit])


def fmt_size(size_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size_bytes >= scale:
            v = size_bytes / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{size_bytes} B"

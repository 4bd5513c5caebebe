"""Region math: which box of the global tensor each device of a layout holds.

A box is a tuple of half-open ``(start, stop)`` intervals, one per tensor dim; ``()`` is the
single element of a 0-d tensor. Sharding follows torch.chunk: ``k`` shards of ``n`` elements take
``ceil(n / k)`` each, so trailing shards may be short or empty.
"""

from __future__ import annotations

import math
from functools import lru_cache

from reshard.ir.chunking import chunk
from reshard.ir.layout import Layout

Box = tuple[tuple[int, int], ...]


@lru_cache(maxsize=256)
def layout_regions(layout: Layout, shape: tuple[int, ...]) -> tuple[Box, ...]:
    """The box held by each device of ``layout.mesh``, indexed by flat mesh position (a Partial
    axis holds whole regions, like Replicate)."""
    layout = layout.for_shape(shape)
    mesh = layout.mesh
    axes_of_dim = [layout.sharded_axes(d) for d in range(len(shape))]
    out = []
    for flat in range(mesh.size):
        coords = mesh.coords(flat)
        box = []
        for dim, n in enumerate(shape):
            lo, hi = 0, n
            for axis in axes_of_dim[dim]:
                lo, hi = chunk(lo, hi, mesh.shape[axis], coords[axis])
            box.append((lo, hi))
        out.append(tuple(box))
    return tuple(out)


def device_regions(layout: Layout, shape: tuple[int, ...]) -> dict[int, Box]:
    """``layout_regions`` by global device id."""
    return dict(zip(layout.mesh.device_ids, layout_regions(layout, shape), strict=True))


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def box_volume(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or None if they share no element."""
    out = []
    for (alo, ahi), (blo, bhi) in zip(a, b, strict=True):
        lo, hi = max(alo, blo), min(ahi, bhi)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def contains(outer: Box, inner: Box) -> bool:
    return all(olo <= ilo and ihi <= ohi for (olo, ohi), (ilo, ihi) in zip(outer, inner, strict=True))


def relative(box: Box, origin: Box) -> Box:
    """``box`` in the local coordinates of a buffer that holds ``origin``."""
    return tuple((lo - olo, hi - olo) for (lo, hi), (olo, _) in zip(box, origin, strict=True))


def is_contiguous(box: Box, holder_shape: tuple[int, ...]) -> bool:
    """Whether ``box`` (local coordinates) is one contiguous run of a C-ordered buffer of ``holder_shape``."""
    dims = list(zip(box, holder_shape, strict=True))
    while dims and dims[-1][0] == (0, dims[-1][1]):
        dims.pop()
    if not dims:
        return True
    dims.pop()  # the innermost partial dim may be any range
    return all(hi - lo == 1 for (lo, hi), _ in dims)

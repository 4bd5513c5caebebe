"""Scaled casts to float8 in flight: ``reshard(..., dtype=Scaled("float8_e4m3fn", scale))``.

A float8 weight is kept with a scale: the engine computes with ``w8 * scale``. A trainer holds
``w`` in a wider type, so each sender divides its shard by the scale and casts it before anything
crosses (a quarter of float32's bytes). The scale is one number for the tensor, or one per block
of a given shape (block-quantised weights, as DeepSeek-V3's and vLLM's): an array of shape
``ceil(shape / block)``. A sender gets only the scales of the blocks its shard overlaps
(``Scaled.for_box``: a ``ScaledCast``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from reshard.dtypes import CASTABLE, dtype_name

FLOAT8 = ("float8_e4m3fn", "float8_e5m2")


@dataclass(frozen=True, init=False)
class Scaled:
    """A float8 destination dtype and the scale its senders divide by first: each element arrives
    as ``(x / scale).to(dtype)``, divided in float32 (float64 for a float64 source, the scales
    first rounded to float32) and cast as torch's ``Tensor.to`` casts (float8_e4m3fn saturates at
    ±448). ``scale``: one positive number, or with ``block`` (a block shape, one length per
    dimension) an array of one positive scale per block, of shape ``ceil(shape / block)``."""

    dtype: str
    scale: float | None
    block: tuple[int, ...] | None
    grid: tuple[int, ...] | None  # the shape of the per-block scales
    scales: tuple[float, ...] | None  # per block, row-major over ``grid``

    def __init__(self, dtype, scale, block=None):
        name = dtype_name(dtype)
        if name not in FLOAT8:
            raise ValueError(f"Scaled casts to {' or '.join(FLOAT8)}, not {name}; give other dtypes as they are")
        values = np.asarray(scale, dtype=np.float64)
        if block is None:
            if values.size != 1:
                raise ValueError(
                    f"Scaled: one scale for the whole tensor, got an array of shape {values.shape}; "
                    "pass block= for one scale per block"
                )
            one, grid, scales, block_shape = float(np.float32(values.reshape(()))), None, None, None
        else:
            block_shape = tuple(int(b) for b in block)
            if not block_shape or any(b < 1 for b in block_shape):
                raise ValueError(f"Scaled: block must be a positive length per dimension, got {block!r}")
            one, grid, scales = None, tuple(values.shape), tuple(float(v) for v in values.astype(np.float32).ravel())
            if len(grid) != len(block_shape):
                raise ValueError(f"Scaled: scales of shape {grid} for blocks {block_shape}: one axis each")
        checked = [one] if one is not None else list(scales or ())
        if not all(math.isfinite(v) and v > 0 for v in checked):
            raise ValueError("Scaled: every scale must be a positive finite number")
        for field, value in (
            ("dtype", name),
            ("scale", one),
            ("block", block_shape),
            ("grid", grid),
            ("scales", scales),
        ):
            object.__setattr__(self, field, value)

    def __repr__(self) -> str:
        if self.block is None:
            return f"Scaled({self.dtype!r}, {self.scale:g})"
        return f"Scaled({self.dtype!r}, <{'x'.join(map(str, self.grid or ()))} scales>, block={self.block})"

    def check(self, src: str, shape: tuple[int, ...]) -> None:
        """ValueError unless a ``src`` tensor of ``shape`` can be cast so."""
        if src not in CASTABLE:
            raise ValueError(f"a scaled cast to {self.dtype} takes one of {', '.join(CASTABLE)}, not {src}")
        if self.block is None:
            return
        if len(self.block) != len(shape):
            raise ValueError(f"Scaled: blocks of {len(self.block)} dimensions for a tensor of shape {list(shape)}")
        want = tuple(-(-n // b) for n, b in zip(shape, self.block, strict=True))
        if self.grid != want:
            raise ValueError(
                f"Scaled: a tensor of shape {list(shape)} in blocks {list(self.block)} takes scales of shape "
                f"{list(want)}, got {list(self.grid or ())}"
            )

    def for_box(self, src: str, box) -> ScaledCast:
        """What the holder of the shard ``box`` (global ``(lo, hi)`` per dimension) needs."""
        if self.block is None or any(lo >= hi for lo, hi in box):
            return ScaledCast(src, 1.0 if self.scale is None else self.scale)
        first = tuple(lo // b for (lo, _), b in zip(box, self.block, strict=True))
        end = tuple(-(-hi // b) for (_, hi), b in zip(box, self.block, strict=True))
        grid = np.asarray(self.scales, dtype=np.float32).reshape(self.grid)
        mine = grid[tuple(slice(a, z) for a, z in zip(first, end, strict=True))]
        offset = tuple(lo - a * b for (lo, _), a, b in zip(box, first, self.block, strict=True))
        return ScaledCast(src, None, self.block, tuple(mine.shape), tuple(float(v) for v in mine.ravel()), offset)


@dataclass(frozen=True, slots=True)
class ScaledCast:
    """A source shard's scaled cast (``Scaled.for_box``): ``src`` its dtype; ``scale`` one for all,
    or per ``block``: the ``scales`` of the blocks the shard overlaps (row-major over ``grid``) and
    where the shard starts inside the first of them (``offset``)."""

    src: str
    scale: float | None
    block: tuple[int, ...] | None = None
    grid: tuple[int, ...] | None = None
    scales: tuple[float, ...] | None = None
    offset: tuple[int, ...] | None = None

    def expanded(self, shape: tuple[int, ...]) -> np.ndarray:
        """The float32 scale of every element of a shard of ``shape`` (a 0-d array: one for all)."""
        if self.scale is not None:
            return np.asarray(self.scale, dtype=np.float32)
        out = np.asarray(self.scales, dtype=np.float32).reshape(self.grid or ())
        for axis, b in enumerate(self.block or ()):
            out = np.repeat(out, b, axis=axis)
        index: tuple[slice, ...] = tuple(slice(o, o + n) for o, n in zip(self.offset or (), shape, strict=True))
        return out[index]

"""A pipeline stage as the user declares it, and the checks that turn a list of them into a
pipeline the runtime can run (shapes and layouts at every boundary, named by stage)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from reshard.dtypes import dtype_name
from reshard.ir.layout import Layout
from reshard.ir.regions import box_shape, layout_regions


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a device mesh, its callables, and the layouts of what crosses its edges.

    ``in_shape``/``in_layout``: the global shape of one microbatch's stage input and its layout on
    this mesh (stage 0: optional, for ``inputs``). ``out_shape``/``out_layout``: the same for the
    output (not on the last stage, which returns a loss). ``dtype`` of both.
    """

    mesh: Any
    forward: Callable
    backward: Callable | None = None
    setup: Callable | None = None
    in_shape: tuple[int, ...] | None = None
    in_layout: Layout | None = None
    out_shape: tuple[int, ...] | None = None
    out_layout: Layout | None = None
    dtype: str = "float32"
    name: str = ""


def check_stage(i: int, s: Stage, n: int) -> Stage:
    mesh = getattr(s.mesh, "mesh", s.mesh)
    if not hasattr(mesh, "device_ids"):
        raise TypeError(f"stage {i}: mesh must be a reshard.DeviceMesh, got {type(s.mesh).__name__}")
    try:
        dtype = dtype_name(s.dtype)
    except TypeError as exc:
        raise TypeError(f"stage {i}: {exc}") from None
    changes: dict[str, Any] = {"dtype": dtype}
    for side in ("in", "out"):
        shape, layout = getattr(s, f"{side}_shape"), getattr(s, f"{side}_layout")
        needed = (side == "in" and i > 0) or (side == "out" and i < n - 1)
        if shape is None and layout is None:
            if needed:
                why = (
                    "every stage after the first takes an input"
                    if side == "in"
                    else "every stage but the last has an output"
                )
                raise ValueError(f"stage {i}: {side}_shape and {side}_layout are required ({why})")
            continue
        if shape is None or layout is None:
            raise ValueError(f"stage {i}: give both {side}_shape and {side}_layout, or neither")
        if side == "out" and i == n - 1:
            raise ValueError(f"stage {i} is the last stage: it returns the loss and has no out_shape/out_layout")
        try:
            shape = tuple(int(x) for x in shape)
        except TypeError:
            raise TypeError(f"stage {i}: {side}_shape must be a tuple of ints, got {shape!r}") from None
        if not isinstance(layout, Layout):
            raise TypeError(f"stage {i}: {side}_layout must be a reshard.Layout, got {type(layout).__name__}")
        if layout.mesh != mesh:
            raise ValueError(
                f"stage {i}: {side}_layout {layout} is on mesh {layout.mesh}, not on the stage's mesh {mesh}"
            )
        try:
            layout.check_shape(shape)
        except ValueError as exc:
            raise ValueError(f"stage {i}: {side}_layout does not fit {side}_shape {shape}: {exc}") from None
        changes[f"{side}_shape"] = shape
    return dataclasses.replace(s, **changes)


def check_boundaries(stages: Sequence[Stage]) -> None:
    for i in range(len(stages) - 1):
        a, b = stages[i], stages[i + 1]
        if a.out_shape != b.in_shape:
            raise ValueError(
                f"stage {i} produces {a.out_shape} ({a.out_layout}) but stage {i + 1} expects an input of "
                f"shape {b.in_shape} ({b.in_layout}); make stage {i}'s out_shape equal stage {i + 1}'s in_shape"
            )
        if a.dtype != b.dtype:
            raise ValueError(f"stage {i} produces {a.dtype} but stage {i + 1} expects {b.dtype}")


def local_shape(layout: Layout | None, shape, flat: int):
    if layout is None:
        return None
    return box_shape(layout_regions(layout, tuple(shape))[flat])

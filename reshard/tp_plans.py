"""Layouts from a tensor-parallel plan, as torch's ``parallelize_module`` plans name them.

A plan maps name patterns (``fnmatch``, e.g. ``"layers.*.attn.qkv"``) to styles; a pattern that
names a module covers its parameters (``.weight``, ``.bias``). The first pattern that matches a
state-dict key decides; keys no pattern matches are replicated. Styles, on the tensor-parallel mesh
axis (every other axis replicates):

- ``"colwise"`` (torch's ``ColwiseParallel``): a Linear's output features: weight and bias
  ``Shard(0)``;
- ``"rowwise"`` (``RowwiseParallel``): a Linear's input features: weight ``Shard(1)``, bias
  replicated (it is added once, after the partial sums are reduced);
- ``"vocab"``: an embedding or output head split by vocabulary rows: ``Shard(0)`` (torch's
  ``RowwiseParallel`` on an ``nn.Embedding``, which the state dict cannot tell from a Linear);
- ``"replicate"``.

Shards split as ``torch.chunk`` does (the last ones smaller when a dim does not divide). The result
is a callable ``(path, tensor) -> Layout``, which ``distribute`` and ``reshard`` take for a tree:

    layouts = tensor_parallel_layouts(inference_mesh, {
        "embed": "vocab", "layers.*.attn.qkv": "colwise", "layers.*.attn.out": "rowwise",
        "layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise", "head": "vocab",
    })
    reshard(trainer_state, trainer_mesh, layouts, out=inference_weights)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

from reshard.ir.layout import Layout
from reshard.ir.placement import Placement, Replicate, Shard

STYLES = ("colwise", "rowwise", "vocab", "replicate")
_TORCH_STYLES = {"ColwiseParallel": "colwise", "RowwiseParallel": "rowwise", "SequenceParallel": "replicate"}


def tensor_parallel_layouts(mesh, plan: Mapping[str, Any], *, axis: int | str = -1) -> Callable[[str, Any], Layout]:
    """The layout of every state-dict entry on ``mesh`` under ``plan`` (name pattern -> style; the
    first match decides; unmatched entries are replicated): a callable ``(path, tensor) -> Layout``
    that ``distribute`` and ``reshard`` take for a tree. ``axis``: the tensor-parallel mesh axis (index or name;
    default the last). Styles are names from ``STYLES`` or torch's style objects
    (``ColwiseParallel()``, ``RowwiseParallel()``, ``SequenceParallel()``). Raises ValueError for
    an unknown style or axis, naming it."""
    abstract = getattr(mesh, "mesh", mesh)
    tp_axis = _axis_index(abstract, axis)
    rules = [(str(pattern), _style(pattern, style)) for pattern, style in plan.items()]

    def layout(path: str, tensor) -> Layout:
        ndim = len(tensor.shape)
        style = next(
            (s for p, s in rules if fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(path, p + ".*")), "replicate"
        )
        placements: list[Placement] = [Replicate()] * abstract.ndim
        dim = _sharded_dim(style, path, ndim)
        if dim is not None:
            placements[tp_axis] = Shard(dim)
        return Layout(mesh, tuple(placements))

    return layout


def _sharded_dim(style: str, path: str, ndim: int) -> int | None:
    if style == "replicate" or ndim == 0:
        return None
    if style == "colwise" or style == "vocab":
        return 0
    # rowwise: a weight's input features; a bias (one dim) is added after the reduction: whole
    return 1 if ndim >= 2 else None


def _style(pattern, style) -> str:
    if isinstance(style, str):
        name = style
    else:
        name = _TORCH_STYLES.get(type(style).__name__, type(style).__name__)
    if name not in STYLES:
        raise ValueError(
            f"tensor-parallel plan entry {pattern!r}: unknown style {style!r}; use one of {', '.join(STYLES)} "
            f"or torch's {', '.join(_TORCH_STYLES)}"
        )
    return name


def _axis_index(mesh, axis: int | str) -> int:
    if isinstance(axis, str):
        names = tuple(mesh.axis_names or ())
        if axis not in names:
            raise ValueError(f"mesh axis {axis!r} is not one of the mesh's axis names {names}")
        return names.index(axis)
    if not -mesh.ndim <= axis < mesh.ndim:
        raise ValueError(f"mesh axis {axis} is out of range for a mesh of shape {mesh.shape}")
    return axis % mesh.ndim

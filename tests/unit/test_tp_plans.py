"""``tensor_parallel_layouts``: a torch-style tensor-parallel plan gives each state-dict entry the
layout torch's styles mean on the tensor-parallel axis, and the regions split as ``torch.chunk``
splits (checked against numpy's ``array_split`` of the same rows, which torch.chunk matches for
dims that divide and for the uneven vocab here)."""

from __future__ import annotations

import numpy as np
import pytest

from reshard import Layout, Replicate, Shard, tensor_parallel_layouts
from reshard.ir.regions import layout_regions
from topology import Mesh

pytestmark = pytest.mark.unit

SHAPES = {
    "embed.weight": (50, 8),
    "layers.0.attn.qkv.weight": (24, 8),
    "layers.0.attn.qkv.bias": (24,),
    "layers.0.attn.out.weight": (8, 8),
    "layers.0.attn.out.bias": (8,),
    "layers.0.norm.weight": (8,),
    "head.weight": (50, 8),
    "step": (),
}
PLAN = {"embed": "vocab", "layers.*.attn.qkv": "colwise", "layers.*.attn.out": "rowwise", "head": "vocab"}


def test_styles_shard_what_torch_styles_shard_on_the_tp_axis_only():
    mesh = Mesh((2, 4), axis_names=("dp", "tp"))
    layout = tensor_parallel_layouts(mesh, PLAN, axis="tp")
    got = {k: layout(k, np.empty(s)) for k, s in SHAPES.items()}
    R = Replicate()
    assert got["embed.weight"] == Layout(mesh, (R, Shard(0)))
    assert got["layers.0.attn.qkv.weight"] == Layout(mesh, (R, Shard(0)))
    assert got["layers.0.attn.qkv.bias"] == Layout(mesh, (R, Shard(0)))
    assert got["layers.0.attn.out.weight"] == Layout(mesh, (R, Shard(1)))
    assert got["layers.0.attn.out.bias"] == Layout(mesh, (R, R))  # added after the reduction
    assert got["layers.0.norm.weight"] == Layout(mesh, (R, R))  # no pattern: replicated
    assert got["step"] == Layout(mesh, (R, R))
    assert tensor_parallel_layouts(mesh, PLAN)("head.weight", np.empty((50, 8))) == got["head.weight"]  # last axis


def test_uneven_vocab_rows_split_as_torch_chunk_does():
    torch = pytest.importorskip("torch")
    mesh = Mesh((4,))
    layout = tensor_parallel_layouts(mesh, PLAN)("embed.weight", np.empty((50, 8)))
    rows = [box[0] for box in layout_regions(layout, (50, 8))]
    chunks = torch.arange(50).chunk(4)
    assert rows == [(int(c[0]), int(c[-1]) + 1) for c in chunks]


def test_torch_style_objects_and_the_first_matching_pattern():
    class ColwiseParallel:  # what torch.distributed.tensor.parallel names its styles
        pass

    class RowwiseParallel:
        pass

    mesh = Mesh((2,))
    plan = {"layers.0.attn.qkv": RowwiseParallel(), "layers.*.attn.qkv": ColwiseParallel()}
    layout = tensor_parallel_layouts(mesh, plan)
    assert layout("layers.0.attn.qkv.weight", np.empty((4, 4))).placements == (Shard(1),)
    assert layout("layers.1.attn.qkv.weight", np.empty((4, 4))).placements == (Shard(0),)


@pytest.mark.parametrize(
    ("plan", "axis", "words"),
    [
        ({"x": "diagonal"}, -1, "unknown style 'diagonal'"),
        ({"x": "colwise"}, "tp", "mesh axis 'tp'"),
        ({"x": "colwise"}, 3, "out of range"),
    ],
)
def test_bad_plans_are_refused_naming_what_is_wrong(plan, axis, words):
    with pytest.raises(ValueError, match=words):
        tensor_parallel_layouts(Mesh((2,)), plan, axis=axis)

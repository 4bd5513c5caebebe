"""``Layout.from_spec`` means what JAX's ``NamedSharding(mesh, PartitionSpec(...))`` means, or
refuses: for random named meshes and specs, the regions a spec gives every device equal those of
an independent oracle of JAX's rule (the names of an entry split its dim outermost first); an
entry in mesh order but for the mesh's first axis last is a ``StridedShard``; a spec whose entry
lists axes in any other order raises ValueError naming it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from problems import SETTINGS

from reshard import Layout, Shard, StridedShard
from reshard.ir.regions import layout_regions
from topology import Mesh

pytestmark = pytest.mark.unit
NAMES = ("dp", "tp", "pp")


@st.composite
def named_specs(draw):
    shape = tuple(draw(st.lists(st.integers(1, 3), min_size=2, max_size=3)))
    names = NAMES[: len(shape)]
    mesh = Mesh(shape, axis_names=names)
    ndim = draw(st.integers(1, 3))
    axes = list(draw(st.permutations(range(len(shape)))))
    entries: list = [None] * ndim
    for a in axes:
        if draw(st.booleans()):
            dim = draw(st.integers(0, ndim - 1))
            entries[dim] = (*(entries[dim] or ()), names[a])
    spec = tuple(e if e is None or len(e) > 1 or draw(st.booleans()) else e[0] for e in entries)
    tensor = tuple(math.prod(shape) * draw(st.integers(1, 2)) for _ in range(ndim))
    return mesh, spec, tensor


def jax_regions(mesh: Mesh, spec, tensor_shape) -> list[tuple]:
    """JAX's rule: an entry's axes split its dim, the first outermost (divisible sizes)."""
    out = []
    for flat in range(mesh.size):
        coords = np.unravel_index(flat, mesh.shape)
        box = []
        for dim, n in enumerate(tensor_shape):
            entry = spec[dim]
            names = () if entry is None else (entry,) if isinstance(entry, str) else entry
            index, parts = 0, 1
            for name in names:
                a = mesh.axis_names.index(name)
                index, parts = index * mesh.shape[a] + int(coords[a]), parts * mesh.shape[a]
            size = n // parts
            box.append((index * size, (index + 1) * size))
        out.append(tuple(box))
    return out


@SETTINGS
@given(named_specs())
def test_from_spec_matches_jax_or_refuses(case):
    mesh, spec, tensor = case

    def expressible(entry) -> bool:
        in_mesh = sorted(entry, key=mesh.axis_names.index)
        return list(entry) in (in_mesh, [*in_mesh[1:], in_mesh[0]])

    if not all(expressible(e) for e in spec if e is not None and not isinstance(e, str)):
        with pytest.raises(ValueError, match="outermost"):
            Layout.from_spec(mesh, spec)
        return
    layout = Layout.from_spec(mesh, spec)
    assert list(layout_regions(layout, tensor)) == jax_regions(mesh, spec, tensor)


def test_the_tensor_parallel_axis_outermost_is_fsdp2_over_tensor_parallelism():
    mesh = Mesh((2, 2), axis_names=("dp", "tp"))
    assert Layout.from_spec(mesh, (("tp", "dp"), None)) == Layout(mesh, (StridedShard(0, 2), Shard(0)))
    assert Layout.from_spec(mesh, (("dp", "tp"), None)) == Layout(mesh, (Shard(0), Shard(0)))
    three = Mesh((2, 2, 2), axis_names=("dp", "tp", "pp"))
    with pytest.raises(ValueError, match=r"\('tp', 'dp', 'pp'\).*'tp' outermost.*List them as \('dp', 'tp', 'pp'\)"):
        Layout.from_spec(three, (("tp", "dp", "pp"),))

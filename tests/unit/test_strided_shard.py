"""StridedShard (torch's ``_StridedShard``, FSDP2 over tensor parallelism): each device's box is the
one torch's own split gives it, and a shape torch would split into pieces that are not one box is
refused by name."""

import itertools

import pytest
import torch
from torch.distributed.tensor.placement_types import Shard as TorchShard
from torch.distributed.tensor.placement_types import _StridedShard

from reshard import Layout, Shard
from reshard.ir.placement import StridedShard, as_placement
from reshard.ir.regions import chunk, layout_regions
from topology.mesh import Mesh


def torch_rows(n: int, dp: int, tp: int, i: int, j: int) -> list[int]:
    """The rows device (i, j) of a (dp, tp) mesh holds under (_StridedShard(0, tp), Shard(0))."""
    rows = torch.arange(n)
    local = _StridedShard(0, split_factor=tp)._split_tensor(rows, dp, with_padding=False)[0][i]
    return TorchShard(0)._split_tensor(local, tp, with_padding=False)[0][j].tolist()


def later_first(n: int, dp: int, tp: int, i: int, j: int) -> list[int]:
    """The rows of device (i, j) when the tp axis splits first and dp then splits each piece."""
    lo, hi = chunk(*chunk(0, n, tp, j), dp, i)
    return list(range(lo, hi))


@pytest.mark.parametrize(("dp", "tp"), [(1, 2), (2, 1), (2, 2), (2, 3), (3, 2), (4, 2)])
def test_each_device_holds_the_rows_torch_gives_it(dp, tp):
    mesh = Mesh((dp, tp), tuple(range(dp * tp)), (0,) * (dp * tp))
    layout = Layout(mesh, (as_placement(_StridedShard(0, split_factor=tp)), Shard(0)))
    assert layout.placements[0] == StridedShard(0, tp) and str(layout.placements[0]) == f"_S(0, {tp})"
    checked = refused = 0
    for n in range(1, 26):
        expected = {(i, j): torch_rows(n, dp, tp, i, j) for i, j in itertools.product(range(dp), range(tp))}
        try:
            regions = layout_regions(layout, (n, 3))
        except ValueError as e:
            assert "does not give each device the box" in str(e)
            assert any(rows != later_first(n, dp, tp, i, j) for (i, j), rows in expected.items())
            refused += 1
            continue
        for (i, j), rows in expected.items():
            (lo, hi), cols = regions[i * tp + j]
            assert list(range(lo, hi)) == rows and cols == (0, 3), (n, i, j)
        checked += 1
    assert checked >= 10


def test_a_strided_axis_must_match_the_axes_after_it():
    mesh = Mesh((2, 2), (0, 1, 2, 3), (0, 0, 0, 0))
    with pytest.raises(ValueError, match="split_factor 3, but the later axes that shard dim 0 have 2 devices"):
        Layout(mesh, (StridedShard(0, 3), Shard(0))).check_shape((8, 8))
    with pytest.raises(ValueError, match="must be the only one and the first to shard dim 0"):
        Layout(mesh, (Shard(0), StridedShard(0, 1))).check_shape((8, 8))
    with pytest.raises(ValueError, match="positive int split_factor"):
        StridedShard(0, 0)
    negative = Layout(mesh, (StridedShard(-2, 2), Shard(-2))).for_shape((8, 8))
    assert negative.placements == (StridedShard(0, 2), Shard(0))

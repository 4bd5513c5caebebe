"""The outputs a replay with ``out=`` writes on one device (``reshard.runtime.device.outputs``),
with a real shard store and no Ray: a commit into the views of a first call's unit block copies
block to block and leaves the bytes between them alone; other outputs are copied one by one; the
outputs' check holds until one of them leaves the store or is replaced."""

from __future__ import annotations

import types

import numpy as np
import pytest

from reshard.errors import ReshardError
from reshard.runtime.device.batches import PreparedBatch
from reshard.runtime.device.host_unit import Places
from reshard.runtime.device.outputs import outputs_of
from reshard.runtime.device.shards import PlacedShards, ShardStore
from reshard.runtime.messages import Bound, shard_name

pytestmark = pytest.mark.unit

N = 5  # tensors of each kind
STRIDE = 64
KINDS = (((16,), np.dtype(np.float32), "float32"), ((3,), np.dtype(np.int16), "int16"))  # the second leaves gaps


def _layout() -> Places:
    """2 x N destinations of a batch whose tensors alternate the two kinds: each kind's lie
    together, as ``host_unit`` lays them out."""
    tensors = tuple(range(0, 2 * N, 2)) + tuple(range(1, 2 * N, 2))
    return Places(
        parts=tensors,
        tensors=tensors,
        dtypes=(KINDS[0][2],) * N + (KINDS[1][2],) * N,
        offsets=np.arange(2 * N, dtype=np.int64) * STRIDE,
        sizes=(64,) * N + (6,) * N,
        groups=tuple((shape, storage, k * N * STRIDE, N, STRIDE) for k, (shape, storage, _) in enumerate(KINDS)),
        mapped=(False,) * (2 * N),
        shape_ids=np.repeat(np.arange(2, dtype=np.int32), N),
        distinct=tuple(shape for shape, _, _ in KINDS),
        metas=None,
    )


def _unit(s: ShardStore, run: str, layout: Places, fill: int, *, staged: bool = False) -> tuple:
    """A unit block laid out as ``layout``, every byte ``fill``, kept as run ``run``'s shards
    (``staged``: its results staged for a commit, without views, as a run stages them); the
    kept ``PlacedShards`` and the views."""
    block, _ = s.allocate_block(layout.extent, False)
    block[:] = fill
    views = [
        np.ndarray(shape, storage, block, offset + k * stride)
        for shape, storage, offset, count, stride in layout.groups
        for k in range(count)
    ]
    placed = PlacedShards(
        run,
        None if staged else views,
        layout.dtypes,
        None,
        (layout.offsets + block.ctypes.data).tolist(),
        layout.sizes,
        [None] * len(views),
        layout.tensors,
        layout.shape_ids,
        layout.distinct,
        layout.shapes,
        block,
        layout,
    )
    assert s.put_run(run, [], placed, staged=staged) is not None
    return placed, views


def _outputs(names: list[str]):
    """The outputs of a batch of 2 x N tensors (alternating kinds) bound to ``names``."""
    kinds = [KINDS[t % 2] for t in range(2 * N)]
    written = (tuple(range(2 * N)), tuple(shape for shape, _, _ in kinds), tuple(d for _, _, d in kinds))
    prepared = PreparedBatch(None, (), (), {}, tensors=tuple(range(2 * N)), written=written)  # type: ignore[arg-type]
    return outputs_of(prepared, Bound((None,) * 2 * N, None, tuple(names), None))


def _device(s: ShardStore):
    return types.SimpleNamespace(store=s, device=0, counters={})


def test_a_replay_into_a_first_calls_outputs_copies_block_to_block_and_leaves_the_gaps():
    s, layout = ShardStore(0, "cpu", 1 << 20), _layout()
    first, outs = _unit(s, "c:1", layout, 0xAB)
    _, results = _unit(s, "c:2", layout, 0, staged=True)
    for k, v in enumerate(results):
        v.view(np.uint8)[:] = np.arange(v.nbytes, dtype=np.uint8) + 7 * k
    ctx = _device(s)
    _outputs([shard_name("c:1", t) for t in range(2 * N)]).commit(ctx, "c:2")
    assert ctx.counters == {"block_commits": 1}
    for out, res in zip(outs, results, strict=True):
        assert out.tobytes() == res.tobytes()
    written = np.zeros(first.block.nbytes, bool)
    for offset, size in zip(layout.offsets.tolist(), layout.sizes, strict=True):
        written[offset : offset + size] = True
    assert (first.block[~written] == 0xAB).all(), "the bytes between destinations are left as they were"


@pytest.mark.parametrize("mix", ["two calls", "shared by name"])
def test_outputs_that_are_not_one_blocks_views_laid_out_alike_are_copied_one_by_one(mix):
    s, layout = ShardStore(0, "cpu", 1 << 20), _layout()
    _, first = _unit(s, "c:1", layout, 0)
    if mix == "two calls":  # the odd tensors' outputs are another call's
        _, second = _unit(s, "c:3", layout, 0)
        names = [shard_name("c:1" if t % 2 == 0 else "c:3", t) for t in range(2 * N)]
        outs = dict(zip(map(shard_name, ["c:1"] * N, range(0, 2 * N, 2)), first[:N], strict=True))
        outs.update(zip(map(shard_name, ["c:3"] * N, range(1, 2 * N, 2)), second[N:], strict=True))
    else:  # one output is a tensor the user shared under a name of its own
        names = [shard_name("c:1", t) for t in range(2 * N)]
        names[3] = "user/w"
        s.share("user/w", np.zeros(3, np.int16), "int16", {})
        outs = {n: s.get(n) for n in names}
    _, results = _unit(s, "c:2", layout, 0, staged=True)
    for k, v in enumerate(results):
        v[...] = k + 1
    ctx = _device(s)
    _outputs(names).commit(ctx, "c:2")
    assert ctx.counters == {}
    at = dict(zip(layout.tensors, results, strict=True))
    for t, name in enumerate(names):
        np.testing.assert_array_equal(outs[name], at[t])


def test_a_check_holds_until_an_output_leaves_the_store_or_is_replaced():
    s, layout = ShardStore(0, "cpu", 1 << 20), _layout()
    _unit(s, "c:1", layout, 0)
    names = [shard_name("c:1", t) for t in range(2 * N)]
    names[3] = "user/w"
    s.share("user/w", np.zeros(3, np.int16), "int16", {})
    s.put("other", np.zeros(4), "other", "float64")
    ctx, out = _device(s), _outputs(names)
    assert len(out.check(ctx, strided=True)) == 2 * N
    assert out.check(ctx, strided=True) is None, "passed as the store is now"
    assert len(out.check(ctx, strided=False)) == 2 * N, "a direct write's check is its own"
    s.free("other")
    assert out.check(ctx, strided=True) is None, "another shard left: the check holds"
    s.share("user/w", np.zeros(4, np.int16), "int16", {})  # another tensor under the output's name
    with pytest.raises(ReshardError, match=r"output shard 'user/w' is int16\[4\], the reshard writes int16\[3\]"):
        out.check(ctx, strided=True)
    s.share("user/w", np.zeros(3, np.int16), "int16", {})
    out.check(ctx, strided=True)
    s.free(names[0])
    with pytest.raises(ReshardError, match=rf"the output shard '{names[0]}' is gone"):
        out.check(ctx, strided=True)


def test_outputs_committed_together_share_a_version_until_another_write_or_a_drop_touches_one():
    """A replay's commit marks its outputs' version by one value they share (``ShardStore.wrote``
    with a cell); a write of one of them by another sync, or one dropped and made again, gives
    them their entries again at the next replay."""
    s = ShardStore(0, "cpu", 1 << 20)
    for n in "abc":
        s.put(n, np.zeros(2), n, "float64")
    cell: list = []
    s.wrote(list("abc"), "r1", cell)
    s.wrote(list("abc"), "r2", cell)
    assert [s.version(n) for n in "abc"] == ["r2"] * 3
    s.wrote(["b"], "x")  # another sync's commit into one of them
    assert [s.version(n) for n in "abc"] == ["r2", "x", "r2"]
    s.wrote(list("abc"), "r3", cell)
    assert [s.version(n) for n in "abc"] == ["r3"] * 3
    s.free("c")
    s.put("c", np.zeros(2), "c", "float64")  # another shard under the name: nothing wrote it yet
    assert s.version("c") is None
    s.wrote(list("abc"), "r4", cell)
    assert [s.version(n) for n in "abc"] == ["r4"] * 3
    s.wrote(["a"], "y", [])  # another replay's outputs (a cell of their own) overlap these
    s.wrote(list("abc"), "r5", cell)
    assert [s.version(n) for n in "abc"] == ["r5"] * 3

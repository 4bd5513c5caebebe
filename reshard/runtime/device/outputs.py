"""The user's shards a run into them writes (``out=``), as one device checks and fills them.

A replay into the same outputs binds the same shards every time, so what it writes where is worked
out once per prepared batch and binding (``Outputs``, cached with the batch's tables). So is the
check that each output exists, is writable and has the shape and dtype written into it
(``checked_outs``): it holds while none of the outputs any run checked has left or been replaced in
the device's store (``ShardStore.edits``), and a replay into thousands of outputs checks them again
only after one has (a shard of another call freed meanwhile costs it nothing).

A commit copies its unit's staged results block to block where the outputs are the views of one
unit block laid out as the staged ones (a replay into the results of the tree's first call): a
strided copy per kind of destination (``host_unit.copy_places``), not a copy per tensor. Its other
results are copied one by one; on a GPU device the small ones all by one kernel (``box_copies``).
"""

from __future__ import annotations

import itertools
import operator

import numpy as np

from reshard.errors import ReshardError
from reshard.runtime import arrays
from reshard.runtime.device import box_copies
from reshard.runtime.device.host_unit import copy_places
from reshard.runtime.messages import shard_name

CACHED = 4  # per prepared batch (one per binding)
#: On a GPU device, results under this size are committed by one kernel: for them a copy's launch
#: (microseconds) costs more than its bytes; larger ones are copied one by one, at the copy's peak.
KERNEL_MAX_BYTES = 1 << 20


class Outputs:
    """The outputs a run of ``prepared`` bound as ``bound`` writes (``PreparedBatch.written``):
    each one's batch tensor, name, shape and dtype; ``written``, the names as one set (what a
    commit holds readers off); ``peers``, the run's participants (``Bound.peers``)."""

    def __init__(self, prepared, bound):
        at, shapes, dtypes = prepared.written
        outs = bound.outs
        self.tensors = [prepared.tensors[i] for i in at]
        self.names = [outs[i] for i in at]
        self.shapes = list(map(tuple, shapes))
        self.dtypes = list(dtypes)
        self.written = frozenset(self.names) - {None}
        self.peers = bound.peers
        self._passed: dict[bool, int] = {}  # strided -> the store's edits when all last passed
        self._blocks: dict[int, tuple] = {}  # id(layout) -> (layout, edits, block address or None, the others)
        self.version: list = []  # the outputs' version cell (``ShardStore.wrote``)

    def check(self, ctx, *, strided: bool) -> list | None:
        """Check every output (``checked_outs``) unless they passed with the store as it is now;
        returns them where it looked them up (None: the last check holds)."""
        if self._passed.get(strided) == ctx.store.edits:
            return None
        edits = ctx.store.watch(self.written)
        found = checked_outs(ctx, self.names, self.shapes, self.dtypes, strided=strided)
        self._passed[strided] = edits
        return found

    def commit(self, ctx, run: str) -> None:
        """Copy run ``run``'s staged results into the outputs, every output checked and every
        result found first (module docstring)."""
        store = ctx.store
        found = self.check(ctx, strided=True)
        rest: range | list[int] = range(len(self.names))
        unit, block = store.staged_unit(run), None
        if unit is not None and unit.layout is not None:
            block, others = self._block_for(store, unit.layout)
            if block is not None:
                rest = others
        srcs, _, shapes = store.staged_results(run, [self.tensors[k] for k in rest])
        if None in shapes:
            gone = shard_name(run, self.tensors[rest[shapes.index(None)]])
            raise ReshardError(f"device {ctx.device}: the staged result {gone!r} is gone")
        dsts = self._at(ctx, found, rest)
        if block is not None:
            copy_places(block, unit.block, unit.layout)
            ctx.counters["block_commits"] = ctx.counters.get("block_commits", 0) + 1
        _copy_results(ctx, dsts, srcs)

    def deliver(self, ctx, unit) -> None:
        """Copy a ``direct`` run's unit results (``host_unit.UnitRun``) into their outputs, every
        output checked first: block to block where the outputs lie as the unit's destinations do,
        else one by one."""
        store = ctx.store
        found = self.check(ctx, strided=False)
        layout = unit.unit.places
        block, _ = self._block_for(store, layout)
        if block is not None:
            copy_places(block, unit.block, layout)
            ctx.counters["block_delivers"] = ctx.counters.get("block_delivers", 0) + 1
            return
        at = dict(zip(self.tensors, itertools.count()))
        arrays.copy_many(self._at(ctx, found, [at.get(t) for t in layout.tensors]), unit.views)

    def _at(self, ctx, found: list | None, positions) -> list:
        """The outputs at ``positions`` (None: a result no output is for), from ``found`` (what
        ``check`` looked up) or the store; ``ReshardError`` where one is gone since its check."""
        names = [None if k is None else self.names[k] for k in positions]
        if found is None:
            dsts = list(map(ctx.store.shards.get, names))
        else:
            dsts = [None if k is None else found[k] for k in positions]
        gone = [n for n, d in zip(names, dsts, strict=True) if d is None]
        if gone:
            raise ReshardError(f"device {ctx.device}: the output shard {gone[0]!r} is gone (unshared or freed)")
        return dsts

    def _block_for(self, store, layout) -> tuple[np.ndarray | None, list[int]]:
        """The unit block the outputs of ``layout``'s destinations are views of, laid out as in
        ``layout``, held (None: they are not, or one left the store since), and the positions of
        the other outputs."""
        edits, address, others = self._unit_block(store, layout)
        return (None if address is None else store.block_at(address, layout.extent, edits)), others

    def _unit_block(self, store, layout) -> tuple[int, int | None, list[int]]:
        """Where the outputs of ``layout``'s destinations lie: at the store's edits count, the
        address of the unit block they are views of, laid out as in ``layout`` (None: they are not),
        and the positions of the other outputs."""
        hit = self._blocks.get(id(layout))
        edits = store.edits
        if hit is not None and hit[0] is layout and hit[1] == edits:
            return hit[1:]
        at = dict(zip(self.tensors, itertools.count()))
        mine = [at.get(t) for t in layout.tensors]
        address = None
        if None not in mine:
            placed = store.placed
            found = np.array([placed.get(self.names[k], -1) for k in mine if k is not None], np.int64)
            start = int(found[0] - layout.offsets[0]) if len(found) else -1
            if start >= 0 and np.array_equal(found - start, layout.offsets):
                address = start
        taken = set(mine)
        others = [k for k in range(len(self.tensors)) if k not in taken]
        if len(self._blocks) >= CACHED:
            self._blocks.clear()
        self._blocks[id(layout)] = (layout, edits, address, others)
        return edits, address, others


def _copy_results(ctx, dsts: list, srcs: list) -> None:
    """Each of ``srcs`` into its output in ``dsts``; on a GPU device the small ones (under
    ``KERNEL_MAX_BYTES``) all by one kernel, the others one by one."""
    small: list[int] = []
    if all(map(arrays.is_device, dsts)) and all(map(arrays.is_device, srcs)):
        small = [k for k, d in enumerate(dsts) if d.nbytes < KERNEL_MAX_BYTES]
    if len(small) > 1:
        box_copies.copy_views([dsts[k] for k in small], [srcs[k] for k in small])
        ctx.counters["kernel_commits"] = ctx.counters.get("kernel_commits", 0) + 1
        taken = set(small)
        large = [k for k in range(len(dsts)) if k not in taken]
        dsts, srcs = [dsts[k] for k in large], [srcs[k] for k in large]
    arrays.copy_many(dsts, srcs)


def outputs_of(prepared, bound) -> Outputs:
    """``Outputs`` of ``prepared`` bound as ``bound`` (cached in the batch's tables)."""
    return prepared.per_binding("outputs", bound, lambda: Outputs(prepared, bound), CACHED)


def checked_outs(ctx, names, shapes, dtypes, *, strided: bool = False) -> list:
    """``checked_out`` of each of ``names`` (with the shape and dtype of the same position): a
    commit's or run's thousands of outputs at once, column by column where all are numpy arrays;
    where one fails, ``checked_out`` of each says which and how."""
    store, shapes, dtypes = ctx.store, list(map(tuple, shapes)), list(dtypes)
    found = list(map(store.shards.get, names))
    if (
        set(map(type, found)) == {np.ndarray}
        and list(map(store.dtypes.get, names)) == dtypes
        and list(map(_SHAPE, found)) == shapes
        and all(map(_WRITEABLE, found))
        and (strided or all(map(_C_CONTIGUOUS, found)))
    ):
        return found
    return [checked_out(ctx, n, shape, d, strided=strided) for n, shape, d in zip(names, shapes, dtypes, strict=True)]


_SHAPE = operator.attrgetter("shape")
_WRITEABLE = operator.attrgetter("flags.writeable")
_C_CONTIGUOUS = operator.attrgetter("flags.c_contiguous")


def checked_out(ctx, name: str | None, shape, dtype: str, *, strided: bool = False):
    """The user's tensor ``name`` that a reshard writes into, checked against what it writes;
    ``strided``: it may be a strided view (a region of a fused tensor), which a commit copies
    into; a ``direct`` write lands messages in place and needs it contiguous."""
    t = None if name is None else ctx.store.get(name)
    if t is None:
        raise ReshardError(f"device {ctx.device}: the output shard {name!r} is gone (unshared or freed)")
    have = ctx.store.dtype(name)
    if tuple(t.shape) != tuple(shape) or have != dtype:
        raise ReshardError(
            f"device {ctx.device}: output shard {name!r} is {have}{list(t.shape)}, the reshard writes "
            f"{dtype}{list(shape)}"
        )
    if not strided and not arrays.contiguous(t):
        raise ReshardError(
            f"device {ctx.device}: output shard {name!r} is a strided view (a region of a fused tensor): a direct "
            "write needs a contiguous one; drop direct=True (the staged write copies into strided views)"
        )
    if not arrays.writable(t):
        raise ReshardError(
            f"device {ctx.device}: output shard {name!r} is read-only (e.g. np.load(mmap_mode='r')); "
            "share a writable array to reshard into it"
        )
    return t

"""Binding a batch to one device's memory: the buffers each part of a run reads and writes.

For every part (one tensor of the batch): its source shard, found by the name the controller gave;
the peers' source shards it pulls, mapped read-only by their descriptors; its destination, which is
the user's tensor itself when the run writes ``direct`` into it (a unit's destinations are copied
into theirs at the end: ``deliver``), else a new shard (written in place when peers pull relays out
of it while the run goes on, else assembled apart and settled into fresh shared memory:
``ShardStore``); its relay board slot when it publishes; its scratch buffer.
``release`` undoes what a failed run bound, so that nothing is left behind; ``keep`` turns a
successful run's destinations into named shards.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

import numpy as np

from reshard.errors import ReshardError, ReshardTimeout
from reshard.runtime import arrays
from reshard.runtime.backends.communicator import PeerFailed
from reshard.runtime.device import host_unit
from reshard.runtime.device.batches import PreparedBatch
from reshard.runtime.device.executor import Run, check_buffer
from reshard.runtime.device.gpu_memory import Pulled
from reshard.runtime.device.host_unit import UnitRun
from reshard.runtime.device.outputs import checked_out, outputs_of
from reshard.runtime.messages import Bound, PlacedDescriptors, RunRequest, shard_name

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch


class Binding:
    """What one run bound on a device (module docstring)."""

    def __init__(self, ctx, req: RunRequest, bound: Bound, prepared: PreparedBatch):
        self.ctx = ctx
        self.req = req
        self.bound = bound
        self.prepared = prepared
        #: tensor -> destination (new shard, or the user's tensor) of each part outside the unit
        self.dsts: dict[int, np.ndarray | torch.Tensor] = {}
        self.slots: dict[int, int] = {}  # tensor -> relay board slot
        self.tmps: dict[int, np.ndarray | torch.Tensor] = {}
        self.pulled: dict[int, dict] = {}  # tensor -> {holder: descriptor of the shard pulled from}
        self.gpu_pulled: Pulled | None = None  # on a GPU device: every shard pulled, viewed and checked at once
        self.relayed: dict[int, dict] = {}  # tensor -> {holder: descriptor of the destination shard relayed from}
        self.unit: UnitRun | None = None  # the parts run as one unit (``host_unit``): no ``Run`` each
        self.sources: dict = {}  # tensor -> source shard of a part that only sends (no ``Run``)
        self.own_bytes = 0  # the destinations' bytes (a user's tensor written direct included)
        self.assembling: int | None = None  # the tensor whose destination is assembled apart (``ShardStore``)

    def runs(self, groups, staging, deadline: float, cancelled, before_op, batch) -> dict[int, Run]:
        """A ``Run`` per part outside the batch's unit (``host_unit``), its buffers bound (module
        docstring); the unit's destinations are views of one block."""
        ctx, bound, prepared = self.ctx, self.bound, self.prepared
        n = len(prepared.parts)
        sources = bound.sources
        outs = bound.outs or (None,) * n
        if len(sources) != n or len(outs) != n:
            raise ReshardError(f"device {ctx.device}: the run names {len(sources)} sources for {n} parts")
        if self.req.direct:  # written in place: before anything moves (a staged run's: after, and in its commit)
            self.check_outputs()
        runs = {}
        tensors = prepared.tensors
        fresh = self._fresh_destinations(tensors, outs)
        casts = bound.casts or (None,) * n
        rest: Iterable[int] = range(n)
        senders = prepared.senders if ctx.cuda_device is None and not self.req.verify and ctx.after_run is None else ()
        lent = self._lend(sorted(senders), sources, casts) if senders else ()
        unit = host_unit.unit_for(ctx, prepared, bound, self.req)
        if unit is not None:
            self.unit = UnitRun(unit, ctx.device, ctx.peers, *ctx.store.allocate_block(unit.nbytes, unit.shared))
            ctx.counters["unit_parts"] = ctx.counters.get("unit_parts", 0) + len(unit.places.parts)
            self.own_bytes = int(self.unit.block.nbytes)
            rest = unit.rest
        if lent:
            rest = [i for i in rest if i not in lent]
        if ctx.cuda_device is not None and bound.pulls:
            self.gpu_pulled = self._gpu_pulled()
        for i in rest:
            part, tensor, source, cast = prepared.parts[i], tensors[i], sources[i], casts[i]
            prog, dtype = part.program, part.dtype
            src = None
            if prog.src_shape is not None:
                src = ctx.store.get(source)
                if src is None:
                    raise ReshardError(f"device {ctx.device}: source shard {source!r} is missing (tensor freed?)")
                if cast is not None:
                    src = self._cast(source, src, cast, dtype)
                if not arrays.contiguous(src):
                    raise ReshardError(
                        f"device {ctx.device}: source shard {source!r} is a strided view (a region of a fused tensor, "
                        "shared to be written into with out=); reshard from a contiguous tensor"
                    )
                if i in senders:
                    check_buffer("source", src, prog.src_shape, dtype, ctx.device)
                    self.sources[tensor] = src
                    continue
            peers: dict = {}
            pulls = bound.pulls.get(tensor) if bound.pulls else None
            if self.gpu_pulled is not None:
                peers = self.gpu_pulled.views.get(tensor, peers)
            elif pulls:
                storage = arrays.storage(dtype)
                peers = {h: ctx.peers.get(h, desc, storage) for h, desc in pulls.items()}
                self.pulled[tensor] = pulls
            dst = None
            if prog.dst_shape is not None:
                dst = fresh[tensor] if tensor in fresh else self._destination(part, dtype, outs[i])
                self.dsts[tensor] = dst
                self.own_bytes += int(dst.nbytes)
                if ctx.store.assembled(dst):
                    self.assembling = tensor
            publish = relayed = None
            if part.publishes:
                self.slots[tensor] = self._open_slot(tensor, dst)
                publish = functools.partial(ctx.board.post, self.slots[tensor])
            if prog.relays:
                relayed = self._relay_source(tensor, prog, dtype, deadline, cancelled)
            tmp = None
            if prog.tmp:
                tmp = self.tmps[tensor] = ctx.store.allocate(prog.src_shape, dtype)
            runs[tensor] = Run(
                part,
                src=src,
                dst=dst,
                groups=groups,
                staging=staging,
                deadline=deadline,
                peers=peers,
                tmp=tmp,
                before_op=before_op,
                batch=batch,
                relayed=relayed,
                publish=publish,
            )
        if self.sources:
            ctx.counters["sender_parts"] = ctx.counters.get("sender_parts", 0) + len(self.sources)
        if bound.pulls:
            ctx.peers.purge(full=False)  # mappings of shards their owners dropped since: let that memory go
        return runs

    def _gpu_pulled(self) -> Pulled:
        """Every peer shard the run pulls, viewed at once and checked still its holder's
        (``GpuPeers.pulled``: the views of an earlier run that pulled the same)."""
        pulls, index, parts = self.bound.pulls or {}, self.prepared.index, self.prepared.parts
        return self.ctx.peers.pulled(pulls, {t: arrays.storage(parts[index[t]].dtype) for t in pulls})

    def _lend(self, senders: list[int], names, casts) -> set[int]:
        """The source shards of parts that only send (``PreparedBatch.senders``: they get no
        ``Run``), looked up and checked as columns; returns the parts done. A part whose source is
        cast, missing, or anything but a C-contiguous numpy array of the program's shape and dtype
        is left to the loop (which casts it, or says what is wrong)."""
        parts, tensors = self.prepared.parts, self.prepared.tensors
        plain = [i for i in senders if casts[i] is None]
        shards = list(map(self.ctx.store.get, [names[i] for i in plain]))
        fit = [
            type(a) is np.ndarray and a.shape == p.program.src_shape and a.dtype == arrays.storage(p.dtype)
            for a, p in zip(shards, map(parts.__getitem__, plain), strict=True)
        ]
        done = [(i, a) for i, a, ok in zip(plain, shards, fit, strict=True) if ok and a.flags.c_contiguous]
        self.sources.update((tensors[i], a) for i, a in done)
        return {i for i, _ in done}

    def _cast(self, name: str, src, cast, dtype: str):
        """Source shard ``name`` cast from ``cast`` (a dtype name, or a ``ScaledCast``: divided by
        its scales first) to the program's ``dtype``, once, before anything is read from it: the
        run then moves ``dtype`` (``reshard(..., dtype=)``)."""
        ctx = self.ctx
        have = ctx.store.dtype(name)
        scaled = not isinstance(cast, str)
        if have != (cast.src if scaled else cast):
            raise ReshardError(f"device {ctx.device}: source shard {name!r} is {have}, the run casts from {cast}")
        if ctx.cuda_device is not None:
            raise ReshardError(f"device {ctx.device}: casts in flight run on CPU devices only (not built for GPUs)")
        return arrays.scaled_cast(src, cast, dtype) if scaled else arrays.cast(src, cast, dtype)

    def check_outputs(self) -> None:
        """Every user's tensor this run writes exists, is writable and has the shape and dtype of
        what is written into it (all of them, before one is written; ``outputs``)."""
        if self.bound.outs is None or not self.prepared.written[0]:
            return
        outputs_of(self.prepared, self.bound).check(self.ctx, strided=not self.req.direct)

    def deliver(self) -> None:
        """A ``direct`` run's unit destinations copied into the user's tensors, once every shard
        the unit read is checked to be still its holder's (``Outputs.deliver``)."""
        if not self.req.direct or self.unit is None or self.bound.outs is None:
            return
        self.unit.check()
        outputs_of(self.prepared, self.bound).deliver(self.ctx, self.unit)

    def _fresh_destinations(self, tensors, outs) -> dict:
        """On a GPU device, every new destination of the run at once: pieces of one block (one
        allocation, one IPC handle for all; ``ShardStore.allocate_many``). Elsewhere none here:
        each part makes its own (``_destination``)."""
        ctx = self.ctx
        if ctx.cuda_device is None or self.req.direct:
            return {}
        wanted = [
            (t, p)
            for t, p in zip(tensors, self.prepared.parts, strict=True)
            if p.program.dst_shape is not None and not p.publishes
        ]
        try:
            made = ctx.store.allocate_many([(p.program.dst_shape, p.dtype) for _, p in wanted])
        except (MemoryError, RuntimeError, OSError) as e:
            raise ReshardError(f"device {ctx.device}: could not allocate the run's destination shards: {e}") from e
        return {t: a for (t, _), a in zip(wanted, made, strict=True)}

    def _destination(self, prepared, dtype: str, out: str | None):
        ctx = self.ctx
        prog = prepared.program
        if self.req.direct:
            return checked_out(ctx, out, prog.dst_shape, dtype)
        try:
            if prepared.publishes:  # peers read it while the run goes on: in place, in shared memory
                return ctx.store.allocate(prog.dst_shape, dtype, mapped=True)
            if self.bound.outs is not None:  # staged for a commit, never mapped by peers: pooled private memory
                return ctx.store.allocate(prog.dst_shape, dtype, shared=False)
            return ctx.store.allocate_destination(prog.dst_shape, dtype)
        except (MemoryError, RuntimeError, OSError) as e:
            raise ReshardError(
                f"device {ctx.device}: could not allocate its destination shard {prog.dst_shape}: {e}"
            ) from e

    def _open_slot(self, tensor: int, dst) -> int:
        """A board slot for a part's publications, naming its destination shard (given its tenure
        now: peers pull from it while the run goes on)."""
        ctx = self.ctx
        block = ctx.store.descriptor(dst) if self.req.direct else ctx.store.begin(dst)
        if ctx.board is None or block is None:
            raise ReshardError(
                f"device {ctx.device}: the program has peers pull relays out of its destination shard, but "
                f"{'it has no relay board' if ctx.board is None else 'that shard is not in shared memory'}"
            )
        return ctx.board.open(shard_name(self.req.run, tensor), block)

    def _relay_source(self, tensor: int, prog, dtype: str, deadline: float, cancelled):
        """``relayed(holder, after)`` for the executor: the holder's destination shard of this
        tensor once it published ``after`` slices, its descriptor recorded (checked after the run)."""
        ctx = self.ctx
        boards = self.bound.relays or {}
        missing = [h for h, _ in prog.relays if h not in boards]
        if missing:
            raise ReshardError(f"device {ctx.device}: no relay board was given for device(s) {missing} it pulls from")
        shapes = dict(prog.relays)
        storage = arrays.storage(dtype)
        name = shard_name(self.req.run, tensor)
        seen = self.relayed.setdefault(tensor, {})

        def relayed(holder: int, after: int):
            shard, block = ctx.peers.relay(
                holder, boards[holder], name, after, shapes[holder], storage, deadline, cancelled.is_set
            )
            seen[holder] = block
            return shard

        return relayed

    @property
    def assembled(self) -> bool:
        return self.assembling is not None

    @property
    def dst_bytes(self) -> int:
        """The memory the destinations take, an assembled one twice (it is copied out at the end)."""
        extra = 0 if self.assembling is None else int(self.dsts[self.assembling].nbytes)
        return self.own_bytes + extra

    def recycle(self) -> None:
        """Scratch buffers back to the pool (the runs that used them are gone)."""
        for tensor in list(self.tmps):
            self.ctx.store.recycle(self.tmps.pop(tensor))

    def settle(self, deadline: float, late_fails: bool) -> None:
        """After a successful run: destinations settled into their shared memory, every shard
        pulled from checked still to be the one pulled (none was freed meanwhile); ``late_fails``:
        a run that ends after its deadline fails (its results wait for a commit that has given up)."""
        ctx = self.ctx
        if not self.req.direct and self.assembling is not None:
            self.dsts[self.assembling] = ctx.store.settle(self.dsts[self.assembling])
        if self.gpu_pulled is not None:
            ctx.peers.check_pulled(self.gpu_pulled)
        for seen in (*self.pulled.values(), *self.relayed.values()):
            for h, desc in seen.items():
                ctx.peers.check(h, desc)
        if self.unit is not None and not self.req.direct:  # a direct run's: checked as it delivered
            self.unit.check()
        if not self.req.direct:
            self.check_outputs()  # still what the commit writes into: it changes all or none
        if late_fails and time.monotonic() >= deadline:
            raise ReshardTimeout(f"device {ctx.device}: the run ended after its deadline; its results are dropped")

    def keep(self, metas: dict) -> tuple[dict[int, tuple | None], PlacedDescriptors | None]:
        """The new destinations as named shards (``shard_name(run, tensor)``), all or none: a run
        the controller aborted meanwhile keeps none. Returns each one's descriptor by tensor, and
        those of the unit's shards as columns where they were kept so."""
        ctx, run, prepared = self.ctx, self.req.run, self.prepared
        if self.req.direct:
            return {}, None
        index, parts = prepared.index, prepared.parts
        entries = [
            (shard_name(run, t), d, parts[index[t]].dtype, metas.get(t), t in self.slots) for t, d in self.dsts.items()
        ]
        staged = self.bound.outs is not None
        placed = None if self.unit is None else self.unit.placed(run, staged)
        kept = ctx.store.put_run(run, entries, placed, staged=staged)
        if kept is None:
            raise PeerFailed(f"device {ctx.device}: the controller aborted the reshard {run}")
        if staged:  # for a commit: nobody maps them
            return {}, None
        descriptors, unit = kept
        out = dict(zip(self.dsts, descriptors, strict=True))
        if isinstance(unit, list) and placed is not None:  # kept one by one
            out.update(zip(placed.tensors, unit, strict=True))
            unit = None
        return out, unit

    def release(self) -> None:
        """Undo a failed run: new destinations dropped (the user's tensors are left as they are),
        publications failed so that pullers fail fast, scratch freed."""
        ctx = self.ctx
        for tensor, dst in self.dsts.items():
            ctx.store.abandon(dst)
            slot = self.slots.get(tensor)
            if slot is not None:
                ctx.board.fail(slot)
                if not self.req.direct:
                    ctx.store.end(dst)
        self.dsts.clear()
        self.slots.clear()
        self.tmps.clear()

"""Pull lanes: a boundary's activations between two stage meshes of one machine copied straight out
of the sender's shared memory, instead of sent through the mesh backend.

Such a lane's program is compiled with the machine as the devices' shared-memory domain
(``reshard.passes.pulls``): each receiver's part is pulls from the senders' source shards, a
sender's part is nothing. What a reshard has for free (its source is complete before the run and
stays so during it) a lane provides itself, for transfer ``n`` (0, 1, ...) of an iteration:

- the SENDER waits until every receiver that pulls from it consumed transfer ``n - SLOTS``, copies
  its output into slot ``n % SLOTS`` of its ring (blocks of its shared memory:
  ``DeviceContext.shared_block``) and posts ``n + 1`` on its board;
- a RECEIVER waits until every sender it pulls from posted ``n + 1``, runs its program with those
  slots as the senders' source shards, and posts on its own board that it consumed ``n + 1``.

A board is one small shared block per worker, a cell per (lane, role) it takes part in; peers map
it read-only and poll it. A cell holds ``iteration << 32 | count``, so a value left from an earlier
iteration is always smaller than one this iteration waits for; count ``FAILED`` says that side of
the lane broke (the peer fails at once rather than at the iteration's deadline). Stores become
visible to other processes in program order on x86 (the slot's bytes before the count), which
is why pull lanes need what the runtime's relay boards need (``DeviceMesh.records[i].board``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from scheduler.pipeline_plan import Lane

SLOTS = 2  # ring slots per sending lane: the sender copies transfer n + 1 while n is pulled
FAILED = 0xFFFFFFFF
_POLL_S = (20e-6, 1e-3)  # first and longest pause between two looks at a peer's board


def cell_value(iteration: int, count: int) -> int:
    return (iteration << 32) | count


class LaneBoard:
    """This worker's cells, one per ``(lane, role)`` it takes part in, in its shared memory."""

    def __init__(self, ctx, keys: Iterable[tuple[Lane, str]]):
        self.index = {k: i for i, k in enumerate(keys)}
        made = ctx.shared_block((max(1, len(self.index)),), "int64")
        if made is None:
            raise RuntimeError(f"device {ctx.device} keeps no shared memory: its pipeline lanes cannot be pull lanes")
        self.cells, self.handle = made
        self.cells[:] = 0

    def post(self, lane: Lane, role: str, iteration: int, count: int) -> None:
        self.cells[self.index[(lane, role)]] = cell_value(iteration, count)


class PeerCell:
    """A peer's cell for one ``(lane, role)``, mapped read-only."""

    def __init__(self, ctx, peer: int, info: Mapping, lane: Lane, role: str):
        self.peer = peer
        self.cells = ctx.peer_block(peer, info["board"], "int64")
        self.at = info["cells"][(lane, role)]

    def wait(self, iteration: int, count: int, left: Callable[[], float], what: str) -> None:
        """Until the cell reaches ``count`` of ``iteration``; ``TimeoutError`` once ``left()``
        is 0, ``RuntimeError`` if the peer's side of the lane failed."""
        want = cell_value(iteration, count)
        failed = cell_value(iteration, FAILED)
        pause = _POLL_S[0]
        while True:
            value = int(self.cells[self.at])
            if value == failed:
                raise RuntimeError(f"{what}: device {self.peer}'s side of the lane failed")
            if value >= want:
                return
            remaining = left()
            if remaining <= 0:
                raise TimeoutError(f"{what}: device {self.peer} had not got there by the iteration deadline")
            time.sleep(min(pause, remaining))
            pause = min(2 * pause, _POLL_S[1])


class SendRing:
    """A sending lane's slots: ``SLOTS`` blocks of this device's source shard's shape."""

    def __init__(self, ctx, shape: tuple[int, ...], dtype: str):
        made = [ctx.shared_block(shape, dtype) for _ in range(SLOTS)]
        if any(m is None for m in made):
            raise RuntimeError(f"device {ctx.device} keeps no shared memory: its pipeline lanes cannot be pull lanes")
        self.slots: list[np.ndarray] = [m[0] for m in made if m is not None]
        self.handles = [m[1] for m in made if m is not None]


def peer_slots(ctx, holder: int, handles: list, dtype: str) -> list[np.ndarray]:
    """A sender's ring, mapped read-only here."""
    return [ctx.peer_block(holder, h, dtype) for h in handles]

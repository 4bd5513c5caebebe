"""The descriptors a call's devices returned as columns, read per tensor when a handle asks.

A device keeps a tree's small new shards as one unit (``reshard.runtime.device.host_unit``) and
returns their descriptors as integer columns (``messages.PlacedDescriptors``) rather than a tuple
each. The driver keeps those columns for the call's new handles (``UnitDescriptors``); a handle
makes its ``{device: descriptor}`` the first time something asks for it (a later reshard that reads
it, pickling it), so a tree whose outputs are only read back or freed never makes one per tensor.
"""

from __future__ import annotations

import numpy as np

from reshard.runtime.messages import PlacedDescriptors


class UnitDescriptors:
    """``{device: PlacedDescriptors}`` of one call of ``n`` tensors, by tensor (``of``)."""

    __slots__ = ("_rows",)

    def __init__(self, placed: dict[int, PlacedDescriptors], n: int):
        self._rows = []
        for device, columns in placed.items():
            rows = np.full(n, -1, np.int64)  # tensor -> its row in the columns (-1: none on this device)
            rows[np.asarray(columns.tensors, np.int64)] = np.arange(len(columns.tensors))
            self._rows.append((device, columns, rows))

    def of(self, tensor: int) -> dict:
        """``{device: descriptor}`` of tensor ``tensor``'s shards kept in its devices' units."""
        return {d: columns.descriptor(int(k)) for d, columns, rows in self._rows if (k := rows[tensor]) >= 0}

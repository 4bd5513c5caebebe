"""What programs are compiled for (``CompileTarget``): the facts about a backend's devices that
decide how their messages and copies are sequenced, in one place. The planner and the plan's
simulation read them here; sequencing and compile too; the runtime makes the target of a mesh
from its backend."""

from __future__ import annotations

from dataclasses import dataclass

# Messages a device issues together, per backend: gloo runs a window's sends and receives at once
# (their latencies overlap). NCCL keeps one at a time: a window is one group call over several
# communicators, whose kernels could queue behind each other on one stream.
WINDOW_OPS = {"gloo": 4}
# ... while they move at most this much together in each direction. Measured on 4 emulated hosts
# (1 Gbit/s, ~1 ms per gloo message): 64 KiB reshards gained from windows, while 4-16 MiB slices in
# flight together ran at half the rate one at a time reached (shard -> replicate at 256 MiB: 4.5 s
# against 2.5 s). On one 2-core machine, a bound of 64 MiB gained nothing either (bench/LOCAL.md).
WINDOW_BYTES = 1 << 20


def window_ops_for(backend: str) -> int:
    """The ``window_ops`` the runtime sequences with for ``backend``'s devices (1: one at a time)."""
    return WINDOW_OPS.get(backend, 1)


@dataclass(frozen=True, slots=True)
class CompileTarget:
    """A backend's devices as compilation sees them: ``backend`` (its name) and ``device_type``
    ("cpu", or "cuda": copies then run on the device's streams, never on a helper thread)."""

    backend: str = "gloo"
    device_type: str = "cpu"

    @property
    def window_ops(self) -> int:
        return window_ops_for(self.backend)

    @property
    def window_bytes(self) -> int:
        return WINDOW_BYTES

    @property
    def copies_beside_messages(self) -> bool:
        """Whether a device's local copies may run on its helper thread beside its messages."""
        return self.device_type == "cpu"

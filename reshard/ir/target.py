"""What programs are compiled for (``CompileTarget``): the facts about a backend's devices that
decide how their messages and copies are sequenced, in one declaration per backend (``TARGETS``).
The planner and the plan's simulation read them here; sequencing, packing and compile too; the
runtime's backend registry holds the same declaration (``register_target``) and makes the target
of a mesh from its backend."""

from __future__ import annotations

from dataclasses import dataclass, replace

# gloo runs a window's sends and receives at once (their latencies overlap) while they move at most
# ``WINDOW_BYTES`` together in each direction. Measured on 4 emulated hosts (1 Gbit/s, ~1 ms per
# gloo message): 64 KiB reshards gained from windows, while 4-16 MiB slices in flight together ran
# at half the rate one at a time reached (shard -> replicate at 256 MiB: 4.5 s against 2.5 s). On
# one 2-core machine, a bound of 64 MiB gained nothing either (bench/LOCAL.md).
WINDOW_BYTES = 1 << 20
#: The staging buffer a window's staged slices may fill side by side.
WINDOW_STAGING_BYTES = 64 << 20
#: Small messages one device sends another travel packed in buckets of at most this many bytes:
#: on gloo about 1 MiB (bench/WEIGHTS.md's sweep).
BUCKET_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class CompileTarget:
    """A backend's devices as compilation sees them: ``backend`` (its name), ``device_type``
    ("cpu", or "cuda": copies then run on the device's streams, never on a helper thread), the
    messages a device issues together (``window_ops``, at most ``window_bytes`` per direction and
    ``window_staging_bytes`` of staging side by side), the size of the buckets small slices
    travel in (``bucket_bytes``), and whether windows alternate between two halves of the staging
    (``double_buffer``: a GPU device packs window k+1, and unpacks window k-1, on a side stream
    while window k's messages move)."""

    backend: str = "gloo"
    device_type: str = "cpu"
    window_ops: int = 1
    window_bytes: int = WINDOW_BYTES
    window_staging_bytes: int = WINDOW_STAGING_BYTES
    bucket_bytes: int = BUCKET_BYTES
    double_buffer: bool = False

    def __post_init__(self) -> None:
        for name in ("window_ops", "window_bytes", "window_staging_bytes", "bucket_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CompileTarget({self.backend!r}).{name} must be a positive int, got {value!r}")
        if not isinstance(self.double_buffer, bool):
            raise ValueError(
                f"CompileTarget({self.backend!r}).double_buffer must be a bool, got {self.double_buffer!r}"
            )
        if not isinstance(self.device_type, str) or not self.device_type:
            raise ValueError(
                f"CompileTarget({self.backend!r}).device_type must name a device type, got {self.device_type!r}"
            )

    @property
    def copies_beside_messages(self) -> bool:
        """Whether a device's local copies may run on its helper thread beside its messages."""
        return self.device_type == "cpu"


#: One declaration per backend. NCCL: a window is one NCCL group per device (each communicator on
#: a stream of its own, so that kernels of one group never queue behind each other); buckets are
#: big because a message costs tens of microseconds of launch and NVLink moves hundreds of GB/s
#: (``python -m bench gpu`` measures the per-message cost and sweeps the bucket size); windows are
#: double-buffered, each in half of the staging bound.
TARGETS: dict[str, CompileTarget] = {
    "gloo": CompileTarget("gloo", "cpu", window_ops=4),
    "nccl": CompileTarget(
        "nccl",
        "cuda",
        window_ops=16,
        window_bytes=1 << 30,
        window_staging_bytes=512 << 20,
        bucket_bytes=64 << 20,
        double_buffer=True,
    ),
}


def register_target(target: CompileTarget) -> None:
    """Declare (or replace) the target of ``target.backend`` (the runtime's backend registry does
    so for a backend registered with a target of its own)."""
    if not isinstance(target, CompileTarget):
        raise TypeError(f"register_target takes a CompileTarget, got {type(target).__name__}")
    TARGETS[target.backend] = target


def target_for(backend: str, device_type: str | None = None) -> CompileTarget:
    """The declared target of ``backend`` (an undeclared one: one message at a time, gloo's
    sizes), with ``device_type`` when given."""
    target = TARGETS.get(backend) or CompileTarget(backend, device_type or "cpu")
    if device_type is not None and device_type != target.device_type:
        target = replace(target, device_type=device_type)
    return target


def window_ops_for(backend: str) -> int:
    """The ``window_ops`` the runtime sequences with for ``backend``'s devices (1: one at a time)."""
    return target_for(backend).window_ops

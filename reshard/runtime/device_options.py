"""What each device actor is told when it becomes a device (``DeviceOptions``): one set of
defaults and one validation for ``DeviceMesh.create`` and ``DeviceMesh.from_actors``, shipped to
the actor as it is (typed, never a dict read back with defaults of its own)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


def positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def positive_seconds(name: str, value) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number of seconds, got {value!r}")
    return float(value)


def byte_count(name: str, value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0 ({what}), got {value!r}")
    return value


@dataclass(frozen=True)
class DeviceOptions:
    """Per-device settings, validated when made. ``op_timeout_s`` bounds connection setup outside a
    reshard; ``staging_keep_bytes`` the staging an idle device keeps; ``buffer_pool_bytes`` the idle
    memory of dropped shards kept for reuse (0 disables the pool); ``assembly_bytes`` the private
    buffer a new destination shard is assembled in before it is written into fresh shared memory
    (0 writes in place); ``torch_threads`` torch's threads in the actor (0: as they are);
    ``shared_memory`` shards that peers pull from: shared memory on CPU devices (peers of the
    machine), CUDA IPC on GPU devices (peers sharing the GPU); ``caller_check_s`` how often a device
    looks at the processes that called it: the state it kept for one that ended (communicators,
    programs, staging) is freed, and the staging of one idle that long is given back;
    ``device_type`` the kind of device the actor serves ("cpu", "cuda"; None: its backend's)."""

    op_timeout_s: float = 300.0
    staging_keep_bytes: int = 64 << 20
    buffer_pool_bytes: int = 256 << 20
    assembly_bytes: int = 256 << 20
    torch_threads: int = 1
    shared_memory: bool = True
    caller_check_s: float = 10.0
    device_type: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "op_timeout_s", positive_seconds("op_timeout_s", self.op_timeout_s))
        byte_count("staging_keep_bytes", self.staging_keep_bytes, "0 keeps none")
        byte_count("buffer_pool_bytes", self.buffer_pool_bytes, "0 disables the pool")
        byte_count("assembly_bytes", self.assembly_bytes, "0 writes destinations in place")
        byte_count("torch_threads", self.torch_threads, "0 leaves them as they are")
        object.__setattr__(self, "shared_memory", bool(self.shared_memory))
        object.__setattr__(self, "caller_check_s", positive_seconds("caller_check_s", self.caller_check_s))
        if self.device_type is not None and self.device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type must be 'cpu', 'cuda' or None (its backend's), got {self.device_type!r}")

    def for_device(self, device_type: str) -> DeviceOptions:
        """What a device actor of ``device_type`` receives: these options, for that kind of device."""
        return replace(self, device_type=device_type)

"""What the pipeline driver and its stage workers say to each other: the spec each device's
worker is built from, one iteration's inputs, and how a failure is reported (no torch here: the
driver imports it)."""

from __future__ import annotations

import enum
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.pipeline_plan import Lane, StagePlan


class Role(str, enum.Enum):
    """A lane thread's side of its transfers."""

    SEND = "send"
    RECV = "recv"


class ErrorKind(str, enum.Enum):
    """What failed in an iteration, in the order the root cause is chosen."""

    USER = "user"  # a stage callable raised
    SLOW = "slow"  # a callable ran past the iteration deadline
    TRANSFER = "transfer"  # a transfer failed
    TIMEOUT = "timeout"  # a wait passed the iteration deadline
    INTERNAL = "internal"


@dataclass(frozen=True)
class WorkerSpec:
    """What one device of one stage needs to run its part of every iteration."""

    pipeline_id: str
    stage: int
    n_stages: int
    device: int
    coords: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    mesh_devices: tuple[int, ...]
    forward: Callable
    backward: Callable | None
    setup: Callable | None
    dtype: str
    in_local_shape: tuple[int, ...] | None  # this device's shard of the stage input
    out_local_shape: tuple[int, ...] | None  # this device's shard of the stage output
    # per lane leaving / entering this stage: this device's program, encoded as the reshard runtime
    # ships its programs (``reshard.ir.serialize.encode_device_program``)
    send_programs: dict[Lane, bytes]
    recv_programs: dict[Lane, bytes]
    timeout_s: float
    name: str = ""
    lane_channels: dict[Lane, str] = field(default_factory=dict)  # lane -> its communicator channel
    stage_channel: str = ""  # the channel of this stage mesh's groups (all_reduce)
    # pull lanes (``scheduler.runtime.pull_lanes``) this device takes part in: sending, the devices
    # that pull from it; receiving, the devices it pulls from
    pull_peers: dict[Lane, tuple[int, ...]] = field(default_factory=dict)
    # lanes whose transfers are NCCL kernels on GPUs: they run only between computes (``worker``)
    kernel_lanes: frozenset[Lane] = frozenset()


@dataclass
class IterationSpec:
    plan: StagePlan
    overlap: bool
    inputs: list | None  # stage 0: this device's input shard per microbatch (numpy), or None
    targets: list | None  # last stage: the target per microbatch (numpy), or None
    timeout_s: float
    number: int = 0  # the pipeline's iteration count: what pull lanes' boards count in


class StageFailure(Exception):
    """Raised inside the worker to carry a located failure."""


def error_info(kind: ErrorKind, spec: WorkerSpec, microbatch, phase, exc: BaseException) -> dict:
    return {
        "kind": kind.value,
        "stage": spec.stage,
        "device": spec.device,
        "microbatch": microbatch,
        "phase": None if phase is None else phase.value,
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "time": time.time(),
    }

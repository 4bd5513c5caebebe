"""Control of the cupy stand-in, for tests: faults, diagnostics, a long kernel.

Faults are per process (call these inside a Ray actor to affect that actor) and are used up
once they have struck ``count`` times:

- ``inject("never_join")``: the next communicator created here never checks in with its
  bootstrap root (it stays ``ncclInProgress``, and so do its peers, until aborted).
- ``inject("async_error", code=6, at="op")``: the next group of operations launched here puts
  asynchronous error ``code`` on its communicators (``ncclRemoteError`` by default; 8 is
  ``ncclTimeout``, which cupy 14 raises as ``KeyError(8)``) and its kernels never complete;
  ``at="init"``: the next creation fails with ``code`` instead.
- ``inject("hang", call=...)``: the next call of ``call`` ("groupEnd", "check_async_error",
  "bcast", "send", "recv", "allReduce", "init") does not return until its communicator is
  aborted from another thread; then it raises ``ncclInternalError``.

``device_memory(headroom)`` bounds a device's memory instead, inside a ``with`` block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from cupy.cuda import _gpu, nccl

FAULTS = ("never_join", "async_error", "hang")
CALLS = ("groupEnd", "check_async_error", "bcast", "send", "recv", "allReduce", "init")


def inject(
    kind: str,
    *,
    count: int = 1,
    code: int | None = None,
    at: str = "op",
    call: str | None = None,
    rank: int | None = None,
) -> None:
    """Arm a fault in this process (see the module docstring); ``rank``: only on communicators of that rank."""
    if kind not in FAULTS:
        raise ValueError(f"unknown fault {kind!r}; choose one of {', '.join(FAULTS)}")
    if kind == "hang" and call not in CALLS:
        raise ValueError(f"inject('hang', call=...) needs one of {', '.join(CALLS)}")
    if at not in ("op", "init"):
        raise ValueError("at must be 'op' or 'init'")
    fault = {"kind": kind, "count": int(count), "code": code, "call": call if kind == "hang" else at, "rank": rank}
    if kind == "never_join":
        fault["call"] = None
    with nccl._faults_lock:
        nccl._faults.append(fault)


def clear_faults() -> None:
    with nccl._faults_lock:
        nccl._faults.clear()


def armed_faults() -> list[dict]:
    with nccl._faults_lock:
        return [dict(f) for f in nccl._faults if f["count"] > 0]


@contextlib.contextmanager
def device_memory(headroom: int, device: int = 0) -> Iterator[None]:
    """Inside the block, this process's allocations on ``device`` take at most ``headroom`` bytes
    more than they do now: a ``cudaMalloc`` past that fails with ``cudaErrorMemoryAllocation``, as
    on a GPU whose memory is spent (CUDA runtime API, ``cudaMalloc``)."""
    _gpu.capacity[device] = _gpu.owned_bytes(device) + int(headroom)
    try:
        yield
    finally:
        _gpu.capacity.pop(device, None)


@contextlib.contextmanager
def launches_held() -> Iterator[None]:
    """Inside the block, non-blocking group launches do not enqueue their kernels (their
    communicators stay ``ncclInProgress``) until it ends, or ``nccl.LAUNCH_HOLD_S`` passed."""
    nccl._launch_gate.clear()
    try:
        yield
    finally:
        nccl._launch_gate.set()


def diagnostics() -> list[str]:
    """What the stand-in reported so far in this process (mismatches, refusals, faults)."""
    return _gpu.notes()


def sleep(seconds: float, stream=None) -> None:
    """A kernel that keeps ``stream`` (default: the current one) busy for ``seconds``, like
    ``torch.cuda._sleep``: later work on that stream waits for it."""
    import time

    _gpu.launch(lambda: time.sleep(seconds), f"sleep({seconds})", stream)


def live_communicators() -> int:
    """Communicators of this process neither aborted nor destroyed (leaked ones included)."""
    return len(nccl.live_communicators())


def sticky_error() -> int | None:
    """The CUDA error that faulted this process's context, if any."""
    return _gpu.sticky()


def reset_device() -> None:
    """Forget a sticky fault (tests of the stand-in only)."""
    _gpu.reset_device()

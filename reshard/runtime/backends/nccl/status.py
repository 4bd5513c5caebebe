"""What cupy's NCCL and CUDA calls answer: NCCL result codes behind cupy's exceptions, and CUDA events
read without losing their errors."""

from __future__ import annotations

from reshard.runtime.backends import cuda_buffers as cb

NCCL_IN_PROGRESS = 7  # ncclInProgress


NCCL_TIMEOUT = 8  # ncclTimeout (NCCL >= 2.30.3; cupy 14 raises it as KeyError(8))


CUDA_NOT_READY = 600  # cudaErrorNotReady


def nccl_status(error: BaseException) -> int | None:
    """The ``ncclResult_t`` behind an exception raised by cupy's NCCL bindings, else None.

    cupy raises ``NcclError(status)``; for codes missing from its message table (``ncclInProgress``
    = 7 on cupy 14, 6 and 7 on cupy 13) building that error raises ``KeyError(status)`` instead."""
    status = getattr(error, "status", None)
    if isinstance(status, int):
        return status
    if type(error) is KeyError and len(error.args) == 1 and type(error.args[0]) is int and 0 <= error.args[0] < 64:
        return error.args[0]
    return None


def event_fired(event) -> bool:
    """Whether a cupy event has fired; a CUDA error recorded by the work before it raises.

    cupy 14's ``Event.done`` compares ``runtime.eventQuery``'s status with 0, so an error there
    reads as "not yet" and a failed kernel would wait for the deadline; the status is read here."""
    cupy = cb.import_cupy()
    status = cupy.cuda.runtime.eventQuery(event.ptr)
    if status in (0, CUDA_NOT_READY):
        return status == 0
    raise cupy.cuda.runtime.CUDARuntimeError(status)


class _Deadline(Exception):
    """Internal: a poll reached its deadline."""


class _PeerAbort(Exception):
    """Internal: a member reported an abort while we polled."""

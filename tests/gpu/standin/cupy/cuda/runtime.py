"""``cupy.cuda.runtime`` of the stand-in: device count and properties, versions, the error type.

Errors follow cupy_backends/cuda/api/runtime.pyx (cupy 14): ``CUDARuntimeError(status)`` carries
``.status`` and the message ``"<cudaGetErrorName>: <cudaGetErrorString>"``. CUDA IPC of memory is
modelled (``_gpu``); of events it is not (its calls raise ``cudaErrorNotSupported``).
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading

# cudaError_t values (driver_types.h) the stand-in raises.
cudaSuccess = 0
cudaErrorInvalidValue = 1
cudaErrorMemoryAllocation = 2
cudaErrorInvalidDevice = 101
cudaErrorInvalidResourceHandle = 400
cudaErrorNotReady = 600
cudaErrorIllegalAddress = 700
cudaErrorLaunchFailure = 719
cudaErrorNotSupported = 801

_NAMES = {
    cudaSuccess: ("cudaSuccess", "no error"),
    cudaErrorInvalidValue: ("cudaErrorInvalidValue", "invalid argument"),
    cudaErrorMemoryAllocation: ("cudaErrorMemoryAllocation", "out of memory"),
    cudaErrorInvalidDevice: ("cudaErrorInvalidDevice", "invalid device ordinal"),
    cudaErrorInvalidResourceHandle: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
    cudaErrorNotReady: ("cudaErrorNotReady", "device not ready"),
    cudaErrorIllegalAddress: ("cudaErrorIllegalAddress", "an illegal memory access was encountered"),
    cudaErrorLaunchFailure: ("cudaErrorLaunchFailure", "unspecified launch failure"),
    cudaErrorNotSupported: ("cudaErrorNotSupported", "operation not supported"),
}

# cudaStreamNonBlocking / cudaEventDisableTiming flags, as cupy exposes them.
streamDefault = 0
streamNonBlocking = 1
eventDefault = 0
eventBlockingSync = 1
eventDisableTiming = 2
eventInterprocess = 4

#: What ``runtimeGetVersion`` / ``driverGetVersion`` report (CUDA 12.8).
CUDA_VERSION = 12080


class CUDARuntimeError(RuntimeError):
    """A CUDA runtime error, as cupy raises it."""

    def __init__(self, status):
        self.status = status
        name, msg = _NAMES.get(status, ("cudaErrorUnknown", "unknown error"))
        super().__init__(f"{name}: {msg}")

    def __reduce__(self):
        return (type(self), (self.status,))


def check_status(status: int) -> None:
    if status != 0:
        raise CUDARuntimeError(status)


def getDeviceCount() -> int:
    """Stand-in GPUs of this process: ``CUPY_STANDIN_DEVICES`` (default 1). Each process has its own
    (own memory, own UUID); ``CUDA_VISIBLE_DEVICES`` is not read (Ray gives stand-in runs no GPUs)."""
    return int(os.environ.get("CUPY_STANDIN_DEVICES", "1"))


_tls = threading.local()


def getDevice() -> int:
    return getattr(_tls, "device", 0)


def setDevice(device: int) -> None:
    if not 0 <= device < getDeviceCount():
        raise CUDARuntimeError(cudaErrorInvalidDevice)
    _tls.device = device


def _uuid(device: int) -> bytes:
    """16 bytes naming stand-in GPU ``device``: every process of a machine shares it, as actors
    sharing one GPU do (each with its own memory, which CUDA IPC maps across processes);
    ``CUPY_STANDIN_GPU_NAME`` names another GPU (a process of a mesh on "another GPU")."""
    seed = f"cupy-standin:{socket.gethostname()}:{os.environ.get('CUPY_STANDIN_GPU_NAME', '')}:{device}".encode()
    return hashlib.blake2b(seed, digest_size=16).digest()


def getDeviceProperties(device: int) -> dict:
    """A few fields of ``cudaDeviceProp``. ``uuid`` goes through cupy's char-array conversion, which
    stops at the first NUL byte (as cupy 14's ``props.uuid.bytes`` does)."""
    if not 0 <= device < getDeviceCount():
        raise CUDARuntimeError(cudaErrorInvalidDevice)
    return {
        "name": b"cupy CPU stand-in",
        "totalGlobalMem": 16 << 30,
        "major": 9,
        "minor": 0,
        "multiProcessorCount": 1,
        "pciBusID": device,
        "pciDeviceID": 0,
        "pciDomainID": 0,
        "uuid": _uuid(device).split(b"\0", 1)[0],
    }


def runtimeGetVersion() -> int:
    return CUDA_VERSION


def driverGetVersion() -> int:
    return CUDA_VERSION


def deviceSynchronize() -> None:
    from cupy.cuda import _gpu

    _gpu.synchronize_device(getDevice())


def memGetInfo() -> tuple[int, int]:
    from cupy.cuda import _gpu

    total = 16 << 30
    return total - _gpu.allocated_bytes(), total


def eventQuery(event: int) -> int:
    """cupy 14's ``runtime.eventQuery`` returns ``cudaEventQuery``'s status (0, 600 = not ready, or
    an error) instead of raising; ``Event.done`` compares it with 0."""
    from cupy.cuda import stream

    return stream.event_query(event)


def streamQuery(stream: int) -> int:
    """``cudaStreamQuery``: 0 once every task queued on the stream completed, ``cudaErrorNotReady``
    before, or the sticky error; returned, not raised (as cupy 14's ``runtime.streamQuery``)."""
    from cupy.cuda import _gpu

    if _gpu.sticky() is not None:
        return _gpu.sticky()
    q = _gpu.queue_of(stream)
    return 0 if q.reached(q.last()) else cudaErrorNotReady


cudaIpcMemLazyEnablePeerAccess = 1


def ipcGetMemHandle(devPtr: int) -> bytes:
    """``cudaIpcGetMemHandle`` (see ``_gpu``: memory in a shared file other processes map)."""
    from cupy.cuda import _gpu

    return _gpu.ipc_handle(int(devPtr))


def ipcOpenMemHandle(handle: bytes, flags: int = cudaIpcMemLazyEnablePeerAccess) -> int:
    from cupy.cuda import _gpu

    return _gpu.ipc_open(handle, getDevice())


def ipcCloseMemHandle(devPtr: int) -> None:
    from cupy.cuda import _gpu

    _gpu.ipc_close(int(devPtr))


def _not_modelled(*args, **kwargs):
    raise CUDARuntimeError(cudaErrorNotSupported)


# Interprocess events are not modelled: the runtime orders a pull after its holder's run by the
# run having finished, not by an event.
ipcGetEventHandle = ipcOpenEventHandle = _not_modelled

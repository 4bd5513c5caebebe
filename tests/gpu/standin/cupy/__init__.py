"""A CPU stand-in for ``cupy``, ``cupy.cuda``, ``cupy.cuda.runtime`` and ``cupy.cuda.nccl``: tests only.

tests/conftest.py puts its folder first on ``sys.path`` and ``PYTHONPATH`` (so Ray workers get it
too) when no real cupy can be found, unless ``RESHARD_GPU_STANDIN=0`` or ``RESHARD_REQUIRE_GPUS``
is set. It reports itself: ``cupy._standin is True``, ``cupy.__version__`` ends in ``+standin``;
it is no installed distribution and never counts as a GPU result.

What it is: device memory as host buffers behind fake pointers (``cuda._gpu``), streams as FIFO
worker threads with events, the subset of ``ndarray`` the NCCL backend and its tests use, and an
NCCL model (``cuda.nccl``) whose ranks live in different processes: unique ids name a bootstrap
root listening in the process that made them, ranks connect over TCP on 127.0.0.1 and move the
bytes rank to rank; non-blocking communicators (``NCCL_COMM_BLOCKING=0``) answer
``ncclInProgress`` until their work is launched; collectives and send/recv are matched by
per-communicator sequence numbers; ``abort`` is local. ``_control`` injects faults and reports what it saw.

What it proves, across real processes: the backend's control logic (the communicator cache,
group pairing, polling, deadlines, abort notices between members, abort from another thread,
stream/event ordering, staging lifetimes, the global operation order), the runtime's GPU device
actors (shards in its device memory, CUDA IPC between processes, DLPack) and that bytes arrive
unchanged. What it does NOT prove: NCCL itself, its transports and protocols, several ranks on
one GPU, compiled kernels (``RawKernel`` is absent: callers fall back to assignments), torch's own
CUDA streams, or speed.
"""

from numpy import (
    bool_,
    complex64,
    complex128,
    dtype,
    float16,
    float32,
    float64,
    int8,
    int16,
    int32,
    int64,
    uint8,
    uint16,
    uint32,
    uint64,
)

from cupy import cuda
from cupy._array import _ufunc, asarray, asnumpy, empty, from_dlpack, full, ndarray, where

__version__ = "14.2.0+standin"
_standin = True

__all__ = [
    "add",
    "bitwise_and",
    "bitwise_or",
    "divide",
    "from_dlpack",
    "get_default_memory_pool",
    "maximum",
    "minimum",
    "multiply",
    "subtract",
    "where",
    "arange",
    "array",
    "asarray",
    "asnumpy",
    "bool_",
    "complex64",
    "complex128",
    "cuda",
    "dtype",
    "empty",
    "empty_like",
    "float16",
    "float32",
    "float64",
    "full",
    "full_like",
    "get_array_module",
    "int8",
    "int16",
    "int32",
    "int64",
    "ndarray",
    "ones",
    "ones_like",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "zeros",
    "zeros_like",
]


def zeros(shape, dtype=float, order="C") -> ndarray:
    return full(shape, 0, dtype, order)


def ones(shape, dtype=float, order="C") -> ndarray:
    return full(shape, 1, dtype, order)


def arange(start, stop=None, step=1, dtype=None) -> ndarray:
    import numpy

    return asarray(numpy.arange(start, stop, step, dtype=dtype))


def array(obj, dtype=None, copy=True, order="K") -> ndarray:
    if isinstance(obj, ndarray):
        return obj.astype(obj.dtype if dtype is None else dtype, copy=True) if copy else asarray(obj, dtype)
    return asarray(obj, dtype)


def empty_like(a, dtype=None) -> ndarray:
    return empty(a.shape, a.dtype if dtype is None else dtype)


def zeros_like(a, dtype=None) -> ndarray:
    return zeros(a.shape, a.dtype if dtype is None else dtype)


def ones_like(a, dtype=None) -> ndarray:
    return ones(a.shape, a.dtype if dtype is None else dtype)


def full_like(a, fill_value, dtype=None) -> ndarray:
    return full(a.shape, fill_value, a.dtype if dtype is None else dtype)


def get_array_module(*args):
    import numpy

    import cupy

    return cupy if any(isinstance(a, ndarray) for a in args) else numpy


add = _ufunc(__import__("numpy").add)
subtract = _ufunc(__import__("numpy").subtract)
multiply = _ufunc(__import__("numpy").multiply)
divide = _ufunc(__import__("numpy").true_divide)
maximum = _ufunc(__import__("numpy").maximum)
minimum = _ufunc(__import__("numpy").minimum)
bitwise_and = _ufunc(__import__("numpy").bitwise_and)
bitwise_or = _ufunc(__import__("numpy").bitwise_or)


class _MemoryPool:
    """``cupy.get_default_memory_pool()`` (cupy/cuda/memory.pyx ``MemoryPool``): ``used_bytes``
    the live allocations, ``total_bytes`` those and the freed blocks the pool keeps for reuse,
    which ``free_all_blocks`` gives back."""

    def free_all_blocks(self) -> None:
        from cupy.cuda import _gpu

        _gpu.release_cached()

    def used_bytes(self) -> int:
        from cupy.cuda import _gpu

        return _gpu.allocated_bytes()

    def total_bytes(self) -> int:
        from cupy.cuda import _gpu

        return _gpu.allocated_bytes() + _gpu.pool_cached_bytes()


_POOL = _MemoryPool()


def get_default_memory_pool() -> _MemoryPool:
    return _POOL
